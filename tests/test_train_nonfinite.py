"""A NaN born anywhere in a step, on one rank, is caught on every rank: the step is skipped
everywhere (``optim.skip_nonfinite``), or the run stops naming the step (exit 3), never a
silent continuation.

The NaN is planted mid-step (`optimized.train.faults`) at PP 2 x DP 2 with EP 2 (world 4,
gloo), in the production stack (the optimized runner, FSDP2 on): in one rank's attention
output, its routed experts' output (before the combine all-to-all carries it to other
ranks' tokens) or the gradient the loss sends back. On a GPU the kernels' old bfloat16
rounding stored such a NaN as zero (`tests/test_ops_nonfinite.py`); here what is held is
that nothing on its way (p2p sends, all-to-all, FSDP2's reductions, the norm's all-reduce)
loses it, and that every rank takes the same decision.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.runtime import launch
from optimized.train import apply_overrides, faults, validate_config
from optimized.train.cli import _rank_main
from optimized.train.config import TrainConfig
from optimized.train.trainer import NonFiniteError

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = ("parallel.pp=2", "parallel.dp=2", "parallel.ep=2")
FAULTS = ("nan-attention@0:3", "nan-mlp@0:3", "nan-loss-grad@0:1")
"""Rank 3 is pp-rank 1 (stages 1 and 2: attention and routed experts, no loss); rank 1 is
pp-rank 0 of the other replica, which holds the loss. All in step 1 of 2: a run that skips
it trains on in step 2."""


def _config(*overrides: str) -> TrainConfig:
    base = [
        "model.name=tiny-deepseek-v2", "data.seq_len=16", "data.micro_batch_size=1",
        "data.micro_batches=4", "steps=2", "optim.warmup_steps=1", *LAYOUT,
    ]  # fmt: skip
    return validate_config(apply_overrides(TrainConfig(), base + list(overrides)))


def _each_fault(faults: tuple[str, ...]) -> list[tuple[list, str | None]]:
    """On one rank: for each fault, the losses of a run that skips non-finite steps, and the
    error of one that stops (None if it did not)."""
    results = []
    for fault in faults:
        os.environ["TWINPIPE_FAULT"] = fault
        skipped = _rank_main(_config("optim.skip_nonfinite=true"))["losses"]
        try:
            _rank_main(_config())
            stopped = None
        except NonFiniteError as error:
            stopped = str(error)
        results.append((skipped, stopped))
    del os.environ["TWINPIPE_FAULT"]
    return results


@pytest.fixture(scope="module")
def outcomes() -> list[list[tuple[list, str | None]]]:
    """Every rank's results, all faults in one launch (ranks start once)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("TWINPIPE_RUNNER", raising=False)  # the production runner: optimized
        patch.delenv("TWINPIPE_FAULT", raising=False)
        return launch(_each_fault, 4, (FAULTS,))


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(FAULTS)), ids=FAULTS)
def test_a_nan_mid_step_skips_the_step_on_every_rank(outcomes, index):
    for rank, per_fault in enumerate(outcomes):
        losses, _ = per_fault[index]
        assert len(losses) == 2 and losses[0] is None, (rank, losses)
        assert math.isfinite(losses[1]), (rank, losses)
    # Every rank logged the same figures: the loss is the global one.
    assert len({tuple(per_fault[index][0]) for per_fault in outcomes}) == 1


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(FAULTS)), ids=FAULTS)
def test_without_skipping_a_nan_mid_step_stops_every_rank_naming_step_and_rank(outcomes, index):
    planted = int(FAULTS[index].rsplit(":", 1)[1])
    what = "gradient norm" if "loss-grad" in FAULTS[index] else "loss"
    for rank, per_fault in enumerate(outcomes):
        _, stopped = per_fault[index]
        assert stopped is not None, f"rank {rank} went on past a NaN ({FAULTS[index]})"
        assert stopped.startswith(f"non-finite {what} at step 1:"), stopped
        ranks = stopped.split("non-finite gradients on rank(s) ")[1].split("]")[0] + "]"
        assert str(planted) in ranks, stopped


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_command_exits_3_naming_the_step():
    """``twinpipe train`` itself: exit 3 (a crash, DESIGN.md), the step and the ranks in its
    error; never 0 or 1. (Two ranks, PP 2: the exit code's path is the layout's no matter.)"""
    done = subprocess.run(
        [sys.executable, "-m", "harness.cli", "train", "--model", "tiny-deepseek-v2",
         "--seq-len", "16", "--micro-batch-size", "1", "--micro-batches", "4", "--pp", "2",
         "--dp", "1", "--ep", "1", "--nproc", "2", "--steps", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "TWINPIPE_FAULT": "nan-mlp@0:1"},
    )  # fmt: skip
    assert done.returncode == 3, done.stderr[-3000:]
    assert "non-finite loss at step 1" in done.stderr, done.stderr[-3000:]
    assert "non-finite gradients on rank(s) [" in done.stderr


def test_a_fault_with_nothing_to_hit_is_an_error():
    """A malformed fault names what is valid; a NaN for a rank's loss gradient on a rank with
    no loss raises rather than passing quietly (`mid_step`)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TWINPIPE_FAULT", "nan-everything@1:0")
        with pytest.raises(ValueError, match="KIND@STEP.*nan-attention"):
            faults.fault_from_env()
    fault = faults.Fault("nan-loss-grad", 0, 0)
    with pytest.raises(RuntimeError, match="rank 0 ran no loss in step 1; choose a rank"):
        with faults.mid_step(fault, 0, 0, torch.nn.Linear(2, 2)):
            pass
