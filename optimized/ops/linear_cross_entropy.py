"""Linear layer and cross-entropy fused over vocabulary chunks.

``loss = cross_entropy(hidden @ weight.T, target)`` makes a ``[tokens, vocab]`` logits
tensor even with the in-place fused cross-entropy. Here the vocabulary is taken a chunk
of columns at a time, ``[tokens, chunk]`` logits in one reused buffer, in two passes:

1. each chunk's logits ``hidden @ weight[chunk].T`` are folded into every row's online
   softmax statistics (the cross-entropy's own kernel, carried from chunk to chunk); after
   the last chunk they give each row's float32 loss;
2. each chunk's logits are made again, the kernel turns them into their gradient in place
   from the finished statistics, and two matmuls use it: ``grad_weight[chunk] =
   grad_logits.T @ hidden``, written once and exactly (all tokens of those vocabulary rows
   at once), and ``grad_hidden += grad_logits @ weight[chunk]``.

Extra memory is the one chunk of logits, ``chunk / vocab`` of the whole: 1/32 by default
(`default_chunk_vocab`; 0.031x at 4096 x 102400). Why chunks of the vocabulary and not of
tokens (as Liger-Kernel's FLCE does): a token chunk small enough for that ratio (128 of
4096 tokens) makes every matmul read the whole ``[vocab, hidden]`` weight for 128 rows, and
``grad_weight`` is read and written once per chunk (0.8 GB each time at 102400 x 2048 in
bf16: 32 times per step); over vocabulary chunks every matmul keeps all tokens as its long
dimension, and only ``grad_hidden`` (``[tokens, hidden]``, 50x smaller there) is summed
over chunks. The price is the second logits matmul: four ``tokens x hidden x vocab``
matmuls where the plain path has three.

With a scalar loss (``mean``, ``sum``) both gradients are finished in the forward, so
backward only scales them by the incoming gradient. With ``reduction="none"`` the incoming
gradient holds one value per token and ``grad_weight`` sums the rows weighted by it, so
the forward runs pass 1 only and backward runs pass 2, the kernel scaling each row by its
incoming value.

The objective (label smoothing, z-loss, reductions) is the fused cross-entropy's,
`optimized.ops.cross_entropy.LossOptions`; the loss is float32 from the chunk logits.

``grad_hidden`` is a sum over chunks. Summed in bfloat16 (one rounding of the running
sum per chunk) its error grew to 2.2x plain PyTorch's at 32 chunks (0.68% against
float64, plain 0.31%); so for 16-bit inputs it is summed in float32, each chunk's product
rounded once (the same error as plain PyTorch's). That float32 ``[tokens, hidden]`` sum
would be 2 x hidden / vocab of the logits (0.04x at 102400 x 2048), so pass 2 takes the
tokens in as few blocks as let a block's logits chunk and its accumulator share pass 1's
buffer (`chunk_plan`: three blocks there); ``grad_weight[chunk]`` then gets one term per
block. ``accumulate_dtype=<the hidden's dtype>`` sums in bfloat16 instead, in one block.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from optimized.ops.cross_entropy import (
    LossOptions,
    aligned_target,
    check_targets,
    grad_scale_for,
    reduce_rows,
)
from optimized.ops.cross_entropy_kernels import STATS, launch_row_grad, launch_row_stats
from optimized.ops.gather import round_up

CHUNKS_PER_VOCABULARY = 32
"""A default chunk is 1/32 of the vocabulary (when that is wider than the hidden size)."""
CHUNK_VOCAB_MULTIPLE = 128
"""Default chunks are a multiple of this many columns (aligned rows, whole GEMM tiles)."""
MIN_CHUNK_VOCAB = 1024
"""Default chunks are at least this wide: narrower ones make thin matmuls and more launches
for little memory (the tiny presets' 512-word vocabulary is one chunk)."""


def default_chunk_vocab(vocab_size: int, hidden_size: int) -> int:
    """Vocabulary columns per chunk: ``max(vocab / 32, hidden, 1024)`` rounded up to a
    multiple of 128, at most the vocabulary. A chunk's logits are then 1/32 of all the
    logits when the vocabulary is at least 32 times the hidden size (102400 / 2048 = 50) and
    32768 words, else as large as the hidden states (Liger-Kernel sizes its token chunks to
    ``chunk * V ~ tokens * H``)."""
    widest = max(-(-vocab_size // CHUNKS_PER_VOCABULARY), hidden_size, MIN_CHUNK_VOCAB)
    return min(vocab_size, round_up(widest, CHUNK_VOCAB_MULTIPLE))


class ChunkPlan(NamedTuple):
    """How the two passes cut the work, and the one flat buffer both use."""

    chunk_vocab: int
    """Vocabulary columns per chunk."""
    block_tokens: int
    """Tokens per block of pass 2 (all of them unless ``grad_hidden`` is summed in float32
    for 16-bit inputs)."""
    accumulator_offset: int
    """Element of the buffer where pass 2's float32 accumulator starts (0: none)."""
    buffer_elements: int
    """Size of the flat buffer, in the hidden's dtype."""


def chunk_plan(
    tokens: int, vocab: int, hidden_size: int, chunk_vocab: int, element_size: int,
    accumulator_size: int,
) -> ChunkPlan:  # fmt: skip
    """Pass 1 holds ``[tokens, chunk]`` logits. Pass 2 with a float32 ``grad_hidden``
    accumulator (``accumulator_size``: 4 bytes a value for 16-bit inputs; 0 when the sum is
    kept in ``grad_hidden`` itself; none for a single chunk) takes the tokens in the fewest
    equal blocks whose ``[block, chunk]`` logits and ``[block, hidden]`` accumulator fit in
    pass 1's buffer, and carves both from it: the whole op's extra memory is one
    ``[tokens, chunk]`` buffer."""
    chunk_vocab = min(chunk_vocab, vocab)
    chunk_bytes = tokens * chunk_vocab * element_size
    if not accumulator_size or tokens == 0 or chunk_vocab == vocab:  # nothing to sum over
        return ChunkPlan(chunk_vocab, tokens, 0, tokens * chunk_vocab)
    per_token = chunk_vocab * element_size + hidden_size * accumulator_size
    most = max(1, chunk_bytes // per_token)
    blocks = -(-tokens // most)
    block = -(-tokens // blocks)
    # The accumulator starts on a 16-byte boundary of the buffer.
    align = 16 // element_size
    offset = round_up(block * chunk_vocab, align)
    accumulator = block * hidden_size * accumulator_size // element_size
    return ChunkPlan(chunk_vocab, block, offset, max(tokens * chunk_vocab, offset + accumulator))


def _chunks(size: int, step: int) -> list[tuple[int, int]]:
    return [(start, min(start + step, size)) for start in range(0, size, step)]


def _logits_view(buffer: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The front of the flat ``buffer`` as contiguous ``[rows, cols]`` logits."""
    return buffer[: rows * cols].view(rows, cols)


def _statistics_pass(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    options: LossOptions,
    plan: ChunkPlan,
    buffer: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pass 1: per-token losses, z-losses and the softmax statistics (`STATS` rows)."""
    tokens, vocab = hidden.shape[0], weight.shape[0]
    losses = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
    z_losses = torch.empty_like(losses)
    stats = torch.empty((STATS, tokens), dtype=torch.float32, device=hidden.device)
    for start, end in _chunks(vocab, plan.chunk_vocab):
        logits = _logits_view(buffer, tokens, end - start)
        torch.mm(hidden, weight[start:end].t(), out=logits)
        launch_row_stats(logits, target, stats, losses, z_losses, options, start, vocab)
    return losses, z_losses, stats


def _gradient_pass(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    options: LossOptions,
    plan: ChunkPlan,
    buffer: torch.Tensor,
    stats: torch.Tensor,
    grad_scale: torch.Tensor,
    gradients: tuple[torch.Tensor | None, torch.Tensor | None],
    upstream: torch.Tensor | None = None,
) -> None:
    """Pass 2, a block of tokens at a time: each chunk's logits again, turned into their
    gradient (times ``upstream`` per row when given) and folded into ``gradients =
    (grad_hidden, grad_weight)``. ``grad_weight[chunk]`` is written by the first block and
    added to by the others; ``grad_hidden[block]`` is summed over chunks in the float32
    accumulator carved from ``buffer`` when the plan has one (`_accumulate_product`; its
    16-bit scratch is ``grad_hidden[block]`` itself, free until the block ends)."""
    grad_hidden, grad_weight = gradients
    vocab = weight.shape[0]
    accumulator = None
    if plan.accumulator_offset and grad_hidden is not None:
        values = plan.block_tokens * hidden.shape[1]
        end = plan.accumulator_offset + values * 4 // buffer.element_size()
        region = buffer[plan.accumulator_offset : end].view(torch.float32)
        accumulator = region.view(plan.block_tokens, hidden.shape[1])
    per_row = upstream is not None and upstream.dim() == 1
    for first_token, end_token in _chunks(hidden.shape[0], plan.block_tokens):
        rows = end_token - first_token
        block = hidden[first_token:end_token]
        block_target, block_stats = target[first_token:end_token], stats[:, first_token:end_token]
        block_upstream = upstream[first_token:end_token] if per_row else upstream
        block_grad = None if grad_hidden is None else grad_hidden[first_token:end_token]
        for start, end in _chunks(vocab, plan.chunk_vocab):
            logits = _logits_view(buffer, rows, end - start)
            torch.mm(block, weight[start:end].t(), out=logits)
            launch_row_grad(logits, block_target, block_stats, grad_scale, options,
                            block_upstream, start, vocab)  # fmt: skip
            if grad_weight is not None:
                if first_token == 0:
                    torch.mm(logits.t(), block, out=grad_weight[start:end])
                else:
                    grad_weight[start:end].addmm_(logits.t(), block)
            if block_grad is None:
                continue
            if accumulator is not None:
                _accumulate_product(accumulator[:rows], logits, weight[start:end], start == 0,
                                    scratch=block_grad)  # fmt: skip
            elif start == 0:
                torch.mm(logits, weight[start:end], out=block_grad)
            else:
                block_grad.addmm_(logits, weight[start:end])
        if accumulator is not None:
            block_grad.copy_(accumulator[:rows])


@functools.cache
def _float32_addmm_into(device: torch.device) -> bool:
    """Whether ``torch.addmm(acc, a, b, out_dtype=float32, out=acc)`` runs on ``device``
    for 16-bit ``a``, ``b`` and a float32 ``acc``: one matmul whose epilogue adds into the
    float32 sum (CUDA builds whose `addmm.dtype_out` takes a float32 ``self``). Tried once
    on a 2 x 2 case."""
    if device.type != "cuda":
        return False
    accumulator = torch.zeros((2, 2), dtype=torch.float32, device=device)
    factor = torch.ones((2, 2), dtype=torch.bfloat16, device=device)
    try:
        torch.addmm(accumulator, factor, factor, out_dtype=torch.float32, out=accumulator)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def _accumulate_product(accumulator: torch.Tensor, logits: torch.Tensor,
                        weight_chunk: torch.Tensor, first: bool,
                        scratch: torch.Tensor) -> None:  # fmt: skip
    """``accumulator (float32) = (first ? 0 : accumulator) + logits @ weight_chunk``: fused
    into the matmul where the device allows it (`_float32_addmm_into`), else the product
    rounded once into ``scratch`` (16-bit, free) and added in float32."""
    if _float32_addmm_into(accumulator.device):
        torch.addmm(accumulator, logits, weight_chunk, beta=0 if first else 1,
                    out_dtype=torch.float32, out=accumulator)  # fmt: skip
        return
    torch.mm(logits, weight_chunk, out=scratch)
    if first:
        accumulator.copy_(scratch)
    else:
        accumulator.add_(scratch)


def _gradient_buffers(
    hidden: torch.Tensor, weight: torch.Tensor, needs: tuple[bool, bool]
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``grad_hidden`` and ``grad_weight``; the passes write every element."""
    grad_hidden = torch.empty_like(hidden) if needs[0] else None
    grad_weight = torch.empty_like(weight) if needs[1] else None
    return grad_hidden, grad_weight


def _plan_for(hidden: torch.Tensor, weight: torch.Tensor, chunk_vocab: int,
              accumulate_dtype: torch.dtype | None) -> ChunkPlan:  # fmt: skip
    wider = accumulate_dtype is not None and accumulate_dtype != hidden.dtype
    accumulator_size = torch.finfo(accumulate_dtype).bits // 8 if wider else 0
    return chunk_plan(hidden.shape[0], weight.shape[0], hidden.shape[1], chunk_vocab,
                      hidden.element_size(), accumulator_size)  # fmt: skip


class LinearCrossEntropy(torch.autograd.Function):
    """Loss and both gradients a chunk of the vocabulary at a time: in forward for a scalar
    loss, in backward (from the forward's statistics) for per-token losses."""

    @staticmethod
    def forward(ctx, hidden, weight, target, options, chunk_vocab, accumulate_dtype):
        needs = tuple(ctx.needs_input_grad[:2])
        target = aligned_target(target)
        check_targets(target, options.ignore_index, weight.shape[0])
        grad_scale = grad_scale_for(target, options)
        deferred = options.reduction == "none"
        gradients = (None, None)
        if not deferred:
            gradients = _gradient_buffers(hidden, weight, needs)
        plan = _plan_for(hidden, weight, chunk_vocab, accumulate_dtype)
        buffer = hidden.new_empty(plan.buffer_elements)
        losses, z_losses, stats = _statistics_pass(hidden, weight, target, options, plan, buffer)
        if any(needs) and not deferred:
            _gradient_pass(hidden, weight, target, options, plan, buffer, stats, grad_scale,
                           gradients)  # fmt: skip
        del buffer
        ctx.options, ctx.plan = options, plan
        ctx.spent = False
        if deferred:
            ctx.save_for_backward(hidden, weight, target, stats[:2], grad_scale)
        else:
            ctx.gradients = gradients
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
            hidden, weight, target, stats, grad_scale = ctx.saved_tensors
            gradients = _gradient_buffers(hidden, weight, tuple(ctx.needs_input_grad[:2]))
            buffer = hidden.new_empty(ctx.plan.buffer_elements)
            _gradient_pass(hidden, weight, target, ctx.options, ctx.plan, buffer, stats,
                           grad_scale, gradients, upstream=grad_loss)  # fmt: skip
            del buffer
            grad_hidden, grad_weight = gradients
        else:
            grad_hidden, grad_weight = ctx.gradients
            del ctx.gradients
            if grad_hidden is not None:
                grad_hidden.mul_(grad_loss)
            if grad_weight is not None:
                grad_weight.mul_(grad_loss)
        return grad_hidden, grad_weight, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_vocab: int | None = None,
    accumulate_dtype: torch.dtype | None = None,
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    return_z_loss: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``cross_entropy(hidden @ weight.T, target, ...)`` in float32, chunk by chunk.

    ``hidden [..., H]``, ``weight [V, H]``, ``target [...]``. A scalar for ``mean`` and
    ``sum``; for ``none`` one loss per token, shaped like ``target``. ``label_smoothing``,
    ``lse_square_scale`` and ``return_z_loss`` are those of
    `optimized.ops.cross_entropy.cross_entropy`. ``chunk_vocab`` (vocabulary columns per
    chunk) defaults to `default_chunk_vocab`; ``accumulate_dtype`` is the dtype
    ``grad_hidden`` is summed in over chunks: float32 by default, or the hidden's own.
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
    if chunk_vocab is None:
        chunk_vocab = default_chunk_vocab(weight.shape[0], weight.shape[1])
    if chunk_vocab < 1:
        raise ValueError(f"chunk_vocab must be >= 1; got {chunk_vocab}")
    if accumulate_dtype is None:
        accumulate_dtype = torch.promote_types(hidden.dtype, torch.float32)
    if accumulate_dtype not in (hidden.dtype, torch.float32):
        raise ValueError(
            f"accumulate_dtype={accumulate_dtype} is not supported; valid: torch.float32 or "
            f"the hidden's dtype ({hidden.dtype})"
        )
    loss, z_loss = LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        target.reshape(-1),
        options,
        chunk_vocab,
        accumulate_dtype,
    )
    if reduction == "none":
        loss, z_loss = loss.view(target.shape), z_loss.view(target.shape)
    return (loss, z_loss) if return_z_loss else loss
