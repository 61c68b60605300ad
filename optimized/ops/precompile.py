"""Every Triton kernel a rank's step launches, launched once before the first step.

Why. Triton compiles a kernel at the first launch of each specialisation key (argument
dtypes, constexprs, which integers and addresses are multiples of 16: see
`optimized.ops.launches`). Left to step 1, each compile and module load runs in the middle
of the DualPipeV schedule while the peers have NCCL work queued on this rank
(`models.runtime.device_sync`). `precompile` runs, forward and backward, each op of this
rank's part that launches a Triton kernel, on dummy tensors of the step's own shapes and
dtype, so the step meets no new key:

- attention: each `optimized.ops.tuning.AttentionKey` of the part, with the ops' launch
  choice (`pretune` tunes, and so compiles, the autotuned ones; this covers the fixed
  blocks);
- the routed experts: each `models.network.Experts` module's own forward (grouped
  linears, SiLU-and-multiply or the clamped SwiGLU, the zero-tail kernel) on 128 rows per
  local expert, as the expert-order buffer pads every group (so the row counts, and with
  them every key, are the step's);
- the loss: the head's own fused loss (``loss_fn``, the schedule's) on ``micro_batch_size x
  seq_len`` dummy hidden states.

The MTP layers' kernels are the same modules' and the same loss's. Gradients go to the
dummy inputs only (`torch.autograd.grad`): no parameter's ``.grad`` is touched. What is not
covered is named in docs/gpus.md ("Before the first step"): work outside the steps, such as
the held-out evaluation's plain cross-entropy.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from models.network import IGNORE_INDEX, Experts
from optimized.ops import launches
from optimized.ops.expert_order import GROUPED_GEMM_ROW_ALIGNMENT, aligned_empty
from optimized.ops.optimized_ops import OptimizedOps
from optimized.ops.tuning import attention_keys, run_attention_key


def _dummy(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(shape, generator=generator)
    return values.to(device=like.device, dtype=like.dtype).requires_grad_()


def _backward(out: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    torch.autograd.grad(out, inputs, torch.ones_like(out))


def _experts(module: Experts, ops: OptimizedOps) -> None:
    """The module's forward and backward on ``128`` rows for each local expert."""
    weight = module.gate_up_proj
    rows = GROUPED_GEMM_ROW_ALIGNMENT * module.num_local
    grouped = aligned_empty(rows, module.down_proj.shape[2 if module.transposed else 1], weight)
    grouped.copy_(torch.randn(grouped.shape, generator=torch.Generator().manual_seed(0)))
    grouped.requires_grad_()
    ends = tuple(GROUPED_GEMM_ROW_ALIGNMENT * (g + 1) for g in range(module.num_local))
    offsets = torch.tensor(ends, dtype=torch.int32, device=weight.device)
    out = module(grouped, offsets, ops, ends=ends)
    _backward(out, [grouped])


def _loss(head, loss_fn, micro_batch_size: int, seq_len: int) -> None:
    """The head's fused loss, forward and backward, on dummy hidden states."""
    weight = head.weight
    hidden = _dummy((micro_batch_size, seq_len, weight.shape[1]), weight)
    labels = torch.zeros((micro_batch_size, seq_len), dtype=torch.long, device=weight.device)
    labels[:, -1] = IGNORE_INDEX
    loss, _ = head.fused_loss(hidden, labels, loss_fn)
    _backward(loss, [hidden])


def precompile(
    part: torch.nn.Module, micro_batch_size: int, seq_len: int, loss_fn=None, blocks=None
) -> dict[str, Any]:
    """Launch, forward and backward, every Triton kernel of ``part``'s step (see the module
    docstring); ``loss_fn``: the schedule's fused loss (the head's loss is skipped without
    it); ``blocks``: the attention launch choice (default ``OptimizedOps.attention_blocks``).
    Returns ``keys`` (new (kernel, key) pairs launched) and ``seconds``."""
    blocks = OptimizedOps.attention_blocks if blocks is None else blocks
    began, before = time.perf_counter(), set(launches.seen())
    device = next(part.parameters()).device
    ops = OptimizedOps()
    for key in attention_keys(part, micro_batch_size, seq_len):
        run_attention_key(key, device, blocks)
    for module in part.modules():
        if isinstance(module, Experts) and module.num_local:
            _experts(module, ops)
    head = getattr(part, "lm_head", None)
    if head is not None and loss_fn is not None:
        _loss(head, loss_fn, micro_batch_size, seq_len)
    return {"keys": len(set(launches.seen()) - before),
            "seconds": round(time.perf_counter() - began, 3)}  # fmt: skip
