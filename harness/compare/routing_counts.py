"""Each router call's expert choices on one rank, counted for the memory estimate.

`twinpipe compare --estimate-routing observed` estimates each rank's peak from the routing
the run actually saw (`optimized.estimator.routing`): a skewed router sends one EP rank
more rows than another, and its measured peak is higher than the balanced estimate says.
A forward hook on every `models.network.Router` counts the experts its call chose. The
counts are taken with numpy off a detached view of the indices, not with an aten op, so
the memory tracker sees nothing of them.

Calls are numbered per layer within a step: DualPipeV forwards each chunk's
micro-batches in order, and the router runs once per forward (it is outside the
recomputed attention block), so a layer's ``n``-th call of a step is micro-batch ``n``.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import numpy as np
import torch

from harness.compare.instruments import Instrument

_LAYER = re.compile(r"layers\.(\d+)\.")


class RoutingCounter:
    """Expert histograms of this rank's router calls, per ``(layer, micro_batch)`` of a step."""

    def __init__(self, part: torch.nn.Module, num_experts: int) -> None:
        from models.network import Router  # noqa: PLC0415

        self.num_experts = num_experts
        self.counting = False
        self._step: dict[tuple[int, int], list[int]] = {}
        self._calls: dict[int, int] = defaultdict(int)
        self._handles = []
        for name, module in part.named_modules():
            if isinstance(module, Router):
                match = _LAYER.search(name)
                if match is None:
                    raise ValueError(f"router {name!r} has no layer index in its name")
                layer = int(match.group(1))
                self._handles.append(module.register_forward_hook(self._hook(layer)))

    def _hook(self, layer: int):
        def count(_module, _inputs, output) -> None:
            if not self.counting:
                return
            index = output[1].detach().cpu().numpy().reshape(-1)
            histogram = np.bincount(index, minlength=self.num_experts)
            self._step[(layer, self._calls[layer])] = [int(n) for n in histogram]
            self._calls[layer] += 1

        return count

    def start_step(self) -> None:
        self._step, self._calls, self.counting = {}, defaultdict(int), True

    def end_step(self) -> dict[tuple[int, int], list[int]]:
        """This step's histograms: ``(layer, micro_batch) -> copies per expert``."""
        self.counting = False
        return self._step

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class RoutingCounts(Instrument):
    """The rank's routing-count instrument: a `RoutingCounter` per stack; each step's
    histograms go, per stack, into the rank's result as ``routing_counts`` (one entry per
    step), the figures `harness.compare.communication` and the observed-routing memory
    estimate read."""

    def __init__(self, stacks: dict[str, Any], num_experts: int) -> None:
        self.counters = {key: RoutingCounter(s.part, num_experts) for key, s in stacks.items()}
        self.steps: dict[str, list] = {key: [] for key in self.counters}

    def start_step(self) -> None:
        for counter in self.counters.values():
            counter.start_step()

    def end_step(self, record) -> None:
        for key, counter in self.counters.items():
            self.steps[key].append(counter.end_step())

    def finish(self, stacks: dict[str, dict[str, Any]]) -> None:
        for key, counter in self.counters.items():
            counter.close()
            stacks[key]["routing_counts"] = self.steps[key]
