"""`harness.compare.verdict.build_report` on records written by hand: what each step is
judged on.

The compare tests run real stacks, whose figures sit far inside every bound, so they show
a verdict that passes, not which quantity of which step a failure would come from. Here
one quantity at a time is put out of bounds (#21: a verdict that took the best gradient's
relative error, or skipped the oracle comparison's later losses, passed every other test).
"""

from __future__ import annotations

import torch

from harness.compare.inplace import pair_sums
from harness.compare.rank import RankPlan
from harness.compare.record import StepRecord
from harness.compare.verdict import build_report
from models.network import preset
from models.runtime import OptimizerConfig, ParallelConfig

TRUTH = {
    name: torch.randn(64, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
    for i, name in enumerate(("embed.weight", "norm.weight", "head.weight"))
}


def _grads(scale: dict[str, float] | None = None) -> dict:
    """Each gradient against the truth; ``scale``: a gradient scaled as a whole (its
    direction, so ``1 - cos``, unchanged; only its relative error shows it)."""
    scale = scale or {}
    return {n: pair_sums(t * scale.get(n, 1.0), t) for n, t in TRUTH.items()}


def _record(loss: tuple[float, float], grads: dict | None = None) -> StepRecord:
    losses = {"baseline": loss[0], "candidate": loss[1]}
    return StepRecord(loss=losses, grads=grads or _grads(), params=_grads())


def _report(records: list[StepRecord], baseline: str = "oracle", candidate: str = "reference"):
    plan = RankPlan(
        preset("tiny-qwen3-moe"), ParallelConfig(), None, baseline, candidate, len(records),
        OptimizerConfig(), trajectory="free", routing="free", track_memory=False,
    )  # fmt: skip
    rank = {"steps": records, "eval": {"loss": {"baseline": 2.0, "candidate": 2.0},
            "routing": {}}, "lockstep": False, "coords": (0, 0, 0)}  # fmt: skip
    return build_report(plan, [rank])


def test_equal_records_pass():
    report = _report([_record((2.0, 2.0)), _record((1.9, 1.9))])
    assert report["passed"], report["problems"]


def test_the_largest_relative_error_is_judged_not_the_smallest():
    # One gradient 1.001 times the truth: 1 - cos 0, relative error 1e-3 (oracle float32
    # bound: 1e-5); the other two exact.
    report = _report([_record((2.0, 2.0), _grads({"norm.weight": 1.001}))])
    assert report["grads"]["max_rel_error"][0] > 9e-4
    assert not report["passed"]
    assert any("norm.weight relative error" in p for p in report["problems"])


def test_against_the_oracle_every_step_s_loss_is_judged():
    # Free-running against the oracle: a later step's gradients are information, its loss
    # is judged (float32: 1e-6 relative).
    report = _report([_record((2.0, 2.0)), _record((1.9, 1.9 * (1 + 1e-3)))])
    assert report["trajectory"]["judged_steps"] == [0, 1]
    assert not report["passed"]
    assert any(p.startswith("step 1: loss differs") for p in report["problems"])


def _nan_grads(name: str = "norm.weight") -> dict:
    """Every gradient exact but ``name``'s, which holds a NaN on the baseline side only."""
    grads = _grads()
    broken = TRUTH[name].clone()
    broken[3] = float("nan")
    grads[name] = pair_sums(TRUTH[name], broken)
    return grads


def test_a_nan_on_either_side_fails_and_so_do_two():
    """NaN never passes: the baseline's NaN loss against the candidate's finite one (what a
    stack that zeroes NaNs shows), the reverse, and both; infinities alike."""
    nan, inf = float("nan"), float("inf")
    for losses in ((nan, 2.0), (2.0, nan), (nan, nan), (inf, 2.0), (2.0, -inf)):
        report = _report([_record(losses)])
        assert not report["passed"], losses
        assert any("step 0: loss not finite" in p for p in report["problems"]), report["problems"]


def test_a_nan_gradient_fails_at_a_step_that_is_not_judged():
    """Free-running pipelines judge step 0 only (later steps measure AdamW's amplified
    rounding): a NaN at step 1, in a gradient or the evaluation, fails all the same."""
    report = _report([_record((2.0, 2.0)), _record((1.9, 1.9), _nan_grads())], "reference",
                     "optimized")  # fmt: skip
    assert report["trajectory"]["judged_steps"] == [0]
    assert not report["passed"]
    assert any("step 1: gradients not finite on a side: norm.weight" in p
               for p in report["problems"]), report["problems"]  # fmt: skip
    plan = RankPlan(
        preset("tiny-qwen3-moe"), ParallelConfig(), None, "reference", "optimized", 1,
        OptimizerConfig(), trajectory="free", routing="free", track_memory=False,
    )  # fmt: skip
    rank = {"steps": [_record((2.0, 2.0))], "eval": {"loss": {"baseline": float("nan"),
            "candidate": 2.0}, "routing": {}}, "lockstep": False, "coords": (0, 0, 0)}  # fmt: skip
    report = build_report(plan, [rank])
    assert not report["passed"]
    assert any(p.startswith("evaluation: loss not finite") for p in report["problems"])
