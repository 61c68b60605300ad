"""Tests that must compute on the CPU in a process of their own on a GPU machine.

A test that asserts exact CPU byte accounting (the memory tracker's CPU backend, the
estimator against it) or drives CPU ranks in threads runs its kernels on CPU tensors. In a
process that compiles Triton kernels (a machine with a GPU) those kernels cannot take CPU
tensors, so `on_cpu_rank` runs the work in a spawned CPU rank, which interprets them; where
this process interprets already (every CPU machine, CI) it runs in place, at no cost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from models.runtime import triton_device


def on_cpu_rank(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` computed on the CPU with Triton interpreted: here when this process
    interprets, else in one spawned CPU rank (``fn`` and ``args`` must pickle; assertions
    inside ``fn`` fail the test with the rank's traceback)."""
    if triton_device().type == "cpu":
        return fn(*args)
    from models.runtime import launch  # noqa: PLC0415

    return launch(_call, 1, (fn, args), device="cpu")[0]


def _call(fn: Callable[..., Any], args: tuple) -> Any:
    return fn(*args)
