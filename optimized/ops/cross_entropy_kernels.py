"""The two row kernels of the fused losses: softmax statistics with the loss, then the
gradient written in place (see `optimized.ops.cross_entropy` for the method).

Both take the columns ``[col_start, col_start + n_cols)`` of a ``vocab``-wide row: the
plain cross-entropy passes the whole row at once, `optimized.ops.linear_cross_entropy`
one vocabulary chunk of logits at a time, the statistics carried from chunk to chunk in
a float32 ``[4, rows]`` tensor (`STATS`): the running maximum ``m``, the sum ``d`` of
``exp(x - m)``, the plain sum of the logits (label smoothing) and the target's logit.

Addresses are formed in 64 bits: a row index times the row stride, a column index times the
column stride (a transposed view's is the row count), and the statistics' rows.

Launch parameters. Compiled (GPU): one program per row, blocks of up to 32768 columns
and 32 warps (Liger-Kernel's CE uses the same: ``BLOCK_SIZE = min(65536 // 2,
next_power_of_2(V))``, ``num_warps = 32`` on CUDA), so a 102400-wide row is four blocks
of 32 values a thread. On the interpreter (CPU) a program costs milliseconds whatever its
size, so it takes a block of rows, `INTERPRETER_ELEMENTS` values at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from optimized.ops._triton import INTERPRETED, INTERPRETER_ELEMENTS, cast_rne, launch, tl, triton

VALID_REDUCTIONS = ("mean", "sum", "none")
STATS = 4
"""Rows of the statistics tensor: running max, sum of exp(x - max), logit sum, target logit."""
MAX_BLOCK = 8192 if INTERPRETED else 32768
"""Most vocabulary columns one program loads at a time (interpreter: times the rows)."""


@dataclass(frozen=True, slots=True)
class LossOptions:
    """The objective both fused losses compute, checked once."""

    ignore_index: int = -100
    """Target value whose row gets no loss and no gradient."""
    reduction: str = "mean"
    """``mean`` (over non-ignored rows; 0 when there are none), ``sum`` or ``none``."""
    label_smoothing: float = 0.0
    """``eps`` in [0, 1]: the target distribution is ``(1 - eps) * onehot + eps / V``."""
    lse_square_scale: float = 0.0
    """z-loss weight ``s`` >= 0: ``s * logsumexp(x)**2`` is added to each row's loss."""

    def __post_init__(self) -> None:
        if self.reduction not in VALID_REDUCTIONS:
            raise ValueError(
                f"reduction={self.reduction!r} is not supported; valid: {VALID_REDUCTIONS}"
            )
        eps = self.label_smoothing
        if not (isinstance(eps, (int, float)) and math.isfinite(eps) and 0.0 <= eps <= 1.0):
            raise ValueError(f"label_smoothing={eps!r} is invalid: must be a number in [0, 1]")
        scale = self.lse_square_scale
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale >= 0.0):
            raise ValueError(f"lse_square_scale={scale!r} is invalid: must be a finite number >= 0")


