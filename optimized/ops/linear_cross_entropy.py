"""Linear layer and cross-entropy fused over token chunks.

``loss = cross_entropy(hidden @ weight.T, target)`` makes a ``[tokens, vocab]``
logits tensor even with the in-place fused cross-entropy. Here the tokens are
taken a chunk at a time: the chunk's logits go into one reused buffer, the
cross-entropy kernel turns them into their gradient in place, and two matmuls
turn that into the chunk's rows of ``grad_hidden`` and its share of
``grad_weight``. Extra memory is one chunk of logits: it grows with the chunk,
not with tokens x vocab.

With a scalar loss (``mean``, ``sum``) both gradients are finished in the forward,
so backward only scales them by the incoming gradient. With ``reduction="none"``
the incoming gradient holds one value per token and ``grad_weight`` sums the rows
weighted by it, so it cannot be finished before backward: the forward computes the
losses only, and backward recomputes each chunk's logits, turns them into their
gradient, scales the rows by the incoming values and runs the two matmuls (one
extra ``[chunk, H] x [H, V]`` matmul per chunk, the same one-chunk buffer).

The objective (label smoothing, z-loss, reductions) is the fused cross-entropy's,
`optimized.ops.cross_entropy.LossOptions`.

``grad_weight`` is summed over chunks in the weight's dtype by default (as
Liger-Kernel does); pass ``accumulate_dtype=torch.float32`` to sum in float32
at the cost of a float32 weight-sized buffer.
"""

from __future__ import annotations

import torch

from optimized.ops.cross_entropy import (
    LossOptions,
    check_targets,
    grad_scale_for,
    launch_cross_entropy_kernel,
    reduce_rows,
)

MIN_CHUNK_TOKENS = 16


def default_chunk_tokens(hidden_size: int) -> int:
    """Tokens per chunk: the largest power of two <= hidden/2, at least `MIN_CHUNK_TOKENS`.

    A chunk's logits ``[chunk, vocab]`` are then at most half the size of the
    weight ``[vocab, hidden]``, which the step holds anyway.
    """
    chunk = MIN_CHUNK_TOKENS
    while chunk * 2 <= hidden_size // 2:
        chunk *= 2
    return chunk


