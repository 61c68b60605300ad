"""Peak memory per rank and step: one tracker, a CPU and a CUDA backend.

- `tracker`: `MemoryTracker`, the one API: register sources, mark the schedule's moments,
  read the peak, its moment, its breakdown by category and the timeline;
- `cpu`: the CPU backend, every storage an aten op touches seen through a dispatch mode,
  weak references and the wrapped ``UntypedStorage.resize_``;
- `cpu_log`: the CPU backend's books: each storage's record and the step's event log,
  replayed for the peak's breakdown and for frees made by another thread;
- `cuda`: the CUDA backend, the caching allocator's own statistics;
- `shared`: what the tracker and the backends share: the categories, the walkers over a
  registered source, and `StepState`, the figures a backend writes.

May import `models` only; never another `harness` subpackage, `optimized` or `reference`.
"""

from harness.memory.shared import CATEGORIES
from harness.memory.tracker import MemoryTracker

__all__ = ["CATEGORIES", "MemoryTracker"]
