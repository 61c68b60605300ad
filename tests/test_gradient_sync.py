"""Gradients reduced once per step per FSDP unit, at the schedule's marks: the marks as the
walk gives them, and what a wrong mark does (a planted early sync changes the gradients or
the counts, or leaves a gradient unreduced and the step refuses to finish)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.distributed.tensor import DTensor

from models.hf import resolve_model
from models.network import BalancedRouting, attach_routing_tape, build_model
from models.runtime import (
    OptimizerConfig,
    ParallelConfig,
    counted_step,
    launch,
    make_layout,
    synthetic_batch,
)
from optimized.estimator.communication import _rank_part, fsdp_units, runner_partition
from optimized.estimator.config import EstimateConfig
from optimized.estimator.schedule import rank_actions
from optimized.estimator.sync_marks import SyncMarks, sync_marks
from optimized.pipeline.gradient_sync import GradientSync
from optimized.pipeline.sharding import ShardedOptimizedPipeline
from optimized.train import ShardedAdamW


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_marks_are_each_chunks_last_backward_and_its_last_w(pp):
    """Every chunk's last backward is its M-th; a chunk has a last-weight mark exactly when
    one of its deferred backwards is W'd after its last backward, and that W is the last
    one to run any of the chunk's deferred work (replayed independently here)."""
    for m in (2 * pp, 2 * pp + 3):
        for rank in range(pp):
            marks = sync_marks(rank, pp, m)
            assert marks.last_backward == (m - 1, m - 1)
            assert sync_marks(rank, pp, m, deferring=False).last_weight == (None, None)
            queue, w_of_chunk, last_b, w_count = [], {0: [], 1: []}, {}, 0
            for position, action in enumerate(rank_actions(rank, pp, m)):
                if action.kind in ("B", "FB"):
                    chunk = action.backward_chunk if action.kind == "FB" else action.chunk
                    last_b[chunk] = position
                    if action.deferred:
                        queue.append(chunk)
                elif action.kind == "W":
                    w_of_chunk[queue.pop(0)].append((position, w_count))
                    w_count += 1
            for chunk in (0, 1):
                late = [w for pos, w in w_of_chunk[chunk] if pos > last_b[chunk]]
                assert marks.last_weight[chunk] == (late[-1] if late else None)
    # DualPipeV defers the last backwards of both chunks on the inner ranks.
    assert sync_marks(1, 2, 4).last_weight == (1, 0)


class _ExtraSync(GradientSync):
    """Also syncs chunk 0 at its first backward: one more reduction of each of its units."""

    def before_backward(self, chunk: int) -> None:
        first = self.backwards[chunk] == 0
        super().before_backward(chunk)
        if chunk == 0 and first:
            for unit in self.units[0].dense:
                unit.set_requires_gradient_sync(True)


class _UncheckedSync(GradientSync):
    """Skips the end-of-step check for unreduced gradients."""

    def finish(self, part) -> None:
        pass


def _one_step(model, parallel, state) -> dict:
    """tiny-gpt-oss, PP=1 DP=2 EP=1, M=2: a step with the right marks, then with planted
    ones; reduce-scatter counts and whole gradients of each."""
    layout = make_layout(parallel)
    out = {}
    right = sync_marks(0, 1, parallel.micro_batches)
    m = parallel.micro_batches
    plans = {
        "right": (GradientSync, right),
        "extra": (_ExtraSync, right),
        "early": (GradientSync, SyncMarks((m - 2, m - 1), right.last_weight)),
        "early-unchecked": (_UncheckedSync, SyncMarks((m - 2, m - 1), right.last_weight)),
        "no-w-mark": (GradientSync, SyncMarks(right.last_backward, (None, None))),
    }
    for name, (cls, marks) in plans.items():
        torch.manual_seed(0)
        runner = ShardedOptimizedPipeline(
            model, parallel, layout, state, OptimizerConfig(), optimizer_class=ShardedAdamW
        )
        sync = runner.schedule.gradient_sync
        runner.schedule.gradient_sync = cls(sync.units, marks, "step", True)
        ids, labels = synthetic_batch(model, parallel, 0)
        steps: list = []
        try:
            with counted_step(layout, steps):
                runner.forward_backward(ids, labels)
        except RuntimeError as error:
            out[name] = {"error": str(error)}
            continue
        grads = {}
        for pname, param in runner.part.named_parameters():
            grad = param.grad
            grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
            grads[pname] = grad.detach().clone()
        rs = steps[0].get(("reduce_scatter", "dp"))
        replica_rs = steps[0].get(("reduce_scatter", "expert_replica"))
        out[name] = {
            "grads": grads,
            "reduce_scatters": (rs.calls if rs else 0) + (replica_rs.calls if replica_rs else 0),
            "units": len(sync.all_units()),
            "chunk0_dense": len(sync.units[0].dense),
        }
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_planted_wrong_marks_change_gradients_or_counts():
    """Right marks: one reduce-scatter per unit. An extra sync at chunk 0's first backward:
    the same gradients, one more reduce-scatter per chunk-0 unit. A sync moved one backward
    early: the step refuses to finish (a later micro-batch's gradient would never be
    reduced), and without that check the gradients lose it. No last-W mark: the experts
    sync before their deferred W gradients land, and the step refuses to finish."""
    model = resolve_model("tiny-gpt-oss")
    parallel = ParallelConfig(pp=1, dp=2, ep=1, micro_batch_size=1, micro_batches=2, seq_len=16)
    state = build_model(model, seed=0).state_dict()
    for rank in launch(_one_step, 2, (model, parallel, state)):
        right, extra = rank["right"], rank["extra"]
        assert right["reduce_scatters"] == right["units"] > 0
        assert extra["reduce_scatters"] == right["units"] + right["chunk0_dense"]
        for name, grad in right["grads"].items():
            torch.testing.assert_close(extra["grads"][name], grad, rtol=1e-5, atol=1e-7)
        assert "never reduced" in rank["early"]["error"]
        assert "never reduced" in rank["no-w-mark"]["error"]
        lost = rank["early-unchecked"]
        assert lost["reduce_scatters"] == right["reduce_scatters"]
        changed = [
            n
            for n, g in right["grads"].items()
            if not torch.allclose(lost["grads"][n], g, rtol=1e-3, atol=1e-6)
        ]
        assert len(changed) >= right["chunk0_dense"], changed


