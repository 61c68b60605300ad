"""The memory tracker on CUDA: the caching allocator's own statistics are the truth.

``reset_peak_memory_stats`` when a step starts, ``max_memory_allocated`` when it
ends; the peak's moment is the phase during which ``max_memory_allocated`` last
grew, checked at every mark. Parameters, gradients and optimizer state are
measured from the registered tensors when that phase ends; activations are the
rest (allocator rounding included).
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
        torch.cuda.reset_peak_memory_stats(self.device)
        self._last_max = int(torch.cuda.max_memory_allocated(self.device))
        self.state.new_peak(self._last_max)
        self.state.breakdown = self._categories(self._last_max)

    def exit(self) -> None:
        torch.cuda.synchronize(self.device)
        self._check_peak()

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
