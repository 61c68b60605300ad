"""The fused attention kernels against plain softmax attention in float64.

`optimized.ops.attention.flash_attention` (Triton: compiled on a GPU, the interpreter on the
CPU; every case runs on `compute_device`, from inputs drawn on the CPU) must agree with
attention written out plainly below, forward and every gradient (q, k, v and the sinks),
within 1e-6 in float32 and 1e-2 in bfloat16 (‖Δ‖/‖ref‖, DESIGN.md): with and without
sinks, windows shorter than a block, not dividing the sequence, of 1 and past the
sequence, GQA groups of 1, 2 and 4, lengths that are no multiple of a block or shorter than
one, and MLA's widths (192 / 128 and the tiny preset's 24 / 16). The cases run at the
device's own blocks (on the interpreter one block per sequence, several heads packed per
program; on a GPU the float32 blocks or the autotuner's, and SDPA for MLA's published
widths) and at small fixed blocks, unpacked as on a GPU and packed, so the banded loops
(masked edge, whole blocks, masked diagonal) are all taken.

What autograd keeps is the op's contract with the memory estimator: ``q``, ``k``, ``v``
themselves, the output (the returned tensor) and a float32 ``[B, h, S]`` log-sum-exp,
nothing ``S x S`` and no copies.
"""

from __future__ import annotations

import re

import pytest
import torch

from models.network import build_model, preset
from optimized.ops import FlashAttention, OptimizedOps
from optimized.ops.attention import flash_attention, sdpa_attention
from optimized.ops.attention_blocks import Blocks
from reference.ops import ReferenceOps

TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-2}
SMALL = Blocks((32, 16), (16, 32), (32, 16))
"""Several blocks per sequence, one (batch x head) pair per program: the GPU's path."""
SMALL_PACKED = Blocks((16, 16), (16, 16), (16, 16), pack=4)


def reference_attention(q, k, v, scaling, window=None, sinks=None) -> torch.Tensor:
    """Causal softmax attention ``[B, S, h * Dv]``, the sinks an extra logit column that is
    dropped after the softmax, written plainly (float64 in, float64 out)."""
    batch, heads, seq, _ = q.shape
    groups = heads // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) * scaling
    i = torch.arange(seq, device=q.device)[:, None]
    j = torch.arange(seq, device=q.device)[None, :]
    visible = j <= i
    if window is not None:
        visible &= i - j < window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        column = sinks.view(1, heads, 1, 1).expand(batch, heads, seq, 1)
        scores = torch.cat([scores, column], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    return (probs @ v).transpose(1, 2).reshape(batch, seq, -1)


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    assert torch.isfinite(actual).all()
    return ((actual - expected).norm() / expected.norm().clamp(min=1e-30)).item()


def draw_inputs(batch, heads, kv_heads, seq, qk_dim, v_dim, dtype, seed, device):
    """Drawn on the CPU (the same values on every device), then moved to ``device``."""
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape, scale=1.0):
        return (torch.randn(shape, generator=generator) * scale).to(device, dtype)

    q, k = draw(batch, heads, seq, qk_dim), draw(batch, kv_heads, seq, qk_dim)
    v, sinks = draw(batch, kv_heads, seq, v_dim), draw(heads, scale=2.0)
    return q, k, v, sinks, draw(batch, seq, heads * v_dim)


def errors(
    device, dtype, heads, kv_heads, qk_dim, v_dim, seq, window, sinks, blocks, batch=2, seed=0
):
    """Relative errors (output, dq, dk, dv[, dsinks]) of the kernel against float64."""
    q, k, v, sink_logits, grad = draw_inputs(
        batch, heads, kv_heads, seq, qk_dim, v_dim, dtype, seed, device
    )
    scaling = qk_dim**-0.5
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sink_logits)]
    out = flash_attention(*leaves[:3], scaling, window, leaves[3] if sinks else None,
                          blocks=blocks)  # fmt: skip
    out.backward(grad)
    references = [t.double().requires_grad_() for t in (q, k, v, sink_logits)]
    expected = reference_attention(*references[:3], scaling, window,
                                   references[3] if sinks else None)  # fmt: skip
    expected.backward(grad.double())
    assert out.dtype == dtype and out.shape == expected.shape == (batch, seq, heads * v_dim)
    result = [rel_error(out, expected)]
    for leaf, reference in zip(leaves[:3], references[:3]):
        assert leaf.grad.dtype == dtype and leaf.grad.shape == leaf.shape
        result.append(rel_error(leaf.grad, reference.grad))
    if sinks:
        assert leaves[3].grad.dtype == dtype
        result.append(rel_error(leaves[3].grad, references[3].grad))
    else:
        assert leaves[3].grad is None
    return result


