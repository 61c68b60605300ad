"""The one place that imports Triton for `optimized.ops`.

In a process that computes on the CPU, Triton kernels run through its interpreter,
which must be switched on (``TRITON_INTERPRET=1``) before `triton` is first imported.
A rank's launcher sets it (`models.runtime.device`); every kernel module imports ``triton``
and ``tl`` from here, so any other process chooses once, early, and a user's explicit
setting is left alone.
"""

from __future__ import annotations

import gc
import os

from models.runtime import choose_triton_mode

choose_triton_mode()

import triton  # noqa: E402  (after the mode is chosen)
import triton.language as tl  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""True when kernels run through the Triton interpreter (CPU tensors)."""

_BLAS_THREAD_SETTERS = (
    "scipy_openblas_set_num_threads64_",  # numpy >= 2 wheels
    "scipy_openblas_set_num_threads",
    "openblas_set_num_threads64_",
    "openblas_set_num_threads",
)


def single_threaded_numpy_blas() -> bool:
    """Make numpy's OpenBLAS, which the interpreter's ``tl.dot`` calls, use one thread;
    True when it could be found.

    The interpreter runs programs one at a time on small tiles, and the CPU suite runs
    several ranks on a few cores: there OpenBLAS's threads wait on each other (measured on
    2 shared cores: a 256 x 16 x 256 product in 30 ms, 0.03 ms on one thread). Torch keeps
    its own thread pool; only numpy's BLAS is touched. The library numpy loaded is found
    in the process's memory map, as threadpoolctl does."""
    import ctypes  # noqa: PLC0415

    import numpy  # noqa: F401, PLC0415  (its BLAS must be loaded to be found)

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    except OSError:
        return False
    for path in sorted(paths):
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _BLAS_THREAD_SETTERS:
            setter = getattr(library, name, None)
            if setter is not None:
                setter(1)
                return True
    return False


def skip_unused_overflow_checks() -> bool:
    """Stop the interpreter from computing integer-overflow checks it then drops; True when
    it did.

    The interpreter's builder sanitizes every 32-bit integer add, subtract and multiply
    (index arithmetic) by redoing it in int64 and comparing, then hands the result to
    ``device_assert``, which does nothing unless the builder's ``debug`` option is on (it
    is off: the interpreter's options are fixed at import). That check was a third of an
    attention kernel's time on the tiny presets. With ``debug`` on it is left alone."""
    import dataclasses  # noqa: PLC0415

    from triton.runtime import interpreter  # noqa: PLC0415

    builder = interpreter.interpreter_builder
    options = getattr(builder, "options", None)
    if options is None or options.debug or not getattr(options, "sanitize_overflow", False):
        return False
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True


if INTERPRETED:
    single_threaded_numpy_blas()
    skip_unused_overflow_checks()

INTERPRETER_ELEMENTS = 1 << 16
"""Elements one program handles on the interpreter. There each program costs milliseconds
of Python whatever its size while numpy does the arithmetic, so kernels give a program
this many elements (a block of rows, a long stretch) instead of what suits a GPU."""


def _cast_rne(x, dtype: tl.constexpr):
    """``x`` (float32) cast to ``dtype``, rounding to nearest even as torch does.

    Triton's interpreter converts float32 to bfloat16 by truncation (toward zero), unlike
    torch and compiled Triton (round to nearest even), and its conversion of subnormals is
    off. Truncation is a biased rounding: its errors do not cancel in later sums, and it
    made every bfloat16 result of the CPU path half an ulp low on average. For bfloat16
    the value is rounded here on its float32 bits (`round_to_bfloat16`) and the top half of
    those bits is the result, taken as it is: no conversion runs, so both paths store the
    same bits, NaNs and infinities included.
    """
    if dtype == tl.bfloat16:
        return (rounded_bits(x) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


def _rounded_bits(x):
    """The bits of ``x`` (float32) rounded to the nearest bfloat16 value, to nearest even
    (uint32, the low half zero): finite values round (the largest ones overflow to infinity,
    as torch's do), infinities stay infinite, and a NaN stays a NaN of its sign.

    Rounding adds ``0x7FFF`` plus the lowest kept bit and drops the low half. A NaN's bits
    must not take that path: a GPU's canonical NaN ``0x7FFFFFFF`` carries into the sign
    bit and becomes ``-0.0``, ``0xFFFFFFFF`` wraps to ``+0.0``, and a NaN whose payload
    lies in the low half only would become an infinity. A NaN keeps its top half instead,
    with the quiet bit set, so it is a NaN in bfloat16 too."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(is_nan, (bits & 0xFFFF0000) | 0x00400000, rounded)


def _round_to_bfloat16(x):
    """``x`` (float32) rounded to the nearest bfloat16 value, kept in float32
    (`_rounded_bits`: NaN and infinities kept)."""
    return rounded_bits(x).to(tl.float32, bitcast=True)


# The interpreter runs kernels as Python, so it calls the helpers as plain functions: as jit
# device functions they would re-patch triton.language on every call (about 1 ms each).
if INTERPRETED:
    rounded_bits, round_to_bfloat16, cast_rne = _rounded_bits, _round_to_bfloat16, _cast_rne
else:
    rounded_bits, round_to_bfloat16, cast_rne = map(
        triton.jit, (_rounded_bits, _round_to_bfloat16, _cast_rne)
    )


from optimized.ops import launches  # noqa: E402  (after triton: it keys launches)


def launch(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, leaving no memory behind on the interpreter.

    Triton's interpreter wraps each launch's arguments in a self-referencing closure
    (``GridExecutor._init_args_hst``) that keeps every argument's storage alive until
    Python's cyclic collector happens to run: up to about 1 MB per pipeline step on the
    tiny presets, landing at random moments, which made the memory tracker charge the
    optimized stack for garbage no GPU run has. Here the collector is held off during the
    launch, so the cycle is still in the youngest generation afterwards, and that
    generation is collected at once. Compiled launches (CUDA) are untouched.

    Every launch is counted by kernel and Triton's specialisation key, and a compile
    inside a scheduled step noted (`optimized.ops.launches`).
    """
    launches.record(kernel, args, kwargs)  # `optimized.ops.launches`: first keys in a step
    if not INTERPRETED:
        before = launches.compile_cache_size(kernel)
        kernel[grid](*args, **kwargs)
        if before is not None and launches.compile_cache_size(kernel) != before:
            launches.note_compile(launches.kernel_name(kernel))
        return
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        kernel[grid](*args, **kwargs)
    finally:
        if was_enabled:
            gc.enable()
        gc.collect(0)


__all__ = [
    "INTERPRETED", "INTERPRETER_ELEMENTS", "cast_rne", "launch", "round_to_bfloat16",
    "rounded_bits", "single_threaded_numpy_blas", "skip_unused_overflow_checks", "tl", "triton",
]  # fmt: skip
