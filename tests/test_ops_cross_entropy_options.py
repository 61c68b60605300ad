"""The fused losses' precision and objective options against float64.

Precision: Liger-Kernel's own criterion (``allclose``, rtol 1e-6, atol 1e-8) at logit
scales 0.1, 1 and 10. At scale 10 the old kernel, which formed the probabilities as
``exp(x - lse)`` with ``lse`` rounded to float32, put 26 of 65536 gradients (16 x 4096)
and 170 of 4.5 M (3 x 47 x 32000, the issue's case) up to 2x outside it.

Options: ``reduction="none"`` with a per-token upstream gradient, z-loss
(``lse_square_scale``, returned for logging) and ``label_smoothing``, in both
`cross_entropy` and `linear_cross_entropy`, float32 and bfloat16.

Every case runs on `compute_device` (compiled on a GPU, interpreted on the CPU), from
inputs drawn on the CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from optimized.ops import cross_entropy, linear_cross_entropy

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
OPTIONS = [(0.1, 0.0), (0.0, 1e-2), (0.2, 1e-3)]
"""``(label_smoothing, lse_square_scale)`` cases: each alone, then both."""


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    assert torch.isfinite(actual).all()
    return ((actual - expected).norm() / expected.norm().clamp(min=1e-30)).item()


def float64_objective(logits, target, reduction, label_smoothing, lse_square_scale):
    """``(loss, z_loss)`` in float64: F.cross_entropy's smoothing plus ``s * lse**2``."""
    rows = F.cross_entropy(
        logits, target, reduction="none", label_smoothing=label_smoothing
    )  # ignored rows: 0
    valid = target != -100
    z_loss = lse_square_scale * torch.logsumexp(logits, dim=-1).square() * valid
    rows = rows + z_loss
    if reduction == "none":
        return rows, z_loss
    scale = 1.0 / valid.sum().clamp(min=1) if reduction == "mean" else 1.0
    return rows.sum() * scale, z_loss.sum() * scale


def upstream_for(loss: torch.Tensor, seed: int) -> torch.Tensor:
    """A per-token upstream gradient for ``none`` (not all equal), else a scalar != 1."""
    if loss.dim() == 0:
        return torch.tensor(1.7, device=loss.device)
    upstream = torch.rand(loss.shape, generator=torch.Generator().manual_seed(seed)) + 0.5
    return upstream.to(loss.device)


# --- precision ----------------------------------------------------------------------------


def float32_case(tokens: int, vocab: int, scale: float, device: torch.device):
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(tokens, vocab, generator=generator) * scale
    target = torch.randint(0, vocab, (tokens,), generator=generator)
    return base.to(device), target.to(device)


def assert_liger_precision(
    tokens: int, vocab: int, scale: float, reduction: str, device: torch.device
) -> None:
    base, target = float32_case(tokens, vocab, scale, device)
    leaf = base.clone().requires_grad_()
    loss = cross_entropy(leaf * 1, target, reduction=reduction)
    loss.backward()
    reference = base.double().requires_grad_()
    expected = F.cross_entropy(reference, target, reduction=reduction)
    expected.backward()
    # Liger's atol, scaled with the gradient for the mean (1 / tokens), so it never hides
    # an error that rtol would catch at sum.
    atol = 1e-8 / tokens if reduction == "mean" else 1e-8
    grad, expected_grad = leaf.grad.double(), reference.grad
    misses = (grad - expected_grad).abs() > atol + 1e-6 * expected_grad.abs()
    assert int(misses.sum()) == 0, (
        f"{int(misses.sum())} of {grad.numel()} gradients outside rtol 1e-6 at scale {scale}"
    )
    assert abs(loss.item() - expected.item()) <= 1e-6 * abs(expected.item())


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("scale", [0.1, 1.0, 10.0])
def test_float32_gradients_at_liger_precision(scale, reduction, compute_device):
    assert_liger_precision(16, 4096, scale, reduction, compute_device)


@pytest.mark.slow
def test_float32_gradients_at_liger_precision_issue_shape(compute_device):
    """B=3, T=47, V=32000, scale 10: where Liger's tests found the defect."""
    assert_liger_precision(3 * 47, 32000, 10.0, "sum", compute_device)


@pytest.mark.parametrize("scale", [0.1, 1.0, 10.0])
def test_bfloat16_at_every_logit_scale(scale, compute_device):
    base, target = float32_case(16, 4096, scale, compute_device)
    base = base.to(torch.bfloat16)
    leaf = base.clone().requires_grad_()
    loss = cross_entropy(leaf * 1, target)
    loss.backward()
    reference = base.double().requires_grad_()
    expected = F.cross_entropy(reference, target)
    expected.backward()
    assert rel_error(loss, expected) <= 1e-2
    assert rel_error(leaf.grad, reference.grad) <= 1e-2


# --- options: cross_entropy ---------------------------------------------------------------


def logits_case(tokens: int, vocab: int, dtype: torch.dtype, seed: int, device: torch.device):
    generator = torch.Generator().manual_seed(seed)
    base = (torch.randn(tokens, vocab, generator=generator) * 3).to(dtype)
    target = torch.randint(0, vocab, (tokens,), generator=generator)
    target[::5] = -100
    return base.to(device), target.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(("label_smoothing", "lse_square_scale"), OPTIONS)
