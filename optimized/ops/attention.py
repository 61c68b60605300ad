"""Fused causal attention: keep O(S) statistics for backward, not the ``S x S`` probabilities.

The plain attention of `reference` saves its ``[B, h, S, S]`` softmax for backward;
at 2 x 128 tokens that is the largest activation of a tiny model's layer, and at
4096 tokens it dwarfs everything else. PyTorch's scaled-dot-product attention
has flash kernels on both devices (a fused CPU kernel; FlashAttention and the
memory-efficient kernel on CUDA) that save only q, k, v, the output and the row
log-sum-exp, and recompute the probabilities in backward.

Two shapes need care:

- MLA's value heads are narrower than its query/key heads (DeepSeek-V2: 128 vs
  192). The flash kernels want one head width, so the values are zero-padded to
  the query width and the padding is dropped from the output; zeros in the
  values change nothing, and their gradient is dropped with them.
- Attention sinks (GPT-OSS) add a learnable per-head logit that no fused kernel
  here takes; with sinks this falls back to the plain computation, which is
  exact and as heavy as the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.layers import causal_mask, eager_attention


def _window_mask(seq_len: int, window: int, device: torch.device) -> torch.Tensor:
    i = torch.arange(seq_len, device=device)
    return (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention ``[B, S, h * Dv]`` of ``q [B, h, S, D]``, ``k``, ``v [B, h_kv, S, Dv]``."""
    batch, heads, seq, _ = q.shape
    if sinks is not None:
        return eager_attention(q, k, v, causal_mask(seq, window, q.device), scaling, sinks)
    value_dim = v.shape[-1]
    if value_dim < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - value_dim))
    elif value_dim > q.shape[-1]:
        pad = value_dim - q.shape[-1]
        q, k = F.pad(q, (0, pad)), F.pad(k, (0, pad))
    gqa = k.shape[1] != heads
    if window is not None and window < seq:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=_window_mask(seq, window, q.device), scale=scaling, enable_gqa=gqa
        )
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
    out = out[..., :value_dim]
    return out.transpose(1, 2).reshape(batch, seq, heads * value_dim)
