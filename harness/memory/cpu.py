"""The memory tracker's CPU accounting: every storage seen, to the byte.

CPU has no allocator statistics, so `CpuAccounting` keeps its own books: a
``TorchDispatchMode`` notes each storage an aten op touches, a weak reference on
each storage reports its free, and ``UntypedStorage.resize_`` is wrapped while a
step runs (the optimized stack's early frees never reach the dispatcher). Every
change goes into the step's log (`harness.memory.cpu_log`), which gives the peak and,
replayed, its breakdown (`harness.memory.tracker` explains the whole design).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from harness.memory.cpu_log import EventLog, StorageRecord
from harness.memory.shared import (
    StepState,
    grads_of,
    iter_parameters,
    iter_source,
    registered_names,
)

# Only one CPU tracker may wrap UntypedStorage.resize_ at a time.
_ACTIVE_LOCK = threading.Lock()
_ACTIVE: list[CpuAccounting] = []


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
    """A tracker's books on CPU (a `harness.memory.shared.Backend`); the tracker's step,
    mark and register call into it.

    State is kept across steps: storages outlive steps.
    """

    def __init__(self, state: StepState) -> None:
        self.state = state
        self._log = EventLog(state)
        self._live: dict[int, StorageRecord] = {}
        self._uids = itertools.count()
        self._pending_frees: list[StorageRecord] = []
        self._categories: dict[int, str] = {}
        self._described: dict[int, StorageRecord] = {}
        """Every storage seen during the step, by uid (what the top-tensor list names)."""
        self._names: dict[int, str] = {}
        """Registered tensors' names by ``id`` (parameters, their gradients, optimizer state)."""
        self._top: list[dict[str, Any]] = []
        self._hooks: list[Any] = []
        self._mode: _AccountingMode | None = None
        self._saved_resize: Any = None
        self._had_own_resize = False
        self._thread = threading.get_ident()

    @property
    def _in_step(self) -> bool:
        return self.state.in_step

    def mark(self) -> None:
        self._drain_frees()
        self._scan_sources()
        self._log.mark()

    def registered(self, parameters: Any) -> None:
        """Sources were registered during a step: adopt them now."""
        self._scan_sources()
        if parameters is not None:
            self._install_grad_hooks(parameters)

    def current_bytes(self) -> int:
        self._drain_frees()
        return self._log.current

    def enter(self) -> None:
        with _ACTIVE_LOCK:
            if _ACTIVE:
                raise RuntimeError(
                    "another MemoryTracker step is running in this process; "
                    "one CPU tracker per process at a time"
                )
            _ACTIVE.append(self)
        self._drain_frees()
        self._thread = threading.get_ident()
        self._categories = {}
        # Storages alive from earlier steps are in use now: they start the log.
        self._described = {info.uid: info for info in self._live.values()}
        self._log.start(self._live.values())
        self._scan_sources()
        self._log.marks = [len(self._log)]
        for source in self.state.sources["parameters"]:
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
        self._log.move_late_frees()
        self.state.breakdown, self._top = self._log.breakdown(self._categories, self._described)

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
            info.touched = len(self._log)
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
        now = len(self._log)
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
            info = StorageRecord(next(self._uids), nbytes, None)  # type: ignore[arg-type]
            info.ref = weakref.ref(storage, self._make_free_callback(key, info))
            self._live[key] = info
            if nbytes:
                self._record(info.uid, nbytes)
            info.touched = len(self._log)
        elif nbytes != info.nbytes:
            delta = nbytes - info.nbytes
            info.nbytes = nbytes
            self._record(info.uid, delta)
        return info.uid

    def _make_free_callback(self, key: int, info: StorageRecord) -> Callable[[Any], None]:
        tracker_ref = weakref.ref(self)

        def on_free(_dead: Any) -> None:
            tracker = tracker_ref()
            if tracker is not None:
                info.late = threading.get_ident() != tracker._thread
                tracker._forget(key, info)

        return on_free

    def _forget(self, key: int, info: StorageRecord) -> None:
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
                self._log.free(info)
            info.nbytes = 0

    def _record(self, uid: int, delta: int) -> None:
        if not self._in_step:
            return
        self._drain_frees()
        self._log.record(uid, delta)

    def _scan_sources(self) -> None:
        self._names = registered_names(self.state.sources)
        for category, sources in self.state.sources.items():
            for source in sources:
                for tensor in iter_source(source, category):
                    self._see(tensor, category)
            if category == "parameters":  # their .grad are gradients
                for source in sources:
                    for grad in grads_of(iter_source(source, "parameters")):
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

        for parameter in iter_parameters(source):
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
