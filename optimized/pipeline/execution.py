"""Per-step execution state of the optimized DualPipeV: deferred work, early frees, exchanges.

One `ExecutionContext` lives for one training step and is passed to every
stage function (no global or class-level state). It owns:

- the `WeightGradStore` that the expert grouped GEMMs defer weight gradients
  into during zero-bubble backwards, and the ops object wired to it;
- the early frees. A stage-boundary buffer whose data nobody reads any more
  (the sorted tokens once the dispatch all-to-all has sent them, the received
  tokens once the experts have grouped them, the expert outputs once the
  combine all-to-all has sent them) still has to stay alive as a Python
  object: it is the root its stage's backward starts from. Its *storage* is
  released with ``untyped_storage().resize_(0)``. A free that must wait for a
  communication is attached to that `Exchange` and drained where the exchange
  is waited;
- the guard that makes frees safe: every stage forward runs under
  `saved_tensors_hooks` that note which storages autograd saved, and a storage
  that is saved, or that an exchange did not copy (expert parallelism 1: the
  "exchange" is the identity and buffers share storage), is never freed. The
  unpack hook raises if backward ever reads a freed storage.

`Exchange` is an asynchronous ``all_to_all_single`` (``async_op=True``): the
stage that starts it returns at once and the stage that consumes the rows
waits. On CPU gloo runs it on its own threads; on CUDA the NCCL work runs on
the communicator's stream, and ``wait()`` orders the compute stream after it,
which is also what makes freeing the sent buffer after ``wait()`` safe there.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
import torch.distributed as dist

from optimized.ops import OptimizedOps, WeightGradStore


def free_storage(tensor: torch.Tensor) -> None:
    """Release the memory behind ``tensor`` (and every view of it); metadata stays."""
    tensor.untyped_storage().resize_(0)


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


class Exchange:
    """An ``all_to_all_single`` in flight; `wait` returns the received rows."""

    def __init__(self, output: torch.Tensor, handle, source: torch.Tensor | None) -> None:
        self._output = output
        self._handle = handle
        self._source = source  # kept alive until the send has completed
        self._frees: list[torch.Tensor] = []

    @property
    def copied(self) -> bool:
        """False when no communication happened and the output is the input itself."""
        return self._handle is not None

    def free_on_wait(self, tensor: torch.Tensor) -> None:
        """Free ``tensor``'s storage once this exchange has completed."""
        self._frees.append(tensor)

    def wait(self) -> torch.Tensor:
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
        for tensor in self._frees:
            free_storage(tensor)
        self._frees, self._source = [], None
        return self._output


def start_exchange(
    x: torch.Tensor,
    output_split_sizes: list[int],
    input_split_sizes: list[int],
    group: dist.ProcessGroup | None,
) -> Exchange:
    """Start sending rows of ``x`` by split sizes; the identity without a group of size > 1."""
    if group is None or dist.get_world_size(group) == 1:
        return Exchange(x, None, None)
    x = x.contiguous()
    out = x.new_empty((sum(output_split_sizes),) + tuple(x.shape[1:]))
    handle = dist.all_to_all_single(
        out, x, list(output_split_sizes), list(input_split_sizes), group=group, async_op=True
    )
    return Exchange(out, handle, x)


class FreedStorageRead(RuntimeError):
    """Backward unpacked a tensor whose storage was freed early: a bug in the free rules."""


class ExecutionContext:
    """State of one optimized DualPipeV step: weight-gradient store, ops, early frees."""

    def __init__(self, record_frees: bool = False, recompute_attention: bool = True) -> None:
        self.weight_grads = WeightGradStore()
        self.ops = OptimizedOps(self.weight_grads, recompute_attention)
        # Storages autograd saved, held weakly: a storage dies with its graph.
        self._saved: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.record_frees = record_frees
        self.freed: list[tuple[str, torch.Tensor]] = []
        """``(what, tensor)`` of every early free, when ``record_frees`` (tests)."""

    # ---------------------------------------------------------- saved tensors
    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        self._saved[storage._cdata] = storage
        return tensor

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.numel() and tensor.untyped_storage().nbytes() == 0:
            raise FreedStorageRead(
                f"backward read a saved tensor {tuple(tensor.shape)} whose storage was freed"
            )
        return tensor

    @contextmanager
    def stage(self):
        """Run one stage forward, noting what autograd saves for its backward."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def is_saved(self, tensor: torch.Tensor) -> bool:
        return _storage_key(tensor) in self._saved

    # ---------------------------------------------------------------- frees
    def can_free(self, tensor: torch.Tensor | None, *, still_read: tuple = ()) -> bool:
        """Whether ``tensor``'s storage is unread from now on.

        ``still_read`` names tensors that stay in use (e.g. an exchange's output
        when the exchange was the identity); a storage shared with one of them,
        or saved by any stage's backward, is kept.
        """
        if tensor is None or tensor.untyped_storage().nbytes() == 0:
            return False
        key = _storage_key(tensor)
        saved = self._saved.get(key)
        if saved is not None and saved._cdata == key:
            return False
        return all(other is None or _storage_key(other) != key for other in still_read)

    def free_now(self, what: str, tensor: torch.Tensor, *, still_read: tuple = ()) -> None:
        """Free ``tensor``'s storage now if nothing reads it any more."""
        if self.can_free(tensor, still_read=still_read):
            self._note(what, tensor)
            free_storage(tensor)

    def free_after(self, what: str, tensor: torch.Tensor, exchange: Exchange) -> None:
        """Free ``tensor``'s storage when ``exchange`` (which reads it) is waited."""
        if exchange.copied and self.can_free(tensor):
            self._note(what, tensor)
            exchange.free_on_wait(tensor)

    def _note(self, what: str, tensor: torch.Tensor) -> None:
        if self.record_frees:
            self.freed.append((what, tensor))

    # ------------------------------------------------------------ end of step
    def finish(self) -> None:
        """Check the step left no deferred work behind and drop the bookkeeping."""
        self.weight_grads.assert_empty()
        self._saved.clear()
