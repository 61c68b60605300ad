"""Grouped linear over F.grouped_mm vs torch's own autograd of `F.grouped_mm` on the same
tensors (``plain``), and vs a loop of per-expert matmuls (``plain_loop``).

Forward and backward, the weight a parameter ``[E, out, in]`` used through its transpose
as DeepSeek-V2 and Qwen3 do; ``tflops_per_s`` counts the three GEMMs (output, input
gradient, weight gradient). GPU shape: 16 experts x 1024 rows, 2048 -> 2816, bf16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks._common import DEVICE, bench, pick
from optimized.ops import grouped_linear

ROWS_PER_EXPERT, FAN_IN, FAN_OUT, EXPERTS = pick(gpu=(1024, 2048, 2816, 16), cpu=(128, 128, 256, 8))
DTYPE = torch.bfloat16
FLOPS = 3 * 2 * ROWS_PER_EXPERT * EXPERTS * FAN_IN * FAN_OUT


def setup():
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    rows = ROWS_PER_EXPERT * EXPERTS
    x = torch.randn(rows, FAN_IN, generator=generator, device=DEVICE, dtype=DTYPE)
    weight = (
        torch.randn(EXPERTS, FAN_OUT, FAN_IN, generator=generator, device=DEVICE, dtype=DTYPE)
        * FAN_IN**-0.5
    )
    offsets = torch.arange(1, EXPERTS + 1, device=DEVICE, dtype=torch.int32) * ROWS_PER_EXPERT
    grad = torch.randn(rows, FAN_OUT, generator=generator, device=DEVICE, dtype=DTYPE)
    return (x.requires_grad_(), weight.requires_grad_(), offsets, grad), {}


def optimized(x, weight, offsets, grad):
    grouped_linear(x, weight.transpose(1, 2), offsets).backward(grad)


def plain(x, weight, offsets, grad):
    """torch's autograd of `F.grouped_mm` (``torch._grouped_mm``), the same tensors."""
    F.grouped_mm(x, weight.transpose(1, 2), offs=offsets).backward(grad)


def plain_loop(x, weight, offsets, grad):
    outputs, start = [], 0
    for expert, end in enumerate(offsets.tolist()):
        outputs.append(x[start:end] @ weight[expert].t())
        start = end
    torch.cat(outputs).backward(grad)


IMPLEMENTATIONS = {"optimized": optimized, "plain": plain, "plain_loop": plain_loop}


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
def test_grouped_linear(benchmark, implementation):
    bench(
        benchmark,
        IMPLEMENTATIONS[implementation],
        setup,
        "grouped_linear",
        implementation,
        flops=FLOPS,
        rows_per_expert=ROWS_PER_EXPERT,
        fan_in=FAN_IN,
        fan_out=FAN_OUT,
        experts=EXPERTS,
        dtype=DTYPE,
    )