CASES = {
    # heads, kv_heads, qk_dim, v_dim, seq, window, sinks, blocks
    "gpt-oss-full": (4, 2, 16, 16, 40, None, True, None),
    "gpt-oss-sliding": (4, 2, 16, 16, 40, 8, True, None),
    "window-not-dividing": (4, 2, 16, 16, 37, 8, True, SMALL),
    "window-below-block": (4, 1, 16, 16, 70, 5, True, SMALL),
    "window-spans-blocks": (4, 4, 16, 16, 70, 20, False, SMALL),
    "window-of-one": (2, 2, 16, 16, 23, 1, True, SMALL),
    "window-past-sequence": (4, 2, 16, 16, 12, 40, True, SMALL),
    "shorter-than-a-block": (4, 2, 16, 16, 9, None, True, SMALL),
    "gqa-4-packed": (8, 2, 16, 16, 45, 13, True, SMALL_PACKED),
    "causal-packed": (4, 2, 32, 32, 33, None, False, SMALL_PACKED),
    "mla-tiny": (4, 4, 24, 16, 30, None, False, None),
    "mla-tiny-blocks": (4, 4, 24, 16, 50, None, False, SMALL),
    "mla-published": (2, 2, 192, 128, 20, None, False, None),
    "head-64-sinks": (4, 2, 64, 64, 48, 16, True, SMALL),
    "head-128": (2, 1, 128, 128, 24, None, True, None),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_forward_and_every_gradient(dtype, case, compute_device):
    heads, kv_heads, qk_dim, v_dim, seq, window, sinks, blocks = CASES[case]
    result = errors(
        compute_device, dtype, heads, kv_heads, qk_dim, v_dim, seq, window, sinks, blocks
    )
    names = ["out", "dq", "dk", "dv", "dsinks"][: len(result)]
    worst = {name: error for name, error in zip(names, result) if error > TOLERANCE[dtype]}
    assert not worst, worst


def test_gpt_oss_shape_in_bfloat16_within_flex_error(compute_device):
    """At a GPT-OSS-like shape (8 heads over 2 KV heads, width 64, 256 tokens; full and a
    128 window) the bfloat16 kernel is within flex_attention's error on an H100 against
    eager float32 (GPU.md: 2.8e-3 output, 3.1e-3 sinks' gradient); here against float64."""
    for window in (None, 128):
        out, dq, dk, dv, dsinks = errors(
            compute_device, torch.bfloat16, 8, 2, 64, 64, 256, window, True, None, batch=1, seed=7
        )
        assert out <= 2.8e-3 and dsinks <= 3.1e-3, (window, out, dsinks)
        assert max(dq, dk, dv) <= 1e-2, (window, dq, dk, dv)


@pytest.mark.gpu
def test_gpt_oss_20b_attention_at_1024_tokens_on_cuda(gpu_device):
    """GPT-OSS-20B's attention (64 heads over 8 KV heads, width 64, sinks) at 1024 tokens,
    full and its 128 window, bfloat16 at the autotuner's blocks: within flex_attention's
    error on an H100 (the bounds above), against float64."""
    for window in (None, 128):
        out, dq, dk, dv, dsinks = errors(
            gpu_device, torch.bfloat16, 64, 8, 64, 64, 1024, window, True, None, batch=1, seed=8
        )
        assert out <= 2.8e-3 and dsinks <= 3.1e-3, (window, out, dsinks)
        assert max(dq, dk, dv) <= 1e-2, (window, dq, dk, dv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_sdpa_route_for_wide_heads_matches_float64(dtype, compute_device):
    """CUDA sends MLA's 192 / 128 heads to SDPA (`sdpa_attention`, values padded); the same
    code against float64 (on the CPU where the process interprets Triton)."""
    q, k, v, _, grad = draw_inputs(2, 4, 4, 24, 192, 128, dtype, seed=5, device=compute_device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = sdpa_attention(*leaves, 192**-0.5)
    out.backward(grad)
    references = [t.double().requires_grad_() for t in (q, k, v)]
    expected = reference_attention(*references, 192**-0.5)
    expected.backward(grad.double())
    errors = [rel_error(out, expected)]
    errors += [rel_error(a.grad, b.grad) for a, b in zip(leaves, references)]
    assert max(errors) <= TOLERANCE[dtype], errors


def test_blocks_and_packing_do_not_change_the_result(compute_device):
    """float32: the device's own blocks (the interpreter's one packed block, a GPU's float32
    blocks), small unpacked blocks and small packed blocks give the same output and
    gradients to rounding."""
    q, k, v, sinks, grad = draw_inputs(
        2, 4, 2, 45, 16, 16, torch.float32, seed=3, device=compute_device
    )
    results = []
    for blocks in (None, SMALL, SMALL_PACKED):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        out = flash_attention(*leaves[:3], 0.25, 11, leaves[3], blocks=blocks)
        out.backward(grad)
        results.append([out.detach()] + [leaf.grad for leaf in leaves])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert rel_error(b, a) <= 1e-6


def test_sink_gradient_is_the_named_helper(compute_device):
    """The sinks' gradient comes from `FlashAttention.sink_gradient` and nowhere else (the
    planted bug ``attention-frozen-sink`` patches that name): zeroed, it changes the sinks'
    gradient only."""
    q, k, v, sinks, grad = draw_inputs(
        2, 4, 2, 20, 16, 16, torch.float32, seed=4, device=compute_device
    )
    grads = []
    for frozen in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        original = FlashAttention.sink_gradient
        if frozen:
            FlashAttention.sink_gradient = staticmethod(
                lambda sinks, lse, delta: torch.zeros_like(sinks)
            )
        try:
            flash_attention(*leaves[:3], 0.25, 8, leaves[3]).backward(grad)
        finally:
            FlashAttention.sink_gradient = staticmethod(original)
        grads.append([leaf.grad for leaf in leaves])
    (dq, dk, dv, dsinks), (fq, fk, fv, fsinks) = grads
    assert dsinks.abs().min() > 0 and not fsinks.any()
    assert torch.equal(dq, fq) and torch.equal(dk, fk) and torch.equal(dv, fv)


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
def test_saves_inputs_output_and_logsumexp_only(window, compute_device):
    seq = 72  # above heads x width (64): the output [B, S, h * Dv] is not square
    q, k, v, sinks, _ = draw_inputs(
        2, 4, 2, seq, 16, 16, torch.float32, seed=1, device=compute_device
    )
    # q and k as the models pass them: transposed views of [B, S, heads, width].
    q, k = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k))
    leaves = [t.requires_grad_() for t in (q, k, v, sinks)]
    outputs = []
    saved = saved_tensors(
        lambda: outputs.append(flash_attention(*leaves[:3], 0.25, window, leaves[3]))
    )
    plain = saved_tensors(lambda: ReferenceOps().attention(*leaves[:3], 0.25, window, leaves[3]))
    assert square_tensors(plain, seq), "the eager path saves its probabilities"
    assert not square_tensors(saved, seq), square_tensors(saved, seq)
    storages = [t.untyped_storage().data_ptr() for t in saved]
    expected = [t.untyped_storage().data_ptr() for t in (*leaves, outputs[0])]
    assert storages[:5] == expected  # q, k, v, sinks (a parameter), the output: no copies
    (lse,) = saved[5:]
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, seq)


