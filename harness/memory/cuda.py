"""The memory tracker on CUDA: the caching allocator's own statistics are the truth.

``reset_peak_memory_stats`` when a step starts, ``max_memory_allocated`` when it
ends; the peak's moment is the phase during which ``max_memory_allocated`` last
grew, checked at every mark. Parameters, gradients and optimizer state are
measured from the registered tensors when that phase ends; activations are the
rest (allocator rounding included), less the library workspaces.

**Library workspaces.** torch gives cuBLAS (and cuBLASLt) a workspace per handle and
stream, allocated through the caching allocator at the first matrix product on that
stream and held until ``torch._C._cuda_clearCublasWorkspaces()`` (32 MiB per stream on
Hopper with the default ``CUBLAS_WORKSPACE_CONFIG``). No model predicts it, and it is no
activation: it is reported apart as ``workspaces``. The backend clears the workspaces when
a step starts (so the step's products allocate theirs inside the step, where they are
counted) and when it ends, and the bytes that second clear gives back are the step's
workspaces, at most what the step added over its start (a step whose peak is its start
holds none of them at the peak). cuDNN's workspaces are allocated and freed within each
call through the same allocator: they are transient, and stay in ``activations``.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.memory.shared import CATEGORIES, REGISTERED, StepState, grads_of, iter_source


class CudaStatistics:
    """A tracker's view of one CUDA device's allocator (a `harness.memory.shared.Backend`)."""

    def __init__(self, state: StepState, device: torch.device) -> None:
        self.state = state
        self.device = device
        self._last_max = 0
        self.workspace_bytes = 0
        """The cuBLAS workspaces held at the last step's peak (module docstring)."""

    def mark(self) -> None:
        self._check_peak()

    def registered(self, parameters: Any) -> None:
        """Nothing to adopt: the allocator already counts every tensor."""

    def current_bytes(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def top_tensors(self) -> list[dict[str, Any]]:
        """None: the CUDA allocator does not say what its blocks hold."""
        return []

    def enter(self) -> None:
        torch.cuda.synchronize(self.device)
        clear_library_workspaces(self.device)  # the step allocates its own, inside it
        self.workspace_bytes = 0
        torch.cuda.reset_peak_memory_stats(self.device)
        self._last_max = int(torch.cuda.max_memory_allocated(self.device))
        self.state.new_peak(self._last_max)
        self.state.breakdown = self._categories(self._last_max)

    def exit(self) -> None:
        torch.cuda.synchronize(self.device)
        self._check_peak()
        state = self.state
        # Bytes allocated at start are not in the step's workspaces: they were cleared.
        start = state.timeline[0]["start_bytes"] if state.timeline else 0
        held = clear_library_workspaces(self.device)
        self.workspace_bytes = workspaces_at_peak(held, state.peak_bytes, start)
        state.breakdown = with_workspaces(state.breakdown, self.workspace_bytes)

    def _check_peak(self) -> None:
        # The allocator counts at launch time on the host: no synchronize needed.
        peak = int(torch.cuda.max_memory_allocated(self.device))
        if peak > self._last_max:
            state = self.state
            self._last_max = peak
            state.new_peak(peak)
            state.breakdown = self._categories(peak)
            if state.timeline:
                state.timeline[-1]["peak_bytes"] = peak

    def _categories(self, total: int) -> dict[str, int]:
        seen: set[int] = set()
        breakdown = dict.fromkeys(CATEGORIES, 0)
        for category, sources in self.state.sources.items():
            tensors = [(category, t) for source in sources for t in iter_source(source, category)]
            if category == "parameters":
                tensors += [
                    ("gradients", grad)
                    for source in sources
                    for grad in grads_of(iter_source(source, "parameters"))
                ]
            for tensor_category, tensor in tensors:
                if tensor.device != self.device:
                    continue
                storage = tensor.untyped_storage()
                if storage._cdata in seen:
                    continue
                seen.add(storage._cdata)
                breakdown[tensor_category] += storage.nbytes()
        named = sum(breakdown[category] for category in REGISTERED)
        breakdown["activations"] = max(total - named, 0)
        breakdown["total"] = total
        return breakdown


def clear_library_workspaces(device: torch.device) -> int:
    """Give back the cuBLAS workspaces torch holds; the bytes ``device``'s allocator had
    allocated for them (0 where this torch cannot clear them)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return 0
    before = int(torch.cuda.memory_allocated(device))
    clear()
    return max(0, before - int(torch.cuda.memory_allocated(device)))


def workspaces_at_peak(held: int, peak: int, start: int) -> int:
    """The workspace bytes in a step's peak: those the step held at its end, but no more
    than the step added over its start (allocated during the step, they are in the peak
    only where the peak rose above the start)."""
    return max(0, min(held, peak - start))


def with_workspaces(breakdown: dict[str, int], workspaces: int) -> dict[str, int]:
    """A CUDA breakdown with ``workspaces`` taken out of ``activations`` and named apart
    (``total`` unchanged)."""
    out = dict(breakdown)
    out["workspaces"] = min(workspaces, out.get("activations", 0))
    out["activations"] = out.get("activations", 0) - out["workspaces"]
    return out