def test_cross_entropy_options_match_float64(
    dtype, reduction, label_smoothing, lse_square_scale, compute_device
):
    base, target = logits_case(24, 1000, dtype, seed=30, device=compute_device)
    options = {"label_smoothing": label_smoothing, "lse_square_scale": lse_square_scale}
    leaf = base.clone().requires_grad_()
    loss, z_loss = cross_entropy(
        leaf * 1, target, reduction=reduction, return_z_loss=True, **options
    )
    upstream = upstream_for(loss, seed=31)
    loss.backward(upstream)

    reference = base.double().requires_grad_()
    expected, expected_z = float64_objective(reference, target, reduction, **options)
    expected.backward(upstream.double())

    assert loss.dtype == torch.float32 and loss.shape == expected.shape
    assert not z_loss.requires_grad
    assert rel_error(loss, expected) <= TOLERANCE[dtype]
    assert rel_error(leaf.grad, reference.grad) <= TOLERANCE[dtype]
    if lse_square_scale:
        assert rel_error(z_loss, expected_z) <= TOLERANCE[dtype]
    else:
        assert torch.equal(z_loss, torch.zeros_like(z_loss))
    if reduction == "none":
        assert torch.equal(loss[target == -100], torch.zeros(5, device=compute_device))


def test_options_across_vocabulary_blocks(compute_device):
    """Smoothing's row sum and the z-loss carried over several 8192-wide blocks."""
    base, target = logits_case(6, 8192 * 2 + 77, torch.float32, seed=32, device=compute_device)
    leaf = base.clone().requires_grad_()
    loss, z_loss = cross_entropy(
        leaf * 1, target, label_smoothing=0.3, lse_square_scale=1e-2, return_z_loss=True
    )
    loss.backward()
    reference = base.double().requires_grad_()
    expected, expected_z = float64_objective(reference, target, "mean", 0.3, 1e-2)
    expected.backward()
    assert rel_error(loss, expected) <= 1e-5
    assert rel_error(z_loss, expected_z) <= 1e-5
    assert rel_error(leaf.grad, reference.grad) <= 1e-5


def test_label_smoothing_is_plain_ops(compute_device):
    """The mean with smoothing is F.cross_entropy's own (its denominator included)."""
    base, target = logits_case(20, 300, torch.float32, seed=33, device=compute_device)
    leaf, plain_leaf = base.clone().requires_grad_(), base.clone().requires_grad_()
    cross_entropy(leaf * 1, target, label_smoothing=0.1).backward()
    F.cross_entropy(plain_leaf, target, label_smoothing=0.1).backward()
    assert rel_error(leaf.grad, plain_leaf.grad) <= 1e-5


def test_without_grad_the_options_leave_the_logits_alone(compute_device):
    base, target = logits_case(8, 200, torch.float32, seed=34, device=compute_device)
    logits = base.clone()
    loss, z_loss = cross_entropy(
        logits, target, reduction="none", label_smoothing=0.1, lse_square_scale=1e-3,
        return_z_loss=True,
    )  # fmt: skip
    expected, expected_z = float64_objective(base.double(), target, "none", 0.1, 1e-3)
    assert torch.equal(logits, base)
    assert rel_error(loss, expected) <= 1e-5 and rel_error(z_loss, expected_z) <= 1e-5


# --- options: linear_cross_entropy --------------------------------------------------------


def linear_case(dtype: torch.dtype, seed: int, device: torch.device):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(50, 24, generator=generator).to(dtype)
    weight = (torch.randn(301, 24, generator=generator) * 0.5).to(dtype)
    target = torch.randint(0, 301, (50,), generator=generator)
    target[::4] = -100
    return hidden.to(device), weight.to(device), target.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(("label_smoothing", "lse_square_scale"), OPTIONS)
def test_linear_cross_entropy_options_match_float64(
    dtype, reduction, label_smoothing, lse_square_scale, compute_device
):
    hidden, weight, target = linear_case(dtype, seed=40, device=compute_device)
    options = {"label_smoothing": label_smoothing, "lse_square_scale": lse_square_scale}
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, z_loss = linear_cross_entropy(
        h, w, target, reduction=reduction, chunk_vocab=64, return_z_loss=True, **options
    )
    upstream = upstream_for(loss, seed=41)
    loss.backward(upstream)

    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    expected, expected_z = float64_objective(h64 @ w64.t(), target, reduction, **options)
    expected.backward(upstream.double())

    assert loss.shape == expected.shape and not z_loss.requires_grad
    assert rel_error(loss, expected) <= TOLERANCE[dtype]
    assert rel_error(h.grad, h64.grad) <= TOLERANCE[dtype]
    assert rel_error(w.grad, w64.grad) <= TOLERANCE[dtype]
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    if lse_square_scale:
        assert rel_error(z_loss, expected_z) <= TOLERANCE[dtype]


def test_linear_none_keeps_leading_dimensions_and_one_gradient(compute_device):
    hidden, weight, target = linear_case(torch.float32, seed=42, device=compute_device)
    w = weight.clone().requires_grad_()
    loss = linear_cross_entropy(
        hidden.view(5, 10, 24), w, target.view(5, 10), reduction="none", chunk_vocab=16
    )
    assert loss.shape == (5, 10)
    upstream = upstream_for(loss, seed=43)
    loss.backward(upstream)
    w64 = weight.double().requires_grad_()
    expected, _ = float64_objective(hidden.double() @ w64.t(), target, "none", 0.0, 0.0)
    expected.backward(upstream.reshape(-1).double())
    assert rel_error(loss.reshape(-1), expected) <= 1e-5
    assert rel_error(w.grad, w64.grad) <= 1e-5
