"""DualPipeV's eight phases, walked action by action to count micro-batches in flight.

The estimator does not trust a closed formula for how many micro-batches each
chunk holds: it replays the schedule (DeepSeek's ``dualpipev.py`` order, the
table in FACTS.md) and counts. A forward of chunk ``c`` adds one micro-batch
to ``c``; its backward removes it; a backward whose weight gradients are
deferred leaves the weight-gradient inputs behind until the matching W.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

PHASES = ("nF0", "nF0F1", "nB1W1F1", "nF0B1F1B0", "nB1F1B0", "nB1B0", "nWB0", "nW")


class Action(NamedTuple):
    """One schedule step of one rank."""

    phase: str
    """Which of the eight phases."""
    kind: str
    """``F``, ``B``, ``W`` or ``FB`` (an overlapped forward of one chunk with a backward of
    the other)."""
    chunk: int
    """Chunk of the forward (or of the B / W)."""
    backward_chunk: int | None
    """For ``FB``: the chunk whose backward overlaps."""
    deferred: bool
    """A B whose weight gradients wait for a later W."""


def rank_actions(rank: int, pp: int, num_microbatches: int) -> Iterator[Action]:
    """The actions of pp-rank ``rank``, in order, phase by phase."""
    if not 0 <= rank < pp:
        raise ValueError(f"rank={rank} is outside 0..{pp - 1}")
    last = rank == pp - 1
    for _ in range(2 * (pp - rank - 1)):
        yield Action("nF0", "F", 0, None, False)
    for _ in range(rank + 1):
        yield Action("nF0F1", "F", 0, None, False)
        yield Action("nF0F1", "F", 1, None, False)
    for _ in range(pp - rank - 1):
        yield Action("nB1W1F1", "B", 1, None, True)
        yield Action("nB1W1F1", "W", 1, None, False)
        yield Action("nB1W1F1", "F", 1, None, False)
    for repeat in range(num_microbatches - 2 * pp + rank + 1):
        if repeat == 0 and last:
            yield Action("nF0B1F1B0", "F", 0, None, False)
            yield Action("nF0B1F1B0", "B", 1, None, False)
        else:
            yield Action("nF0B1F1B0", "FB", 0, 1, False)
        yield Action("nF0B1F1B0", "FB", 1, 0, False)
    for _ in range(pp - rank - 1):
        yield Action("nB1F1B0", "B", 1, None, False)
        yield Action("nB1F1B0", "FB", 1, 0, False)
    repeats, deferring = rank + 1, False
    for repeat in range(repeats):
        if repeat == repeats // 2 and rank % 2 == 1:
            deferring = True
        yield Action("nB1B0", "B", 1, None, deferring)
        if repeat == repeats // 2 and rank % 2 == 0:
            deferring = True
        yield Action("nB1B0", "B", 0, None, deferring)
    for _ in range(pp - rank - 1):
        yield Action("nWB0", "W", 0, None, False)
        yield Action("nWB0", "B", 0, None, True)
    for _ in range(rank + 1):
        yield Action("nW", "W", 0, None, False)


class InFlight(NamedTuple):
    """Micro-batches each chunk holds after an action."""

    action: Action
    forward_micro_batch: int | None
    """Micro-batch the action's forward ran (None without a forward)."""
    backward_micro_batch: int | None
    """Micro-batch the action's backward ran (None without a backward)."""
    in_flight: tuple[int, int]
    """Micro-batches forwarded and not yet backwarded, per chunk."""
    awaiting_w: tuple[int, int]
    """Micro-batches backwarded with weight gradients deferred, not yet W'd, per chunk."""


def walk(rank: int, pp: int, num_microbatches: int) -> Iterator[InFlight]:
    """Each action of ``rank`` with the in-flight counts after it.

    Micro-batches go through each chunk in order (F and B are FIFO per chunk);
    W steps drain deferred backwards in the order they ran.
    """
    forwarded, backwarded = [0, 0], [0, 0]
    awaiting: list[int] = []  # chunks of deferred backwards, oldest first
    for action in rank_actions(rank, pp, num_microbatches):
        f_mb = b_mb = None
        if action.kind in ("F", "FB"):
            f_mb = forwarded[action.chunk]
            forwarded[action.chunk] += 1
        b_chunk = action.backward_chunk if action.kind == "FB" else action.chunk
        if action.kind in ("B", "FB"):
            if backwarded[b_chunk] >= forwarded[b_chunk]:
                raise AssertionError(f"rank {rank}: B{b_chunk} before its F in {action.phase}")
            b_mb = backwarded[b_chunk]
            backwarded[b_chunk] += 1
            if action.deferred:
                awaiting.append(b_chunk)
        if action.kind == "W" and awaiting:
            awaiting.pop(0)
        in_flight = (forwarded[0] - backwarded[0], forwarded[1] - backwarded[1])
        waiting = (awaiting.count(0), awaiting.count(1))
        yield InFlight(action, f_mb, b_mb, in_flight, waiting)
    if forwarded != [num_microbatches] * 2 or backwarded != [num_microbatches] * 2 or awaiting:
        raise AssertionError(f"rank {rank}: schedule left work undone")
