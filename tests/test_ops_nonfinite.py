"""A NaN or an infinity reaches every kernel's output as what it is: never a zero.

A GPU's arithmetic makes the canonical NaN ``0x7FFFFFFF`` (``0xFFFFFFFF`` negated); the
CPU's numpy makes ``0x7FC00000``. The kernels' bfloat16 rounding once added ``0x7FFF`` to
the bits of every value, which carried a GPU's NaN into the sign bit: ``-0.0`` (and
``+0.0`` for the negative one). A NaN born in attention or an MLP was stored as zeros, the
loss stayed finite and no check fired. The CPU never showed it: its NaNs survive that
addition and no kernel test fed one.

Here the GPU's bit patterns, and infinities, are fed in float32 into every bfloat16 store:
the rounding itself, the fused cross-entropy's gradient and the linear cross-entropy's (the
per-row upstream gradient is float32), attention's output, dQ, dK and dV (float32 sinks
start every row's softmax), both activations forward and backward (their launches store
into a tensor of any dtype, so float32 inputs meet the bfloat16 store), and the grouped
linear. Each result is held against float64 torch: NaN where it has NaN, an infinity of
the same sign where it has one, and the finite values within bfloat16's rounding. On the
interpreter here, compiled where a GPU is present (`compute_device`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from optimized.ops import cross_entropy, flash_attention, grouped_linear, linear_cross_entropy
from optimized.ops._triton import cast_rne, round_to_bfloat16, tl, triton
from optimized.ops.activations import (
    launch_clamped_swiglu,
    launch_clamped_swiglu_backward,
    launch_silu_and_mul,
    launch_silu_and_mul_backward,
)
from reference.ops import ReferenceOps
from tests._nonfinite import GPU_NAN, GPU_NEGATIVE_NAN, NANS, NONFINITE, PATTERNS, from_bits


def assert_same_nonfinite(
    got: torch.Tensor, want: torch.Tensor, rtol: float = 2e-2, exact_nan: bool = True
) -> None:
    """Non-finite exactly where ``want`` is, an infinity of the same sign where both are
    infinite, NaN where ``want`` has NaN (unless ``exact_nan`` is off: two formulas may
    meet ``inf - inf`` in different places), and the finite values close (bfloat16's
    rounding, relative to the tensor's largest finite value)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert torch.equal(got.isfinite(), want.isfinite()), (got, want)
    if exact_nan:
        assert torch.equal(got.isnan(), want.isnan()), (got, want)
    both = got.isinf() & want.isinf()
    assert torch.equal(got[both].sign(), want[both].sign()), (got, want)
    finite = want.isfinite()
    if finite.any():
        scale = want[finite].abs().max().clamp(min=1e-30)
        assert ((got[finite] - want[finite]).abs() <= rtol * scale).all(), (got, want)


# ------------------------------------------------------------------------ the rounding
@triton.jit
def _rounding_kernel(x_ptr, rounded_ptr, stored_ptr, n, BLOCK: tl.constexpr):
    index = tl.arange(0, BLOCK)
    mask = index < n
    x = tl.load(x_ptr + index, mask=mask)
    tl.store(rounded_ptr + index, round_to_bfloat16(x), mask=mask)
    tl.store(stored_ptr + index, cast_rne(x, stored_ptr.dtype.element_ty), mask=mask)


def test_rounding_keeps_nan_and_infinity(compute_device):
    """`round_to_bfloat16` keeps every NaN a NaN of its sign and every infinity infinite,
    and rounds finite values exactly as torch does (ties to even, overflow to infinity,
    subnormals); the bfloat16 store after it (`cast_rne`) holds the same values."""
    g = torch.Generator().manual_seed(0)
    scales = torch.exp2(torch.randint(-130, 128, (200,), generator=g).float())
    finite = torch.randn(200, generator=g) * scales
    ties = from_bits([0x3F808000, 0x3F818000, 0xBF808000, 0x00008000, 0x7F7F8000])
    edges = from_bits([0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x80000000, 0x00000000])
    x = torch.cat([NONFINITE, ties, edges, finite[finite.isfinite()]]).to(compute_device)
    rounded = torch.empty_like(x)
    stored = torch.empty_like(x, dtype=torch.bfloat16)
    _rounding_kernel[(1,)](x, rounded, stored, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    want = x.cpu().to(torch.bfloat16)  # torch rounds to nearest even on the bits, too
    rounded, stored = rounded.cpu(), stored.cpu()
    nan = x.cpu().isnan()
    assert rounded[nan].isnan().all() and stored[nan].isnan().all(), rounded[: len(PATTERNS)]
    assert torch.equal(rounded[nan].signbit(), x.cpu()[nan].signbit())  # the sign is kept
    assert torch.equal(rounded[~nan].view(torch.int32), want[~nan].float().view(torch.int32))
    assert torch.equal(stored[~nan].view(torch.int16), want[~nan].view(torch.int16))
    assert rounded[5] == float("inf") and rounded[6] == float("-inf")


# ------------------------------------------------------------------------ losses
def _upstream(rows: int, device) -> torch.Tensor:
    """A float32 per-row upstream gradient: every non-finite pattern, then finite rows."""
    finite = torch.linspace(0.5, 1.5, rows - len(PATTERNS))
    return torch.cat([NONFINITE, finite]).to(device)


def test_cross_entropy_gradient_keeps_nan_and_infinity(compute_device):
    """The fused loss's gradient, stored over bfloat16 logits, times a per-row float32
    upstream gradient holding the GPU's NaNs and infinities."""
    rows, vocab = 10, 48
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(rows, vocab, generator=g).to(compute_device, torch.bfloat16)
    target = torch.randint(0, vocab, (rows,), generator=g).to(compute_device)
    upstream = _upstream(rows, compute_device)
    ours = logits.clone().requires_grad_()
    cross_entropy(ours * 1, target, reduction="none").backward(upstream)
    truth = logits.double().requires_grad_()
    F.cross_entropy(truth, target, reduction="none").backward(upstream.double())
    assert ours.grad.dtype == torch.bfloat16
    # At the target column torch's log-softmax backward meets inf - inf (NaN), this kernel
    # (p - 1) * inf: non-finite both.
    assert_same_nonfinite(ours.grad, truth.grad, exact_nan=False)
    assert ours.grad[:NANS].isnan().all()  # the GPU's NaNs: the old rounding stored zeros


def test_linear_cross_entropy_gradient_keeps_nan_and_infinity(compute_device):
    """The chunked linear cross-entropy: each chunk's gradient is stored in bfloat16, then
    multiplied into the hidden states' and the output layer's gradients."""
    rows, hidden_size, vocab = 10, 16, 40
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(rows, hidden_size, generator=g).to(compute_device, torch.bfloat16)
    weight = (torch.randn(vocab, hidden_size, generator=g) / 4).to(compute_device, torch.bfloat16)
    target = torch.randint(0, vocab, (rows,), generator=g).to(compute_device)
    upstream = _upstream(rows, compute_device)
    ours = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    loss = linear_cross_entropy(*ours, target, reduction="none", chunk_vocab=16)
    loss.backward(upstream)
    truth = [hidden.double().requires_grad_(), weight.double().requires_grad_()]
    F.cross_entropy(truth[0] @ truth[1].T, target, reduction="none").backward(upstream.double())
    for got, want in zip(ours, truth, strict=True):
        assert_same_nonfinite(got.grad, want.grad, exact_nan=False)
    assert ours[0].grad[:NANS].isnan().all() and ours[1].grad.isnan().all()


# ------------------------------------------------------------------------ attention
def _attention_truth(q, k, v, scaling, sinks):
    """Float64 attention with sinks, as the reference stack computes it."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(groups, dim=1) for t in (k, v))
    scores = (q.double() @ k.transpose(-1, -2)) * scaling
    seq = q.shape[2]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    sink = sinks.double()[None, :, None, None].expand(*scores.shape[:3], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = probs @ v
    return out.transpose(1, 2).reshape(q.shape[0], seq, -1)


def test_attention_keeps_nan_in_output_and_every_gradient(compute_device):
    """Float32 sinks holding the GPU's NaNs start the softmax of heads 0 and 1 (which share
    KV head 0): their output rows, dQ, and dK and dV of KV head 0 are stored as NaN, every
    element. Heads 2 and 3 (KV head 1; sinks -inf, i.e. none, and finite) are untouched: no
    NaN crosses to a head or a key that does not see it."""
    batch, heads, kv_heads, seq, width = 2, 4, 2, 24, 16
    g = torch.Generator().manual_seed(3)

    def draw(*shape):
        return torch.randn(*shape, generator=g).to(compute_device, torch.bfloat16)

    q, k, v = draw(batch, heads, seq, width), draw(batch, kv_heads, seq, width), draw(
        batch, kv_heads, seq, width)  # fmt: skip
    sinks = torch.cat([from_bits([GPU_NAN, GPU_NEGATIVE_NAN, 0xFF800000]), torch.tensor([0.3])])
    sinks = sinks.to(compute_device)
    grad = draw(batch, seq, heads * width)
    ours = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out = flash_attention(*ours[:3], width**-0.5, None, ours[3])
    out.backward(grad)
    nan_out = out.view(batch, seq, heads, width)[:, :, :2]
    assert nan_out.isnan().all(), nan_out
    assert ours[0].grad[:, :2].isnan().all() and ours[1].grad[:, 0].isnan().all()
    assert ours[2].grad[:, 0].isnan().all() and ours[3].grad[:2].isnan().all()
    truth = [t.double().requires_grad_() for t in (q[:, 2:], k[:, 1:], v[:, 1:], sinks[2:])]
    want = _attention_truth(*truth[:3], width**-0.5, truth[3])
    want.backward(grad.view(batch, seq, heads, width)[:, :, 2:].reshape(batch, seq, -1).double())
    assert_same_nonfinite(out.view(batch, seq, heads, width)[:, :, 2:].reshape(batch, seq, -1),
                          want)  # fmt: skip
    for got, expected in zip(
        (ours[0].grad[:, 2:], ours[1].grad[:, 1:], ours[2].grad[:, 1:], ours[3].grad[2:]),
        (t.grad for t in truth),
        strict=True,
    ):
        assert_same_nonfinite(got, expected)


def test_attention_keeps_infinities_in_the_output(compute_device):
    """Values of +inf and -inf at the first key, which every query sees: every output row
    holds them, with their signs, in their columns; the value gradient (``P^T dO``) is
    finite. (One sequence, one head: a key a query cannot see enters the products as
    ``0 * inf``, which is NaN in torch's plain attention too.)"""
    seq, width = 20, 16
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 1, seq, width, generator=g) for _ in range(3))
    v[0, 0, 0, 0], v[0, 0, 0, 5] = float("inf"), float("-inf")
    q, k, v = (t.to(compute_device, torch.bfloat16).requires_grad_() for t in (q, k, v))
    out = flash_attention(q, k, v, width**-0.5)
    no_sink = torch.full((1,), float("-inf"), device=compute_device)
    truth = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = _attention_truth(*truth, width**-0.5, no_sink)
    assert_same_nonfinite(out, want)
    assert out[0, :, 0].isposinf().all() and out[0, :, 5].isneginf().all()
    grad = torch.randn(1, seq, width, generator=g).to(compute_device, torch.bfloat16)
    out.backward(grad)
    want.backward(grad.double())
    assert_same_nonfinite(v.grad, truth[2].grad)
    assert v.grad.isfinite().all()