@triton.jit
def _row_stats_kernel(
    logits_ptr, stride_row, stride_col, n_rows, n_cols, col_start, vocab,
    target_ptr, ignore_index, label_smoothing, lse_square_scale,
    stats_ptr, stats_stride, loss_ptr, z_loss_ptr,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
):  # fmt: skip
    """Fold columns ``[col_start, col_start + n_cols)`` into each row's statistics (fresh
    when ``FIRST``); when ``LAST``, write the row's loss (z-loss included) and z-loss."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    target = tl.load(target_ptr + rows, mask=row_mask, other=ignore_index).to(tl.int64)
    valid = row_mask & (target != ignore_index)
    stats_row = tl.cast(stats_stride, tl.int64)  # (a stride of 1 arrives as a constant)
    row_ptrs = logits_ptr + rows[:, None] * stride_row
    offsets = tl.arange(0, BLOCK)
    if FIRST:
        running_max = tl.full([ROWS], float("-inf"), tl.float32)
        running_sum = tl.zeros([ROWS], tl.float32)
        logit_sum = tl.zeros([ROWS], tl.float32)
        target_logit = tl.zeros([ROWS], tl.float32)
    else:
        running_max = tl.load(stats_ptr + rows, mask=row_mask, other=0.0)
        running_sum = tl.load(stats_ptr + stats_row + rows, mask=row_mask, other=0.0)
        logit_sum = tl.load(stats_ptr + 2 * stats_row + rows, mask=row_mask, other=0.0)
        target_logit = tl.load(stats_ptr + 3 * stats_row + rows, mask=row_mask, other=0.0)
    # An ignored row is read like any other and its results are dropped.
    for start in range(0, n_cols, BLOCK):
        cols = start + offsets
        col_mask = cols[None, :] < n_cols
        x = tl.load(row_ptrs + cols.to(tl.int64)[None, :] * stride_col,
                    mask=row_mask[:, None] & col_mask,
                    other=0.0).to(tl.float32)  # fmt: skip
        logit_sum += tl.sum(x, axis=1)  # masked columns load as 0
        x = tl.where(col_mask, x, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(x, axis=1))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(
            tl.exp(x - new_max[:, None]), axis=1
        )
        running_max = new_max
    local_target = target - col_start
    in_chunk = valid & (local_target >= 0) & (local_target < n_cols)
    target_logit += tl.load(logits_ptr + rows * stride_row + local_target * stride_col,
                            mask=in_chunk, other=0.0).to(tl.float32)  # fmt: skip
    tl.store(stats_ptr + rows, running_max, mask=row_mask)
    tl.store(stats_ptr + stats_row + rows, running_sum, mask=row_mask)
    if LAST:
        log_sum_exp = running_max + tl.log(running_sum)
        z_loss = lse_square_scale * log_sum_exp * log_sum_exp
        # eps * mean(x) only when smoothing: 0 * (-inf) would be NaN for a row of -inf logits.
        smooth = tl.where(label_smoothing > 0.0, label_smoothing * (logit_sum / vocab), 0.0)
        loss = log_sum_exp - (1.0 - label_smoothing) * target_logit - smooth + z_loss
        tl.store(loss_ptr + rows, tl.where(valid, loss, 0.0), mask=row_mask)
        tl.store(z_loss_ptr + rows, tl.where(valid, z_loss, 0.0), mask=row_mask)
    else:
        tl.store(stats_ptr + 2 * stats_row + rows, logit_sum, mask=row_mask)
        tl.store(stats_ptr + 3 * stats_row + rows, target_logit, mask=row_mask)


@triton.jit
def _row_grad_kernel(
    logits_ptr, stride_row, stride_col, n_rows, n_cols, col_start, vocab,
    target_ptr, ignore_index, label_smoothing, lse_square_scale,
    stats_ptr, stats_stride, scale_ptr, upstream_ptr, upstream_stride,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, UPSTREAM: tl.constexpr,
):  # fmt: skip
    """Overwrite columns ``[col_start, col_start + n_cols)`` with d loss / d logits:
    ``(p * (1 + 2 s lse) - (1 - eps) onehot - eps / V) * scale (* upstream[row])``,
    ``p = exp(x - m) / d`` from the finished statistics; zeros on an ignored row."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    target = tl.load(target_ptr + rows, mask=row_mask, other=ignore_index).to(tl.int64)
    valid = row_mask & (target != ignore_index)
    stats_row = tl.cast(stats_stride, tl.int64)  # (a stride of 1 arrives as a constant)
    row_max = tl.load(stats_ptr + rows, mask=row_mask, other=0.0)
    row_sum = tl.load(stats_ptr + stats_row + rows, mask=row_mask, other=1.0)
    log_sum_exp = row_max + tl.log(row_sum)
    scale = tl.load(scale_ptr).to(tl.float32) + tl.zeros([ROWS], tl.float32)
    if UPSTREAM:
        scale *= tl.load(upstream_ptr + rows * upstream_stride, mask=row_mask, other=0.0).to(
            tl.float32
        )
    scale = tl.where(valid, scale, 0.0)
    probability_scale = 1.0 + 2.0 * lse_square_scale * log_sum_exp
    uniform = label_smoothing / vocab
    local_target = target - col_start
    row_ptrs = logits_ptr + rows[:, None] * stride_row
    offsets = tl.arange(0, BLOCK)
    for start in range(0, n_cols, BLOCK):
        cols = start + offsets
        mask = row_mask[:, None] & (cols[None, :] < n_cols)
        ptrs = row_ptrs + cols.to(tl.int64)[None, :] * stride_col
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        probability = tl.exp(x - row_max[:, None]) / row_sum[:, None]
        grad = probability * probability_scale[:, None] - uniform
        grad -= tl.where(cols[None, :] == local_target[:, None], 1.0 - label_smoothing, 0.0)
        grad = grad * scale[:, None]
        tl.store(ptrs, cast_rne(grad, logits_ptr.dtype.element_ty), mask=mask)


