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
  denominator with no value: a virtual key whose score is the sink. The sink rides in
  one extra feature column: queries get ``sink[h]`` there, real keys 0, and the virtual
  key ``1 / scaling`` (and zeros elsewhere), so its score is ``sink[h]`` for every query
  (exactly where ``1 / scaling`` is exact in the dtype: GPT-OSS's is 8). The virtual
  key is the same for every head, so grouped KV heads stay grouped. It sits first; a
  zero query row is put first as well, so the square causal mask (no mask tensor) lets
  query ``i`` see the sink and keys ``0..i``; that extra row's output is dropped.
  The sinks' gradient is not the kernel's: that would be the column's query gradient,
  each row rounded to the input dtype before the sum over rows, and the rows' terms
  cancel (in bfloat16 the sum lost 1e-2). The column is detached, and the virtual key's
  value is 1 in the column after the values (zeros elsewhere; one more column when none
  is free), so the output carries ``p_sink`` there; `_SinkGradient` sums
  ``d sink[h] = -sum_rows p_sink (dO . O)`` (the softmax's gradient at the sink's
  logit) in float32. Below float32 the kernel's ``O`` and ``p_sink`` are themselves too
  coarse for that sum (their roundings alone cost up to 2.5e-2 on random draws), so
  its backward reruns the forward kernel in float32 on the saved inputs, one KV head's
  group at a time: O(S) float32 per group, below the gradients the kernel's backward
  makes next, and about a third more attention work on the CPU.
- A sliding window shorter than the sequence is banded, not masked: queries are
  cut into blocks of ``window`` rows, and block ``b`` attends to keys
  ``[(b-1) w, (b+1) w)`` through one ``[w, 2w]`` mask shared by every block (the
  first block is plain causal). Nothing ``S x S`` is made, not even a mask; keys and
  values are copied twice over, and the work is ``O(S w)`` instead of ``O(S^2)``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class _Sink(NamedTuple):
    """The virtual key and value ``[B, h_kv, 1, W]``, the sinks ``[h]`` (float32, in the
    autograd graph; the kernel's copy is detached), the output column carrying ``p_sink``
    and the feature column carrying the sink."""

    key: torch.Tensor
    value: torch.Tensor
    logits: torch.Tensor
    column: int
    key_column: int


class _SinkGradient(torch.autograd.Function):
    """Identity on the kernel's output ``[N, h, R, W]``; its backward gives the sinks'
    gradient ``-sum_rows p_sink (dO . O)`` in float32. Below float32 it recomputes ``O``
    and ``p_sink`` in float32 from the kernel's inputs (which the kernel saves anyway), one
    KV head's group at a time, the virtual key's column exactly ``1 / scaling``."""

    @staticmethod
    def forward(ctx, out, logits, columns: tuple[int, int], q, k, v, scaling: float, kwargs):
        ctx.save_for_backward(out, q, k, v)
        ctx.columns, ctx.scaling, ctx.kwargs = columns, scaling, kwargs
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out, q, k, v = ctx.saved_tensors
        (column, key_column), groups = ctx.columns, q.shape[1] // k.shape[1]
        sink = []
        for head in range(k.shape[1]):
            rows = slice(head * groups, (head + 1) * groups)
            if out.dtype in (torch.float32, torch.float64):
                o = out[:, rows]
            else:
                key = k[:, head : head + 1].float()
                key[:, :, 0, key_column] = 1.0 / ctx.scaling  # the virtual key
                o = F.scaled_dot_product_attention(
                    q[:, rows].float(), key, v[:, head : head + 1].float(),
                    scale=ctx.scaling, enable_gqa=groups > 1, **ctx.kwargs,
                )  # fmt: skip
            delta = (grad[:, rows, :, :column].float() * o[..., :column]).sum(-1)
            sink.append(-(delta * o[..., column]).sum((0, 2)))  # one per head of the group
        return (grad, torch.cat(sink)) + (None,) * 6


def _attend(q, k, v, scaling: float, sink: _Sink | None, **kwargs) -> torch.Tensor:
    gqa = k.shape[1] != q.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, scale=scaling, enable_gqa=gqa, **kwargs)
    if sink is None or not sink.logits.requires_grad:
        return out
    return _SinkGradient.apply(
        out, sink.logits, (sink.column, sink.key_column), q, k, v, scaling, kwargs
    )


def _causal(q, k, v, scaling: float, sink: _Sink | None) -> torch.Tensor:
    """Square causal attention; with ``sink``, the sink first in keys and queries."""
    if sink is None:
        return _attend(q, k, v, scaling, None, is_causal=True)
    q = F.pad(q, (0, 0, 1, 0))
    k = torch.cat([sink.key, k], dim=2)
    v = torch.cat([sink.value, v], dim=2)
    return _attend(q, k, v, scaling, sink, is_causal=True)[:, :, 1:]


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


def _sliding(q, k, v, scaling: float, window: int, sink: _Sink | None):
    """Causal attention over the last ``window`` keys, block by block (module docstring)."""
    batch, heads, seq, _ = q.shape
    blocks = -(-seq // window)
    padding = blocks * window - seq  # padded keys come after every real query: never seen
    q, k, v = (F.pad(x, (0, 0, 0, padding)) for x in (q, k, v))
    first = _causal(q[:, :, :window], k[:, :, :window], v[:, :, :window], scaling, sink)
    if blocks == 1:
        return first[:, :, :seq]
    queries = _blocks(q[:, :, window:], window, window)
    keys, values = _blocks(k, 2 * window, window), _blocks(v, 2 * window, window)
    if sink is not None:
        keys = torch.cat([sink.key.repeat_interleave(blocks - 1, dim=0), keys], dim=2)
        values = torch.cat([sink.value.repeat_interleave(blocks - 1, dim=0), values], dim=2)
    mask = _band_mask(window, sink is not None, q.device)
    rest = _attend(queries, keys, values, scaling, sink, attn_mask=mask)
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
    batch, heads, seq, qk_dim = q.shape
    value_dim = v.shape[-1]
    sink = None
    if sinks is not None:
        # The virtual key's value is 1 in the column after the values (one more column if
        # none is free), so that column of the output carries p_sink.
        width = max(qk_dim, value_dim) + 1
        sink_column = sinks.detach().to(q.dtype).view(1, heads, 1, 1)
        q = torch.cat([q, sink_column.expand(batch, heads, seq, 1)], dim=-1)
        q = F.pad(q, (0, width - qk_dim - 1)) if width > qk_dim + 1 else q
        k = F.pad(k, (0, width - qk_dim))
        key = k.new_zeros((k.shape[0], k.shape[1], 1, width))
        key[..., qk_dim] = 1.0 / scaling
        value = torch.zeros_like(key)
        value[..., value_dim] = 1.0
        # In float32, so the two kernels' (banded) parts add before one rounding.
        sink = _Sink(key, value, sinks.float(), value_dim, qk_dim)
    if value_dim < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - value_dim))
    elif value_dim > q.shape[-1]:
        pad = value_dim - q.shape[-1]
        q, k = F.pad(q, (0, pad)), F.pad(k, (0, pad))
    if window is not None and window < seq:
        out = _sliding(q, k, v, scaling, window, sink)
    else:
        out = _causal(q, k, v, scaling, sink)
    out = out[..., :value_dim]
    return out.transpose(1, 2).reshape(batch, seq, heads * value_dim)
