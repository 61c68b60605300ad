"""Chunked linear cross-entropy vs ``F.cross_entropy(hidden @ W.T)``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks._common import DEVICE, bench, pick
from optimized.ops import linear_cross_entropy

TOKENS, VOCAB, HIDDEN = pick(gpu=(4096, 102400, 2048), cpu=(64, 4096, 64))
DTYPE = torch.bfloat16


def setup():
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator, device=DEVICE, dtype=DTYPE)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator, device=DEVICE, dtype=DTYPE)
    weight = (weight * HIDDEN**-0.5).requires_grad_()
    target = torch.randint(0, VOCAB, (TOKENS,), generator=generator, device=DEVICE)
    return (hidden.requires_grad_(), weight, target), {}


def optimized(hidden, weight, target):
    linear_cross_entropy(hidden, weight, target).backward()


def plain(hidden, weight, target):
    F.cross_entropy(hidden @ weight.t(), target).backward()


def optimized_options(hidden, weight, target):
    """reduction="none" (gradients recomputed chunk by chunk in backward), smoothing, z-loss."""
    linear_cross_entropy(
        hidden, weight, target, reduction="none", label_smoothing=0.1, lse_square_scale=1e-4
    ).mean().backward()


IMPLEMENTATIONS = {"optimized": optimized, "plain": plain, "optimized_options": optimized_options}


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
def test_linear_cross_entropy(benchmark, implementation):
    run = IMPLEMENTATIONS[implementation]
    bench(
        benchmark,
        run,
        setup,
        "linear_cross_entropy",
        implementation,
        tokens=TOKENS,
        vocab=VOCAB,
        hidden=HIDDEN,
        dtype=DTYPE,
    )