def launch_parameters(rows: int, cols: int) -> tuple[int, int, int]:
    """``(rows per program, block, num_warps)`` for ``rows x cols`` logits: see the module
    docstring."""
    block = min(triton.next_power_of_2(max(cols, 1)), MAX_BLOCK)
    if INTERPRETED:
        per_program = max(1, min(triton.next_power_of_2(rows), INTERPRETER_ELEMENTS // block))
        return per_program, block, 4
    return 1, block, min(32, max(4, block // 1024))


def launch_row_stats(
    logits: torch.Tensor,
    target: torch.Tensor,
    stats: torch.Tensor,
    losses: torch.Tensor,
    z_losses: torch.Tensor,
    options: LossOptions,
    col_start: int = 0,
    vocab: int | None = None,
) -> None:
    """Fold ``logits`` (columns ``col_start`` onwards of ``vocab``; the whole row by
    default) into ``stats [>=2, rows]``; after the last columns, ``losses`` and
    ``z_losses`` hold each row's loss (z-loss included) and z-loss. The first columns
    start the statistics afresh; with fewer than ``vocab`` columns, ``stats`` must have
    `STATS` rows."""
    rows, cols = logits.shape
    vocab = cols if vocab is None else vocab
    first, last = col_start == 0, col_start + cols == vocab
    if not (first and last) and stats.shape[0] < STATS:
        raise ValueError(
            f"a chunk of the vocabulary needs stats [{STATS}, rows]; got {tuple(stats.shape)}"
        )
    if rows == 0:
        return
    per_program, block, num_warps = launch_parameters(rows, cols)
    launch(
        _row_stats_kernel,
        (triton.cdiv(rows, per_program),),
        logits, logits.stride(0), logits.stride(1), rows, cols, col_start, vocab,
        target, options.ignore_index, float(options.label_smoothing),
        float(options.lse_square_scale), stats, stats.stride(0), losses, z_losses,
        ROWS=per_program, BLOCK=block, FIRST=first, LAST=last, num_warps=num_warps,
    )  # fmt: skip


def launch_row_grad(
    logits: torch.Tensor,
    target: torch.Tensor,
    stats: torch.Tensor,
    scale: torch.Tensor,
    options: LossOptions,
    upstream: torch.Tensor | None = None,
    col_start: int = 0,
    vocab: int | None = None,
) -> None:
    """Overwrite ``logits`` (columns ``col_start`` onwards of ``vocab``) with the gradient
    of ``sum(losses) * scale`` from the finished ``stats``, times ``upstream``: a 0-d
    tensor or one value per row (any stride), when given."""
    rows, cols = logits.shape
    vocab = cols if vocab is None else vocab
    if rows == 0:
        return
    per_program, block, num_warps = launch_parameters(rows, cols)
    has_upstream = upstream is not None
    upstream_stride = upstream.stride(0) if has_upstream and upstream.dim() else 0
    launch(
        _row_grad_kernel,
        (triton.cdiv(rows, per_program),),
        logits, logits.stride(0), logits.stride(1), rows, cols, col_start, vocab,
        target, options.ignore_index, float(options.label_smoothing),
        float(options.lse_square_scale), stats, stats.stride(0), scale,
        upstream if has_upstream else scale, upstream_stride,
        ROWS=per_program, BLOCK=block, UPSTREAM=has_upstream, num_warps=num_warps,
    )  # fmt: skip
