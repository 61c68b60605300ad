"""bfloat16 matrix products on CPUs without native bfloat16 GEMM.

A GPU multiplies bfloat16 matrices with bfloat16 inputs and float32 accumulation, and
rounds the result once. So do CPUs with AVX512-BF16 or AMX (x86) or the BF16 extension
(Arm). Elsewhere (an AVX2-only x86, say) torch's bfloat16 matmul falls back to kernels that
are not just slower but pathologically so: on an AMD EPYC with AVX2 only, torch 2.13 ran
``a @ b`` with a row-major right operand (the shape of every linear's input gradient) at
0.29 GFLOP/s, ``a @ b.t()`` at 20 GFLOP/s, against 127 GFLOP/s in float32. A bfloat16
compare that takes two minutes on one CPU did not finish in fifteen on the other.

On such a CPU, `Bf16Gemm` computes each bfloat16 product as the float32 product of the
same bfloat16 values, rounded once to bfloat16 (to nearest even, as torch rounds): what a
GPU's bfloat16 GEMM computes, at float32 speed. It is a ``TorchDispatchMode``, entered for
the whole of a rank's work, so both stacks (and the float32 truth, which it leaves alone)
run alike, and their comparison is unchanged; the report says it was on.

It sits below any memory tracker entered later: the tracker sees the bfloat16 product and
its bfloat16 result, not the float32 copies made here, so measured peaks are the ones a
GPU's GEMM would give.

``TWINPIPE_CPU_BF16_GEMM`` overrides the detection: ``native`` (torch's own kernels),
``float32`` (the products above), ``auto`` (the default: float32 products exactly when the
CPU has no native bfloat16 GEMM).
"""

from __future__ import annotations

import os
import platform
from contextlib import AbstractContextManager, nullcontext

import torch
from torch.utils._python_dispatch import TorchDispatchMode

GEMM_ENV = "TWINPIPE_CPU_BF16_GEMM"
GEMM_CHOICES = ("auto", "native", "float32")

aten = torch.ops.aten

_PRODUCTS = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.baddbmm.default,
    aten.mv.default,
    aten.addmv.default,
    aten.dot.default,
    aten._grouped_mm.default,
}
"""Matrix products whose every floating-point output has the inputs' dtype."""

_ATTENTION = {
    # (output, log-sum-exp): only the output is bfloat16; the statistics are float32.
    aten._scaled_dot_product_flash_attention_for_cpu.default: (0,),
    # (dq, dk, dv).
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (0, 1, 2),
}
"""CPU flash attention (its products run on the same bfloat16 GEMM): which outputs are in
the inputs' dtype."""


def native_bf16_gemm() -> tuple[bool, str]:
    """Whether this CPU multiplies bfloat16 matrices natively, and what says so."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i686"):
        if torch.cpu._is_amx_tile_supported():
            return True, "AMX"
        if torch.cpu._is_avx512_bf16_supported():
            return True, "AVX512-BF16"
        capability = torch.backends.cpu.get_cpu_capability()
        return False, f"{capability} without AVX512-BF16 or AMX"
    if machine in ("aarch64", "arm64"):
        features = _cpu_features()
        if "bf16" in features:
            return True, "Arm BF16"
        return False, "Arm without the BF16 extension"
    return False, f"{machine}: no known native bfloat16 GEMM"


def _cpu_features() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.lower().startswith(("features", "flags"))]
    except OSError:
        return set()
    return set(lines[0].split(":", 1)[1].split()) if lines else set()


def gemm_choice() -> str:
    """``TWINPIPE_CPU_BF16_GEMM`` (default ``auto``), checked."""
    choice = os.environ.get(GEMM_ENV, "auto")
    if choice not in GEMM_CHOICES:
        raise ValueError(
            f"{GEMM_ENV}={choice!r}: expected one of {', '.join(GEMM_CHOICES)} "
            "(auto: float32 products where the CPU has no native bfloat16 GEMM)"
        )
    return choice


def float32_products(dtype: torch.dtype, device: torch.device) -> tuple[bool, str]:
    """Whether a rank computing in ``dtype`` on ``device`` runs its bfloat16 products in
    float32 (`Bf16Gemm`), and why, in words for the report."""
    if dtype != torch.bfloat16 or device.type != "cpu":
        return False, ""
    choice = gemm_choice()
    native, what = native_bf16_gemm()
    if choice == "native" or (choice == "auto" and native):
        return False, f"native bfloat16 GEMM ({what})" if native else f"native ({what})"
    if choice == "auto":
        why = f"this CPU has no native bfloat16 GEMM ({what})"
    else:  # asked for, whatever the CPU has
        why = f"{GEMM_ENV}={choice} ({'native' if native else 'no native'} bfloat16 GEMM: {what})"
    return True, f"bfloat16 products computed as float32 products rounded once: {why}"


class Bf16Gemm(TorchDispatchMode):
    """Every bfloat16 CPU matrix product as a float32 product of the same values, rounded
    once to bfloat16 (module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rounded = _rounded_outputs(func, args, kwargs)
        if rounded is None:
            return func(*args, **kwargs)
        widened = [_widen(a) for a in args]
        out = func(*widened, **{k: _widen(v) for k, v in kwargs.items()})
        if isinstance(out, torch.Tensor):
            return out.to(torch.bfloat16) if 0 in rounded else out
        return type(out)(
            o.to(torch.bfloat16) if i in rounded and isinstance(o, torch.Tensor) else o
            for i, o in enumerate(out)
        )


def _rounded_outputs(func, args, kwargs) -> tuple[int, ...] | None:
    """Which outputs go back to bfloat16 when ``func`` is a product on bfloat16 CPU inputs
    (None: run ``func`` as it is)."""
    if func in _PRODUCTS:
        if kwargs.get("out_dtype") not in (None, torch.bfloat16):
            outputs: tuple[int, ...] = ()
        else:
            outputs = (0,)
    elif func in _ATTENTION:
        outputs = _ATTENTION[func]
    else:
        return None
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not any(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors):
        return None
    return outputs


def _widen(value):
    if isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16:
        return value.float()
    return value


def bf16_gemm(dtype: torch.dtype, device: torch.device) -> AbstractContextManager:
    """`Bf16Gemm` where `float32_products` says so, else nothing: enter it for a rank's
    work, before any memory tracker."""
    return Bf16Gemm() if float32_products(dtype, device)[0] else nullcontext()


__all__ = [
    "GEMM_CHOICES",
    "GEMM_ENV",
    "Bf16Gemm",
    "bf16_gemm",
    "float32_products",
    "gemm_choice",
    "native_bf16_gemm",
]
