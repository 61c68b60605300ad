"""Fused causal attention: keep O(S) statistics for backward, not the ``S x S`` probabilities.

The plain attention of `reference` saves its ``[B, h, S, S]`` softmax for backward;
at 2 x 128 tokens that is the largest activation of a tiny model's layer, and at
4096 tokens it dwarfs everything else. PyTorch's scaled-dot-product attention
has flash kernels on both devices (a fused CPU kernel; FlashAttention and the
memory-efficient kernel on CUDA) that save only q, k, v, the output and the row
log-sum-exp, and recompute the probabilities in backward. Three things need care:

- MLA's value heads are narrower than its query/key heads (DeepSeek-V2: 128 vs
  192). The flash kernels want one head width, so the values are zero-padded to
  the query width and the padding is dropped from the output; zeros in the
  values change nothing, and their gradient is dropped with them.
- Attention sinks (GPT-OSS) are a learnable per-head logit in the softmax's
  denominator with no value: a virtual key whose score is the sink and whose value
  is zero. The sink rides in one extra feature column: queries get ``sink[h]``
  there, real keys 0, and the virtual key ``1 / scaling`` (and zeros elsewhere), so
  its score is exactly ``sink[h]`` for every query and the sink's gradient is that
  column's query gradient. The virtual key is the same for every head, so grouped
  KV heads stay grouped. It sits first; a zero query row is put first as well, so
  the square causal mask (no mask tensor) lets query ``i`` see the sink and keys
  ``0..i``; that extra row's output is dropped.
- A sliding window shorter than the sequence is banded, not masked: queries are
  cut into blocks of ``window`` rows, and block ``b`` attends to keys
  ``[(b-1) w, (b+1) w)`` through one ``[w, 2w]`` mask shared by every block (the
  first block is plain causal). Nothing ``S x S`` is made, not even a mask; keys and
  values are copied twice over, and the work is ``O(S w)`` instead of ``O(S^2)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _sink_key(k: torch.Tensor, scaling: float) -> torch.Tensor:
    """The virtual key ``[B, h_kv, 1, D + 1]``: zeros, then ``1 / scaling``."""
    key = k.new_zeros((k.shape[0], k.shape[1], 1, k.shape[-1] + 1))
    key[..., -1] = 1.0 / scaling
    return key


def _causal(q, k, v, scaling: float, sink_key: torch.Tensor | None) -> torch.Tensor:
    """Square causal attention; with ``sink_key``, the sink first in keys and queries."""
    gqa = k.shape[1] != q.shape[1]
    if sink_key is None:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa
        )
    q = F.pad(q, (0, 0, 1, 0))
    k = torch.cat([sink_key, k], dim=2)
    v = F.pad(v, (0, 0, 1, 0))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
    return out[:, :, 1:]


def _band_mask(window: int, sink: bool, device: torch.device) -> torch.Tensor:
    """``[w, 2w (+1)]``: query ``r`` of a block sees key ``c`` of the two blocks ending at
    its own when ``r < c <= r + w`` (causal and within the window); a sink column first."""
    r = torch.arange(window, device=device)[:, None]
    c = torch.arange(2 * window, device=device)[None, :]
    allowed = (c > r) & (c <= r + window)
    if sink:
        allowed = torch.cat([allowed.new_ones((window, 1)), allowed], dim=1)
    return allowed


def _blocks(x: torch.Tensor, size: int, step: int) -> torch.Tensor:
    """``[B, H, S, D]`` -> ``[B * n, H, size, D]``: the ``n`` windows of ``size`` rows
    starting every ``step`` rows."""
    batch, heads, _, dim = x.shape
    windows = x.unfold(2, size, step)  # [B, H, n, D, size]
    count = windows.shape[2]
    return windows.permute(0, 2, 1, 4, 3).reshape(batch * count, heads, size, dim)


def _sliding(q, k, v, scaling: float, window: int, sink_key: torch.Tensor | None):
    """Causal attention over the last ``window`` keys, block by block (module docstring)."""
    batch, heads, seq, _ = q.shape
    blocks = -(-seq // window)
    padding = blocks * window - seq  # padded keys come after every real query: never seen
    q, k, v = (F.pad(x, (0, 0, 0, padding)) for x in (q, k, v))
    first = _causal(q[:, :, :window], k[:, :, :window], v[:, :, :window], scaling, sink_key)
    if blocks == 1:
        return first[:, :, :seq]
    queries = _blocks(q[:, :, window:], window, window)
    keys, values = _blocks(k, 2 * window, window), _blocks(v, 2 * window, window)
    if sink_key is not None:
        keys = torch.cat([sink_key.repeat_interleave(blocks - 1, dim=0), keys], dim=2)
        values = F.pad(values, (0, 0, 1, 0))
    mask = _band_mask(window, sink_key is not None, q.device)
    rest = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=mask, scale=scaling, enable_gqa=k.shape[1] != heads
    )
    rest = rest.view(batch, blocks - 1, heads, window, -1).transpose(1, 2)
    rest = rest.reshape(batch, heads, (blocks - 1) * window, -1)
    return torch.cat([first, rest], dim=2)[:, :, :seq]


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention ``[B, S, h * Dv]`` of ``q [B, h, S, D]``, ``k``, ``v [B, h_kv, S, Dv]``,
    keys limited to the last ``window`` positions when given, with per-head ``sinks [h]``."""
    batch, heads, seq, _ = q.shape
    value_dim = v.shape[-1]
    sink_key = None
    if sinks is not None:
        sink_column = sinks.to(q.dtype).view(1, heads, 1, 1).expand(batch, heads, seq, 1)
        q = torch.cat([q, sink_column], dim=-1)
        sink_key = _sink_key(k, scaling)
        k = F.pad(k, (0, 1))
    if value_dim < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - value_dim))
    elif value_dim > q.shape[-1]:
        pad = value_dim - q.shape[-1]
        q, k = F.pad(q, (0, pad)), F.pad(k, (0, pad))
        sink_key = None if sink_key is None else F.pad(sink_key, (0, pad))
    if window is not None and window < seq:
        out = _sliding(q, k, v, scaling, window, sink_key)
    else:
        out = _causal(q, k, v, scaling, sink_key)
    out = out[..., :value_dim]
    return out.transpose(1, 2).reshape(batch, seq, heads * value_dim)
