"""Fused cross-entropy: one kernel pass, the gradient written over the logits.

`F.cross_entropy` on ``[tokens, vocab]`` logits keeps the logits for backward,
makes a softmax of the same size, and in backward a gradient of the same size
again (and a float32 upcast of the logits doubles each of those). Here one
Triton program per row (a block of rows on the CPU interpreter) runs an online
softmax in float32 over vocabulary blocks, then writes
``softmax - onehot(target)`` (already scaled for ``mean``) into the logits
buffer itself. Backward only multiplies that buffer by the
incoming scalar gradient and hands it on: no logits-sized tensor is ever made.

The price is that the logits are consumed. The forward bumps their autograd
version counter, so any other autograd node that saved them (``tanh``, a
multiply by a learnable scale, a second loss on the same logits, ...) raises
"modified by an inplace operation" in backward instead of silently reading
gradient values; backward also refuses if the buffer was changed after the
forward. A leaf that requires grad is refused outright (its data would be
destroyed). Without grad (evaluation), nothing is written.
"""

from __future__ import annotations

import torch

from optimized.ops._triton import INTERPRETED, INTERPRETER_ELEMENTS, cast_rne, launch, tl, triton

VALID_REDUCTIONS = ("mean", "sum")
MAX_BLOCK = 8192
"""Largest vocabulary block one program loads at a time."""


@triton.jit
def _cross_entropy_kernel(
    logits_ptr,
    stride_row,
    stride_col,
    target_ptr,
    loss_ptr,
    grad_scale_ptr,
    n_rows,
    n_cols,
    ignore_index,
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

    # Pass 1: running max and running sum of exponentials per row, in float32. An ignored
    # row is read like any other (its values are finite) and its results are dropped.
    running_max = tl.full([ROWS], float("-inf"), tl.float32)
    running_sum = tl.zeros([ROWS], tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + offsets
        col_mask = cols[None, :] < n_cols
        x = tl.load(row_ptrs + cols[None, :] * stride_col, mask=row_mask[:, None] & col_mask,
                    other=0.0)  # fmt: skip
        x = tl.where(col_mask, x.to(tl.float32), float("-inf"))
        new_max = tl.maximum(running_max, tl.max(x, axis=1))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(
            tl.exp(x - new_max[:, None]), axis=1
        )
        running_max = new_max
    log_sum_exp = running_max + tl.log(running_sum)
    target_logit = tl.load(logits_ptr + rows * stride_row + target * stride_col, mask=valid,
                           other=0.0).to(tl.float32)  # fmt: skip
    tl.store(loss_ptr + rows, tl.where(valid, log_sum_exp - target_logit, 0.0), mask=row_mask)

    # Pass 2: d loss / d logits = (softmax - onehot) * scale, written in place (zeros on an
    # ignored row).
    if WRITE_GRAD:
        scale = tl.load(grad_scale_ptr)
        for start in range(0, n_cols, BLOCK):
            cols = start + offsets
            mask = row_mask[:, None] & (cols[None, :] < n_cols)
            ptrs = row_ptrs + cols[None, :] * stride_col
            x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            grad = tl.exp(x - log_sum_exp[:, None]) - tl.where(
                cols[None, :] == target[:, None], 1.0, 0.0
            )
            grad = tl.where(valid[:, None], grad * scale, 0.0)
            tl.store(ptrs, cast_rne(grad, logits_ptr.dtype.element_ty), mask=mask)


def check_inputs(logits: torch.Tensor, target: torch.Tensor, reduction: str) -> None:
    if reduction not in VALID_REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not supported; valid: {VALID_REDUCTIONS}")
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


def grad_scale_for(
    target: torch.Tensor, ignore_index: int, reduction: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 factor of d loss / d logits for ``reduction``, and the valid-token count.

    Both stay on the device: ``mean`` divides by ``max(valid, 1)`` so an all-ignored
    batch gives 0, not NaN.
    """
    num_valid = (target != ignore_index).sum()
    if reduction == "mean":
        return 1.0 / num_valid.clamp(min=1).to(torch.float32), num_valid
    return torch.ones((), dtype=torch.float32, device=target.device), num_valid


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
    grad_scale: torch.Tensor,
    ignore_index: int,
    write_grad: bool,
) -> None:
    """Per-row losses into ``losses``; with ``write_grad`` the logits become the gradient."""
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
        grad_scale,
        tokens,
        vocab,
        ignore_index,
        ROWS=rows,
        BLOCK=block,
        WRITE_GRAD=write_grad,
        num_warps=8 if block >= 4096 else 4,
    )


def cross_entropy_forward_(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    reduction: str,
    write_grad: bool,
) -> torch.Tensor:
    """Run the kernel on ``logits`` (overwritten with the gradient when ``write_grad``).

    Returns the float32 loss (0-dim); the gradient written is that of this loss.
    """
    target = target.contiguous()
    check_targets(target, ignore_index, logits.shape[1])
    grad_scale, _ = grad_scale_for(target, ignore_index, reduction)
    losses = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    launch_cross_entropy_kernel(logits, target, losses, grad_scale, ignore_index, write_grad)
    loss = losses.sum()
    return loss * grad_scale if reduction == "mean" else loss


class FusedCrossEntropy(torch.autograd.Function):
    """Loss in forward, gradient in the logits buffer; backward only scales it."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction):
        write_grad = ctx.needs_input_grad[0]
        loss = cross_entropy_forward_(logits, target, ignore_index, reduction, write_grad)
        if write_grad:
            # The logits now hold the gradient: let autograd see the in-place change,
            # so any other node that saved them fails loudly when it unpacks them.
            torch.autograd.graph.increment_version(logits)
            ctx.grad_buffer = logits.detach()
            ctx.version = logits._version
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
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
        buffer.mul_(grad_loss)
        return buffer, None, None, None


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Token cross-entropy of ``logits [N, V]`` against ``target [N]``, as a float32 scalar.

    ``mean`` averages over non-ignored tokens; a batch with every target ignored
    gives loss 0 and a zero gradient. When the logits require grad, their
    storage is overwritten with the gradient (see the module docstring): do not
    use them after this call.
    """
    check_inputs(logits, target, reduction)
    if logits.requires_grad and torch.is_grad_enabled():
        if logits.is_leaf:
            raise RuntimeError(
                "fused cross_entropy writes the gradient into the logits buffer and so cannot "
                "take a leaf tensor that requires grad (its data would be destroyed); pass a "
                "non-leaf such as the output of the LM head, or logits.clone()"
            )
        return FusedCrossEntropy.apply(logits, target, ignore_index, reduction)
    with torch.no_grad():
        loss = cross_entropy_forward_(logits, target, ignore_index, reduction, False)
    return loss
