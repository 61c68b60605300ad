"""Chunked linear cross-entropy against F.cross_entropy(hidden @ weight.T) and float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from optimized.ops import linear_cross_entropy
from optimized.ops.linear_cross_entropy import MIN_CHUNK_TOKENS, default_chunk_tokens

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    assert torch.isfinite(actual).all()
    return ((actual - expected).norm() / expected.norm().clamp(min=1e-30)).item()


def make_case(tokens, hidden_size, vocab, dtype, seed, ignored_every=4):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=generator).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=generator) * 0.3).to(dtype)
    target = torch.randint(0, vocab, (tokens,), generator=generator)
    if ignored_every:
        target[::ignored_every] = -100
    return hidden, weight, target


def reference(hidden, weight, target, reduction, dtype=torch.float64):
    h = hidden.to(dtype).requires_grad_()
    w = weight.to(dtype).requires_grad_()
    loss = F.cross_entropy(h @ w.t(), target, reduction=reduction)
    loss.backward()
    return loss, h.grad, w.grad


def fused(hidden, weight, target, reduction, **kwargs):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    loss = linear_cross_entropy(h, w, target, reduction=reduction, **kwargs)
    loss.backward()
    return loss, h.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_tokens", [None, 7, 64])
def test_matches_float64_and_plain_op(dtype, reduction, chunk_tokens):
    hidden, weight, target = make_case(50, 24, 301, dtype, seed=11)
    got = fused(hidden, weight, target, reduction, chunk_tokens=chunk_tokens)
    expected = reference(hidden, weight, target, reduction)
    for actual, ref in zip(got, expected):
        assert rel_error(actual, ref) <= TOLERANCE[dtype]
    assert got[1].dtype == dtype and got[2].dtype == dtype
    if dtype == torch.float32:
        plain = reference(hidden, weight, target, reduction, dtype=torch.float32)
        for actual, ref in zip(got, plain):
            assert rel_error(actual, ref) <= 1e-5


def test_float32_accumulation_of_the_weight_gradient():
    hidden, weight, target = make_case(64, 16, 200, torch.bfloat16, seed=12)
    got = fused(hidden, weight, target, "mean", chunk_tokens=8, accumulate_dtype=torch.float32)
    expected = reference(hidden, weight, target, "mean")
    assert got[2].dtype == torch.bfloat16
    for actual, ref in zip(got, expected):
        assert rel_error(actual, ref) <= 1e-2


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_ignored_gives_zero_loss_and_zero_gradients(reduction):
    hidden, weight, target = make_case(20, 8, 50, torch.float32, seed=13, ignored_every=None)
    target[:] = -100
    loss, grad_hidden, grad_weight = fused(hidden, weight, target, reduction, chunk_tokens=6)
    assert loss.item() == 0.0
    assert torch.equal(grad_hidden, torch.zeros_like(grad_hidden))
    assert torch.equal(grad_weight, torch.zeros_like(grad_weight))


def test_leading_dimensions_and_incoming_gradient():
    hidden, weight, target = make_case(24, 8, 40, torch.float32, seed=14)
    h = hidden.view(4, 6, 8).clone().requires_grad_()
    w = weight.clone().requires_grad_()
    (3.0 * linear_cross_entropy(h, w, target.view(4, 6), chunk_tokens=5)).backward()
    _, grad_hidden, grad_weight = reference(hidden, weight, target, "mean")
    assert rel_error(h.grad.view(24, 8), 3.0 * grad_hidden) <= 1e-5
    assert rel_error(w.grad, 3.0 * grad_weight) <= 1e-5


def test_only_weight_requires_grad():
    hidden, weight, target = make_case(16, 8, 40, torch.float32, seed=15)
    w = weight.clone().requires_grad_()
    linear_cross_entropy(hidden, w, target, chunk_tokens=5).backward()
    assert rel_error(w.grad, reference(hidden, weight, target, "mean")[2]) <= 1e-5


def test_default_chunk_is_at_most_half_the_hidden_size():
    assert default_chunk_tokens(64) == 32
    assert default_chunk_tokens(2048) == 1024
    assert default_chunk_tokens(7) == MIN_CHUNK_TOKENS


def test_bad_input_names_the_problem():
    hidden, weight, target = make_case(4, 8, 10, torch.float32, seed=16)
    with pytest.raises(ValueError, match="weight must be"):
        linear_cross_entropy(hidden, weight.t(), target)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(hidden, weight, target, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing=-0.1 is invalid"):
        linear_cross_entropy(hidden, weight, target, label_smoothing=-0.1)
