"""One peak-memory tracker for CPU and CUDA, per rank, per training step.

The estimator is judged against this figure and the optimized stack's memory
tricks (early frees of stage-boundary storage, deferred weight gradients) are
proved by it, so on CPU it has to be exact to the byte. CPU has no allocator
statistics, so there the tracker does its own accounting:

- every aten op runs through a ``TorchDispatchMode`` that notes each storage it
  has not seen yet (outputs: new allocations; inputs: storages born before the
  step or outside torch's dispatcher, counted from the moment they are first
  seen), with its size in bytes;
- a weak reference on each storage reports its free when it dies;
- ``UntypedStorage.resize_`` is wrapped while a step runs, because a resize on
  a storage never reaches the dispatcher; without this the early frees of the
  optimized stack (``x.untyped_storage().resize_(0)``) would be invisible and
  the optimized stack would look no better than the reference. Size changes
  made by aten ops (``Tensor.resize_``, ``set_``) are seen by the mode.

Every allocation, free and resize during a step is logged as ``(storage, delta)``.
The running total gives the peak exactly; the breakdown at the peak is computed
when the step ends by replaying the log up to the peak and classifying each
storage live at that moment with everything learned during the step. That is
why a gradient produced by a backward op is counted as a gradient even if the
peak fell before autograd stored it in ``.grad``, and why optimizer state that
Adam creates lazily is counted as optimizer state.

On CUDA the caching allocator's own statistics are the truth:
``reset_peak_memory_stats`` when a step starts, ``max_memory_allocated`` when it
ends. The peak's moment is the phase during which ``max_memory_allocated``
last grew, checked at every :meth:`MemoryTracker.mark`; parameters, gradients
and optimizer state are measured from the registered tensors when that phase
ends, and activations are the rest (allocator rounding included).

The CPU accounting lives in `harness.memory.cpu` (its event log in
`harness.memory.cpu_log`), the CUDA statistics in `harness.memory.cuda`; `MemoryTracker`
is the one API over both, and `harness.memory.shared` what they share.

Usage::

    tracker = MemoryTracker(device)
    tracker.register(parameters=model, optimizer_state=optimizer)
    with tracker.step():
        tracker.mark("F", micro_batch=0)
        ...
    tracker.peak_bytes, tracker.breakdown(), tracker.peak_moment

Categories: ``parameters`` (parameters and buffers of registered modules, or
registered tensors), ``gradients`` (``.grad`` of registered parameters, found
by a post-accumulate-grad hook and at every mark, plus registered gradient
tensors), ``optimizer_state`` (tensors in a registered optimizer's ``state``),
``activations`` (everything else: saved activations, stage-boundary buffers,
temporaries). A source may be a tensor, a module, an optimizer, a mapping or
iterable of them, or a callable returning any of these; sources are re-read at
the start and end of each step and at every mark, so state created during the
step is found.

The CPU tracker counts what torch allocates for tensors; buffers a kernel or
library allocates privately (gloo, numpy inside the Triton interpreter) are
not tensors and are not counted.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from harness.memory.shared import CATEGORIES, START_PHASE, Backend, StepState

__all__ = ["CATEGORIES", "MemoryTracker"]


class MemoryTracker:
    """Peak memory of one training step on one device, with its breakdown and moment.

    ``device`` is ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device``.
    Use one tracker per rank; steps may repeat, each one resets the peak.
    """

    def __init__(self, device: str | torch.device) -> None:
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as error:
            raise ValueError(
                f"MemoryTracker: device={device!r} is not a device; use 'cpu' or 'cuda[:N]'"
            ) from error
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"MemoryTracker: device={str(self.device)!r} is not supported; "
                "use 'cpu' or 'cuda[:N]'"
            )
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._state = StepState()
        self._steps_done = 0
        self._start_bytes = 0
        self._end_bytes = 0
        self._backend: Backend
        if self.device.type == "cuda":
            from harness.memory.cuda import CudaStatistics  # noqa: PLC0415

            self._backend = CudaStatistics(self._state, self.device)
        else:
            from harness.memory.cpu import CpuAccounting  # noqa: PLC0415

            self._backend = CpuAccounting(self._state)

    # ------------------------------------------------------------------ public API

    def register(
        self,
        parameters: Any = None,
        gradients: Any = None,
        optimizer_state: Any = None,
    ) -> None:
        """Classify bytes: each argument is a tensor, module, optimizer, container or callable.

        Registered sources stay registered for later steps. Gradients of
        registered parameters are found without registering them.
        """
        for category, source in (
            ("parameters", parameters),
            ("gradients", gradients),
            ("optimizer_state", optimizer_state),
        ):
            if source is not None:
                self._state.sources[category].append(source)
        if self._state.in_step:
            self._backend.registered(parameters)

    def mark(self, phase: str, micro_batch: int | None = None) -> None:
        """Note that the schedule now enters ``phase`` for ``micro_batch``."""
        state = self._state
        if not state.in_step:
            raise RuntimeError("MemoryTracker.mark() called outside `with tracker.step():`")
        self._backend.mark()
        state.moment = {"phase": str(phase), "micro_batch": micro_batch}
        current = self._backend.current_bytes()
        state.timeline.append({**state.moment, "start_bytes": current, "peak_bytes": current})

    @contextmanager
    def step(self) -> Iterator[MemoryTracker]:
        """Track one training step; the peak and breakdown are ready when it exits.

        Python's cyclic garbage collector runs once before the step and is paused during
        it. Tensors caught in reference cycles are freed only when the collector runs, and
        it runs when its allocation counters say so: left on, the same step measured twice
        could differ by whatever those cycles held (docs/memory.md: how the peak is measured).
        Paused, the figure is reproducible (cycles made during the step count as held, as
        they would on a GPU until a collection).
        """
        state = self._state
        if state.in_step:
            raise RuntimeError("MemoryTracker.step() is already running; steps do not nest")
        gc.collect()
        gc_was_enabled = gc.isenabled()
        gc.disable()
        state.in_step = True
        state.moment = {"phase": START_PHASE, "micro_batch": None}
        state.timeline = []
        try:
            self._backend.enter()
        except BaseException:
            state.in_step = False
            if gc_was_enabled:
                gc.enable()
            raise
        start = self._backend.current_bytes()
        self._start_bytes = start
        state.timeline = [{**state.moment, "start_bytes": start, "peak_bytes": start}]
        try:
            yield self
        finally:
            try:
                self._backend.exit()
                self._end_bytes = self._backend.current_bytes()
            finally:
                state.in_step = False
                self._steps_done += 1
                if gc_was_enabled:
                    gc.enable()

    @property
    def peak_bytes(self) -> int:
        """Highest bytes in use during the last step."""
        self._require_step()
        return self._state.peak_bytes

    @property
    def peak_moment(self) -> dict[str, Any]:
        """``{"phase": ..., "micro_batch": ...}`` of the last mark before the peak."""
        self._require_step()
        return dict(self._state.peak_moment)

    def breakdown(self) -> dict[str, int]:
        """Bytes by category at the peak of the last step, plus ``total`` (== peak_bytes)."""
        self._require_step()
        return dict(self._state.breakdown)

    @property
    def start_bytes(self) -> int:
        """Bytes in use when the last step started (what it inherited)."""
        self._require_step()
        return self._start_bytes

    @property
    def end_bytes(self) -> int:
        """Bytes in use when the last step ended (what it leaves behind)."""
        self._require_step()
        return self._end_bytes

    def top_tensors(self) -> list[dict[str, Any]]:
        """The five largest storages live at the last step's peak, largest first: ``what``
        (a registered tensor's name, e.g. ``grad of model.layers.1.mlp.experts.down_proj``,
        or the aten op that produced it), ``shape`` and ``dtype`` of the tensor it was first
        seen through, ``bytes`` at the peak and ``category``. CPU only (the CUDA allocator
        does not say what its blocks hold): empty on CUDA."""
        self._require_step()
        return self._backend.top_tensors()

    def summary(self) -> dict[str, Any]:
        """Breakdown plus ``peak_moment``: the per-rank memory entry of a compare report."""
        return {**self.breakdown(), "peak_moment": self.peak_moment}

    @property
    def timeline(self) -> list[dict[str, Any]]:
        """Per mark of the last step: phase, micro_batch, bytes at the mark and peak until the next.

        On CUDA ``peak_bytes`` of an interval is only known when it raised the step's peak;
        otherwise it is the bytes at the mark.
        """
        return [dict(entry) for entry in self._state.timeline]

    def _require_step(self) -> None:
        if self._steps_done == 0 or self._state.in_step:
            raise RuntimeError(
                "MemoryTracker: no finished step yet; read results after `with tracker.step():`"
            )
