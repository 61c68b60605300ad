"""The WSD schedule (`optimized.train.schedule`): each decay style against a transcription of
its published formula and against megatron-core's own ``OptimizerParamScheduler``; the rule
for extending a run on resume."""

from __future__ import annotations

import math
import warnings

import pytest

from optimized.train import TrainConfig, apply_overrides, validate_config
from optimized.train.schedule import decay_start, lr_at, resume_conflict


def wsd(*overrides: str) -> TrainConfig:
    base = ["steps=100", "optim.lr=1.0", "optim.min_lr=0.1", "optim.warmup_steps=10",
            "optim.lr_schedule=wsd", "optim.decay_fraction=0.2"]  # fmt: skip
    return validate_config(apply_overrides(TrainConfig(), base + list(overrides)))


# The published formulas, written out: r in [0, 1] through the decay, f(r) the multiplier of
# (lr - min_lr) above min_lr.
PUBLISHED = {
    "linear": lambda r: 1 - r,  # Megatron "linear"; torchtitan decay_type "linear"
    "cosine": lambda r: (1 + math.cos(math.pi * r)) / 2,  # Megatron "cosine"
    "1-sqrt": lambda r: 1 - r**0.5,  # Hägele et al. 2024; Megatron "minus_sqrt"
    "exponential": lambda r: 2 * 0.5**r - 1,  # Megatron; MiniCPM 0.5**r, made to end at 0
}


@pytest.mark.parametrize("style", sorted(PUBLISHED))
def test_each_decay_style_follows_its_formula(style):
    cfg = wsd(f"optim.decay_style={style}")
    assert decay_start(cfg) == 80
    for step in range(0, 110):
        if step < 10:
            want = (step + 1) / 10  # the shared warmup
        elif step <= 80:
            want = 1.0  # stable
        elif step < 100:
            want = 0.1 + 0.9 * PUBLISHED[style]((step - 80) / 20)
        else:
            want = 0.1
        assert lr_at(step, cfg) == pytest.approx(want, rel=1e-12, abs=1e-15), (style, step)
    values = [lr_at(s, cfg) for s in range(80, 101)]
    assert all(a > b for a, b in zip(values, values[1:])), values  # strictly down to min_lr


@pytest.mark.parametrize(
    ("style", "megatron"),
    [("linear", "linear"), ("cosine", "cosine"), ("1-sqrt", "minus_sqrt"),
     ("exponential", "exponential")],
)  # fmt: skip
def test_wsd_matches_megatron_core(style, megatron):
    """megatron-core's scheduler after its warmup (``num_steps`` = this step), run here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class Optimizer:
        param_groups = [{"params": [], "lr": 0.0}]

    scheduler = OptimizerParamScheduler(
        Optimizer(), init_lr=0.0, max_lr=1.0, min_lr=0.1, lr_warmup_steps=10,
        lr_decay_steps=100, lr_decay_style="WSD", start_wd=0.0, end_wd=0.0,
        wd_incr_steps=100, wd_incr_style="constant", wsd_decay_steps=20,
        lr_wsd_decay_style=megatron,
    )  # fmt: skip
    cfg = wsd(f"optim.decay_style={style}")
    for step in range(10, 105):
        scheduler.num_steps = step
        want = scheduler.get_lr(Optimizer.param_groups[0])
        assert lr_at(step, cfg) == pytest.approx(want, rel=1e-12), (step, want)


def test_decay_inside_the_warmup_is_refused():
    with pytest.raises(ValueError, match=r"optim.decay_fraction = 0.95 is invalid.*warmup of 10"):
        wsd("optim.decay_fraction=0.95")
    for bad in ("optim.decay_fraction=0", "optim.decay_style=square"):
        with pytest.raises(ValueError, match=bad.split("=")[0]):
            wsd(bad)


def test_a_run_extends_before_its_decay_and_not_after():
    saved = wsd()  # 100 steps: the decay starts after step 80
    assert resume_conflict(saved, wsd("steps=200"), 60) is None  # stable so far: extend
    assert resume_conflict(saved, wsd("steps=200"), 81) is None  # step 81 still at lr
    problem = resume_conflict(saved, wsd("steps=200"), 85)
    assert "its decay began at step 81" in problem and "step 82 ran at lr" in problem
    assert resume_conflict(saved, wsd(), 85) is None  # the same schedule goes on
    other = wsd("optim.lr=2.0", "steps=200")
    assert "its schedule differs" in resume_conflict(saved, other, 5)
    cosine = validate_config(apply_overrides(TrainConfig(), ["steps=100"]))
    longer = validate_config(apply_overrides(TrainConfig(), ["steps=200"]))
    assert resume_conflict(cosine, longer, 50) is None  # cosine's old rule: taken as given
