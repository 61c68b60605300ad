"""Token rows grouped by expert, each group padded for the grouped GEMM.

A grouped GEMM runs fastest, and on some backends only works, when every
expert's group starts on an aligned row. `scatter_for_grouped_gemm` sorts the
routed token rows by expert (stable within an expert) into a zeroed buffer in
which each expert's group is padded up to a multiple of
`GROUPED_GEMM_ROW_ALIGNMENT` rows (an expert with no tokens gets no rows). The
buffer's row stride is also padded to 16 bytes, which `F.grouped_mm` requires
of its operands, so an odd hidden size costs no copy later.

The returned `ExpertLayout` holds the int32 cumulative group ends, padding
included (``offsets[-1]`` is the buffer's row count), and ``positions[i]``, the
buffer row of input row ``i``: all the reverse step `gather_from_grouped` needs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from models.network import ExpertLayout
from optimized.ops.gather import padded_index_gather, round_up

GROUPED_GEMM_ROW_ALIGNMENT = 128
"""Each expert's group of rows is padded to a multiple of this."""

GROUPED_GEMM_STRIDE_BYTES = 16
"""`F.grouped_mm` needs every non-unit stride to be a multiple of this many bytes."""


def aligned_empty(rows: int, cols: int, like: torch.Tensor, zero: bool = False) -> torch.Tensor:
    """A ``[rows, cols]`` tensor whose row stride is a multiple of 16 bytes."""
    per_row = max(1, GROUPED_GEMM_STRIDE_BYTES // like.element_size())
    make = torch.zeros if zero else torch.empty
    buffer = make((rows, round_up(cols, per_row)), dtype=like.dtype, device=like.device)
    return buffer[:, :cols]


def expert_layout(
    expert_ids: torch.Tensor, num_experts: int, alignment: int = GROUPED_GEMM_ROW_ALIGNMENT
) -> ExpertLayout:
    """Padded group ends and the padded-buffer row of every routed row (no host sync)."""
    # A scatter-add, not `torch.bincount`: on CUDA bincount reads the largest id on the
    # host to size its output.
    counts = torch.zeros(num_experts, dtype=torch.long, device=expert_ids.device)
    counts.index_add_(0, expert_ids, torch.ones_like(expert_ids))
    padded_counts = (counts + alignment - 1) // alignment * alignment
    offsets = torch.cumsum(padded_counts, 0)
    order = torch.argsort(expert_ids, stable=True)
    sorted_ids = expert_ids[order]
    # Row j of the sorted order is the (j - first_row_of_its_expert)-th of its group.
    first_sorted_row = torch.cumsum(counts, 0) - counts
    rank_in_group = torch.arange(order.numel(), device=order.device) - first_sorted_row[sorted_ids]
    positions = torch.empty_like(order)
    positions[order] = (offsets - padded_counts)[sorted_ids] + rank_in_group
    return ExpertLayout(offsets.to(torch.int32), positions)


class _ScatterToGroups(torch.autograd.Function):
    """Rows of ``tokens`` copied to ``positions`` of a zeroed aligned buffer."""

    @staticmethod
    def forward(ctx, tokens, positions, total_rows):
        ctx.save_for_backward(positions)
        grouped = aligned_empty(total_rows, tokens.shape[1], tokens, zero=True)
        return grouped.index_copy_(0, positions, tokens)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_grouped):
        (positions,) = ctx.saved_tensors
        return grad_grouped.index_select(0, positions), None, None


def scatter_for_grouped_gemm(
    tokens: torch.Tensor,
    expert_ids: torch.Tensor,
    num_experts: int,
    alignment: int = GROUPED_GEMM_ROW_ALIGNMENT,
    group_rows: Sequence[int] | None = None,
) -> tuple[torch.Tensor, ExpertLayout]:
    """Rows of ``tokens [N, H]`` grouped by ``expert_ids [N]`` with padded groups.

    Returns the ``[offsets[-1], H]`` buffer (padding rows zero) and its
    `ExpertLayout`. Differentiable in ``tokens``; saves only the positions.

    ``group_rows``, the rows of each expert when the caller knows them on the host (a MoE
    layer's split sizes), sizes the buffer without reading anything back from the device;
    without them the row count and the ids' validity are read in one synchronisation.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [rows, hidden]; got shape {tuple(tokens.shape)}")
    if expert_ids.dim() != 1 or expert_ids.shape[0] != tokens.shape[0]:
        raise ValueError(
            f"expert_ids must be [{tokens.shape[0]}] (one per token row); "
            f"got {tuple(expert_ids.shape)}"
        )
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1; got {num_experts}")
    expert_ids = expert_ids.long()
    if group_rows is not None:
        return _scatter_known_rows(tokens, expert_ids, num_experts, alignment, group_rows)
    # The buffer's row count and the ids' validity come back to the host in one read (the
    # op's one synchronisation); the layout is built from clamped ids so that a bad id
    # cannot index out of bounds on the device before it is reported.
    out_of_range = ((expert_ids < 0) | (expert_ids >= num_experts)).sum()
    layout = expert_layout(expert_ids.clamp(0, num_experts - 1), num_experts, alignment)
    total_rows, bad = torch.stack([layout.offsets[-1].long(), out_of_range]).tolist()
    if bad:
        raise ValueError(f"expert_ids must lie in [0, {num_experts}); {bad} do not")
    grouped = _ScatterToGroups.apply(tokens, layout.positions, total_rows)
    return grouped, layout


def _scatter_known_rows(
    tokens: torch.Tensor,
    expert_ids: torch.Tensor,
    num_experts: int,
    alignment: int,
    group_rows: Sequence[int],
) -> tuple[torch.Tensor, ExpertLayout]:
    """`scatter_for_grouped_gemm` with the buffer sized from the host's ``group_rows``.

    The ids are checked on the device (`torch._assert_async`: at once on the CPU, a device
    assert on a GPU). Ids that disagree with ``group_rows`` (a caller's bug) cannot write
    out of bounds either: the offsets and positions are clamped to the buffer, so such rows
    collide and give wrong results rather than touch memory past it.
    """
    if len(group_rows) != num_experts or sum(group_rows) != tokens.shape[0]:
        raise ValueError(
            f"group_rows must give {num_experts} row counts summing to the {tokens.shape[0]} "
            f"token rows; got {list(group_rows)}"
        )
    out_of_range = ((expert_ids < 0) | (expert_ids >= num_experts)).any()
    torch._assert_async(out_of_range.logical_not(), f"expert_ids must lie in [0, {num_experts})")
    ends = tuple(itertools.accumulate(round_up(rows, alignment) for rows in group_rows))
    total_rows = ends[-1] if ends else 0
    offsets, positions, _ = expert_layout(
        expert_ids.clamp(0, num_experts - 1), num_experts, alignment
    )
    layout = ExpertLayout(
        offsets.clamp_(max=total_rows), positions.clamp_(max=total_rows - 1), ends
    )
    grouped = _ScatterToGroups.apply(tokens, layout.positions, total_rows)
    return grouped, layout


def gather_from_grouped(grouped: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """The reverse step: row ``i`` of the result is ``grouped[layout.positions[i]]``."""
    return padded_index_gather(grouped, layout.positions)