PARALLEL_M8 = ParallelConfig(pp=2, dp=2, ep=2, micro_batch_size=1, micro_batches=8, seq_len=8)


def _reduce_scatters_at_m8(model, state, modes) -> dict:
    """PP=2 DP=2 EP=2 M=8, tiny-deepseek-v2 with balanced routing: one counted step of the
    FSDP runner per ``--grad-sync`` mode; its reduce-scatter calls (every group) and FSDP
    units, as the runner holds them and as the estimator counts them (`fsdp_units`)."""
    out = {}
    for mode in modes:
        parallel = replace(PARALLEL_M8, grad_sync=mode)
        layout = make_layout(parallel)
        torch.manual_seed(0)
        runner = ShardedOptimizedPipeline(
            model, parallel, layout, state, OptimizerConfig(), optimizer_class=ShardedAdamW
        )
        attach_routing_tape(runner.part, BalancedRouting())
        ids, labels = synthetic_batch(model, parallel, 0)
        steps: list = []
        with counted_step(layout, steps):
            runner.forward_backward(ids, labels)
        config = EstimateConfig(
            model, pp=parallel.pp, dp=parallel.dp, ep=parallel.ep,
            micro_batch_size=parallel.micro_batch_size, seq_len=parallel.seq_len,
            num_microbatches=parallel.micro_batches, fsdp=True, shard_optimizer=True,
        )  # fmt: skip
        partition = runner_partition(config)
        pp_rank, ep_rank = layout.pp_rank, layout.ep_rank
        chunks = (partition[pp_rank], partition[parallel.pp * 2 - 1 - pp_rank])
        part = _rank_part(config, pp_rank, ep_rank, chunks)
        out[mode] = {
            "reduce_scatters": sum(
                t.calls for (kind, _), t in steps[0].items() if kind == "reduce_scatter"
            ),
            "units": len(runner.schedule.gradient_sync.all_units()),
            "estimated_units": len(fsdp_units(config, part, chunks, pp_rank)),
        }
        del runner
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_one_reduce_scatter_per_unit_per_step_at_m8():
    """The issue's target layout, PP=2 DP=2 EP=2 M=8: with ``--grad-sync step`` (the
    default) each rank reduce-scatters once per FSDP unit per step; ``micro-batch`` once per
    unit and micro-batch, 8x. The units are both the runner's and the estimator's count."""
    model = resolve_model("tiny-deepseek-v2")
    state = build_model(model, seed=0).state_dict()
    ranks = launch(_reduce_scatters_at_m8, 4, (model, state, ("step", "micro-batch")))
    for rank, figures in enumerate(ranks):
        step, micro = figures["step"], figures["micro-batch"]
        assert step["units"] == step["estimated_units"] == micro["units"] > 0, (rank, figures)
        assert step["reduce_scatters"] == step["units"], (rank, figures)
        assert micro["reduce_scatters"] == 8 * micro["units"], (rank, figures)
    # the two stages hold different units (embedding, norm and head on the first)
    assert ranks[0]["step"]["units"] != ranks[2]["step"]["units"]
