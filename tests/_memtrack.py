"""A byte-accurate tracker of live tensor storage on CPU, for the memory tests.

Every tensor an aten op returns while the tracker is active is registered by
its storage; a weak reference releases the bytes when the storage dies, and
``UntypedStorage.resize_`` (which does not pass through the dispatcher) is
patched so frees made with ``untyped_storage().resize_(0)`` count too. Storage
that existed before the tracker started is not counted, nor are views of it. Allocations made inside
one aten kernel and freed before it returns are invisible, as with
`torch.distributed._tools.mem_tracker.MemTracker` whose approach this follows.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class StorageTracker(TorchDispatchMode):
    """Tracks ``current`` and ``peak`` bytes of storage allocated while active."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._bytes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._original_resize = torch.UntypedStorage.resize_

    def _observe(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        nbytes = storage.nbytes()
        if key not in self._bytes:
            self._refs[key] = weakref.ref(storage, lambda _ref, key=key: self._release(key))
            self._bytes[key] = 0
        self.current += nbytes - self._bytes[key]
        self._bytes[key] = nbytes
        self.peak = max(self.peak, self.current)

    def _release(self, key: int) -> None:
        self.current -= self._bytes.pop(key, 0)
        self._refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            item.untyped_storage()._cdata
            for item in tree_flatten((args, kwargs))[0]
            if isinstance(item, torch.Tensor)
        }
        for item in tree_flatten(out)[0]:
            if not isinstance(item, torch.Tensor) or item.device.type == "meta":
                continue
            storage = item.untyped_storage()
            # A storage an input already had is a view or an in-place result: it is
            # new only if the tracker has seen it allocated (then the size may change).
            if storage._cdata in inputs and storage._cdata not in self._bytes:
                continue
            self._observe(storage)
        return out

    def __enter__(self):
        tracker = self
        original = self._original_resize

        def resize_(storage: torch.UntypedStorage, size: int):
            result = original(storage, size)
            if storage._cdata in tracker._bytes:
                tracker._observe(storage)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._original_resize
        return super().__exit__(*exc)

    def reset_peak(self) -> None:
        self.peak = self.current
