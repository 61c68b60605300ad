"""Fused Triton activations against the plain PyTorch ops and float64, on `compute_device`
(compiled on a GPU, interpreted on the CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from optimized.ops import clamped_swiglu, silu_and_mul

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
ALPHA, LIMIT = 1.702, 7.0


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    assert torch.isfinite(actual).all()
    return ((actual - expected).norm() / expected.norm().clamp(min=1e-30)).item()


def plain_silu_and_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def plain_clamped_swiglu(x, alpha=ALPHA, limit=LIMIT):
    gate = x[..., ::2].clamp(max=limit)
    up = x[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def forward_backward(fn, source, grad_out, dtype=None):
    x = (source.to(dtype) if dtype else source.clone()).requires_grad_()
    out = fn(x)
    out.backward(grad_out.to(out.dtype))
    return out, x.grad


PAIRS = [(silu_and_mul, plain_silu_and_mul), (clamped_swiglu, plain_clamped_swiglu)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("fused", "plain"), PAIRS)
@pytest.mark.parametrize("shape", [(37, 2 * 45), (3, 5, 2 * 600), (1, 2)])
def test_matches_plain_and_float64(dtype, fused, plain, shape, compute_device):
    generator = torch.Generator().manual_seed(shape[-1])
    # Scaled so that a good share of values lie beyond the clamp limit.
    source = (torch.randn(shape, generator=generator) * 5).to(compute_device, dtype)
    grad_out = torch.randn(shape[:-1] + (shape[-1] // 2,), generator=generator)
    grad_out = grad_out.to(compute_device, dtype)
    out, grad = forward_backward(fused, source, grad_out)
    ref_out, ref_grad = forward_backward(plain, source, grad_out, torch.float64)
    same_out, same_grad = forward_backward(plain, source, grad_out)
    assert out.dtype == dtype and grad.dtype == dtype
    for actual, ref, same in ((out, ref_out, same_out), (grad, ref_grad, same_grad)):
        assert rel_error(actual, ref) <= TOLERANCE[dtype]
        assert rel_error(actual, same) <= TOLERANCE[dtype]


def test_clamped_swiglu_blocks_gradient_beyond_the_limit(compute_device):
    x = torch.tensor([[8.0, 1.0, 1.0, -9.0, 0.5, 7.5]], device=compute_device, requires_grad=True)
    clamped_swiglu(x, ALPHA, LIMIT).sum().backward()
    assert x.grad[0, 0] == 0  # gate above the limit
    assert x.grad[0, 3] == 0 and x.grad[0, 5] == 0  # up outside [-limit, limit]
    assert x.grad[0, 1] != 0 and x.grad[0, 2] != 0 and x.grad[0, 4] != 0


def test_other_alpha_and_limit_and_non_contiguous_input(compute_device):
    generator = torch.Generator().manual_seed(60)
    source = (torch.randn(64, 20, generator=generator) * 3).to(compute_device)
    x = source.t()  # [20, 64], non-contiguous
    got = clamped_swiglu(x, 1.0, 2.0)
    assert rel_error(got, plain_clamped_swiglu(x.double(), 1.0, 2.0)) <= 1e-5
    assert rel_error(silu_and_mul(x), plain_silu_and_mul(x.double())) <= 1e-5


def test_odd_last_dimension_is_refused(compute_device):
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.randn(3, 5, device=compute_device))
    with pytest.raises(ValueError, match="even"):
        clamped_swiglu(torch.randn(3, 5, device=compute_device))
