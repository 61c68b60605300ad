"""DualPipeV's eight phases, walked action by action to count micro-batches in flight.

The estimator does not trust a closed formula for how many micro-batches each
chunk holds: it replays the schedule (DeepSeek's ``dualpipev.py`` order, the
table in FACTS.md) and counts. A forward of chunk ``c`` adds one micro-batch
to ``c``; its backward removes it; a backward whose weight gradients are
deferred leaves the weight-gradient inputs behind until the matching W.
"""

from __future__ import annotations

import functools
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


class Message(NamedTuple):
    """One point-to-point message of the schedule: activations or gradients of a chunk."""

    kind: str
    """``activation`` (a forward's output) or ``gradient`` (a backward's input gradient)."""
    chunk: int
    micro_batch: int


class CommEvent(NamedTuple):
    """A rank's receive or send of one message, in its program order."""

    op: str
    """``recv`` or ``send``."""
    peer: int
    message: Message


def _forward_peers(rank: int, pp: int, chunk: int) -> tuple[int | None, int | None]:
    """(source, destination) of a forward of ``chunk`` on ``rank``; None: no message (the
    embedding, the loss, or the last rank's local hand-over between its chunks)."""
    if chunk == 0:
        return (rank - 1 if rank > 0 else None), (rank + 1 if rank < pp - 1 else None)
    return (rank + 1 if rank < pp - 1 else None), (rank - 1 if rank > 0 else None)


def comm_events(rank: int, pp: int, num_microbatches: int) -> Iterator[CommEvent]:
    """The point-to-point messages of ``rank``, in the order the optimized schedule posts them.

    A forward receives its input first and sends its output last; a backward receives the
    output gradient first and sends the input gradient last; an overlapped F&B receives
    the forward's input, then the backward's gradient, and sends the forward's output,
    then the backward's gradient (`optimized.pipeline.dualpipev.DualPipeV.FB`).
    """
    for step in walk(rank, pp, num_microbatches):
        action = step.action
        f_chunk = action.chunk if action.kind in ("F", "FB") else None
        b_chunk = {"B": action.chunk, "FB": action.backward_chunk}.get(action.kind)
        receives, sends = [], []
        if f_chunk is not None:
            src, dst = _forward_peers(rank, pp, f_chunk)
            message = Message("activation", f_chunk, step.forward_micro_batch)
            receives.append((src, message))
            sends.append((dst, message))
        if b_chunk is not None:
            # The gradient flows against the forward: it comes from the forward's destination.
            src, dst = _forward_peers(rank, pp, b_chunk)
            message = Message("gradient", b_chunk, step.backward_micro_batch)
            receives.append((dst, message))
            sends.append((src, message))
        for peer, message in receives:
            if peer is not None:
                yield CommEvent("recv", peer, message)
        for peer, message in sends:
            if peer is not None:
                yield CommEvent("send", peer, message)


def send_completions(rank: int, pp: int, num_microbatches: int) -> list[int | None]:
    """See `_send_completions` (cached: the partition search asks for the same rank's many
    times)."""
    return list(_send_completions(rank, pp, num_microbatches))


@functools.lru_cache(maxsize=256)
def _send_completions(rank: int, pp: int, num_microbatches: int) -> tuple[int | None, ...]:
    """For each send of ``rank`` (in its order), how many receives ``rank`` must have done
    before that send is known complete; None: not before the step ends.

    A send to a peer is complete once the peer has received it. The peer's program is
    known (the same schedule), so the send is certainly complete as soon as ``rank``
    has received any message the peer sent *after* receiving ours: waiting it then never
    blocks, whatever the timing. On gloo that is the only way to learn it (a send's
    work reports completion only once waited), and it makes the moment every send
    buffer is freed a property of the schedule, which the estimator replays.
    """
    events = list(comm_events(rank, pp, num_microbatches))
    peer_events = {
        peer: list(comm_events(peer, pp, num_microbatches))
        for peer in (rank - 1, rank + 1)
        if 0 <= peer < pp
    }
    # How many receives rank has done once it has received each (peer, message).
    received_after: dict[tuple[int, Message], int] = {}
    for event in events:
        if event.op == "recv":
            received_after[(event.peer, event.message)] = len(received_after) + 1
    completions: list[int | None] = []
    for event in events:
        if event.op != "send":
            continue
        theirs = peer_events[event.peer]
        taken = theirs.index(CommEvent("recv", rank, event.message))
        later = (e for e in theirs[taken + 1 :] if e.op == "send" and e.peer == rank)
        reply = next(later, None)
        completions.append(None if reply is None else received_after[(event.peer, reply.message)])
    return tuple(completions)
