"""Every Triton launch counted by kernel and specialisation key, and whether a key was first
met inside a scheduled step.

Why. Triton compiles a kernel the first time it meets a new specialisation key, and a
compile (seconds of host work, then a module load) inside a DualPipeV step runs while the
peers have NCCL work queued on this rank (`models.runtime.device_sync`). So every kernel
the step launches is launched once before the first step (`optimized.ops.precompile`), and
this registry lets a CPU test show it: `record` (called by `optimized.ops._triton.launch`
for every launch) keys each launch as Triton does, and `first_seen_in_step` lists the keys
whose first launch happened inside `models.runtime.scheduled_step`.

The key is Triton's own (`triton.runtime.jit.create_function_from_signature`): per
argument, a constexpr's value; a tensor's dtype and whether its address is a multiple of
16 bytes; an integer's width (i32, i64, u64), whether it is 1 (a constant) and whether it
is a multiple of 16; a float or bool's type only. The launch options (``num_warps``,
``num_stages``) and the device are part of it. What it leaves out: an autotuner's chosen
configuration (its keys are tuned before the step, `optimized.ops.tuning`), and a kernel
with ``do_not_specialize`` arguments (none in this package). Compiled (CUDA), `launch`
also watches Triton's own kernel cache: a compile inside a step is counted
(``compiled_in_step``) even where this key would have missed it.

Cost. Keying a launch takes tens of microseconds of host time, as much as a compiled launch
itself, so keys are taken while the registry watches: from `watch` (a runner's preparation;
a fresh process starts watching) until `first_step_kernels` has reported the first step,
whose shapes every later step repeats. Triton's cache is watched in every step (two
lengths read per launch).

The state is per process, shared by threads (the CPU model runs ranks as threads).
"""

from __future__ import annotations

import inspect
import sys
import threading
from typing import NamedTuple

from models.runtime import in_scheduled_step


class Launches(NamedTuple):
    """What the registry knows of one (kernel, key)."""

    launches: int
    first_in_step: bool
    """Its first launch ran inside a scheduled step."""


_lock = threading.Lock()
_seen: dict[tuple[str, tuple], Launches] = {}
_compiled_in_step: list[str] = []
_signatures: dict[int, tuple[str, inspect.Signature]] = {}
_watching = [True]


def _python_function(kernel):
    """The Python function behind a jit function, an interpreted one or an autotuner."""
    fn = kernel
    while not inspect.isfunction(fn):
        fn = fn.fn
    return fn


def _signature(kernel) -> tuple[str, inspect.Signature]:
    found = _signatures.get(id(kernel))
    if found is None:
        fn = _python_function(kernel)
        found = (f"{fn.__module__}.{fn.__qualname__}", inspect.signature(fn))
        _signatures[id(kernel)] = found
    return found


def _is_constexpr(parameter: inspect.Parameter) -> bool:
    annotation = parameter.annotation
    return "constexpr" in (annotation if isinstance(annotation, str) else repr(annotation))


def specialisation(kernel, args: tuple, kwargs: dict) -> tuple[str, tuple]:
    """``(kernel name, key)`` of one launch, keyed as Triton keys its compiled kernels."""
    from triton._C.libtriton import native_specialize_impl  # noqa: PLC0415
    from triton.backends.compiler import BaseBackend  # noqa: PLC0415

    name, signature = _signature(kernel)
    params = {key: value for key, value in kwargs.items() if key in signature.parameters}
    options = tuple(sorted((key, repr(value)) for key, value in kwargs.items()
                           if key not in signature.parameters))  # fmt: skip
    bound = signature.bind_partial(*args, **params)  # an autotuner supplies its configs'
    bound.apply_defaults()
    key, device = [], None
    for parameter_name, value in bound.arguments.items():
        if _is_constexpr(signature.parameters[parameter_name]):
            key.append(("constexpr", repr(value)))
            continue
        if device is None and hasattr(value, "device"):
            device = str(value.device)
        key.append(tuple(native_specialize_impl(BaseBackend, value, False, True, True)[:2]))
    return name, (tuple(key), options, device)


def watch() -> None:
    """Key every launch from now until `first_step_kernels` (a run's preparation begins)."""
    _watching[0] = True


def record(kernel, args: tuple, kwargs: dict) -> tuple[str, tuple] | None:
    """Count one launch while watching (see the module docstring); its ``(name, key)``."""
    if not _watching[0]:
        return None
    entry = specialisation(kernel, args, kwargs)
    with _lock:
        seen = _seen.get(entry)
        if seen is None:
            _seen[entry] = Launches(1, in_scheduled_step())
        else:
            _seen[entry] = seen._replace(launches=seen.launches + 1)
    return entry


def compile_cache_size(kernel) -> int | None:
    """How many compiled kernels Triton holds for ``kernel`` (None on the interpreter)."""
    jit = kernel
    while not hasattr(jit, "device_caches") and hasattr(jit, "fn"):
        jit = jit.fn
    caches = getattr(jit, "device_caches", None)
    if caches is None:
        return None
    return sum(len(cache[0]) for cache in list(caches.values()))


def note_compile(name: str) -> None:
    """Triton compiled ``name`` during a launch: kept when inside a scheduled step."""
    if in_scheduled_step():
        with _lock:
            _compiled_in_step.append(name)


def seen() -> dict[tuple[str, tuple], Launches]:
    """Every (kernel, key) launched since the last `forget`."""
    with _lock:
        return dict(_seen)


def first_seen_in_step() -> list[str]:
    """A line per (kernel, key) whose first launch was inside a scheduled step, and per
    compile Triton did inside one; empty when the preparation covered the step."""
    with _lock:
        lines = [f"{name} {key}" for (name, key), entry in _seen.items() if entry.first_in_step]
        return lines + [f"{name} compiled by Triton" for name in _compiled_in_step]


def forget() -> None:
    """Clear the registry and watch (a test's fresh start)."""
    _watching[0] = True
    with _lock:
        _seen.clear()
        _compiled_in_step.clear()


def first_step_kernels(rank: int) -> list[str]:
    """`first_seen_in_step` after a run's first step (a compile inside the schedule on a GPU
    for each), said on stderr with ``rank`` when any; the list (empty when
    `optimized.ops.precompile` covered the step). The trainer and compare call it."""
    first = first_seen_in_step()
    _watching[0] = False  # later steps repeat the first one's shapes
    if first:
        shown = "; ".join(first[:3]) + (f"; and {len(first) - 3} more" if len(first) > 3 else "")
        print(
            f"warning: rank {rank}: step 1 launched {len(first)} Triton kernel key(s) not "
            f"launched before it (compiled mid-step on a GPU): {shown}",
            file=sys.stderr, flush=True,
        )  # fmt: skip
    return first


def kernel_name(kernel) -> str:
    return _signature(kernel)[0]


__all__ = [
    "Launches", "compile_cache_size", "first_seen_in_step", "first_step_kernels", "forget",
    "kernel_name", "note_compile", "record", "seen", "specialisation", "watch",
]  # fmt: skip
