"""The memory tracker's CPU accounting: every storage seen, to the byte.

CPU has no allocator statistics, so `CpuAccounting` keeps its own books: a
``TorchDispatchMode`` notes each storage an aten op touches, a weak reference on
each storage reports its free, and ``UntypedStorage.resize_`` is wrapped while a
step runs (the optimized stack's early frees never reach the dispatcher). Every
change is logged as ``(storage, delta)``; the peak's breakdown is found by
replaying the log (`harness.memory` explains the whole design).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from harness.memory.tracker import CATEGORIES, _grads_of, _iter_parameters, _iter_source

if TYPE_CHECKING:
    from harness.memory.tracker import MemoryTracker

TOP_TENSORS = 5
"""How many of the largest live storages at the peak the tracker names."""

# Only one CPU tracker may wrap UntypedStorage.resize_ at a time.
_ACTIVE_LOCK = threading.Lock()
_ACTIVE: list[CpuAccounting] = []


@dataclass
class _Storage:
    """What the tracker knows about one live storage."""

    uid: int
    nbytes: int
    ref: weakref.ref
    what: str = ""
    """Where it came from: a registered tensor's name, or the aten op that made it."""
    shape: tuple[int, ...] = ()
    """The shape of the tensor it was first seen through."""
    dtype: str = ""
    named: bool = False
    """Whether ``what`` is a registered name (an op's name gives way to it)."""
    touched: int = 0
    """The step's event count when the step's own thread last used it (see `_late_frees`)."""
    late: bool = False
    """Freed by another thread (a gloo worker letting a collective's buffer go)."""


def _iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors in an op's arguments or results (flat lists, tuples, dicts)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _iter_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _iter_tensors(item)


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).replace("torch.", "")


class _AccountingMode(TorchDispatchMode):
    """Sees every aten op of the step and reports storages to the tracker."""

    def __init__(self, tracker: CpuAccounting) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tracker = self.tracker
        # Inputs first: a storage born outside the dispatcher counts from now.
        used = [
            tracker._see(t, what=func)
            for t in itertools.chain(_iter_tensors(args), _iter_tensors(kwargs))
        ]
        result = func(*args, **kwargs)
        for tensor in _iter_tensors(result):
            tracker._see(tensor, what=func)
        # In-place size changes (Tensor.resize_, set_) show on the inputs.
        if func.overloadpacket in _RESIZING_OPS:
            for tensor in itertools.chain(_iter_tensors(args), _iter_tensors(kwargs)):
                tracker._see(tensor)
        tracker._touched(used)  # the inputs were in use until the op returned
        return result


_RESIZING_OPS = {
    torch.ops.aten.resize_,
    torch.ops.aten.resize_as_,
    torch.ops.aten.set_,
}


