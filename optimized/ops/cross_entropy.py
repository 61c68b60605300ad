"""Fused cross-entropy: one read of the logits in forward, the gradient written over them
in backward.

`F.cross_entropy` on ``[tokens, vocab]`` logits keeps the logits for backward,
makes a softmax of the same size, and in backward a gradient of the same size
again (and a float32 upcast of the logits doubles each of those). Here the forward is
one Triton pass over each row (one program per row; a block of rows on the CPU
interpreter) that keeps an online softmax in float32: the row's maximum ``m``, the sum
``d`` of ``exp(x - m)``, and what the objective needs, and writes the row's loss. Only
``m`` and ``d`` (8 bytes a row) wait for backward, which is one more pass that writes
the gradient of the loss, already times the incoming gradient (a scalar, or one value
per row for ``reduction="none"``), into the logits buffer itself and hands it on: no
logits-sized tensor is ever made, and the logits are read twice and written once
(Liger-Kernel's CE reads them twice and writes once too, in its forward, then multiplies
the whole gradient by the incoming one unless that is 1).

The objective (`LossOptions`) is what training users of fused losses ask for:

- ``label_smoothing`` ``eps``: the target is ``(1 - eps) * onehot + eps / V``, as in
  `F.cross_entropy`, so ``loss = lse - (1 - eps) * x_t - eps * mean(x)``;
- z-loss ``lse_square_scale`` ``s`` (PaLM): ``s * lse**2`` is added to each row's loss
  and returned on its own for logging;
- ``reduction``: ``mean`` over non-ignored rows, ``sum``, or ``none`` (one loss per row).

The gradient of a row is ``p * (1 + 2 s lse) - (1 - eps) * onehot - eps / V`` with
``p = exp(x - m) / d``. The probabilities are never formed as ``exp(x - lse)``:
``lse = m + log d`` rounded to float32 carries half an ulp of ``|lse|`` (1.9e-6 at
``|lse|`` ~ 40), and that absolute error in the exponent became the relative error of
every gradient in the row; it put 170 of 4.5 M float32 gradients (3 x 47 x 32000, logits
scale 10) 2x outside Liger's ``rtol=1e-6`` against float64. Dividing by ``d`` adds half
an ulp, relative.

The two kernels also take a slice of the vocabulary (``col_start``, the full ``vocab``):
`optimized.ops.linear_cross_entropy` runs them chunk by chunk, carrying the statistics
from one chunk to the next.

The price of the in-place gradient is that the logits are consumed. The forward
bumps their autograd version counter, so any other autograd node that saved them
(``tanh``, a multiply by a learnable scale, a second loss on the same logits, ...)
raises "modified by an inplace operation" in backward instead of silently reading
gradient values; backward also refuses if the buffer was changed after the
forward. A leaf that requires grad is refused outright (its data would be
destroyed). Without grad (evaluation), nothing is written.
"""

from __future__ import annotations

import torch

from optimized.ops.cross_entropy_kernels import (
    VALID_REDUCTIONS,
    LossOptions,
    launch_row_grad,
    launch_row_stats,
)

__all__ = [
    "VALID_REDUCTIONS",
    "FusedCrossEntropy",
    "aligned_target",
    "LossOptions",
    "check_inputs",
    "check_targets",
    "cross_entropy",
    "grad_scale_for",
    "reduce_rows",
]


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


def aligned_target(target: torch.Tensor) -> torch.Tensor:
    """``target`` contiguous and starting on a 16-byte boundary (a copy of ``tokens x 8``
    bytes when not). Triton specialises a kernel on its pointers' alignment, and labels are
    often a view one token into a row (``ids[:, 1:]``): aligned here, the kernels' key is
    the same whatever view the caller passes, so the one compiled before the first step
    is the one the step runs (`optimized.ops.precompile`)."""
    target = target.contiguous()
    return target if target.data_ptr() % 16 == 0 else target.clone()


def check_targets(target: torch.Tensor, ignore_index: int, vocab: int) -> None:
    """Raise on a target outside ``[0, vocab)`` that is not ``ignore_index``, without
    stopping the host: the check is an assertion on the device (`torch._assert_async`).
    On the CPU it fails at once and is reported as a ValueError naming the value; on a GPU
    a bad target is a device-side assertion (the trainer's data was checked against the
    vocabulary before the run: `optimized.train.preflight`)."""
    out_of_range = (target != ignore_index) & ((target < 0) | (target >= vocab))
    valid = out_of_range.any().logical_not()
    message = f"target outside [0, {vocab}) and not ignore_index={ignore_index}"
    if target.device.type != "cpu":
        torch._assert_async(valid, message)
        return
    try:
        torch._assert_async(valid, message)
    except RuntimeError:
        bad = target[out_of_range][0].item()  # the error's own read
        raise ValueError(
            f"target holds {bad}, outside [0, {vocab}) and not ignore_index={ignore_index}"
        ) from None


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


def _losses_and_stats(
    logits: torch.Tensor, target: torch.Tensor, options: LossOptions
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row losses (z-loss included), z-losses and the ``[2, rows]`` softmax statistics
    (row max, sum of exp(x - max)) the gradient needs: one pass over the logits."""
    tokens = logits.shape[0]
    losses = torch.empty(tokens, dtype=torch.float32, device=logits.device)
    z_losses = torch.empty_like(losses)
    stats = torch.empty((2, tokens), dtype=torch.float32, device=logits.device)
    launch_row_stats(logits, target, stats, losses, z_losses, options)
    return losses, z_losses, stats


class FusedCrossEntropy(torch.autograd.Function):
    """Loss and softmax statistics in forward; backward writes the gradient (times the
    incoming one) over the logits buffer and hands the buffer on."""

    @staticmethod
    def forward(ctx, logits, target, options):
        target = aligned_target(target)
        check_targets(target, options.ignore_index, logits.shape[1])
        grad_scale = grad_scale_for(target, options)
        losses, z_losses, stats = _losses_and_stats(logits, target, options)
        loss = reduce_rows(losses, options.reduction, grad_scale)
        z_loss = reduce_rows(z_losses, options.reduction, grad_scale)
        ctx.mark_non_differentiable(z_loss)
        # The logits are consumed (backward writes the gradient over them): let autograd
        # see it now, so any other node that saved them fails loudly when it unpacks them.
        torch.autograd.graph.increment_version(logits)
        ctx.grad_buffer = logits.detach()
        ctx.version = logits._version
        ctx.options = options
        ctx.save_for_backward(target, stats, grad_scale)
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
                "fused cross_entropy: the logits buffer, which backward overwrites with the "
                f"gradient, was modified in place (version {ctx.version} -> {buffer._version}); "
                "the logits are consumed by this loss and must not be reused"
            )
        target, stats, grad_scale = ctx.saved_tensors
        launch_row_grad(buffer, target, stats, grad_scale, ctx.options, upstream=grad_loss)
        return buffer, None, None


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

    When the logits require grad, backward overwrites their storage with the gradient
    (see the module docstring): do not use them after this call.
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
            target = aligned_target(target)
            check_targets(target, options.ignore_index, logits.shape[1])
            grad_scale = grad_scale_for(target, options)
            losses, z_losses, _ = _losses_and_stats(logits, target, options)
            loss = reduce_rows(losses, reduction, grad_scale)
            z_loss = reduce_rows(z_losses, reduction, grad_scale)
    return (loss, z_loss) if return_z_loss else loss
