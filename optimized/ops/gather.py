"""Row gather and scatter-add that save only the index.

`x.index_select(0, index)` under autograd keeps nothing but the index either,
but its output is sized exactly ``len(index)`` rows; in MoE dispatch that count
changes every micro-batch, so the caching allocator keeps carving new block
sizes and fragments. `padded_index_gather` writes into a buffer whose row
count is rounded up to `GATHER_ROW_ALIGNMENT`, so micro-batches reuse the same
few block sizes; it returns the view of the first ``len(index)`` rows and keeps
the tail rows zero (safe to feed to a grouped GEMM). Backward is a scatter-add
into a zeroed buffer shaped like the input: the input itself is never saved. Its sums
over repeated indices are deterministic in deterministic mode (`models.runtime.determinism`).
"""

from __future__ import annotations

import torch

from models.runtime import index_add_

GATHER_ROW_ALIGNMENT = 1024
"""Rows of a gather output buffer are rounded up to a multiple of this."""


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _check_index(index: torch.Tensor, name: str = "index") -> None:
    if index.dim() != 1 or index.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"{name} must be a 1-D int64 or int32 tensor; got {index.dtype} {tuple(index.shape)}"
        )


def _gather_into_padded(x: torch.Tensor, index: torch.Tensor, alignment: int) -> torch.Tensor:
    rows = index.shape[0]
    buffer = x.new_empty((round_up(rows, alignment),) + tuple(x.shape[1:]))
    torch.index_select(x, 0, index, out=buffer[:rows])
    buffer[rows:].zero_()
    return buffer[:rows]


def _scatter_add(src: torch.Tensor, index: torch.Tensor, num_rows: int) -> torch.Tensor:
    out = src.new_zeros((num_rows,) + tuple(src.shape[1:]))
    return index_add_(out, index, src)  # by sort and segment sum in deterministic mode


class PaddedIndexGather(torch.autograd.Function):
    """``x[index]`` into a row-padded buffer; saves the index only."""

    @staticmethod
    def forward(ctx, x, index, alignment):
        ctx.save_for_backward(index)
        ctx.input_rows = x.shape[0]
        return _gather_into_padded(x, index, alignment)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        (index,) = ctx.saved_tensors
        return _scatter_add(grad_out, index, ctx.input_rows), None, None


class ScatterAddRows(torch.autograd.Function):
    """``zeros[num_rows].index_add(index, src)``; backward is a padded gather."""

    @staticmethod
    def forward(ctx, src, index, num_rows):
        ctx.save_for_backward(index)
        return _scatter_add(src, index, num_rows)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        (index,) = ctx.saved_tensors
        return _gather_into_padded(grad_out, index, GATHER_ROW_ALIGNMENT), None, None


def padded_index_gather(
    x: torch.Tensor, index: torch.Tensor, alignment: int = GATHER_ROW_ALIGNMENT
) -> torch.Tensor:
    """``x.index_select(0, index)`` as a view of a buffer padded to ``alignment`` rows.

    The storage behind the result holds ``round_up(len(index), alignment)`` rows;
    rows past ``len(index)`` are zero. Saves only ``index`` for backward.
    """
    _check_index(index)
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1; got {alignment}")
    return PaddedIndexGather.apply(x, index, alignment)


def scatter_add_rows(src: torch.Tensor, index: torch.Tensor, num_rows: int) -> torch.Tensor:
    """A ``[num_rows, ...]`` tensor with ``src[i]`` added into row ``index[i]``."""
    _check_index(index)
    if index.shape[0] != src.shape[0]:
        raise ValueError(f"index has {index.shape[0]} entries but src has {src.shape[0]} rows")
    return ScatterAddRows.apply(src, index, num_rows)
