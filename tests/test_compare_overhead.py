"""What `twinpipe compare` adds to a rank's training footprint, measured by the tracker.

Each stack alone: one training step (forward, backward, AdamW) under a `MemoryTracker`,
after a first step that created the optimizer state. The harness: both stacks in lockstep
(`harness.compare.lockstep`), the whole of the same step (both forwards and backwards, the in-place
comparisons, the candidate's update on the side, the baseline's update) under one
tracker. The difference is what the harness holds: one gradient-sized set of tensors in the
model dtype (the baseline's gradients while the candidate runs, the candidate's updated
parameters while the baseline updates), plus what the other stack keeps of its own (its
rotary tables, its last batch: 16 KiB here, its loss: 4 bytes, its step's load and balancing
losses: `models.network.StepBalance`), and in bfloat16 with the noise floor what the float32
truth keeps of its own (the same: its buffers, last batch and step's balance).
The float32 truth of a bfloat16 run is bounded the same way, its own step included: it
runs one micro-batch at a time (`ReferenceDualPipeV.sequential`), the bf16 parameters it
copies are freed and AdamW's moments parked in a file meanwhile (`harness.compare.spill`), and its
gradients wait in a file until they are compared, so nothing of it is held while the
candidate runs.
"""

from __future__ import annotations

import pytest
import torch

from harness.compare.lockstep import shared_step, step_batches
from harness.compare.rank import Rank, RankPlan
from harness.compare.record import StepRecord
from harness.compare.stacks import stack_class
from harness.memory import MemoryTracker
from models.network import SeededWeights, preset
from models.runtime import OptimizerConfig, ParallelConfig, launch, make_layout, synthetic_batch


def _buffer_bytes(part: torch.nn.Module) -> int:
    return sum(b.untyped_storage().nbytes() for b in part.buffers())


def _overhead_worker(model, parallel, state, noise_floor):
    layout = make_layout(parallel)
    alone = {}
    for name in ("reference", "optimized"):
        stack = stack_class(name)(model, parallel, layout, state, OptimizerConfig())
        stack.train_step(*synthetic_batch(model, parallel, 0))
        tracker = MemoryTracker("cpu")
        tracker.register(parameters=stack.part, optimizer_state=stack.optimizer)
        batch = synthetic_batch(model, parallel, 1)
        with tracker.step():
            stack.train_step(*batch)
        alone[name] = tracker.peak_bytes
        del stack, tracker
    # Free routing: the routing tapes' records are not what this bounds (the tracker here
    # sees the steps, not the tapes a pinned run attaches around them).
    plan = RankPlan(
        model, parallel, state, "reference", "optimized", 2, OptimizerConfig(),
        routing="free", noise_floor=noise_floor, track_memory=False, progress=False,
    )  # fmt: skip
    rank = Rank(plan, torch.device("cpu"))
    rank.start_step()
    shared_step(rank, step_batches(plan, 0), StepRecord())
    tracker = MemoryTracker("cpu")
    tracker.register(parameters=rank.baseline.part, optimizer_state=rank.baseline.optimizer)
    for key in ("baseline", "candidate"):  # each stack's schedule marks its actions
        getattr(rank, key).observer = lambda phase, mb, key=key: tracker.mark(f"{key} {phase}", mb)
    batches = step_batches(plan, 1)
    rank.start_step()
    with tracker.step():
        shared_step(rank, batches, StepRecord())
    during = [e["peak_bytes"] for e in tracker.timeline if e["phase"].startswith("candidate")]
    return {
        "alone": alone,
        "harness": tracker.peak_bytes,
        "during_candidate": max(during),
        "parameters": sum(p.untyped_storage().nbytes() for p in rank.baseline.part.parameters()),
        "buffers": _buffer_bytes(rank.baseline.part),
        # The float32 truth (bfloat16 with the noise floor) is a third stack: like the
        # baseline it keeps its buffers and its last micro-batches, not its parameters.
        "truth_buffers": _buffer_bytes(rank.truth.part) if rank.truth is not None else 0,
        # The baseline's schedule keeps its step's micro-batches until its next step, and
        # its step's routing controls (`models.network.StepBalance`: the load, aux, z).
        "batch": sum(t.untyped_storage().nbytes() for t in synthetic_batch(model, parallel, 1)),
        "balance": _balance_bytes(rank.baseline.balance),
    }


def _balance_bytes(balance) -> int:
    tensors = [balance.aux, balance.z, *balance.load.values()] if balance is not None else []
    return sum(t.untyped_storage().nbytes() for t in tensors)


CASES = [
    ("float32", False, (2, 1, 1)),
    ("bfloat16", False, (1, 2, 2)),
    ("bfloat16", True, (2, 2, 2)),
]
"""(dtype, noise floor, (pp, dp, ep)): each dtype and noise-floor setting once, each at a
layout of its own (pairwise: the three settings, the three layouts), the hardest (the float32
truth beside two bfloat16 stacks) at PP2 DP2 EP2."""


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(("dtype", "noise_floor", "layout"), CASES)
def test_the_harness_adds_at_most_one_copy_of_the_parameters(dtype, noise_floor, layout):
    model = preset("tiny-deepseek-v2")
    pp, dp, ep = layout
    parallel = ParallelConfig(
        pp=pp, dp=dp, ep=ep, micro_batches=2 * pp, micro_batch_size=2, seq_len=64, dtype=dtype
    )
    state = SeededWeights(model)
    results = launch(_overhead_worker, parallel.world_size, (model, parallel, state, noise_floor))
    for rank, r in enumerate(results):
        added = r["harness"] - max(r["alone"].values())
        # While the candidate runs, everything it does not own is the harness's.
        beside = r["during_candidate"] - r["alone"]["optimized"]
        print(
            f"rank {rank} {dtype} noise floor {noise_floor}: alone {r['alone']}, harness "
            f"{r['harness']:,} (+{added:,}); during the candidate's step {beside:+,} = "
            f"{beside / r['parameters']:.2f} x parameters ({r['parameters']:,} B; baseline "
            f"buffers {r['buffers']:,} B)"
        )
        assert r["during_candidate"] <= r["harness"]
        # What the baseline keeps (and its loss scalar); the truth keeps the same of its own.
        others = r["buffers"] + r["batch"] + r["balance"] + 64
        if noise_floor:
            others += r["truth_buffers"] + r["batch"] + r["balance"] + 64
        assert added <= r["parameters"] + others, (rank, added, r)
        assert r["parameters"] <= beside <= r["parameters"] + others, (rank, beside, r)