@pytest.mark.parametrize("layer", [0, 1])  # tiny-gpt-oss: sliding, then full attention
def test_gpt_oss_layer_saves_no_square_tensor(layer, compute_device):
    """A whole GPT-OSS decoder layer on the optimized ops, attention kept (not recomputed),
    saves nothing S x S; on the reference ops it does."""
    config = preset("tiny-gpt-oss")
    seq = 200  # past every width of the tiny model, and not a multiple of the window
    decoder = build_model(config, seed=3).decoder_layers[layer]
    with torch.no_grad():
        decoder.self_attn.sinks.normal_()  # initialised to zero: make them matter
    decoder.to(compute_device)
    hidden = torch.randn(2, seq, config.hidden_size, generator=torch.Generator().manual_seed(2))
    hidden = hidden.to(compute_device)
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


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"window": 0}, "window=0 is invalid"),
        ({"window": 2.5}, "window=2.5 is invalid"),
        ({"sinks": torch.zeros(3)}, "sinks of shape (3,) is invalid"),
        ({"k": torch.zeros(1, 3, 8, 16), "v": torch.zeros(1, 3, 8, 16)}, "3 heads must divide"),
        ({"v": torch.zeros(1, 2, 8, 16, dtype=torch.float64)}, "float32 or bfloat16"),
        ({"blocks": Blocks((16, 32), (16, 16), (16, 16))}, "Blocks.forward=(16, 32)"),
        ({"blocks": Blocks((16, 16), (16, 16), (16, 16), pack=3)}, "Blocks.pack=3"),
        ({"blocks": Blocks((24, 24), (16, 16), (16, 16))}, "powers of two >= 16"),
    ],
)
def test_bad_input_is_refused_with_the_field_named(change, message, compute_device):
    arguments = {
        "q": torch.zeros(1, 4, 8, 16), "k": torch.zeros(1, 2, 8, 16),
        "v": torch.zeros(1, 2, 8, 16), "window": None, "sinks": None, "blocks": None,
    }  # fmt: skip
    arguments.update(change)
    arguments = {name: value.to(compute_device) if torch.is_tensor(value) else value
                 for name, value in arguments.items()}  # fmt: skip
    blocks = arguments.pop("blocks")
    with pytest.raises(ValueError, match=re.escape(message)):
        flash_attention(scaling=0.25, blocks=blocks, **arguments)
