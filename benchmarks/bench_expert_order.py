"""scatter_for_grouped_gemm (padded groups) vs the plain stable sort into expert order."""

from __future__ import annotations

import pytest
import torch

from benchmarks._common import DEVICE, bench, pick
from optimized.ops import gather_from_grouped, scatter_for_grouped_gemm

ROWS, HIDDEN, EXPERTS = pick(gpu=(8 * 4096, 2048, 64), cpu=(4096, 256, 16))
DTYPE = torch.bfloat16


def setup():
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    tokens = torch.randn(ROWS, HIDDEN, generator=generator, device=DEVICE, dtype=DTYPE)
    expert_ids = torch.randint(0, EXPERTS, (ROWS,), generator=generator, device=DEVICE)
    return (tokens.requires_grad_(), expert_ids), {}


def optimized(tokens, expert_ids):
    grouped, layout = scatter_for_grouped_gemm(tokens, expert_ids, EXPERTS)
    gather_from_grouped(grouped, layout).sum().backward()


def plain(tokens, expert_ids):
    order = torch.argsort(expert_ids, stable=True)
    grouped = tokens.index_select(0, order)
    positions = torch.empty_like(order)
    positions[order] = torch.arange(order.numel(), device=order.device)
    grouped.index_select(0, positions).sum().backward()


@pytest.mark.parametrize("implementation", ["optimized", "plain"])
def test_expert_order(benchmark, implementation):
    run = optimized if implementation == "optimized" else plain
    bench(
        benchmark,
        run,
        setup,
        "expert_order",
        implementation,
        rows=ROWS,
        hidden=HIDDEN,
        experts=EXPERTS,
        dtype=DTYPE,
    )
