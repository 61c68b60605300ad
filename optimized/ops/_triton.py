"""The one place that imports Triton for `optimized.ops`.

In a process that computes on the CPU, Triton kernels run through its interpreter,
which must be switched on (``TRITON_INTERPRET=1``) before `triton` is first imported.
A rank's launcher sets it (`models.device`); every kernel module imports ``triton``
and ``tl`` from here, so any other process chooses once, early, and a user's explicit
setting is left alone.
"""

from __future__ import annotations

import gc
import os

from models.device import choose_triton_mode

choose_triton_mode()

import triton  # noqa: E402  (after the mode is chosen)
import triton.language as tl  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""True when kernels run through the Triton interpreter (CPU tensors)."""

INTERPRETER_ELEMENTS = 1 << 16
"""Elements one program handles on the interpreter. There each program costs milliseconds
of Python whatever its size while numpy does the arithmetic, so kernels give a program
this many elements (a block of rows, a long stretch) instead of what suits a GPU."""


def _cast_rne(x, dtype: tl.constexpr):
    """``x`` (float32) cast to ``dtype``, rounding to nearest even as torch does.

    Triton's interpreter converts float32 to bfloat16 by truncation (toward zero),
    unlike torch and compiled Triton (round to nearest even). Truncation is a biased
    rounding: its errors do not cancel in later sums, and it made every bfloat16
    result of the CPU path half an ulp low on average. For bfloat16 the value is
    rounded here on its float32 bits first, so the conversion that follows is exact
    on both paths (on CUDA the same rounding happens twice, which changes nothing).
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


# The interpreter runs kernels as Python, so it calls the helper as a plain function: as a
# jit device function it would re-patch triton.language on every call (about 1 ms each).
cast_rne = _cast_rne if INTERPRETED else triton.jit(_cast_rne)


def launch(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, leaving no memory behind on the interpreter.

    Triton's interpreter wraps each launch's arguments in a self-referencing closure
    (``GridExecutor._init_args_hst``) that keeps every argument's storage alive until
    Python's cyclic collector happens to run: up to about 1 MB per pipeline step on the
    tiny presets, landing at random moments, which made the memory tracker charge the
    optimized stack for garbage no GPU run has. Here the collector is held off during the
    launch, so the cycle is still in the youngest generation afterwards, and that
    generation is collected at once. Compiled launches (CUDA) are untouched.
    """
    if not INTERPRETED:
        kernel[grid](*args, **kwargs)
        return
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        kernel[grid](*args, **kwargs)
    finally:
        if was_enabled:
            gc.enable()
        gc.collect(0)


__all__ = ["INTERPRETED", "INTERPRETER_ELEMENTS", "cast_rne", "launch", "tl", "triton"]
