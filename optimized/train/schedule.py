"""The learning-rate schedule: warmup, then cosine, constant, or warmup-stable-decay (WSD).

`lr_at` gives the rate of each optimizer step (0-based ``step``). Every schedule starts with
the same linear warmup; after it:

- ``cosine``: ``min_lr + (lr - min_lr) * (1 + cos(pi * t)) / 2``,
  ``t = (step - warmup) / (steps - warmup)``;
- ``constant``: ``lr``;
- ``wsd`` (MiniCPM's warmup-stable-decay, Hu et al. 2024): ``lr`` until the decay starts
  at ``A = steps - D``, ``D = round(decay_fraction * steps)``, then
  ``min_lr + (lr - min_lr) * f(r)``, ``r = (step - A) / D``, with ``f`` one of the decay
  styles of Megatron-Core's ``OptimizerParamScheduler`` (its ``WSD`` branch,
  ``--lr-wsd-decay-style``), transcribed in `DECAY_STYLES`:

  - ``linear``: ``1 - r``;
  - ``cosine``: ``(1 + cos(pi * r)) / 2``;
  - ``1-sqrt`` (Megatron's ``minus_sqrt``; Hägele et al. 2024): ``1 - sqrt(r)``;
  - ``exponential``: ``2 * 0.5**r - 1``: MiniCPM's exponential decay ``0.5**r`` with
    half-life ``D``, shifted and scaled so that it ends at ``min_lr`` as the others do.

Each reaches ``min_lr`` at ``step == steps`` (the step after the last), as ``cosine`` does,
and stays there after. Step ``s`` here is Megatron's ``num_steps`` when it computes the rate
of the same step (it counts the steps already taken).

A WSD run may be extended on resume (``--steps`` raised) as long as no step taken so far
had a rate the new schedule would change: before its decay began. `resume_conflict` says
why a resume is refused otherwise (the trainer's preflight exits 2 with it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

TrainConfig = Any
"""`optimized.train.config.TrainConfig` (not imported: that module imports this one)."""

LR_SCHEDULES = ("cosine", "constant", "wsd")
DEFAULT_WARMUP_STEPS = 10
"""Warmup of a run that sets none, clamped to its length: ``--steps 5`` warms up 5 steps."""

DECAY_STYLES = {
    "linear": lambda r: 1.0 - r,
    "cosine": lambda r: 0.5 * (math.cos(math.pi * r) + 1.0),
    "1-sqrt": lambda r: 1.0 - math.sqrt(r),
    "exponential": lambda r: 2.0 * math.pow(0.5, r) - 1.0,
}
"""WSD's decay shapes ``f(r)``, ``r`` in [0, 1] from the decay's start to its end."""


def check_schedule(
    cfg: TrainConfig, check: Callable[[bool, str, str], None], earlier_problems: bool
) -> None:
    """`optimized.train.config.validate_config`'s checks of the schedule's own fields; the
    WSD decay's start only once every other field is valid (``earlier_problems`` false)."""
    opt = cfg.optim
    failed: list[str] = []

    def checked(ok: bool, key: str, valid: str) -> None:
        failed.extend([] if ok else [key])
        check(ok, key, valid)

    checked(opt.lr_schedule in LR_SCHEDULES, "optim.lr_schedule",
            f"must be one of {', '.join(LR_SCHEDULES)}")  # fmt: skip
    checked(math.isfinite(opt.decay_fraction) and 0 < opt.decay_fraction <= 1,
            "optim.decay_fraction", "must be in (0, 1]")  # fmt: skip
    checked(opt.decay_style in DECAY_STYLES, "optim.decay_style",
            f"must be one of {', '.join(DECAY_STYLES)}")  # fmt: skip
    valid = not (earlier_problems or failed)
    if opt.lr_schedule == "wsd" and valid and decay_start(cfg) < warmup_of(cfg):
        check(False, "optim.decay_fraction",
              f"the decay would start at step {decay_start(cfg) + 1}, inside the warmup of "
              f"{warmup_of(cfg)} steps: use a smaller fraction or a shorter warmup")  # fmt: skip


