"""Fused Triton activations vs their plain PyTorch forms, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks._common import DEVICE, bench, pick
from optimized.ops import clamped_swiglu, silu_and_mul

ROWS, INNER = pick(gpu=(16384, 2816), cpu=(256, 512))
DTYPE = torch.bfloat16


def setup():
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(ROWS, 2 * INNER, generator=generator, device=DEVICE, dtype=DTYPE) * 3
    grad = torch.randn(ROWS, INNER, generator=generator, device=DEVICE, dtype=DTYPE)
    return (x.requires_grad_(), grad), {}


def plain_silu_and_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def plain_clamped_swiglu(x, alpha=1.702, limit=7.0):
    gate = x[..., ::2].clamp(max=limit)
    up = x[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


ACTIVATIONS = {
    ("silu_and_mul", "optimized"): silu_and_mul,
    ("silu_and_mul", "plain"): plain_silu_and_mul,
    ("clamped_swiglu", "optimized"): clamped_swiglu,
    ("clamped_swiglu", "plain"): plain_clamped_swiglu,
}


@pytest.mark.parametrize(("op", "implementation"), list(ACTIVATIONS))
def test_activation(benchmark, op, implementation):
    activation = ACTIVATIONS[(op, implementation)]

    def run(x, grad):
        activation(x).backward(grad)

    bench(benchmark, run, setup, op, implementation, rows=ROWS, inner=INNER, dtype=DTYPE)
