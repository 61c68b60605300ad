"""Fused causal attention with GPT-OSS's sinks and sliding windows, O(S) memory (Triton).

The plain attention of `reference` keeps its ``[B, h, S, S]`` softmax for backward; at
4096 tokens that dwarfs everything else in a layer. Here one FlashAttention-2 kernel
family (`optimized.ops.attention_kernels`) keeps the output and the float32 row
log-sum-exp and recomputes the probabilities in backward, for every shape the three
families use:

- causal, GQA (query heads share a key/value head in groups; the key-block backward sums
  dK and dV over the group, nothing is expanded), query/key and value widths apart (MLA's
  192 / 128 on DeepSeek-V2);
- a sliding window visits only the key blocks within its reach from each query block
  (and the reverse in backward): work ``O(S * window)``, no mask tensor;
- sinks (GPT-OSS: a learnable logit per head in the softmax's denominator that carries no
  value) start each row's online softmax; their gradient ``d sink[h] = -sum_{b,i}
  exp(sink[h] - lse_bhi) (dO_bhi . O_bhi)`` is summed in float32 from the ``dO . O`` row
  terms the backward forms anyway (`FlashAttention.sink_gradient`): no rerun.

What autograd keeps: ``q``, ``k``, ``v`` as given (views of the projections: no copies),
the output ``[B, S, h * Dv]`` (the very tensor returned, which the output projection
saves as its input) and the log-sum-exp ``[B, h, S]`` in float32. The backward adds the
float32 ``delta`` ``[B, h, S]`` (and, for the sinks' gradient, one more such transient
before the gradients exist), then the gradients in their inputs' layouts.

How the kernels are launched (interpreter, GPUs, block sizes, autotuning) is
`optimized.ops.attention_blocks`. On CUDA, MLA's wide heads (query/key wider than 128, no
sinks, no window) go to `F.scaled_dot_product_attention` as before this kernel
(`sdpa_attention`: values padded to the query width, cuDNN's kernel on an H100); that path
keeps SDPA's own tensors (the padded values, a padded output) and copies its output into
``[B, S, h * Dv]``, which the memory estimator, held to the CPU's measurements, does not
model.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from optimized.ops._triton import INTERPRETED, INTERPRETER_ELEMENTS, launch, triton
from optimized.ops.attention_blocks import (
    AUTOTUNED,
    FLOAT32_BLOCKS,
    PREPROCESS_ROWS,
    Blocks,
    check_shape,
    interpreter_blocks,
    kernel_launch,
)
from optimized.ops.attention_kernels import attention_backward_preprocess_kernel

LOG2E = math.log2(math.e)
SDPA_MIN_WIDTH = 129
"""On CUDA, query/key heads at least this wide (MLA's 192) go to SDPA when they need no
sinks and no window."""


class _Shape(NamedTuple):
    batch: int
    heads: int
    groups: int
    seq_len: int
    qk_dim: int
    v_dim: int
    window: int
    """The window, or the sequence length for none (the same mask)."""
    scaling: float

    @property
    def block_v(self) -> int:
        return max(16, triton.next_power_of_2(self.v_dim))

    def constexprs(self) -> dict:
        return {
            "QK_DIM": self.qk_dim, "V_DIM": self.v_dim, "UPCAST": INTERPRETED,
            "BLOCK_QK": max(16, triton.next_power_of_2(self.qk_dim)), "BLOCK_V": self.block_v,
        }  # fmt: skip

    def scalars(self) -> tuple:
        """heads, groups, seq_len, window, base-2 scale."""
        return self.heads, self.groups, self.seq_len, self.window, self.scaling * LOG2E


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    """(batch, head, row) strides of a ``[B, H, S, D]`` tensor whose rows are contiguous."""
    return x.stride(0), x.stride(1), x.stride(2)


def _head_strides(x: torch.Tensor, width: int) -> tuple[int, int, int]:
    """(batch, head, row) strides of ``[B, S, H * width]`` viewed as ``[B, H, S, width]``."""
    return x.stride(0), width, x.stride(1)


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class FlashAttention(torch.autograd.Function):
    """``[B, S, h * Dv]`` attention of ``q [B, h, S, D]``, ``k [B, h_kv, S, D]``,
    ``v [B, h_kv, S, Dv]`` with optional ``sinks [h]``; saves ``q``, ``k``, ``v``, the
    output and the float32 log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, shape: _Shape, blocks: Blocks | str | None):
        s = shape
        out = q.new_empty((s.batch, s.seq_len, s.heads * s.v_dim))
        lse = torch.empty((s.batch, s.heads, s.seq_len), dtype=torch.float32, device=q.device)
        kernel, grid, keywords = kernel_launch("forward", blocks, s.seq_len, s.batch * s.heads)
        launch(
            kernel, grid, q, k, v, sinks if sinks is not None else lse, out, lse,
            *_strides(q), *_strides(k), *_strides(v), *_head_strides(out, s.v_dim),
            *s.scalars(), HAS_SINKS=sinks is not None, **s.constexprs(), **keywords,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.shape, ctx.blocks = shape, blocks
        return out

    @staticmethod
    def sink_gradient(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor):
        """``d sink[h] = -sum_{b,i} p_sink[b,h,i] delta[b,h,i]`` with the sink's probability
        ``p_sink = exp(sink[h] - lse)`` and ``delta = dO . O`` (``lse``, ``delta``:
        ``[B, h, S]``, float32), summed in float32, in the sinks' dtype. (The softmax's
        gradient at the sink's logit: ``p_sink (0 - delta)``, the sink having no value.)
        Planted bugs patch this name."""
        p_sink = torch.exp(sinks.detach().float()[None, :, None] - lse)
        return (-p_sink.mul_(delta).sum(dim=(0, 2))).to(sinks.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        s, blocks = ctx.shape, ctx.blocks
        grad = _rows_contiguous(grad)
        grad_strides = _head_strides(grad, s.v_dim)
        delta = torch.empty_like(lse)
        rows = PREPROCESS_ROWS
        if INTERPRETED:
            rows = min(triton.next_power_of_2(delta.numel()), INTERPRETER_ELEMENTS // s.block_v)
        launch(
            attention_backward_preprocess_kernel, (triton.cdiv(delta.numel(), rows),),
            out, grad, delta, *_head_strides(out, s.v_dim), *grad_strides, s.heads, s.seq_len,
            delta.numel(), V_DIM=s.v_dim, BLOCK_V=s.block_v, BLOCK_R=rows,
        )  # fmt: skip
        sinks_grad = None
        if sinks is not None and ctx.needs_input_grad[3]:
            sinks_grad = FlashAttention.sink_gradient(sinks, lse, delta)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        pairs = s.batch * s.heads
        kernel, grid, keywords = kernel_launch("backward_kv", blocks, s.seq_len, pairs // s.groups)
        launch(
            kernel, grid, q, k, v, grad, lse, delta, dk, dv,
            *_strides(q), *_strides(k), *_strides(v), *grad_strides, *_strides(dk),
            *_strides(dv), *s.scalars(), s.scaling, **s.constexprs(), **keywords,
        )  # fmt: skip
        kernel, grid, keywords = kernel_launch("backward_q", blocks, s.seq_len, pairs)
        launch(
            kernel, grid, q, k, v, grad, lse, delta, dq,
            *_strides(q), *_strides(k), *_strides(v), *grad_strides, *_strides(dq),
            *s.scalars(), s.scaling, **s.constexprs(), **keywords,
        )  # fmt: skip
        return dq, dk, dv, sinks_grad, None, None


def _check(q, k, v, window, sinks, blocks) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"flash_attention: q, k, v must be [B, heads, S, width]; got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    batch, heads, seq, qk_dim = q.shape
    if not (q.numel() and v.numel()):
        raise ValueError(f"flash_attention: q {tuple(q.shape)} and v {tuple(v.shape)} are empty")
    if k.shape[:3] != v.shape[:3] or k.shape[0] != batch or k.shape[2] != seq:
        raise ValueError(
            f"flash_attention: k {tuple(k.shape)} and v {tuple(v.shape)} must be "
            f"[{batch}, kv_heads, {seq}, width] like q {tuple(q.shape)}"
        )
    if k.shape[3] != qk_dim or heads % k.shape[1]:
        raise ValueError(
            f"flash_attention: k's width {k.shape[3]} must equal q's ({qk_dim}) and its "
            f"{k.shape[1]} heads must divide q's {heads}"
        )
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            f"flash_attention: q, k, v must share one dtype, float32 or bfloat16; got "
            f"{q.dtype}, {k.dtype}, {v.dtype}"
        )
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):  # fmt: skip
        raise ValueError(f"flash_attention: window={window!r} is invalid: an int >= 1 or None")
    if sinks is not None and tuple(sinks.shape) != (heads,):
        raise ValueError(
            f"flash_attention: sinks of shape {tuple(sinks.shape)} is invalid: one per "
            f"query head, ({heads},)"
        )
    if blocks is not None and blocks != AUTOTUNED:
        blocks.check()
    check_shape(batch, heads, seq)


def sdpa_attention(q, k, v, scaling: float) -> torch.Tensor:
    """Causal `F.scaled_dot_product_attention` as `flash_attention` returns it, ``[B, S, h *
    Dv]``: what CUDA runs for MLA's wide heads. Values narrower than the queries are
    zero-padded to their width, which the fused backends want (zeros change nothing), and
    the padding is dropped from the output, as the stack did before its own kernel: the
    path measured on an H100 (GPU.md)."""
    value_dim = v.shape[-1]
    if value_dim < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - value_dim))
    gqa = k.shape[1] != q.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, scale=scaling, is_causal=True, enable_gqa=gqa)
    return out[..., :value_dim].transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    *,
    blocks: Blocks | str | None = None,
) -> torch.Tensor:
    """Causal attention ``[B, S, h * Dv]`` of ``q [B, h, S, D]``, ``k``, ``v [B, h_kv, S, Dv]``,
    keys limited to the last ``window`` positions when given, with per-head ``sinks [h]``.
    ``blocks`` fixes the kernels' launch (tests; by default the interpreter's one block,
    `FLOAT32_BLOCKS` for float32 on GPUs, the autotuner's choice for bfloat16; `AUTOTUNED`:
    the autotuner's, on the interpreter too)."""
    _check(q, k, v, window, sinks, blocks)
    batch, heads, seq, qk_dim = q.shape
    no_band = window is None or window >= seq
    if q.device.type == "cuda" and blocks is None:
        if qk_dim >= SDPA_MIN_WIDTH and no_band and sinks is None:
            return sdpa_attention(q, k, v, scaling)
    if blocks is None and INTERPRETED:
        blocks = interpreter_blocks(seq)
    elif blocks is None and q.dtype == torch.float32:
        blocks = FLOAT32_BLOCKS
    shape = _Shape(
        batch, heads, heads // k.shape[1], seq, qk_dim, v.shape[-1],
        seq if no_band else window, float(scaling),
    )  # fmt: skip
    q, k, v = _rows_contiguous(q), _rows_contiguous(k), _rows_contiguous(v)
    return FlashAttention.apply(q, k, v, sinks, shape, blocks)
