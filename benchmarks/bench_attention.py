"""GPT-OSS attention with sinks: the fused Triton kernel against what torch ships.

GPU shape: one GPT-OSS-20B layer's attention at 4096 tokens (64 query heads, 8 KV heads,
head width 64), causal, full and sliding (window 128), bfloat16, forward and backward.
Implementations:

- ``optimized``: `optimized.ops.flash_attention` with the sinks (O(S) memory);
- ``sdpa``: `F.scaled_dot_product_attention` without sinks (it has none), causal; the
  window as a boolean ``[S, S]`` mask: the bar for speed, not the same function;
- ``flex``: `torch.nn.attention.flex_attention` compiled, with the sinks applied as
  ``out * sigmoid(lse - sink)`` (exact: the sink only adds ``exp(sink)`` to the
  denominator), the window as a block mask; CUDA only (its backward is not implemented on
  the CPU);
- ``plain``: the reference stack's eager attention, which keeps the ``[h, S, S + 1]``
  probabilities.

Each records ``tflops_per_s``: forward and backward FLOPs of the visible (query, key) pairs
only (causal, within the window; `attention_flops`), over the mean time.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks._common import DEVICE, ON_CUDA, bench, pick
from models.network import causal_mask, eager_attention
from optimized.ops import flash_attention

BATCH, HEADS, KV_HEADS, SEQ, HEAD_DIM = pick(gpu=(1, 64, 8, 4096, 64), cpu=(1, 8, 2, 256, 64))
WINDOW = 128
DTYPE = torch.bfloat16
SCALING = HEAD_DIM**-0.5


def attention_flops(batch, heads, seq, qk_dim, v_dim, window=None) -> int:
    """Forward and backward FLOPs of causal attention over the visible pairs: forward
    ``QK^T`` and ``PV``, backward the recomputed ``QK^T``, ``dV``, ``dP``, ``dQ``, ``dK``
    (2 FLOPs a multiply-add): ``2 * pairs * (4 * qk_dim + 3 * v_dim)`` per head."""
    width = seq if window is None else min(window, seq)
    # Query i sees min(i + 1, width) keys.
    pairs = width * (width + 1) // 2 + (seq - width) * width
    return 2 * batch * heads * pairs * (4 * qk_dim + 3 * v_dim)


def setup():
    generator = torch.Generator(device=DEVICE).manual_seed(0)

    def draw(*shape):
        return torch.randn(shape, generator=generator, device=DEVICE, dtype=DTYPE)

    q = draw(BATCH, HEADS, SEQ, HEAD_DIM)
    k, v = draw(BATCH, KV_HEADS, SEQ, HEAD_DIM), draw(BATCH, KV_HEADS, SEQ, HEAD_DIM)
    sinks, grad = draw(HEADS), draw(BATCH, SEQ, HEADS * HEAD_DIM)
    return tuple(t.requires_grad_() for t in (q, k, v, sinks)) + (grad,), {}


def optimized(q, k, v, sinks, grad, window):
    flash_attention(q, k, v, SCALING, window, sinks).backward(grad)


def sdpa(q, k, v, sinks, grad, window):
    mask = None if window is None else causal_mask(SEQ, window, q.device) == 0
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=window is None, scale=SCALING, enable_gqa=True
    )
    out.transpose(1, 2).reshape(grad.shape).backward(grad)


_FLEX = {}


def flex(q, k, v, sinks, grad, window):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "attention" not in _FLEX:
        _FLEX["attention"] = torch.compile(flex_attention)
    if window not in _FLEX:

        def visible(b, h, i, j):
            return (j <= i) & (i - j < (SEQ if window is None else window))

        _FLEX[window] = create_block_mask(visible, None, None, SEQ, SEQ, device=q.device)
    out, lse = _FLEX["attention"](
        q, k, v, block_mask=_FLEX[window], scale=SCALING, enable_gqa=True, return_lse=True
    )
    out = out * torch.sigmoid(lse - sinks.float().view(1, -1, 1)).unsqueeze(-1).to(out.dtype)
    out.transpose(1, 2).reshape(grad.shape).backward(grad)


def plain(q, k, v, sinks, grad, window):
    mask = causal_mask(SEQ, window, q.device)
    eager_attention(q, k, v, mask, SCALING, sinks).backward(grad)


IMPLEMENTATIONS = {"optimized": optimized, "sdpa": sdpa, "flex": flex, "plain": plain}


@pytest.mark.parametrize("window", [None, WINDOW], ids=["full", "sliding"])
@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
def test_attention_with_sinks(benchmark, implementation, window):
    if implementation == "flex" and not ON_CUDA:
        pytest.skip("flex_attention's backward is not implemented on the CPU")
    attention = IMPLEMENTATIONS[implementation]

    def run(*args):
        attention(*args, window=window)

    bench(
        benchmark,
        run,
        setup,
        "attention_sinks" if window is None else "attention_sinks_sliding",
        implementation,
        flops=attention_flops(BATCH, HEADS, SEQ, HEAD_DIM, HEAD_DIM, window),
        batch=BATCH,
        heads=HEADS,
        kv_heads=KV_HEADS,
        seq=SEQ,
        head_dim=HEAD_DIM,
        window=window,
        dtype=DTYPE,
    )
