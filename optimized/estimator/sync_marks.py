"""Where each chunk's gradients of a step are complete, read off the DualPipeV walk.

Gradient accumulation across micro-batches should reduce each FSDP unit's gradient once
per step, after the last contribution to it and not before. DualPipeV interleaves
micro-batches and chunks, so the trainer cannot say "this is the last backward"; but the
schedule is static, so each rank knows it in advance:

- every chunk runs M backwards; the one numbered M - 1 (0-based, in the chunk's order)
  is the last, whatever the phase it falls in;
- a zero-bubble backward leaves the routed experts' weight gradients to a later W step
  (W steps run deferred backwards oldest first). If the chunk's last backward was
  deferred, or any of its deferred backwards is W'd after it, the experts' gradients are
  complete only after that W: the *last weight* mark.

`sync_marks` replays `optimized.estimator.schedule.rank_actions` (the order both stacks
run) and returns the marks as ordinals the runner counts itself: "the chunk's n-th
backward", "the rank's n-th W step". The FSDP2 runner (`optimized.pipeline.gradient_sync`)
syncs there and only there, and the traffic estimator
(`optimized.estimator.communication`) counts one reduction per unit from the same marks.
"""

from __future__ import annotations

from typing import NamedTuple

from optimized.estimator.schedule import rank_actions


class SyncMarks(NamedTuple):
    """When a rank's gradients of each chunk are complete within one step."""

    last_backward: tuple[int, int]
    """Per chunk: the ordinal (0-based, among that chunk's backwards) of its last backward."""
    last_weight: tuple[int | None, int | None]
    """Per chunk: the ordinal (0-based, among the rank's W steps) of the W after which the
    chunk's deferred expert weight gradients are complete; None where they are complete at
    the chunk's last backward (nothing of the chunk is W'd after it)."""


def sync_marks(rank: int, pp: int, num_microbatches: int, deferring: bool = True) -> SyncMarks:
    """The marks of pp-rank ``rank``. ``deferring``: whether the schedule defers expert
    weight gradients to W steps (the optimized stack); the reference computes them in
    the backward, so its W steps complete nothing."""
    backwards = [0, 0]
    last_backward_at: list[int | None] = [None, None]
    last_backward_ordinal: list[int | None] = [None, None]
    deferred: list[int] = []  # chunks of deferred backwards not yet W'd, oldest first
    weights = 0
    last_weight: list[tuple[int, int] | None] = [None, None]  # (position, W ordinal)
    for position, action in enumerate(rank_actions(rank, pp, num_microbatches)):
        if action.kind in ("B", "FB"):
            chunk = action.backward_chunk if action.kind == "FB" else action.chunk
            last_backward_at[chunk] = position
            last_backward_ordinal[chunk] = backwards[chunk]
            backwards[chunk] += 1
            if action.deferred and deferring:
                deferred.append(chunk)
        elif action.kind == "W":
            if deferred:
                last_weight[deferred.pop(0)] = (position, weights)
            weights += 1
    if None in last_backward_ordinal or deferred:
        raise AssertionError(f"rank {rank}: a chunk has no backward or a deferral has no W")
    marks_weight = tuple(
        None if mark is None or mark[0] < last_backward_at[chunk] else mark[1]
        for chunk, mark in enumerate(last_weight)
    )
    return SyncMarks(tuple(last_backward_ordinal), marks_weight)  # type: ignore[arg-type]
