"""Peak memory of each phase of a training run, per rank: load, train, save.

A run's peak must not come from the edges: loading a checkpoint or saving one should
cost no more than training does (the steady footprint: weights, gradients, optimizer
state, activations). `PhasePeaks` measures each phase's own peak by resetting the
high-water mark when the phase starts: the CUDA allocator's peak statistics on GPU, the
process's resident-set high-water mark on CPU (``VmHWM``, reset by writing ``5`` to
``/proc/self/clear_refs``; it counts every byte the process touches, the mapped
checkpoint pages included). Where the reset is not allowed the figure is the lifetime
peak so far, and ``resettable`` says so.
"""

from __future__ import annotations

import re
import resource
from contextlib import contextmanager

import torch

_HWM = re.compile(r"VmHWM:\s+(\d+) kB")


def _reset_cpu_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _cpu_peak() -> int:
    with open("/proc/self/status") as f:
        match = _HWM.search(f.read())
    return int(match.group(1)) * 1024 if match else 0


class PhasePeaks:
    """``with peaks.phase("save"): ...`` records the phase's peak bytes (max over repeats);
    `lifetime` stays the whole run's peak however often a phase resets the mark."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.peaks: dict[str, int] = {}
        self.resettable = True
        self._lifetime = 0
        self._counted = True

    def _current(self) -> int:
        return torch.cuda.max_memory_allocated() if self.cuda else _cpu_peak()

    def begin(self, counted: bool = True) -> None:
        """Start a phase: the mark restarts from what is held now. ``counted=False``: the
        phase's peak stays out of `lifetime` (the warm-up before step 1: what the autotuner
        and the communicators allocate is no step's)."""
        if self._counted:
            self._lifetime = max(self._lifetime, self._current())
        self._counted = counted
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            self.resettable = _reset_cpu_peak() and self.resettable

    def end(self, name: str) -> None:
        """End phase ``name``: its peak is the mark since `begin`."""
        self.peaks[name] = max(self.peaks.get(name, 0), self._current())

    @contextmanager
    def phase(self, name: str):
        self.begin()
        try:
            yield
        finally:
            self.end(name)

    def lifetime(self) -> int:
        """The peak of the whole run so far (bytes)."""
        return max(self._lifetime, self._current() if self._counted else 0)

    @property
    def source(self) -> str:
        if self.cuda:
            return "cuda-max-memory-allocated"
        return "rss-high-water-mark" if self.resettable else "rss-lifetime-peak"


def format_peaks(per_rank: list[dict[str, int]], source: str) -> str:
    """One line per phase: every rank's peak in GB, and the worst edge-to-train ratio."""
    phases = [p for p in ("load", "train", "save") if any(p in r for r in per_rank)]
    lines = [f"peak memory per rank ({source}), GB:"]
    for phase in phases:
        values = " ".join(f"{r.get(phase, 0) / 1e9:6.2f}" for r in per_rank)
        lines.append(f"  {phase:<5} {values}")
    for edge in ("load", "save"):
        ratios = [r[edge] / r["train"] for r in per_rank if edge in r and r.get("train")]
        if ratios:
            lines.append(f"  {edge} / train: worst rank {max(ratios):.3f}")
    return "\n".join(lines)


def peak_memory(peaks: PhasePeaks) -> tuple[int, str]:
    """This process's peak memory in bytes and how it was measured (``peaks``: the run's
    phases reset the high-water mark, and keep the lifetime peak)."""
    if peaks.cuda:
        return peaks.lifetime(), "cuda-max-memory-allocated"
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return max(kib * 1024, peaks.lifetime()), "max-rss"
