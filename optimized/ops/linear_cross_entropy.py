"""Linear layer and cross-entropy fused over token chunks.

``loss = cross_entropy(hidden @ weight.T, target)`` makes a ``[tokens, vocab]``
logits tensor even with the in-place fused cross-entropy. Here the tokens are
taken a chunk at a time: the chunk's logits go into one reused buffer, the
cross-entropy kernel turns them into their gradient in place, and two matmuls
turn that into the chunk's rows of ``grad_hidden`` and its share of
``grad_weight``. Both gradients are finished in the forward, so backward only
scales them by the incoming gradient. Extra memory is one chunk of logits: it
grows with the chunk, not with tokens x vocab.

``grad_weight`` is summed over chunks in the weight's dtype by default (as
Liger-Kernel does); pass ``accumulate_dtype=torch.float32`` to sum in float32
at the cost of a float32 weight-sized buffer.
"""

from __future__ import annotations

import torch

from optimized.ops.cross_entropy import (
    VALID_REDUCTIONS,
    check_targets,
    grad_scale_for,
    launch_cross_entropy_kernel,
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


class LinearCrossEntropy(torch.autograd.Function):
    """Loss and both gradients in forward, a chunk of logits at a time."""

    @staticmethod
    def forward(
        ctx, hidden, weight, target, ignore_index, reduction, chunk_tokens, accumulate_dtype
    ):
        tokens, vocab = hidden.shape[0], weight.shape[0]
        need_hidden_grad, need_weight_grad = ctx.needs_input_grad[:2]
        write_grad = need_hidden_grad or need_weight_grad
        target = target.contiguous()
        check_targets(target, ignore_index, vocab)
        grad_scale, _ = grad_scale_for(target, ignore_index, reduction)
        losses = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden_grad else None
        grad_weight = None
        if need_weight_grad:
            grad_weight = torch.zeros(
                weight.shape, dtype=accumulate_dtype or weight.dtype, device=weight.device
            )
        logits_buffer = hidden.new_empty((min(chunk_tokens, tokens), vocab))
        for start in range(0, tokens, chunk_tokens):
            end = min(start + chunk_tokens, tokens)
            hidden_chunk = hidden[start:end]
            logits = logits_buffer[: end - start]
            torch.mm(hidden_chunk, weight.t(), out=logits)
            launch_cross_entropy_kernel(
                logits, target[start:end], losses[start:end], grad_scale, ignore_index, write_grad
            )
            if grad_hidden is not None:
                torch.mm(logits, weight, out=grad_hidden[start:end])
            if grad_weight is not None:
                if grad_weight.dtype == logits.dtype:
                    grad_weight.addmm_(logits.t(), hidden_chunk)
                else:
                    grad_weight.add_(logits.t() @ hidden_chunk)
        del logits_buffer
        ctx.grad_hidden = grad_hidden
        ctx.grad_weight = grad_weight
        ctx.weight_dtype = weight.dtype
        ctx.spent = False
        loss = losses.sum()
        return loss * grad_scale if reduction == "mean" else loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        if ctx.spent:
            raise RuntimeError(
                "linear_cross_entropy: backward can run once; its gradients are spent"
            )
        grad_hidden, grad_weight = ctx.grad_hidden, ctx.grad_weight
        del ctx.grad_hidden, ctx.grad_weight
        ctx.spent = True
        if grad_hidden is not None:
            grad_hidden.mul_(grad_loss)
        if grad_weight is not None:
            grad_weight.mul_(grad_loss)
            grad_weight = grad_weight.to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_tokens: int | None = None,
    accumulate_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T, target)`` as a float32 scalar, chunk by chunk.

    ``hidden [..., H]``, ``weight [V, H]``, ``target [...]``. ``chunk_tokens``
    defaults to `default_chunk_tokens`; ``accumulate_dtype`` is the dtype
    ``grad_weight`` is summed in (the weight's by default).
    """
    if reduction not in VALID_REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not supported; valid: {VALID_REDUCTIONS}")
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
    hidden = hidden.reshape(-1, hidden.shape[-1])
    return LinearCrossEntropy.apply(
        hidden,
        weight,
        target.reshape(-1),
        ignore_index,
        reduction,
        chunk_tokens,
        accumulate_dtype,
    )
