"""bfloat16 products on CPUs without native bfloat16 GEMM (`models.runtime.cpu_gemm`): each is the
float32 product of the same bfloat16 values, rounded once, whatever the op, direction or
layout; float32 work is untouched; a tracker entered later sees only bfloat16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from models.runtime import GEMM_ENV, Bf16Gemm, bf16_gemm, float32_products, native_bf16_gemm

BF16 = torch.bfloat16


def _draw(*shape, seed=0, scale=1.0):
    generator = torch.Generator().manual_seed(seed + sum(shape))
    return (torch.randn(*shape, generator=generator) * scale + 0.3).to(BF16)


def _equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a, b), f"max difference {(a.float() - b.float()).abs().max().item()}"


def test_products_are_float32_products_rounded_once():
    a, b, bias = _draw(24, 40), _draw(40, 56, seed=1), _draw(56, seed=2)
    batched, other = _draw(3, 24, 40, seed=3), _draw(3, 40, 8, seed=4)
    with Bf16Gemm():
        mm, at_b, linear = a @ b, a.t().matmul(a), F.linear(a, b.t(), bias)
        bmm, vector = torch.bmm(batched, other), a @ b[:, 0]
    _equal(mm, (a.float() @ b.float()).to(BF16))
    _equal(at_b, (a.float().t() @ a.float()).to(BF16))
    _equal(linear, torch.addmm(bias.float(), a.float(), b.float()).to(BF16))
    _equal(bmm, torch.bmm(batched.float(), other.float()).to(BF16))
    _equal(vector, (a.float() @ b.float()[:, 0]).to(BF16))


def test_grouped_products_and_their_gradients():
    x, w = _draw(48, 32).requires_grad_(), _draw(3, 32, 16, seed=5).requires_grad_()
    offs = torch.tensor([16, 16, 48], dtype=torch.int32)  # an empty group too
    with Bf16Gemm():
        out = F.grouped_mm(x, w, offs=offs)
        out.backward(_draw(48, 16, seed=6))
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    expected = F.grouped_mm(xf, wf, offs=offs)
    expected.backward(_draw(48, 16, seed=6).float())
    _equal(out, expected.to(BF16))
    _equal(x.grad, xf.grad.to(BF16))
    _equal(w.grad, wf.grad.to(BF16))


def test_a_linear_backward_runs_every_product_in_float32():
    x, w = _draw(16, 32).requires_grad_(), _draw(24, 32, seed=7).requires_grad_()
    grad = _draw(16, 24, seed=8)
    with Bf16Gemm():
        F.linear(x, w).backward(grad)
    _equal(x.grad, (grad.float() @ w.detach().float()).to(BF16))
    _equal(w.grad, (grad.float().t() @ x.detach().float()).to(BF16))


def test_cpu_flash_attention_forward_and_backward():
    """The kernel's own float32 forward and backward on the same bfloat16 values (the
    backward reads the output autograd saved: the rounded one)."""
    q, k, v = (_draw(1, 2, 40, 16, seed=s).requires_grad_() for s in (9, 10, 11))
    grad = _draw(1, 2, 40, 16, seed=12)
    with Bf16Gemm():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)
    forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    wide = [t.detach().float() for t in (q, k, v)]
    expected, lse = forward(*wide, 0.0, True)
    _equal(out, expected.to(BF16))
    grads = backward(grad.float(), *wide, expected.to(BF16).float(), lse, 0.0, True)
    for mine, truth in zip((q, k, v), grads):
        _equal(mine.grad, truth.to(BF16))


def test_float32_work_is_untouched():
    a, b = _draw(8, 16).float(), _draw(16, 4, seed=13).float()
    with Bf16Gemm():
        product = a @ b
    assert product.dtype == torch.float32
    _equal(product, a @ b)


class _Seen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.dtypes: dict[str, set] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.dtypes.setdefault(func.__name__, set()).add(out.dtype)
        return out


def test_a_tracker_entered_later_sees_the_bfloat16_product_only():
    """The float32 copies are made below any mode entered after this one (a memory
    tracker): it measures what a GPU's bfloat16 GEMM would hold."""
    a, b = _draw(8, 16), _draw(16, 4, seed=14)
    with Bf16Gemm(), _Seen() as seen:
        a @ b
    assert seen.dtypes == {"mm.default": {BF16}}, seen.dtypes


def test_the_choice_follows_the_cpu_and_the_override(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    native, what = native_bf16_gemm()
    assert what
    monkeypatch.delenv(GEMM_ENV, raising=False)
    assert float32_products(BF16, cpu)[0] is (not native)
    assert float32_products(torch.float32, cpu) == (False, "")
    assert float32_products(BF16, cuda) == (False, "")
    monkeypatch.setenv(GEMM_ENV, "float32")
    on, why = float32_products(BF16, cpu)
    assert on and "float32 products rounded once" in why
    assert isinstance(bf16_gemm(BF16, cpu), Bf16Gemm)
    monkeypatch.setenv(GEMM_ENV, "native")
    assert not float32_products(BF16, cpu)[0]
    assert not isinstance(bf16_gemm(BF16, cpu), Bf16Gemm)
    monkeypatch.setenv(GEMM_ENV, "fast")
    with pytest.raises(ValueError, match="'fast': expected one of auto, native, float32"):
        float32_products(BF16, cpu)