# ------------------------------------------------------------------------ activations
def _pairs_with_nonfinite(rows: int, inner: int, interleaved: bool) -> torch.Tensor:
    """float32 ``[rows, 2 * inner]`` with each non-finite pattern as a gate and as an up value
    (row ``i`` gate, row ``i + len(PATTERNS)`` up), the rest random."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(rows, 2 * inner, generator=g) * 3
    gate = (slice(None), slice(0, None, 2)) if interleaved else (slice(None), slice(0, inner))
    up = (slice(None), slice(1, None, 2)) if interleaved else (slice(None), slice(inner, None))
    gates, ups = x[gate], x[up]
    for i, value in enumerate(NONFINITE):
        gates[i, i % inner] = value
        ups[i + len(PATTERNS), i % inner] = value
    x[gate], x[up] = gates, ups
    return x


ACTIVATIONS = {
    "silu_and_mul": (launch_silu_and_mul, launch_silu_and_mul_backward, False, ()),
    "clamped_swiglu": (launch_clamped_swiglu, launch_clamped_swiglu_backward, True, (1.702, 7.0)),
}


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activation_forward_keeps_nan_and_infinity(compute_device, name):
    """float32 inputs holding the patterns, the output stored in bfloat16: what torch's
    plain formula gives in float64 (GPT-OSS's clamps pass NaN on, as torch's do)."""
    forward, _, interleaved, args = ACTIVATIONS[name]
    x = _pairs_with_nonfinite(2 * len(PATTERNS) + 2, 8, interleaved).to(compute_device)
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=torch.bfloat16, device=compute_device)
    forward(x, out, *args)
    want = getattr(ReferenceOps(), name)(x.double(), *args)
    assert_same_nonfinite(out, want)
    assert out[0].isnan().any() and out[1].isnan().any()  # the GPU's two NaNs as gates


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activation_backward_keeps_nan_and_infinity(compute_device, name):
    """The gradient stored in bfloat16, from a float32 upstream gradient holding the
    patterns (finite inputs), and from inputs holding them (a finite upstream gradient):
    every row with a NaN keeps one."""
    _, backward, interleaved, args = ACTIVATIONS[name]
    rows, inner = 2 * len(PATTERNS) + 2, 8
    g = torch.Generator().manual_seed(6)
    finite_x = torch.randn(rows, 2 * inner, generator=g)
    upstream = torch.randn(rows, inner, generator=g)
    upstream[: len(PATTERNS), 0] = NONFINITE
    nonfinite_x = _pairs_with_nonfinite(rows, inner, interleaved)
    for x, grad_out in ((finite_x, upstream), (nonfinite_x, upstream.clamp(-1, 1))):
        x, grad_out = x.to(compute_device), grad_out.to(compute_device)
        grad_x = torch.empty_like(x, dtype=torch.bfloat16)
        backward(x, grad_out, grad_x, *args)
        truth = x.double().requires_grad_()
        getattr(ReferenceOps(), name)(truth, *args).backward(grad_out.double())
        # An infinite upstream gradient meets inf - inf in torch's product rule, and is
        # factored out of the sum here: non-finite both.
        assert_same_nonfinite(grad_x, truth.grad, exact_nan=False)
        assert grad_x[:NANS].isnan().any(dim=1).all()


# ------------------------------------------------------------------------ grouped linear
def test_grouped_linear_keeps_nan_and_infinity(compute_device):
    """NaN and infinite rows through the grouped GEMMs and the zeroed tail rows (a kernel
    on GPUs): the tail is zero and everything else is torch's float64 result."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(12, 16, generator=g)
    x[1, 3], x[4, 0], x[6, 2] = float("nan"), float("inf"), float("-inf")
    weight = torch.randn(3, 16, 8, generator=g) / 4
    offsets = torch.tensor([3, 7, 10], dtype=torch.int32)  # rows 10 and 11: past the groups
    grad = torch.randn(12, 8, generator=g)
    x, weight, grad = (t.to(compute_device, torch.bfloat16) for t in (x, weight, grad))
    ours = [x.clone().requires_grad_(), weight.clone().requires_grad_()]
    out = grouped_linear(ours[0], ours[1], offsets.to(compute_device))
    out.backward(grad)
    truth = [x.double().requires_grad_(), weight.double().requires_grad_()]
    want = ReferenceOps().grouped_linear(*truth, offsets.to(compute_device))
    want.backward(grad.double())
    assert_same_nonfinite(out, want)
    assert (out[10:] == 0).all() and out[1].isnan().all() and out[4].isinf().any()
    for got, expected in zip(ours, truth, strict=True):
        assert_same_nonfinite(got.grad, expected.grad)
