"""How a compare rank computes, and what its report says of it.

A rank computes on the device its launcher handed it (`models.runtime.rank_device`: the
parent resolved ``--device`` once and started every rank with it and its Triton mode).
Everything the rank builds takes its device from there or from the tensors and parts made
there: the stacks, the float32 truth, the oracle, the batches, the bisection's model.

Two settings make a comparison mean what it says:

- **float32 is float32.** On Ampere and later GPUs torch may run float32 matrix products
  and convolutions on TF32 tensor cores (10 mantissa bits): cuDNN does by default. A
  float32 comparison (the DESIGN's 1e-5 and 1e-8 bounds, the float32 truth of a bfloat16
  step) would then measure TF32's rounding, not the stacks'. Every rank turns it off
  (`exact_float32`); on a CPU this changes nothing. For the same reason cuBLAS may not
  reduce a bfloat16 product's partial sums in bfloat16
  (``allow_bf16_reduced_precision_reduction``, on by default): every rank turns that off
  too, and the report says so beside TF32.
- **bfloat16 products as a GPU computes them.** On a CPU without native bfloat16 GEMM the
  rank computes them as float32 products rounded once (`models.runtime.cpu_gemm`), for both
  stacks alike, entered for the rank's whole work before any memory tracker; the report
  says so.

`device_section` is the report's ``device``: the device's kind and name, the torch, Triton
and CUDA versions (`harness.report.device_description`), whether bfloat16 products ran as
float32 products and why, the TF32 settings and the bfloat16 reduction setting the rank ran
with, and whether it ran deterministic (`models.runtime.determinism`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch

from harness.report import device_description
from models.runtime import bf16_gemm, deterministic_mode, float32_products, rank_device


def exact_float32() -> dict[str, Any]:
    """TF32 off for matrix products and cuDNN, float32 matmul precision ``highest``, and
    cuBLAS's reduced-precision reductions off for bfloat16 and float16 products (with them
    on, cuBLAS may add a bf16 GEMM's partial sums in bf16; the CPU emulation and the bf16
    bounds assume float32 accumulation); the settings as torch reports them afterwards
    (`float32_settings`)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    return float32_settings()


def float32_settings() -> dict[str, Any]:
    """This process's TF32 and reduction settings: ``cuda_matmul_tf32``, ``cudnn_tf32``,
    ``float32_matmul_precision``, ``bf16_reduced_precision_reduction`` and
    ``fp16_reduced_precision_reduction``."""
    matmul = torch.backends.cuda.matmul
    return {
        "cuda_matmul_tf32": bool(matmul.allow_tf32),
        "cudnn_tf32": bool(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "bf16_reduced_precision_reduction": bool(matmul.allow_bf16_reduced_precision_reduction),
        "fp16_reduced_precision_reduction": bool(matmul.allow_fp16_reduced_precision_reduction),
    }


class RankArithmetic(NamedTuple):
    """What `rank_arithmetic` set up: the rank's device and its report section."""

    device: torch.device
    section: dict[str, Any]


def device_section(
    device: torch.device, dtype: torch.dtype, settings: dict[str, Any]
) -> dict[str, Any]:
    """The report's ``device`` for a rank computing in ``dtype`` on ``device`` with the TF32
    ``settings`` it runs under."""
    widened, why = float32_products(dtype, device)
    return {
        **device_description(device),
        "float32_products": widened,
        "float32_products_why": why,
        "tf32": settings["cuda_matmul_tf32"] or settings["cudnn_tf32"],
        "float32_matmul_precision": settings["float32_matmul_precision"],
        "bf16_reduced_precision_reduction": settings["bf16_reduced_precision_reduction"],
    }


@contextmanager
def rank_arithmetic(dtype: torch.dtype, deterministic: bool = False) -> Iterator[RankArithmetic]:
    """A rank's work computes inside this: on its device, TF32 and bf16 reduced-precision
    reductions off, bfloat16 products as a GPU's (`models.runtime.bf16_gemm`, entered
    before any memory tracker), deterministic if asked (`models.runtime.determinism`)."""
    device = rank_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    section = device_section(device, dtype, exact_float32())
    with deterministic_mode(deterministic), bf16_gemm(dtype, device):
        yield RankArithmetic(device, {**section, "deterministic": deterministic})


__all__ = [
    "RankArithmetic",
    "device_section",
    "exact_float32",
    "float32_settings",
    "rank_arithmetic",
]
