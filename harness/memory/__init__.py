"""Peak memory per rank and step: one tracker, a CPU and a CUDA backend."""

from harness.memory.tracker import CATEGORIES, MemoryTracker

__all__ = ["CATEGORIES", "MemoryTracker"]
