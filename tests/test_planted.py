"""Planted bugs fail the bfloat16 verdict; the same stack without them passes.

Each bug (`harness.planted`) is small: nothing crashes and the loss hardly moves. Tiny
presets, bfloat16, lockstep with the float32 noise floor; one launch per model runs the
correct stack and every bug that applies (the bugs are planted and removed in the ranks).
At real widths: the README's `twinpipe compare --plant` commands.
"""

from __future__ import annotations

import pytest

from harness.lockstep import RankPlan, run_rank
from harness.verdict import build_report
from models import SeededWeights, preset
from models.distributed import ParallelConfig, launch
from models.training import OptimizerConfig

CASES = {
    "tiny-gpt-oss": (
        "activation-round-to-zero",
        "attention-drops-sink",
        "attention-drops-window",
        "dispatch-wrong-expert",
    ),
    "tiny-qwen3-moe": ("cross-entropy-grad-1.01", "dispatch-wrong-expert"),
}
PARALLEL = ParallelConfig(
    pp=2, dp=1, ep=1, micro_batches=4, micro_batch_size=1, seq_len=32, dtype="bfloat16"
)
"""Sequences of 32 tokens: longer than tiny GPT-OSS's sliding window (16)."""


def _worker(plans):
    return [run_rank(plan) for plan in plans]


_REPORTS: dict = {}


def _reports(name: str) -> dict:
    if name not in _REPORTS:
        model = preset(name)
        state = SeededWeights(model)
        plans = [
            RankPlan(
                model,
                PARALLEL,
                state,
                "reference",
                "optimized",
                1,
                OptimizerConfig(),
                noise_floor=True,
                track_memory=False,
                progress=False,
                plant=plant,
            )  # fmt: skip
            for plant in (None, *CASES[name])
        ]
        per_rank = launch(_worker, PARALLEL.world_size, (plans,))
        _REPORTS[name] = {
            plan.plant: build_report(plan, [r[i] for r in per_rank], name)
            for i, plan in enumerate(plans)
        }
    return _REPORTS[name]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(CASES))
def test_the_correct_stack_passes(name):
    report = _reports(name)[None]
    assert report["passed"], report["problems"]
    assert report["noise_floor"]["steps"][0]["passed"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("name", "plant"), [(name, plant) for name, plants in CASES.items() for plant in plants]
)
def test_a_planted_bug_fails(name, plant):
    report = _reports(name)[plant]
    assert not report["passed"]
    assert report["config"]["plant"] == plant
    # The noise floor names what is wrong (the fixed backstop alone misses the subtle ones).
    floor = report["noise_floor"]["steps"][0]
    assert not floor["passed"], floor["problems"]
