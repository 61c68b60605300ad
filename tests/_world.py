"""Many cases in one launch of ranks: a world of ranks serves every job of a test module
that needs its size, each job building its own process groups (`make_layout` may be called
again and again, in the same order on every rank).

Starting ranks, joining gloo and building the groups costs more than a tiny model's step,
so a module lists its jobs per world size once; the first test that asks for one launches
that world for all of them, and the others read its results (cached per process: under
pytest-xdist a worker that gets none of them launches nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from models.runtime import launch

Job = tuple[Callable[..., Any], tuple]


def _serve(jobs: dict[str, Job]) -> dict[str, Any]:
    return {key: fn(*args) for key, (fn, args) in jobs.items()}


class SharedWorlds:
    """``jobs()`` returns ``{world_size: {key: (fn, args)}}``; `result` launches each world
    once and returns ``[rank 0's, rank 1's, ...]`` results of one job."""

    def __init__(self, jobs: Callable[[], dict[int, dict[str, Job]]]) -> None:
        self._jobs = jobs
        self._results: dict[int, list[dict[str, Any]]] = {}

    def result(self, key: str) -> list[Any]:
        for world, jobs in self._jobs().items():
            if key in jobs:
                if world not in self._results:
                    self._results[world] = launch(_serve, world, (jobs,))
                return [rank[key] for rank in self._results[world]]
        raise KeyError(key)