class CpuAccounting:
    """A tracker's books on CPU; the tracker's step, mark and register call into it.

    State is kept across steps: storages outlive steps.
    """

    def __init__(self, tracker: MemoryTracker) -> None:
        self.tracker = tracker
        self._live: dict[int, _Storage] = {}
        self._uids = itertools.count()
        self._pending_frees: list[_Storage] = []
        self._categories: dict[int, str] = {}
        self._described: dict[int, _Storage] = {}
        """Every storage seen during the step, by uid (what the top-tensor list names)."""
        self._names: dict[int, str] = {}
        """Registered tensors' names by ``id`` (parameters, their gradients, optimizer state)."""
        self._top: list[dict[str, Any]] = []
        self._events: list[tuple[int, int]] = []
        self._current = 0
        self._peak_event = 0
        self._hooks: list[Any] = []
        self._mode: _AccountingMode | None = None
        self._saved_resize: Any = None
        self._had_own_resize = False
        self._thread = threading.get_ident()
        self._late: list[tuple[int, int]] = []
        """This step's frees made by another thread: (index of the free's event, event count
        when the step's thread last used the storage)."""
        self._marks: list[int] = []
        """The event count at each timeline entry of the step (the start, then each mark)."""

    @property
    def _in_step(self) -> bool:
        return self.tracker._in_step

    def mark(self) -> None:
        self._drain_frees()
        self._scan_sources()
        self._marks.append(len(self._events))

    def registered(self, parameters: Any) -> None:
        """Sources were registered during a step: adopt them now."""
        self._scan_sources()
        if parameters is not None:
            self._install_grad_hooks(parameters)

    def current_bytes(self) -> int:
        self._drain_frees()
        return self._current

    def enter(self) -> None:
        with _ACTIVE_LOCK:
            if _ACTIVE:
                raise RuntimeError(
                    "another MemoryTracker step is running in this process; "
                    "one CPU tracker per process at a time"
                )
            _ACTIVE.append(self)
        self._drain_frees()
        self._events = []
        self._late = []
        self._thread = threading.get_ident()
        self._categories = {}
        self._described = {}
        # Storages alive from earlier steps are in use now: they start the log.
        for info in self._live.values():
            self._described[info.uid] = info
            if info.nbytes:
                self._events.append((info.uid, info.nbytes))
            info.touched = len(self._events)
        self._current = sum(info.nbytes for info in self._live.values())
        self.tracker._peak_bytes = self._current
        self._peak_event = len(self._events)
        self.tracker._peak_moment = dict(self.tracker._moment)
        self._scan_sources()
        self._marks = [len(self._events)]
        for source in self.tracker._sources["parameters"]:
            self._install_grad_hooks(source)
        self._wrap_resize()
        self._mode = _AccountingMode(self)
        self._mode.__enter__()

    def exit(self) -> None:
        try:
            if self._mode is not None:
                self._mode.__exit__(None, None, None)
                self._mode = None
        finally:
            self._unwrap_resize()
            for handle in self._hooks:
                handle.remove()
            self._hooks = []
            with _ACTIVE_LOCK:
                if self in _ACTIVE:
                    _ACTIVE.remove(self)
        self._drain_frees()
        self._scan_sources()
        self._late_frees()
        self.tracker._breakdown = self._replay_breakdown()

    def top_tensors(self) -> list[dict[str, Any]]:
        """The largest storages live at the last step's peak (see `MemoryTracker`)."""
        return [dict(entry) for entry in self._top]

    def _see(
        self, tensor: torch.Tensor, category: str | None = None, what: Any = None
    ) -> int | None:
        """Account for ``tensor``'s storage; returns its uid (None if not tracked here).

        ``what``: the aten op it passed through (named when first seen) or, for a
        registered tensor, nothing: its registered name is looked up."""
        if isinstance(tensor, DTensor):  # an FSDP2 shard: this rank holds its local rows
            tensor = tensor._local_tensor
        if tensor.device.type != "cpu":
            return None
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested, storage-less subclasses
            return None
        uid = self._see_storage(storage)
        if uid is None:
            return None
        info = self._live.get(storage._cdata)
        if info is not None and info.uid == uid:
            self._described[uid] = info
            info.touched = len(self._events)
            if not info.what:
                info.shape, info.dtype = tuple(tensor.shape), _dtype_name(tensor)
                info.what = str(what) if what is not None else "tensor"
            name = self._names.get(id(tensor)) if category is not None else None
            if name is not None and not info.named:
                info.what, info.named = name, True
                info.shape, info.dtype = tuple(tensor.shape), _dtype_name(tensor)
        if category is not None:
            self._categories.setdefault(uid, category)
        return uid

    def _touched(self, uids: list[int | None]) -> None:
        """The storages behind ``uids`` were in use until now (an op's inputs)."""
        now = len(self._events)
        for uid in uids:
            info = self._described.get(uid) if uid is not None else None
            if info is not None:
                info.touched = now

    def _see_storage(self, storage: torch.UntypedStorage) -> int | None:
        key = storage._cdata
        nbytes = storage.nbytes()
        info = self._live.get(key)
        if info is not None and info.ref() is None:  # died, callback not run yet
            self._forget(key, info)
            info = None
        if info is None:
            info = _Storage(next(self._uids), nbytes, None)  # type: ignore[arg-type]
            info.ref = weakref.ref(storage, self._make_free_callback(key, info))
            self._live[key] = info
            if nbytes:
                self._record(info.uid, nbytes)
            info.touched = len(self._events)
        elif nbytes != info.nbytes:
            delta = nbytes - info.nbytes
            info.nbytes = nbytes
            self._record(info.uid, delta)
        return info.uid

    def _make_free_callback(self, key: int, info: _Storage) -> Callable[[Any], None]:
        tracker_ref = weakref.ref(self)

        def on_free(_dead: Any) -> None:
            tracker = tracker_ref()
            if tracker is not None:
                info.late = threading.get_ident() != tracker._thread
                tracker._forget(key, info)

        return on_free

    def _forget(self, key: int, info: _Storage) -> None:
        # May run from a garbage-collector callback in the middle of other
        # bookkeeping: only unlink here, the free is recorded by _drain_frees.
        if self._live.get(key) is info:
            del self._live[key]
            self._pending_frees.append(info)

    def _drain_frees(self) -> None:
        # Frees only lower the total, so recording them just before the next
        # event keeps the peak exact.
        while self._pending_frees:
            info = self._pending_frees.pop()
            if info.nbytes and self._in_step:
                if info.late and info.touched < len(self._events):
                    self._late.append((len(self._events), info.touched))
                self._events.append((info.uid, -info.nbytes))
                self._current -= info.nbytes
            info.nbytes = 0

    def _record(self, uid: int, delta: int) -> None:
        if not self._in_step:
            return
        self._drain_frees()
        self._events.append((uid, delta))
        self._current += delta
        if self.tracker._timeline and self._current > self.tracker._timeline[-1]["peak_bytes"]:
            self.tracker._timeline[-1]["peak_bytes"] = self._current
        if self._current > self.tracker._peak_bytes:
            self.tracker._peak_bytes = self._current
            self._peak_event = len(self._events)
            self.tracker._peak_moment = dict(self.tracker._moment)

    def _late_frees(self) -> None:
        """Frees made by another thread, moved back to the step's last use of the storage;
        the peak, its moment and the timeline are then replayed from the log.

        gloo's worker thread holds a collective's buffers until it lets the finished work
        go, and when the program has already dropped a buffer the worker's release frees
        it, as soon as that thread next gets the GIL: a moment the OS scheduler decides.
        Counted then, the same step's peak moved by one 65,536 B buffer in some runs of
        the same test (tiny-deepseek-v2 DP2 EP2 FSDP2, bf16: 1 in 3 to 1 in 30 under
        load). The program drops such a buffer after its last use, so the free is
        recorded there, and the figure no longer depends on the scheduler.
        """
        moved = [(touched, index) for index, touched in self._late if touched < index]
        if not moved:
            return
        inserts: dict[int, list[tuple[int, int]]] = {}
        for touched, index in moved:
            inserts.setdefault(touched, []).append(self._events[index])
        skipped = {index for _, index in moved}
        marks = set(self._marks)
        events: list[tuple[int, int]] = []
        position: dict[int, int] = {}  # a mark's event count in the new log
        for i in range(len(self._events) + 1):
            events.extend(inserts.get(i, ()))
            if i in marks:
                position[i] = len(events)
            if i < len(self._events) and i not in skipped:
                events.append(self._events[i])
        self._events = events
        self._marks = [position[m] for m in self._marks]
        prefix = list(itertools.accumulate((delta for _, delta in events), initial=0))
        timeline, tracker = self.tracker._timeline, self.tracker
        start = self._marks[0]
        tracker._peak_bytes, self._peak_event = max(prefix[: start + 1]), start
        for count in range(start + 1, len(prefix)):
            if prefix[count] > tracker._peak_bytes:
                tracker._peak_bytes, self._peak_event = prefix[count], count
        ends = self._marks[1:] + [len(events)]
        for entry, begin, end in zip(timeline, self._marks, ends):
            entry["start_bytes"] = prefix[begin]
            entry["peak_bytes"] = max(prefix[begin : end + 1])
        # The moment of the peak: the last mark before the event that reached it.
        owner = max([0] + [k for k, m in enumerate(self._marks) if m < self._peak_event])
        tracker._peak_moment = {k: timeline[owner][k] for k in ("phase", "micro_batch")}

    def _learn_names(self) -> None:
        """Names of the registered tensors: parameters by their module names, their
        gradients as ``grad of NAME``, optimizer state as ``KEY of NAME``."""
        names: dict[int, str] = {}
        by_parameter: dict[int, str] = {}
        for source in self.tracker._sources["parameters"]:
            if isinstance(source, torch.nn.Module):
                for name, param in source.named_parameters():
                    names[id(param)] = by_parameter[id(param)] = name
                    if param.grad is not None:
                        names[id(param.grad)] = f"grad of {name}"
                for name, buffer in source.named_buffers():
                    names[id(buffer)] = name
        for source in self.tracker._sources["optimizer_state"]:
            if isinstance(source, torch.optim.Optimizer):
                for param, state in source.state.items():
                    owner = by_parameter.get(id(param), "a parameter")
                    for key, value in state.items():
                        if isinstance(value, torch.Tensor):
                            names[id(value)] = f"{key} of {owner}"
        self._names = names

    def _scan_sources(self) -> None:
        self._learn_names()
        for category, sources in self.tracker._sources.items():
            for source in sources:
                for tensor in _iter_source(source, category):
                    self._see(tensor, category)
            if category == "parameters":  # their .grad are gradients
                for source in sources:
                    for grad in _grads_of(_iter_source(source, "parameters")):
                        self._see(grad, "gradients")

    def _install_grad_hooks(self, source: Any) -> None:
        tracker_ref = weakref.ref(self)

        def on_grad(parameter: torch.Tensor) -> None:
            tracker = tracker_ref()
            if tracker is not None and tracker._in_step and parameter.grad is not None:
                owner = tracker._names.get(id(parameter))
                if owner is not None:
                    tracker._names[id(parameter.grad)] = f"grad of {owner}"
                tracker._see(parameter.grad, "gradients")

        for parameter in _iter_parameters(source):
            self._hooks.append(parameter.register_post_accumulate_grad_hook(on_grad))

    def _wrap_resize(self) -> None:
        storage_class = torch.UntypedStorage
        self._had_own_resize = "resize_" in storage_class.__dict__
        original = storage_class.resize_
        self._saved_resize = original
        tracker_ref = weakref.ref(self)

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            tracker = tracker_ref()
            if tracker is not None and tracker._in_step and storage.device.type == "cpu":
                tracker._see_storage(storage)  # adopt at its old size if new to us
                result = original(storage, size)
                tracker._see_storage(storage)  # record the change
                return result
            return original(storage, size)

        resize_.__doc__ = original.__doc__
        storage_class.resize_ = resize_  # type: ignore[method-assign]

    def _unwrap_resize(self) -> None:
        if self._saved_resize is None:
            return
        if self._had_own_resize:
            torch.UntypedStorage.resize_ = self._saved_resize  # type: ignore[method-assign]
        else:
            del torch.UntypedStorage.resize_
        self._saved_resize = None

    def _replay_breakdown(self) -> dict[str, int]:
        live: dict[int, int] = {}
        for uid, delta in self._events[: self._peak_event]:
            live[uid] = live.get(uid, 0) + delta
        breakdown = dict.fromkeys(CATEGORIES, 0)
        for uid, nbytes in live.items():
            breakdown[self._categories.get(uid, "activations")] += nbytes
        largest = sorted(
            ((nbytes, uid) for uid, nbytes in live.items() if nbytes > 0), reverse=True
        )[:TOP_TENSORS]
        self._top = []
        for nbytes, uid in largest:
            info = self._described.get(uid)
            self._top.append(
                {
                    "what": info.what if info is not None else "?",
                    "shape": list(info.shape) if info is not None else [],
                    "dtype": info.dtype if info is not None else "",
                    "bytes": nbytes,
                    "category": self._categories.get(uid, "activations"),
                }
            )
        breakdown["total"] = sum(breakdown[category] for category in CATEGORIES)
        peak = self.tracker._peak_bytes
        if breakdown["total"] != peak:  # pragma: no cover - an accounting bug
            raise AssertionError(f"memory replay gave {breakdown['total']} bytes, peak was {peak}")
        return breakdown

    # ------------------------------------------------------------------ CUDA statistics
