"""Fused attention with GPT-OSS sinks vs the eager attention the reference stack runs.

GPU shape: one GPT-OSS-20B layer's attention at 4096 tokens (64 query heads, 8 KV heads,
head width 64), full and sliding (window 128), bfloat16. The eager path keeps the
``[h, S, S + 1]`` probabilities; the fused path keeps O(S) (`optimized.ops.attention`).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks._common import DEVICE, bench, pick
from models.layers import causal_mask, eager_attention
from optimized.ops import flash_attention

BATCH, HEADS, KV_HEADS, SEQ, HEAD_DIM = pick(gpu=(1, 64, 8, 4096, 64), cpu=(1, 4, 2, 256, 16))
WINDOW = pick(gpu=128, cpu=16)
DTYPE = torch.bfloat16
SCALING = HEAD_DIM**-0.5


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


def plain(q, k, v, sinks, grad, window):
    mask = causal_mask(SEQ, window, q.device)
    eager_attention(q, k, v, mask, SCALING, sinks).backward(grad)


@pytest.mark.parametrize("window", [None, WINDOW], ids=["full", "sliding"])
@pytest.mark.parametrize("implementation", ["optimized", "plain"])
def test_attention_with_sinks(benchmark, implementation, window):
    attention = optimized if implementation == "optimized" else plain

    def run(*args):
        attention(*args, window=window)

    bench(
        benchmark,
        run,
        setup,
        "attention_sinks" if window is None else "attention_sinks_sliding",
        implementation,
        batch=BATCH,
        heads=HEADS,
        kv_heads=KV_HEADS,
        seq=SEQ,
        head_dim=HEAD_DIM,
        window=window,
        dtype=DTYPE,
    )
