"""Fused cross-entropy: one kernel pass, the gradient written over the logits.

`F.cross_entropy` on ``[tokens, vocab]`` logits keeps the logits for backward,
makes a softmax of the same size, and in backward a gradient of the same size
again (and a float32 upcast of the logits doubles each of those). Here one
Triton program per row (a block of rows on the CPU interpreter) runs an online
softmax in float32 over vocabulary blocks, then writes the gradient of the row's
loss (already scaled for ``mean``) into the logits buffer itself. Backward only
multiplies that buffer by the incoming gradient (a scalar, or one value per row
for ``reduction="none"``) and hands it on: no logits-sized tensor is ever made.

The objective (`LossOptions`) is what training users of fused losses ask for:

- ``label_smoothing`` ``eps``: the target is ``(1 - eps) * onehot + eps / V``, as in
  `F.cross_entropy`, so ``loss = lse - (1 - eps) * x_t - eps * mean(x)``;
- z-loss ``lse_square_scale`` ``s`` (PaLM): ``s * lse**2`` is added to each row's loss
  and returned on its own for logging;
- ``reduction``: ``mean`` over non-ignored rows, ``sum``, or ``none`` (one loss per row).

The gradient of a row is ``p * (1 + 2 s lse) - (1 - eps) * onehot - eps / V`` with
``p = exp(x - m) / d`` (``m`` the row maximum, ``d`` the sum of ``exp(x - m)``). The
probabilities are never formed as ``exp(x - lse)``: ``lse = m + log d`` rounded to
float32 carries half an ulp of ``|lse|`` (1.9e-6 at ``|lse|`` ~ 40), and that absolute
error in the exponent became the relative error of every gradient in the row; it put
170 of 4.5 M float32 gradients (3 x 47 x 32000, logits scale 10) 2x outside Liger's
``rtol=1e-6`` against float64. Dividing by ``d`` adds half an ulp, relative.

The price of the in-place gradient is that the logits are consumed. The forward
bumps their autograd version counter, so any other autograd node that saved them
(``tanh``, a multiply by a learnable scale, a second loss on the same logits, ...)
raises "modified by an inplace operation" in backward instead of silently reading
gradient values; backward also refuses if the buffer was changed after the
forward. A leaf that requires grad is refused outright (its data would be
destroyed). Without grad (evaluation), nothing is written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from optimized.ops._triton import INTERPRETED, INTERPRETER_ELEMENTS, cast_rne, launch, tl, triton

VALID_REDUCTIONS = ("mean", "sum", "none")
MAX_BLOCK = 8192
"""Largest vocabulary block one program loads at a time."""


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
def _cross_entropy_kernel(
    logits_ptr,
    stride_row,
    stride_col,
    target_ptr,
    loss_ptr,
    z_loss_ptr,
    grad_scale_ptr,
    n_rows,
    n_cols,
    ignore_index,
    label_smoothing,
    lse_square_scale,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    target = tl.load(target_ptr + rows, mask=row_mask, other=ignore_index).to(tl.int64)
    valid = row_mask & (target != ignore_index)
    row_ptrs = logits_ptr + rows[:, None] * stride_row
    offsets = tl.arange(0, BLOCK)

    # Pass 1: running max, running sum of exponentials and the plain sum per row, in
    # float32. An ignored row is read like any other and its results are dropped.
    running_max = tl.full([ROWS], float("-inf"), tl.float32)
    running_sum = tl.zeros([ROWS], tl.float32)
    logit_sum = tl.zeros([ROWS], tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + offsets
        col_mask = cols[None, :] < n_cols
        x = tl.load(row_ptrs + cols[None, :] * stride_col, mask=row_mask[:, None] & col_mask,
                    other=0.0).to(tl.float32)  # fmt: skip
        logit_sum += tl.sum(x, axis=1)  # masked columns load as 0
        x = tl.where(col_mask, x, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(x, axis=1))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(
            tl.exp(x - new_max[:, None]), axis=1
        )
        running_max = new_max
    log_sum_exp = running_max + tl.log(running_sum)
    target_logit = tl.load(logits_ptr + rows * stride_row + target * stride_col, mask=valid,
                           other=0.0).to(tl.float32)  # fmt: skip
    z_loss = lse_square_scale * log_sum_exp * log_sum_exp
    # eps * mean(x) only when smoothing: 0 * (-inf) would be NaN for a row with -inf logits.
    smooth = tl.where(label_smoothing > 0.0, label_smoothing * (logit_sum / n_cols), 0.0)
    loss = log_sum_exp - (1.0 - label_smoothing) * target_logit - smooth + z_loss
    tl.store(loss_ptr + rows, tl.where(valid, loss, 0.0), mask=row_mask)
    tl.store(z_loss_ptr + rows, tl.where(valid, z_loss, 0.0), mask=row_mask)

    # Pass 2: d loss / d logits = (p * (1 + 2 s lse) - (1 - eps) onehot - eps / V) * scale,
    # written in place (zeros on an ignored row), with p = exp(x - m) / d: see the module
    # docstring for why not exp(x - lse).
    if WRITE_GRAD:
        scale = tl.load(grad_scale_ptr)
        probability_scale = 1.0 + 2.0 * lse_square_scale * log_sum_exp
        uniform = label_smoothing / n_cols
        for start in range(0, n_cols, BLOCK):
            cols = start + offsets
            mask = row_mask[:, None] & (cols[None, :] < n_cols)
            ptrs = row_ptrs + cols[None, :] * stride_col
            x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            probability = tl.exp(x - running_max[:, None]) / running_sum[:, None]
            grad = probability * probability_scale[:, None] - uniform
            grad -= tl.where(cols[None, :] == target[:, None], 1.0 - label_smoothing, 0.0)
            grad = tl.where(valid[:, None], grad * scale, 0.0)
            tl.store(ptrs, cast_rne(grad, logits_ptr.dtype.element_ty), mask=mask)


def check_inputs(logits: torch.Tensor, target: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [tokens, vocab]; got shape {tuple(logits.shape)}")
    if target.shape != logits.shape[:1]:
        raise ValueError(
            f"target must be [tokens] = [{logits.shape[0]}]; got shape {tuple(target.shape)}"
        )
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits dtype {logits.dtype} is not float32, bfloat16 or float16")
    if target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"target dtype {target.dtype} is not int64 or int32")


def check_targets(target: torch.Tensor, ignore_index: int, vocab: int) -> None:
    """Raise on a target outside ``[0, vocab)`` that is not ``ignore_index``."""
    out_of_range = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bool(out_of_range.any()):
        bad = target[out_of_range][0].item()
        raise ValueError(
            f"target holds {bad}, outside [0, {vocab}) and not ignore_index={ignore_index}"
        )


def grad_scale_for(target: torch.Tensor, options: LossOptions) -> torch.Tensor:
    """The float32 factor of d loss / d logits for ``options.reduction``, on the device.

    ``mean`` divides by ``max(valid, 1)`` so an all-ignored batch gives 0, not NaN.
    """
    if options.reduction == "mean":
        num_valid = (target != options.ignore_index).sum()
        return 1.0 / num_valid.clamp(min=1).to(torch.float32)
    return torch.ones((), dtype=torch.float32, device=target.device)


def reduce_rows(rows: torch.Tensor, reduction: str, grad_scale: torch.Tensor) -> torch.Tensor:
    """Per-row values reduced as the loss is: ``none`` keeps them."""
    if reduction == "none":
        return rows
    total = rows.sum()
    return total * grad_scale if reduction == "mean" else total


def _rows_per_program(tokens: int, block: int) -> int:
    """One row per program when compiled; on the interpreter as many rows as fit in
    `INTERPRETER_ELEMENTS` per vocabulary block (every row is still reduced on its own)."""
    if not INTERPRETED:
        return 1
    return max(1, min(triton.next_power_of_2(tokens), INTERPRETER_ELEMENTS // block))


def launch_cross_entropy_kernel(
    logits: torch.Tensor,
    target: torch.Tensor,
    losses: torch.Tensor,
    z_losses: torch.Tensor,
    grad_scale: torch.Tensor,
    options: LossOptions,
    write_grad: bool,
) -> None:
    """Per-row losses (z-loss included) into ``losses`` and z-losses into ``z_losses``;
    with ``write_grad`` the logits become the gradient of ``sum(losses) * grad_scale``."""
    tokens, vocab = logits.shape
    if tokens == 0:
        return
    block = min(triton.next_power_of_2(vocab), MAX_BLOCK)
    rows = _rows_per_program(tokens, block)
    launch(
        _cross_entropy_kernel,
        (triton.cdiv(tokens, rows),),
        logits,
        logits.stride(0),
        logits.stride(1),
        target,
        losses,
        z_losses,
        grad_scale,
        tokens,
        vocab,
        options.ignore_index,
        float(options.label_smoothing),
        float(options.lse_square_scale),
        ROWS=rows,
        BLOCK=block,
        WRITE_GRAD=write_grad,
        num_warps=8 if block >= 4096 else 4,
    )


def cross_entropy_forward_(
    logits: torch.Tensor, target: torch.Tensor, options: LossOptions, write_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kernel on ``logits`` (overwritten with the gradient when ``write_grad``).

    Returns the float32 loss and z-loss, reduced as ``options.reduction`` asks; the
    gradient written is that of the loss (for ``none``: of the sum of the rows).
    """
    target = target.contiguous()
    check_targets(target, options.ignore_index, logits.shape[1])
    grad_scale = grad_scale_for(target, options)
    losses = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    z_losses = torch.empty_like(losses)
    launch_cross_entropy_kernel(logits, target, losses, z_losses, grad_scale, options, write_grad)
    reduction = options.reduction
    return reduce_rows(losses, reduction, grad_scale), reduce_rows(z_losses, reduction, grad_scale)


