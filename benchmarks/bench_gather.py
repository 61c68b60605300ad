"""Padded index gather vs ``index_select`` (the dispatch gather), forward and backward."""

from __future__ import annotations

import pytest
import torch

from benchmarks._common import DEVICE, bench, pick
from optimized.ops import padded_index_gather

SOURCE_ROWS, GATHERED_ROWS, HIDDEN = pick(gpu=(16384, 8 * 16384 - 300, 2048), cpu=(1024, 6000, 256))
DTYPE = torch.bfloat16


def setup():
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(SOURCE_ROWS, HIDDEN, generator=generator, device=DEVICE, dtype=DTYPE)
    index = torch.randint(0, SOURCE_ROWS, (GATHERED_ROWS,), generator=generator, device=DEVICE)
    grad = torch.randn(GATHERED_ROWS, HIDDEN, generator=generator, device=DEVICE, dtype=DTYPE)
    return (x.requires_grad_(), index, grad), {}


def optimized(x, index, grad):
    padded_index_gather(x, index).backward(grad)


def plain(x, index, grad):
    x.index_select(0, index).backward(grad)


@pytest.mark.parametrize("implementation", ["optimized", "plain"])
def test_gather_rows(benchmark, implementation):
    run = optimized if implementation == "optimized" else plain
    bench(
        benchmark,
        run,
        setup,
        "gather_rows",
        implementation,
        source_rows=SOURCE_ROWS,
        gathered_rows=GATHERED_ROWS,
        hidden=HIDDEN,
        dtype=DTYPE,
    )
