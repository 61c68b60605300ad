"""Fused attention against eager attention in float64: sinks, windows, GQA, MLA widths.

The fused path must agree forward and backward (sinks included) within 1e-5 in
float32 and 1e-2 in bfloat16, and must save nothing ``S x S`` for backward: not
the probabilities, and for a sliding window not even a mask.

The sinks' gradient is one number per head summed over every row of the batch, and
the rows' terms partly cancel (at 2 x 40 tokens, window 8, seed 40, two heads' terms add
to 1/33 and 1/48 of their magnitudes), so each row's bfloat16 rounding counts many times
over: the eager bfloat16 path is 1.07e-2 from float64 there. The fused path sums it in
float32 from a float32 rerun of the kernel (`flash_attention`) and is held to the plain
bound like every other tensor.
"""

from __future__ import annotations

import pytest
import torch

from models.layers import causal_mask, eager_attention
from models.model import build_model
from models.presets import preset
from optimized.ops import OptimizedOps
from optimized.ops.attention import flash_attention
from reference.ops import ReferenceOps

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    assert torch.isfinite(actual).all()
    return ((actual - expected).norm() / expected.norm().clamp(min=1e-30)).item()


def inputs(batch, heads, kv_heads, seq, qk_dim, v_dim, dtype, seed):
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape, scale=1.0):
        return (torch.randn(shape, generator=generator) * scale).to(dtype)

    q, k = draw(batch, heads, seq, qk_dim), draw(batch, kv_heads, seq, qk_dim)
    v, sinks = draw(batch, kv_heads, seq, v_dim), draw(heads, scale=2.0)
    return q, k, v, sinks, draw(batch, seq, heads * v_dim)


CASES = [
    # heads, kv_heads, qk_dim, v_dim, seq, window, sinks
    (4, 2, 16, 16, 40, None, True),  # GPT-OSS full layer: sinks and GQA
    (4, 2, 16, 16, 40, 8, True),  # GPT-OSS sliding layer: window divides the sequence
    (4, 2, 16, 16, 37, 8, True),  # window does not divide it (padded last block)
    (4, 4, 16, 16, 9, 5, True),  # two blocks, the second partly padded
    (4, 2, 16, 16, 12, 12, True),  # window as long as the sequence: plain causal
    (4, 1, 16, 16, 30, 7, False),  # window without sinks, one KV head
    (4, 4, 24, 16, 24, None, True),  # values narrower than queries
    (2, 2, 8, 12, 24, 6, True),  # values wider than queries
    (4, 2, 16, 16, 24, None, False),  # plain causal GQA
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "qk_dim", "v_dim", "seq", "window", "sinks"), CASES)
def test_matches_eager_attention_in_float64(
    dtype, heads, kv_heads, qk_dim, v_dim, seq, window, sinks
):
    q, k, v, sink_logits, grad = inputs(2, heads, kv_heads, seq, qk_dim, v_dim, dtype, seed=seq)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sink_logits)]
    out = flash_attention(*leaves[:3], 0.3, window, leaves[3] if sinks else None)
    out.backward(grad)

    references = [t.double().requires_grad_() for t in (q, k, v, sink_logits)]
    mask = causal_mask(seq, window, q.device).double()
    expected = eager_attention(*references[:3], mask, 0.3, references[3] if sinks else None)
    expected.backward(grad.double())

    assert out.dtype == dtype and out.shape == expected.shape
    assert rel_error(out, expected) <= TOLERANCE[dtype]
    for leaf, reference in zip(leaves[:3], references[:3]):
        assert leaf.grad.dtype == dtype
        assert rel_error(leaf.grad, reference.grad) <= TOLERANCE[dtype]
    if not sinks:
        assert leaves[3].grad is None
        return
    assert leaves[3].grad.dtype == dtype
    assert rel_error(leaves[3].grad, references[3].grad) <= TOLERANCE[dtype]


def saved_tensors(run) -> list[torch.Tensor]:
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return saved


def square_tensors(saved: list[torch.Tensor], seq: int) -> list[tuple[int, ...]]:
    """Shapes of saved tensors with two dimensions of at least the sequence length."""
    return [tuple(t.shape) for t in saved if sum(size >= seq for size in t.shape) >= 2]


@pytest.mark.parametrize("window", [None, 8])
def test_sinks_save_no_square_tensor(window):
    seq = 64
    q, k, v, sink_logits, _ = inputs(2, 4, 2, seq, 16, 16, torch.float32, seed=1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sink_logits)]
    fused = saved_tensors(lambda: flash_attention(*leaves[:3], 0.25, window, leaves[3]))
    plain = saved_tensors(lambda: ReferenceOps().attention(*leaves[:3], 0.25, window, leaves[3]))
    assert square_tensors(plain, seq), "the eager path saves its probabilities"
    assert not square_tensors(fused, seq), square_tensors(fused, seq)
    # Everything saved is O(S): within a few copies of q, k, v and the output.
    qkv_out = 2 * q.numel() + k.numel() + v.numel()
    assert sum(t.numel() for t in fused) <= 4 * qkv_out


@pytest.mark.parametrize("layer", [0, 1])  # tiny-gpt-oss: sliding, then full attention
def test_gpt_oss_layer_saves_no_square_tensor(layer):
    """A whole GPT-OSS decoder layer on the optimized ops, attention kept (not recomputed),
    saves nothing S x S; on the reference ops it does."""
    config = preset("tiny-gpt-oss")
    seq = 200  # past every width of the tiny model, and not a multiple of the window
    decoder = build_model(config, seed=3).decoder_layers[layer]
    with torch.no_grad():
        decoder.self_attn.sinks.normal_()  # initialised to zero: make them matter
    hidden = torch.randn(2, seq, config.hidden_size, generator=torch.Generator().manual_seed(2))
    keep_attention = OptimizedOps()
    keep_attention.recompute_attention = False
    results = {}
    for name, ops in (("optimized", keep_attention), ("reference", ReferenceOps())):
        leaf = hidden.clone().requires_grad_()
        out = []
        saved = saved_tensors(lambda ops=ops, leaf=leaf, out=out: out.append(decoder(leaf, ops)))
        results[name] = (square_tensors(saved, seq), out[0])
    assert results["reference"][0]
    assert not results["optimized"][0], results["optimized"][0]
    assert rel_error(results["optimized"][1], results["reference"][1]) <= 1e-5