def _chunked_pass(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    options: LossOptions,
    chunk_tokens: int,
    grad_scale: torch.Tensor,
    grad_hidden: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
    row_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token losses and z-losses of ``hidden @ weight.T``, a chunk of logits at a time.

    When ``grad_hidden`` or ``grad_weight`` is given, each chunk's logits become their
    gradient (times ``row_scale[row]`` when given) and are folded into them.
    """
    tokens, vocab = hidden.shape[0], weight.shape[0]
    write_grad = grad_hidden is not None or grad_weight is not None
    losses = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
    z_losses = torch.empty_like(losses)
    logits_buffer = hidden.new_empty((min(chunk_tokens, tokens), vocab))
    for start in range(0, tokens, chunk_tokens):
        end = min(start + chunk_tokens, tokens)
        hidden_chunk = hidden[start:end]
        logits = logits_buffer[: end - start]
        torch.mm(hidden_chunk, weight.t(), out=logits)
        launch_cross_entropy_kernel(
            logits, target[start:end], losses[start:end], z_losses[start:end], grad_scale,
            options, write_grad,
        )  # fmt: skip
        if not write_grad:
            continue
        if row_scale is not None:
            logits.mul_(row_scale[start:end].unsqueeze(1))
        if grad_hidden is not None:
            torch.mm(logits, weight, out=grad_hidden[start:end])
        if grad_weight is not None:
            if grad_weight.dtype == logits.dtype:
                grad_weight.addmm_(logits.t(), hidden_chunk)
            else:
                grad_weight.add_(logits.t() @ hidden_chunk)
    return losses, z_losses


def _gradient_buffers(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    needs: tuple[bool, bool],
    accumulate_dtype: torch.dtype | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    grad_hidden = torch.empty_like(hidden) if needs[0] else None
    grad_weight = None
    if needs[1]:
        grad_weight = torch.zeros(
            weight.shape, dtype=accumulate_dtype or weight.dtype, device=weight.device
        )
    return grad_hidden, grad_weight


class LinearCrossEntropy(torch.autograd.Function):
    """Loss and both gradients a chunk of logits at a time: in forward for a scalar loss,
    recomputed in backward for per-token losses."""

    @staticmethod
    def forward(ctx, hidden, weight, target, options, chunk_tokens, accumulate_dtype):
        needs = tuple(ctx.needs_input_grad[:2])
        target = target.contiguous()
        check_targets(target, options.ignore_index, weight.shape[0])
        grad_scale = grad_scale_for(target, options)
        deferred = options.reduction == "none"
        grad_hidden, grad_weight = (None, None)
        if not deferred:
            grad_hidden, grad_weight = _gradient_buffers(hidden, weight, needs, accumulate_dtype)
        losses, z_losses = _chunked_pass(
            hidden, weight, target, options, chunk_tokens, grad_scale, grad_hidden, grad_weight
        )
        ctx.options, ctx.chunk_tokens, ctx.accumulate_dtype = (
            options,
            chunk_tokens,
            accumulate_dtype,
        )
        ctx.weight_dtype = weight.dtype
        ctx.spent = False
        if deferred:
            ctx.save_for_backward(hidden, weight, target, grad_scale)
        else:
            ctx.grad_hidden, ctx.grad_weight = grad_hidden, grad_weight
        z_loss = reduce_rows(z_losses, options.reduction, grad_scale)
        ctx.mark_non_differentiable(z_loss)
        return reduce_rows(losses, options.reduction, grad_scale), z_loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _grad_z_loss):
        if ctx.spent:
            raise RuntimeError(
                "linear_cross_entropy: backward can run once; its gradients are spent"
            )
        ctx.spent = True
        if ctx.options.reduction == "none":
            hidden, weight, target, grad_scale = ctx.saved_tensors
            grad_hidden, grad_weight = _gradient_buffers(
                hidden, weight, tuple(ctx.needs_input_grad[:2]), ctx.accumulate_dtype
            )
            _chunked_pass(
                hidden, weight, target, ctx.options, ctx.chunk_tokens, grad_scale,
                grad_hidden, grad_weight, row_scale=grad_loss,
            )  # fmt: skip
        else:
            grad_hidden, grad_weight = ctx.grad_hidden, ctx.grad_weight
            del ctx.grad_hidden, ctx.grad_weight
            if grad_hidden is not None:
                grad_hidden.mul_(grad_loss)
            if grad_weight is not None:
                grad_weight.mul_(grad_loss)
        if grad_weight is not None:
            grad_weight = grad_weight.to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_tokens: int | None = None,
    accumulate_dtype: torch.dtype | None = None,
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    return_z_loss: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``cross_entropy(hidden @ weight.T, target, ...)`` in float32, chunk by chunk.

    ``hidden [..., H]``, ``weight [V, H]``, ``target [...]``. A scalar for ``mean`` and
    ``sum``; for ``none`` one loss per token, shaped like ``target``. ``label_smoothing``,
    ``lse_square_scale`` and ``return_z_loss`` are those of
    `optimized.ops.cross_entropy.cross_entropy`. ``chunk_tokens`` defaults to
    `default_chunk_tokens`; ``accumulate_dtype`` is the dtype ``grad_weight`` is summed
    in (the weight's by default).
    """
    options = LossOptions(ignore_index, reduction, label_smoothing, lse_square_scale)
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"weight must be [vocab, hidden={hidden.shape[-1]}]; got {tuple(weight.shape)}"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden is {hidden.dtype} but weight is {weight.dtype}")
    if target.shape != hidden.shape[:-1]:
        raise ValueError(
            f"target must have shape {tuple(hidden.shape[:-1])}; got {tuple(target.shape)}"
        )
    chunk_tokens = chunk_tokens or default_chunk_tokens(weight.shape[1])
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1; got {chunk_tokens}")
    loss, z_loss = LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        target.reshape(-1),
        options,
        chunk_tokens,
        accumulate_dtype,
    )
    if reduction == "none":
        loss, z_loss = loss.view(target.shape), z_loss.view(target.shape)
    return (loss, z_loss) if return_z_loss else loss
