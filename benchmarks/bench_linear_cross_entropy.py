"""Chunked linear cross-entropy vs ``F.cross_entropy(hidden @ W.T)``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks._common import DEVICE, ON_CUDA, bench
from optimized.ops import linear_cross_entropy

TOKENS, VOCAB, HIDDEN = (4096, 102400, 2048) if ON_CUDA else (64, 4096, 64)
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


@pytest.mark.parametrize("implementation", ["optimized", "plain"])
def test_linear_cross_entropy(benchmark, implementation):
    run = optimized if implementation == "optimized" else plain
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
