"""Per-stack peak memory inside `twinpipe compare`, where two stacks share one process.

Each stack gets its own `MemoryTracker`, registered with its own parameters and
optimizer state, and measures its own regions of a step (its forward and backward,
its optimizer update). The CPU tracker counts only storages its step touches or that
were registered with it, so what the harness holds aside for the comparison (the
other stack's gradients, the float32 truth's, the candidate's updated parameters) is
not part of a stack's figure; the harness reports those bytes beside it
(``held``). On CUDA the allocator counts everything, so ``held`` is taken out of the
activations there.

A step's figure is the largest of its regions. Where both stacks share one optimizer
(`harness.compare.stacks.shares_state`) the update runs once, measured on the baseline; the
candidate's update figure is its own resident bytes when its backward ended plus what
that same update added on the baseline (the moments AdamW creates at step 0 and its
per-parameter temporaries): the same operation on the same tensors.

The tracker is the rank's device's (`harness.memory`): on a GPU, the caching allocator's
statistics, with the cuBLAS workspaces the step's products hold reported apart
(``workspaces``: counted in ``total``, in no category; the estimate is compared without
them); on the CPU, ``workspaces`` is 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from harness.compare.instruments import Instrument
from harness.compare.record import StepRecord


class Meter:
    """One stack's memory regions, step by step (``enabled=False``: records nothing)."""

    def __init__(self, pipeline: Any, enabled: bool, device: torch.device) -> None:
        self.pipeline = pipeline
        self.enabled = enabled and hasattr(pipeline, "schedule")
        self.regions: list[dict[str, Any]] = []
        self.tracker = None
        if self.enabled:
            from harness.memory import MemoryTracker  # noqa: PLC0415

            self.tracker = MemoryTracker(device)  # the rank's: the allocator's on a GPU
            # A stack whose optimizer is no torch Optimizer names its state tensors itself.
            state = getattr(pipeline, "optimizer_state", pipeline.optimizer)
            self.tracker.register(parameters=pipeline.part, optimizer_state=state)

    @contextmanager
    def region(self, phase: str, held: int = 0) -> Iterator[None]:
        """Measure the code inside as one region of this stack's step; ``held``: bytes the
        harness keeps outside this stack meanwhile (reported, never counted in)."""
        if not self.enabled:
            yield
            return
        tracker = self.tracker
        self.pipeline.observer = tracker.mark
        try:
            with tracker.step():
                yield
        finally:
            self.pipeline.observer = None
        summary: dict[str, Any] = dict(tracker.breakdown())
        summary.setdefault("workspaces", 0)  # cuBLAS's, on CUDA (`harness.memory.cuda`)
        if tracker.device.type == "cuda":  # the allocator saw the harness's tensors too
            summary["activations"] = max(0, summary["activations"] - held)
            summary["total"] = tracker.peak_bytes - held
        else:
            summary["total"] = tracker.peak_bytes
        summary["peak_moment"] = {**tracker.peak_moment, "region": phase}
        summary["held"] = held
        summary["start_bytes"] = tracker.start_bytes
        summary["end_bytes"] = tracker.end_bytes
        summary["top_tensors"] = tracker.top_tensors()
        self.regions.append(summary)

    def add_shared_update(self, baseline_update: dict[str, Any] | None) -> None:
        """The candidate's update figure from the baseline's measured update region (see
        the module docstring)."""
        if not self.enabled or baseline_update is None or not self.regions:
            return
        backward = self.regions[-1]
        added = baseline_update["total"] - baseline_update["start_bytes"]
        summary = dict(baseline_update)
        summary["total"] = backward["end_bytes"] + added
        named = sum(baseline_update[k] for k in ("parameters", "gradients", "optimizer_state"))
        summary["activations"] = summary["total"] - named - summary["workspaces"]
        summary["held"] = backward["held"]
        summary["peak_moment"] = {**baseline_update["peak_moment"], "region": "update (shared)"}
        summary["derived"] = True
        self.regions.append(summary)

    def last(self, phase: str) -> dict[str, Any] | None:
        for summary in reversed(self.regions):
            if summary["peak_moment"].get("region") == phase:
                return summary
        return None

    def finish_step(self) -> dict[str, Any] | None:
        """This step's figure: the largest region; the regions are cleared."""
        if not self.regions:
            return None
        worst = max(self.regions, key=lambda s: s["total"])
        self.regions = []
        return worst


class MemoryMeters(Instrument):
    """The rank's memory instrument: one `Meter` per stack (``baseline``, ``candidate`` and,
    where it runs, the float32 ``truth``, whose step is the harness's own), a region of a
    stack measured by its meter, each step's figures into ``record.memory``."""

    def __init__(self, stacks: dict[str, Any], enabled: bool, device: torch.device) -> None:
        self.meters = {key: Meter(stack, enabled, device) for key, stack in stacks.items()}

    @contextmanager
    def region(self, key: str, phase: str, held: int) -> Iterator[None]:
        with self.meters[key].region(phase, held):
            yield

    def share_update(self) -> None:
        """The candidate's update figure from the baseline's, when both stacks share one
        optimizer (`Meter.add_shared_update`)."""
        self.meters["candidate"].add_shared_update(self.meters["baseline"].last("update"))

    def end_step(self, record: StepRecord) -> None:
        record.memory = {key: meter.finish_step() for key, meter in self.meters.items()}
