"""The memory estimator against the measured peak of the FSDP2 runner (``optimized-fsdp``).

As `tests/test_estimator_vs_measured.py` does for the two unsharded stacks: one launch per
layout and dtype runs ``optimized`` and ``optimized-fsdp`` side by side (free trajectories,
as `twinpipe compare --trajectory free` measures them, two steps, routing counted), and per
rank the estimate of the step with the higher peak, under the routing that step saw, must
agree with the tracker within 1%; its weights and optimizer state must equal the tracker's.
The estimate is the one `twinpipe compare` prints (`harness.compare.estimates.add_estimates`:
`ShardedAdamW`'s float32 moments and masters, the runner's grad-sync and reshard settings).

The runner's defaults only (``grad_sync="step"``, ``reshard_after_forward`` off): the
other settings hold FSDP2's gathered module and reduce-scatter buffers in the walk, which
the estimator does not yet count (see `EstimateConfig.fsdp`). Each layout has one model
(launches dominate the time), each family at one layout with DP > 1.
"""

from __future__ import annotations

import contextlib

import pytest

import harness.compare.meter as meter
from harness.compare.lockstep import run_rank
from harness.compare.rank import RankPlan
from models.network import SeededWeights, preset
from models.runtime import OptimizerConfig, ParallelConfig, launch
from tests._measured_peaks import observed_estimates, peak_steps

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

STACK = "optimized-fsdp"
CASES = (
    ("tiny-gpt-oss", (1, 2, 1), "float32"),
    ("tiny-deepseek-v2", (1, 2, 2), "bfloat16"),
    ("tiny-qwen3-moe", (2, 2, 2), "float32"),
)
"""Each family at one layout with DP > 1, each dtype: bfloat16 (the float32 masters and moments
beside bfloat16 parameters) at DP 2 EP 2, where its ranks hold different experts.
Qwen3-MoE at (2, 2, 2) ran in bfloat16 before; what bfloat16 adds to the sharded state does
not depend on PP, and bfloat16 matmuls are emulated on CPUs without it (many times float32's
time)."""
TOLERANCE = 0.01


def _rank(model, parallel, state, optimizer):
    """`run_rank` with a memory mark at the start of the FSDP2 runner's optimizer step (the
    schedule's last mark is its last W), so that the step's own peak is read too: the last
    interval of the step region's timeline."""
    from optimized.pipeline.sharding import ShardedOptimizedPipeline  # noqa: PLC0415

    step_peaks: list[int] = []
    optimizer_step, region = ShardedOptimizedPipeline.optimizer_step, meter.Meter.region

    def marked_step(self):
        if self.observer is not None:
            self.observer("optimizer:step", None)
        optimizer_step(self)

    @contextlib.contextmanager
    def tracked(self, phase, held=0):
        with region(self, phase, held):
            yield
        if self.enabled and self.pipeline.name == STACK:
            step_peaks.append(self.tracker.timeline[-1]["peak_bytes"])

    ShardedOptimizedPipeline.optimizer_step = marked_step
    meter.Meter.region = tracked
    try:
        plan = RankPlan(
            model, parallel, state, "optimized", STACK, 2, optimizer,
            trajectory="free", progress=False, count_routing=True,
        )  # fmt: skip
        result = run_rank(plan)
    finally:
        ShardedOptimizedPipeline.optimizer_step = optimizer_step
        meter.Meter.region = region
    result["optimizer_step_peaks"] = step_peaks
    return result


@pytest.mark.parametrize(
    ("name", "layout", "dtype"), CASES, ids=[f"{n}-{lay}-{d}" for n, lay, d in CASES]
)
def test_fsdp_estimate_matches_measured_peak(name, layout, dtype):
    pp, dp, ep = layout
    model = preset(name)
    parallel = ParallelConfig(
        pp=pp, dp=dp, ep=ep, micro_batches=2 * pp if pp > 1 else 2,
        micro_batch_size=2, seq_len=64, dtype=dtype,
    )  # fmt: skip
    assert parallel.grad_sync == "step" and not parallel.reshard_after_forward
    per_rank = launch(
        _rank, parallel.world_size, (model, parallel, SeededWeights(model), OptimizerConfig())
    )
    steps = peak_steps(per_rank, STACK)
    observed = observed_estimates(model, parallel, per_rank, STACK)
    rows, failures = [], []
    for rank, result in enumerate(per_rank):
        measured = result[STACK]["memory"][steps[rank]]
        est = observed[rank]
        error = est["peak_bytes"] / measured["total"] - 1
        rows.append(
            f"{result['coords']}: est {est['peak_bytes']:,} ({est['peak_phase']} "
            f"{est['peak_action']}) measured {measured['total']:,} ({error:+.2%}) at "
            f"{measured['peak_moment']}"
        )
        static = (("weights_bytes", "parameters"), ("optimizer_bytes", "optimizer_state"))
        for ours, theirs in static:
            if est[ours] != measured[theirs]:
                failures.append(f"{result['coords']} {ours} {est[ours]:,} != {measured[theirs]:,}")
        if abs(error) > TOLERANCE:
            failures.append(f"{result['coords']} peak off by {error:+.2%}")
        # The optimizer step on its own (at tiny width the walk's peak hides it): the
        # same step's figure, from the same routing (the step holds no routed activations).
        step_peak = result["optimizer_step_peaks"][steps[rank]]
        step_error = est["optimizer_step_bytes"] / step_peak - 1
        rows.append(f"  optimizer step: est {est['optimizer_step_bytes']:,} measured "
                    f"{step_peak:,} ({step_error:+.3%})")  # fmt: skip
        if abs(step_error) > TOLERANCE / 10:
            failures.append(f"{result['coords']} optimizer step off by {step_error:+.3%}")
    print(f"\n{name} {STACK} {layout} {dtype}:\n  " + "\n  ".join(rows))
    assert not failures, "\n".join(failures + rows)
