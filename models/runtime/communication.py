"""Every collective and point-to-point call a rank makes, counted: kind, group, calls, bytes.

Why here: both stacks, the FSDP2 runner and the trainer communicate through
`torch.distributed` (DESIGN.md: nothing home-made replaces it), and the estimator's
traffic prediction (`optimized.estimator.communication`) is judged against these
counts. `models` is what every side may import, so the counter lives next to
`models.runtime.distributed`.

How: `CommunicationCounter` replaces the public entry points of
`torch.distributed` (and of `torch.distributed.distributed_c10d`, where they live)
with wrappers that note the call and then run the original. FSDP2 calls them through
the module (``dist.all_gather_single``, ``dist.reduce_scatter_single``), the stacks
through ``dist.all_to_all_single``, ``dist.isend`` ...; so every call any of them makes
while the counter is installed passes a wrapper. One entry point may call another
(``all_gather_into_tensor`` calls ``all_gather_single``): only the outermost call
counts. The ``*_object`` helpers are not wrapped: the tensor collectives they run
inside are counted instead (their pickled size is only known there).

Bytes: what this rank would send to and receive from its peers if every collective
were done by direct messages, no ring or tree relaying, and never counting the slice a
rank keeps for itself. So an all-gather of an ``s``-byte shard over ``n`` ranks sends
and receives ``(n - 1) * s``; a reduce-scatter of an ``n * s``-byte input the same; an
all-reduce of ``s`` bytes ``(n - 1) * s`` each way; an all-to-all the rows bound for,
or coming from, other ranks; a broadcast ``(n - 1) * s`` from the source and ``s`` to
each other rank; a send or receive its tensor. These figures do not depend on the
backend's algorithm, so a prediction from the config can match them to the byte.

Groups are named from the `Layout` (``pp``, ``dp``, ``ep``, ``expert_replica``, ``host``, the
p2p streams ``forward0`` ... ``backward1`` of `models.runtime.p2p`) and ``world`` for the default
group; any other group by its ranks (``ranks(0,2)``).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

KINDS = (
    "send",
    "recv",
    "all_to_all",
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "barrier",
)
"""Every kind a count can have, in report order."""


@dataclass(slots=True)
class Traffic:
    """Calls and bytes of one kind on one group."""

    calls: int = 0
    """How many calls."""
    sent: int = 0
    """Bytes this rank sent to other ranks (see the module docstring)."""
    received: int = 0
    """Bytes this rank received from other ranks."""

    @property
    def bytes(self) -> int:
        """Sent plus received."""
        return self.sent + self.received

    def add(self, other: Traffic) -> None:
        self.calls += other.calls
        self.sent += other.sent
        self.received += other.received

    def as_dict(self) -> dict[str, int]:
        return {
            "calls": self.calls,
            "bytes_sent": self.sent,
            "bytes_received": self.received,
            "bytes": self.bytes,
        }


Counts = dict[tuple[str, str], Traffic]
"""``(kind, group name) -> Traffic``."""


def by_kind(counts: Counts) -> dict[str, dict[str, Any]]:
    """``kind -> {calls, bytes_sent, bytes_received, bytes, groups: {group -> same}}``, in
    `KINDS` order, kinds with no call left out."""
    out: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        groups = {g: t for (k, g), t in sorted(counts.items()) if k == kind and t.calls}
        if not groups:
            continue
        total = Traffic()
        for traffic in groups.values():
            total.add(traffic)
        out[kind] = {**total.as_dict(), "groups": {g: t.as_dict() for g, t in groups.items()}}
    return out


def total_bytes(counts: Counts) -> int:
    return sum(t.bytes for t in counts.values())


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def _size(group) -> int:
    return dist.get_world_size(group)


def _group_rank(group) -> int:
    return dist.get_rank(group)


def _row_bytes(tensor: torch.Tensor) -> int:
    rows = tensor.shape[0] if tensor.dim() else 1
    return _nbytes(tensor) // rows if rows else 0


def _a2a_single(a: dict) -> tuple[int, int]:
    group, out, inp = a.get("group"), a["output"], a["input"]
    n, me = _size(group), _group_rank(group)
    splits_in = a.get("input_split_sizes") or [inp.shape[0] // n] * n
    splits_out = a.get("output_split_sizes") or [out.shape[0] // n] * n
    sent = (sum(splits_in) - splits_in[me]) * _row_bytes(inp)
    received = (sum(splits_out) - splits_out[me]) * _row_bytes(out)
    return sent, received


def _a2a_list(a: dict) -> tuple[int, int]:
    me = _group_rank(a.get("group"))
    sent = sum(_nbytes(t) for i, t in enumerate(a["input_tensor_list"]) if i != me)
    received = sum(_nbytes(t) for i, t in enumerate(a["output_tensor_list"]) if i != me)
    return sent, received


def _gather_single(a: dict) -> tuple[int, int]:
    shard, n = _nbytes(a["input_tensor"]), _size(a.get("group"))
    return (n - 1) * shard, _nbytes(a["output_tensor"]) - shard


def _gather_list(a: dict) -> tuple[int, int]:
    shard, n = _nbytes(a["tensor"]), _size(a.get("group"))
    return (n - 1) * shard, sum(_nbytes(t) for t in a["tensor_list"]) - shard


def _reduce_scatter_single(a: dict) -> tuple[int, int]:
    out, n = _nbytes(a["output"]), _size(a.get("group"))
    return _nbytes(a["input"]) - out, (n - 1) * out


def _reduce_scatter_list(a: dict) -> tuple[int, int]:
    group = a.get("group")
    me, n, out = _group_rank(group), _size(group), _nbytes(a["output"])
    sent = sum(_nbytes(t) for i, t in enumerate(a["input_list"]) if i != me)
    return sent, (n - 1) * out


def _all_reduce(a: dict) -> tuple[int, int]:
    tensors = a["tensors"] if "tensors" in a else [a["tensor"]]
    moved = (_size(a.get("group")) - 1) * sum(_nbytes(t) for t in tensors)
    return moved, moved


def _root(a: dict, global_key: str, group_key: str) -> bool:
    """Whether this rank is the root (``src``/``dst``) of a rooted collective."""
    if a.get(group_key) is not None:
        return _group_rank(a.get("group")) == a[group_key]
    return dist.get_rank() == a.get(global_key)


def _broadcast(a: dict) -> tuple[int, int]:
    size = _nbytes(a["tensor"])
    if _root(a, "src", "group_src"):
        return (_size(a.get("group")) - 1) * size, 0
    return 0, size


def _reduce(a: dict) -> tuple[int, int]:
    size = _nbytes(a["tensor"])
    if _root(a, "dst", "group_dst"):
        return 0, (_size(a.get("group")) - 1) * size
    return size, 0


def _gather(a: dict) -> tuple[int, int]:
    size = _nbytes(a["tensor"])
    if _root(a, "dst", "group_dst"):
        return 0, (_size(a.get("group")) - 1) * size
    return size, 0


def _scatter(a: dict) -> tuple[int, int]:
    size = _nbytes(a["tensor"])
    if _root(a, "src", "group_src"):
        return (_size(a.get("group")) - 1) * size, 0
    return 0, size


def _send(a: dict) -> tuple[int, int]:
    return _nbytes(a["tensor"]), 0


def _recv(a: dict) -> tuple[int, int]:
    return 0, _nbytes(a["tensor"])


ENTRY_POINTS: dict[str, tuple[str, Callable[[dict], tuple[int, int]]]] = {
    "send": ("send", _send),
    "isend": ("send", _send),
    "recv": ("recv", _recv),
    "irecv": ("recv", _recv),
    "all_to_all_single": ("all_to_all", _a2a_single),
    "all_to_all": ("all_to_all", _a2a_list),
    "all_gather": ("all_gather", _gather_list),
    "all_gather_into_tensor": ("all_gather", _gather_single),
    "all_gather_single": ("all_gather", _gather_single),
    "_all_gather_base": ("all_gather", _gather_single),
    "reduce_scatter": ("reduce_scatter", _reduce_scatter_list),
    "reduce_scatter_tensor": ("reduce_scatter", _reduce_scatter_single),
    "reduce_scatter_single": ("reduce_scatter", _reduce_scatter_single),
    "_reduce_scatter_base": ("reduce_scatter", _reduce_scatter_single),
    "all_reduce": ("all_reduce", _all_reduce),
    "all_reduce_coalesced": ("all_reduce", _all_reduce),
    "broadcast": ("broadcast", _broadcast),
    "reduce": ("reduce", _reduce),
    "gather": ("gather", _gather),
    "scatter": ("scatter", _scatter),
    "barrier": ("barrier", lambda a: (0, 0)),
    "monitored_barrier": ("barrier", lambda a: (0, 0)),
}
"""``torch.distributed`` function -> (kind, its bytes (sent, received) from its arguments)."""

_P2P_BATCH = "batch_isend_irecv"


def group_names(layout: Any) -> dict[int, str]:
    """``id(process group) -> name`` for a `models.runtime.Layout`'s groups: ``pp``,
    ``dp``, ``ep``, ``expert_replica``, ``host`` (a gloo group beside NCCL; on a gloo job it
    is the default group, ``world``) and the p2p streams ``forward0`` ... ``backward1``."""
    names = {}
    for name in ("pp", "dp", "ep", "expert_replica", "host"):
        group = getattr(layout, f"{name}_group", None)
        if group is not None:
            names[id(group)] = name
    streams = getattr(layout, "streams", None)
    if streams is not None:
        for name, group in zip(streams._fields, streams, strict=True):
            names[id(group)] = name
    return names


class CommunicationCounter:
    """Counts this process's `torch.distributed` calls while `counting` (see the module
    docstring). Install it once per process, as a context manager::

        with CommunicationCounter(group_names(layout)) as counter:
            with counter.counting():
                step()
            counts = counter.take()
    """

    _installed: CommunicationCounter | None = None

    def __init__(self, names: dict[int, str] | None = None) -> None:
        self.names = dict(names or {})
        self.counts: Counts = {}
        self.active = False
        self._local = threading.local()
        self._saved: list[tuple[Any, str, Any]] = []

    # ------------------------------------------------------------ install
    def __enter__(self) -> CommunicationCounter:
        if CommunicationCounter._installed is not None:
            raise RuntimeError("a CommunicationCounter is already installed in this process")
        CommunicationCounter._installed = self
        for name, (kind, measure) in ENTRY_POINTS.items():
            self._wrap(name, self._counted(name, kind, measure))
        self._wrap(_P2P_BATCH, self._counted_batch)
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def install(self) -> CommunicationCounter:
        """Put the wrappers in place (as entering the context does)."""
        return self.__enter__()

    def remove(self) -> None:
        """Restore the original entry points (idempotent)."""
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved = []
        if CommunicationCounter._installed is self:
            CommunicationCounter._installed = None

    def _wrap(self, name: str, make: Callable[[Callable], Callable]) -> None:
        original = getattr(c10d, name, None)
        if original is None:
            return
        wrapper = make(original)
        for module in (dist, c10d):
            if getattr(module, name, None) is original:
                self._saved.append((module, name, original))
                setattr(module, name, wrapper)

    # ------------------------------------------------------------ counting
    @contextmanager
    def counting(self) -> Iterator[CommunicationCounter]:
        """Count the calls made inside (the counter must be installed)."""
        if CommunicationCounter._installed is not self:
            raise RuntimeError("CommunicationCounter.counting: install the counter first")
        self.active = True
        try:
            yield self
        finally:
            self.active = False

    def start(self) -> None:
        """Count from now on (`counting` as two calls, for loops a context cannot wrap)."""
        if CommunicationCounter._installed is not self:
            raise RuntimeError("CommunicationCounter.start: install the counter first")
        self.active = True

    @contextmanager
    def paused(self) -> Iterator[CommunicationCounter]:
        """Count nothing inside (calls a step makes that are not its traffic: a logged
        value's reduction), then go on as before."""
        was_active, self.active = self.active, False
        try:
            yield self
        finally:
            self.active = was_active

    def stop(self) -> Counts:
        """Stop counting; the counts since the last `take`, and start again from zero."""
        self.active = False
        return self.take()

    def take(self) -> Counts:
        """The counts so far, and start again from zero."""
        counts, self.counts = self.counts, {}
        return counts

    def group_name(self, group) -> str:
        if group is None or group is c10d.GroupMember.WORLD:
            return "world"
        name = self.names.get(id(group))
        if name is None:
            name = "ranks(" + ",".join(map(str, dist.get_process_group_ranks(group))) + ")"
        return name

    def _note(self, kind: str, group, sent: int, received: int) -> None:
        key = (kind, self.group_name(group))
        traffic = self.counts.setdefault(key, Traffic())
        traffic.calls += 1
        traffic.sent += sent
        traffic.received += received

    def _outermost(self) -> bool:
        return self.active and not getattr(self._local, "depth", 0)

    @contextmanager
    def _inside(self):
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1

    def _counted(self, name: str, kind: str, measure) -> Callable[[Callable], Callable]:
        def make(original: Callable) -> Callable:
            signature = inspect.signature(original)

            def wrapper(*args, **kwargs):
                if self._outermost():
                    bound = signature.bind(*args, **kwargs)
                    arguments = dict(bound.arguments)
                    if dist.get_rank(arguments.get("group")) >= 0:  # a member of the group
                        sent, received = measure(arguments)
                        self._note(kind, arguments.get("group"), sent, received)
                with self._inside():
                    return original(*args, **kwargs)

            wrapper.__name__ = name
            wrapper.counted_by = self
            return wrapper

        return make

    def _counted_batch(self, original: Callable) -> Callable:
        def wrapper(p2p_op_list, *args, **kwargs):
            if self._outermost():
                for op in p2p_op_list:
                    name = getattr(op.op, "__name__", "")
                    kind = "send" if "send" in name else "recv"
                    size = _nbytes(op.tensor)
                    self._note(kind, op.group, *((size, 0) if kind == "send" else (0, size)))
            with self._inside():
                return original(p2p_op_list, *args, **kwargs)

        wrapper.counted_by = self
        return wrapper


@contextmanager
def counted_step(layout: Any, steps: list[Counts]) -> Iterator[None]:
    """Count the calls made inside (groups named from ``layout``) and append them to
    ``steps``: installs a counter for the duration, so nothing outside is touched."""
    with CommunicationCounter(group_names(layout)) as counter, counter.counting():
        yield
    steps.append(counter.take())
