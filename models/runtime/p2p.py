"""Point-to-point streams of the DualPipeV schedules: one process group per stream.

The problem. NCCL ignores the ``tag`` of ``isend``/``irecv``: between one pair of ranks on
one communicator it matches the k-th send to the k-th receive, whatever their tags
(gloo matches by tag, which is why the CPU runs never showed it). A DualPipeV rank
talks to its neighbour on four streams, the activations and the gradients of each of
its two chunks, and the schedule orders them differently on the two sides: at PP >= 3
pp-rank 0 sends F0 then B1 to pp-rank 1 while pp-rank 1 receives B1 first. Both are
``[mbs, seq, hidden]`` tensors of the run's dtype, so on one communicator an
activation would silently be taken for a gradient (or the ranks would hang).

The rule. Every stream is its own process group (`StreamGroups`, created for each
pipeline by `models.runtime.make_layout` and held by the `Layout`):

==============  ==========================  ==============================
stream          carries                     between pp-ranks
==============  ==========================  ==============================
``forward0``    chunk 0's activations       r -> r + 1
``forward1``    chunk 1's activations       r -> r - 1
``backward0``   chunk 0's input gradients   r -> r - 1
``backward1``   chunk 1's input gradients   r -> r + 1
==============  ==========================  ==============================

On one stream, between one pair of ranks, messages go one way only, and each side
handles the micro-batches of that stream in order (forwards of a chunk run in
micro-batch order, so do its backwards). So the k-th send is the k-th receive by
construction: order per pair is all the matching needs, on NCCL and on gloo alike, and no
tag is passed. One way per pair and group also keeps NCCL from serialising a send
behind a receive on the same pair's stream.

Why not DualPipe's matched ``batch_isend_irecv``: it makes correctness a property of
every action posting, on both ranks, lists that pair up exactly; the schedules here send
a tensor as soon as it exists and receive it when it is needed, which reads like the
paper's figure and lets the optimized stack free a sent activation the moment the
schedule knows it was taken (`optimized.estimator.schedule.send_completions`). Separate
groups keep that order and make the matching hold whatever either side posts
meanwhile. The price is four communicators per pipeline instead of one (NCCL creates
each pair's on first use).

`PointToPoint` is the seam the schedules send through: `TorchPointToPoint` is
``torch.distributed`` (what every run uses); a test puts an in-process transport there
that matches sends to receives as NCCL does (tests/test_p2p_order.py).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist

FORWARD, BACKWARD = "forward", "backward"
"""The two directions: activations (forward) and input gradients (backward)."""

DIRECTIONS = (FORWARD, BACKWARD)


class StreamGroups(NamedTuple):
    """One pipeline's four point-to-point streams, each its own process group over the
    pipeline's PP ranks (the table in the module docstring)."""

    forward0: dist.ProcessGroup
    """Chunk 0's activations, pp-rank r to r + 1."""
    forward1: dist.ProcessGroup
    """Chunk 1's activations, pp-rank r to r - 1."""
    backward0: dist.ProcessGroup
    """Chunk 0's input gradients, pp-rank r to r - 1."""
    backward1: dist.ProcessGroup
    """Chunk 1's input gradients, pp-rank r to r + 1."""

    def pick(self, direction: str, chunk: int) -> dist.ProcessGroup:
        """The group of ``direction``'s (`FORWARD` or `BACKWARD`) stream of ``chunk``."""
        return getattr(self, stream_name(direction, chunk))


def stream_name(direction: str, chunk: int) -> str:
    """``forward0`` ... ``backward1``: the stream's field in `StreamGroups`, and the group
    name the communication counter reports (`models.runtime.group_names`)."""
    if direction not in DIRECTIONS or chunk not in (0, 1):
        raise ValueError(
            f"no p2p stream for direction={direction!r}, chunk={chunk!r}: expected a direction "
            f"in {DIRECTIONS} and chunk 0 or 1"
        )
    return f"{direction}{chunk}"


def new_stream_groups(ranks: list[int]) -> StreamGroups:
    """The four stream groups over one pipeline's global ``ranks`` (collective: every rank
    of the world calls it for every pipeline, in the same order)."""
    return StreamGroups(*(dist.new_group(ranks) for _ in StreamGroups._fields))


class Work(Protocol):
    """What ``isend``/``irecv`` return: ``wait()`` until the tensor is sent or received."""

    def wait(self) -> object: ...


class PointToPoint(Protocol):
    """How a schedule sends and receives one tensor; ``peer`` is a global rank, ``group``
    the stream's group (`StreamGroups.pick`)."""

    def isend(self, tensor: torch.Tensor, peer: int, group: dist.ProcessGroup) -> Work: ...

    def irecv(self, tensor: torch.Tensor, peer: int, group: dist.ProcessGroup) -> Work: ...


class TorchPointToPoint:
    """`PointToPoint` through ``torch.distributed`` (NCCL or gloo), untagged."""

    def isend(self, tensor: torch.Tensor, peer: int, group: dist.ProcessGroup) -> Work:
        return dist.isend(tensor, dst=peer, group=group)

    def irecv(self, tensor: torch.Tensor, peer: int, group: dist.ProcessGroup) -> Work:
        return dist.irecv(tensor, src=peer, group=group)