def warmup_of(cfg: TrainConfig) -> int:
    """``optim.warmup_steps``, or unset: ``min(DEFAULT_WARMUP_STEPS, steps)``."""
    given = cfg.optim.warmup_steps
    return min(DEFAULT_WARMUP_STEPS, max(cfg.steps, 0)) if given is None else given


def decay_steps_of(cfg: TrainConfig) -> int:
    """WSD's decay length: ``round(decay_fraction * steps)``."""
    return int(round(cfg.optim.decay_fraction * cfg.steps))


def decay_start(cfg: TrainConfig) -> int:
    """The first step whose rate is below ``lr`` under WSD (the decay's ``A``); ``steps``
    when it has no decay."""
    return cfg.steps - decay_steps_of(cfg)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based).

    Warmup: ``lr * (step + 1) / warmup_steps`` for the first ``warmup_steps`` steps,
    so step 0 already moves and step ``warmup_steps - 1`` uses the full ``lr``. Then
    ``constant`` stays at ``lr``; ``cosine`` follows
    ``min_lr + (lr - min_lr) * (1 + cos(pi * t)) / 2`` with
    ``t = (step - warmup_steps) / (steps - warmup_steps)``, reaching ``min_lr`` at
    ``step == steps`` and staying there after; ``wsd`` as the module docstring says.
    """
    opt = cfg.optim
    warmup = warmup_of(cfg)
    if step < 0:
        raise ValueError(f"step = {step} is invalid: must be >= 0")
    if step < warmup:
        return opt.lr * (step + 1) / warmup
    if opt.lr_schedule == "constant":
        return opt.lr
    if opt.lr_schedule == "wsd":
        return _wsd(step, cfg)
    if opt.lr_schedule != "cosine":
        raise ValueError(
            f"optim.lr_schedule = {opt.lr_schedule!r} is invalid: "
            f"must be one of {', '.join(LR_SCHEDULES)}"
        )
    decay_steps = cfg.steps - warmup
    if decay_steps <= 0:
        return opt.min_lr
    progress = min(1.0, (step - warmup) / decay_steps)
    return opt.min_lr + (opt.lr - opt.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _wsd(step: int, cfg: TrainConfig) -> float:
    opt = cfg.optim
    length, start = decay_steps_of(cfg), decay_start(cfg)
    if step >= cfg.steps:
        return opt.min_lr
    if length <= 0 or step <= start:
        return opt.lr
    shape = DECAY_STYLES[opt.decay_style]
    return opt.min_lr + (opt.lr - opt.min_lr) * shape((step - start) / length)


def resume_conflict(saved: TrainConfig, cfg: TrainConfig, step: int) -> str | None:
    """Why a run saved after ``step`` steps under ``saved``'s schedule must not go on under
    ``cfg``'s (None: it may). Under WSD on either side, the steps already taken must have
    had the same rates under both (a run is extended before its decay, never after); the
    cosine and constant schedules keep their old rule (any change is taken as given)."""
    if "wsd" not in (saved.optim.lr_schedule, cfg.optim.lr_schedule):
        return None
    for done in range(step):
        old, new = lr_at(done, saved), lr_at(done, cfg)
        if not math.isclose(old, new, rel_tol=1e-12, abs_tol=0.0):
            began = decay_start(saved)
            when = (
                f"its decay began at step {began + 1}"
                if saved.optim.lr_schedule == "wsd" and began < step
                else "its schedule differs"
            )
            return (
                f"steps = {cfg.steps} (optim.lr_schedule = {cfg.optim.lr_schedule}, "
                f"decay_fraction = {cfg.optim.decay_fraction}): the checkpoint is step {step} "
                f"of a run of {saved.steps} steps (optim.lr_schedule = "
                f"{saved.optim.lr_schedule}) and {when}; step {done + 1} ran at lr {old:.6g}, "
                f"the new schedule would have run it at {new:.6g}. A WSD run is extended only "
                "before its decay starts: resume with its own --steps and schedule, or branch "
                "a new run from the checkpoint with --init-from"
            )
    return None
