"""scatter_for_grouped_gemm: rows grouped by expert, groups padded to 128-row multiples."""

from __future__ import annotations

import pytest
import torch

from models.runtime import HostSyncCounter
from optimized.ops import (
    GROUPED_GEMM_ROW_ALIGNMENT,
    gather_from_grouped,
    scatter_for_grouped_gemm,
)

ALIGN = GROUPED_GEMM_ROW_ALIGNMENT


def expected_groups(tokens, expert_ids, num_experts):
    """Each expert's rows in input order (a stable sort), the plain way."""
    return [tokens[expert_ids == e] for e in range(num_experts)]


def check_layout(tokens, expert_ids, num_experts):
    grouped, layout = scatter_for_grouped_gemm(tokens, expert_ids, num_experts)
    counts = torch.bincount(expert_ids, minlength=num_experts)
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    assert layout.offsets.dtype == torch.int32
    assert torch.equal(layout.offsets.long(), torch.cumsum(padded, 0))
    assert grouped.shape == (int(padded.sum()), tokens.shape[1])
    assert layout.positions.shape == (tokens.shape[0],)
    starts = torch.cumsum(padded, 0) - padded
    for expert, rows in enumerate(expected_groups(tokens, expert_ids, num_experts)):
        start, count = int(starts[expert]), int(counts[expert])
        assert torch.equal(grouped[start : start + count], rows)
        pad = grouped[start + count : start + int(padded[expert])]
        assert torch.equal(pad, torch.zeros_like(pad))
    assert torch.equal(grouped[layout.positions], tokens)
    assert torch.equal(gather_from_grouped(grouped, layout), tokens)
    return grouped, layout


@pytest.mark.parametrize(
    ("rows", "hidden", "num_experts", "ids"),
    [
        (300, 16, 6, None),  # random, some experts likely empty
        (50, 7, 8, [0, 5]),  # only two experts used, odd hidden size
        (0, 5, 4, None),  # zero tokens
        (130, 3, 1, None),  # a single expert, group over 128 rows
        (129, 33, 3, [2]),  # everything on the last expert
    ],
)
def test_layout_edge_cases(rows, hidden, num_experts, ids):
    generator = torch.Generator().manual_seed(rows + hidden)
    tokens = torch.randn(rows, hidden, generator=generator)
    if ids is None:
        expert_ids = torch.randint(0, num_experts, (rows,), generator=generator)
    else:
        choice = torch.randint(0, len(ids), (rows,), generator=generator)
        expert_ids = torch.tensor(ids)[choice]
    grouped, layout = check_layout(tokens, expert_ids, num_experts)
    # With each expert's rows known on the host (a MoE layer's split sizes), the same
    # buffer and layout, and nothing read back from the device.
    rows_per_expert = torch.bincount(expert_ids, minlength=num_experts).tolist()
    with HostSyncCounter() as counter, counter.counting():
        known, known_layout = scatter_for_grouped_gemm(
            tokens, expert_ids, num_experts, group_rows=rows_per_expert
        )
    assert counter.events == [], counter.events
    assert torch.equal(known, grouped)
    assert torch.equal(known_layout.offsets, layout.offsets)
    assert torch.equal(known_layout.positions, layout.positions)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_gradients(dtype):
    generator = torch.Generator().manual_seed(40)
    source = torch.randn(90, 11, generator=generator).to(dtype)
    expert_ids = torch.randint(0, 5, (90,), generator=generator)
    weights = torch.randn(90, 11, generator=generator).to(dtype)
    tokens = source.clone().requires_grad_()
    grouped, layout = scatter_for_grouped_gemm(tokens, expert_ids, 5)
    grouped_weights = torch.randn(grouped.shape, generator=generator).to(dtype)
    out = gather_from_grouped(grouped * grouped_weights, layout)
    (out * weights).sum().backward()
    expected = grouped_weights[layout.positions].double() * weights.double()
    assert ((tokens.grad.double() - expected).norm() / expected.norm()).item() <= 1e-2
    if dtype == torch.float32:
        assert torch.allclose(tokens.grad, (grouped_weights[layout.positions] * weights))


def test_buffer_rows_are_16_byte_aligned_for_grouped_mm():
    grouped, _ = scatter_for_grouped_gemm(
        torch.randn(10, 5, dtype=torch.bfloat16), torch.zeros(10, dtype=torch.long), 2
    )
    assert (grouped.stride(0) * grouped.element_size()) % 16 == 0


def test_bad_expert_ids_are_named():
    with pytest.raises(ValueError, match=r"expert_ids must lie in \[0, 3\)"):
        scatter_for_grouped_gemm(torch.randn(2, 4), torch.tensor([0, 3]), 3)
    with pytest.raises(ValueError, match="expert_ids must be"):
        scatter_for_grouped_gemm(torch.randn(2, 4), torch.tensor([0]), 3)
    # With host-known rows the ids are checked on the device: at once on the CPU.
    with pytest.raises(RuntimeError, match=r"expert_ids must lie in \[0, 3\)"):
        scatter_for_grouped_gemm(torch.randn(2, 4), torch.tensor([0, 3]), 3, group_rows=[1, 0, 1])
    with pytest.raises(ValueError, match="group_rows must give 3 row counts summing to the 2"):
        scatter_for_grouped_gemm(torch.randn(2, 4), torch.tensor([0, 1]), 3, group_rows=[1, 0])