def scale_by_upstream_(gradient: torch.Tensor, grad_loss: torch.Tensor) -> torch.Tensor:
    """``gradient`` (rows of d loss / d x) times the incoming gradient, in place: a scalar,
    or one value per row for ``reduction="none"``."""
    if grad_loss.dim() == 0:
        return gradient.mul_(grad_loss)
    return gradient.mul_(grad_loss.unsqueeze(-1))


class FusedCrossEntropy(torch.autograd.Function):
    """Loss in forward, gradient in the logits buffer; backward only scales it."""

    @staticmethod
    def forward(ctx, logits, target, options):
        write_grad = ctx.needs_input_grad[0]
        loss, z_loss = cross_entropy_forward_(logits, target, options, write_grad)
        ctx.mark_non_differentiable(z_loss)
        if write_grad:
            # The logits now hold the gradient: let autograd see the in-place change,
            # so any other node that saved them fails loudly when it unpacks them.
            torch.autograd.graph.increment_version(logits)
            ctx.grad_buffer = logits.detach()
            ctx.version = logits._version
        return loss, z_loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _grad_z_loss):
        buffer = getattr(ctx, "grad_buffer", None)
        if buffer is None:
            raise RuntimeError("fused cross_entropy: backward can run once; its buffer is spent")
        del ctx.grad_buffer
        if buffer._version != ctx.version:
            raise RuntimeError(
                "fused cross_entropy: the logits buffer, which holds the gradient after the "
                f"forward, was modified in place (version {ctx.version} -> {buffer._version}); "
                "the logits are consumed by this loss and must not be reused"
            )
        return scale_by_upstream_(buffer, grad_loss), None, None


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    return_z_loss: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Token cross-entropy of ``logits [N, V]`` against ``target [N]``, in float32.

    A scalar for ``mean`` (over non-ignored tokens; a batch with every target ignored
    gives loss 0 and a zero gradient) and ``sum``, ``[N]`` for ``none`` (0 on ignored
    rows). ``label_smoothing`` is `F.cross_entropy`'s; ``lse_square_scale`` adds the
    z-loss ``s * logsumexp**2`` per row, which ``return_z_loss`` also returns on its own,
    reduced the same way and without gradient, for logging: ``(loss, z_loss)``.

    When the logits require grad, their storage is overwritten with the gradient (see
    the module docstring): do not use them after this call.
    """
    options = LossOptions(ignore_index, reduction, label_smoothing, lse_square_scale)
    check_inputs(logits, target)
    if logits.requires_grad and torch.is_grad_enabled():
        if logits.is_leaf:
            raise RuntimeError(
                "fused cross_entropy writes the gradient into the logits buffer and so cannot "
                "take a leaf tensor that requires grad (its data would be destroyed); pass a "
                "non-leaf such as the output of the LM head, or logits.clone()"
            )
        loss, z_loss = FusedCrossEntropy.apply(logits, target, options)
    else:
        with torch.no_grad():
            loss, z_loss = cross_entropy_forward_(logits, target, options, False)
    return (loss, z_loss) if return_z_loss else loss
