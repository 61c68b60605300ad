"""Fused expert activations (Triton): SiLU-and-multiply and GPT-OSS's clamped SwiGLU.

Written plainly, each activation keeps several ``[tokens, intermediate]``
intermediates for backward (the gate and up slices, the sigmoid, products) and
runs one pass over memory per elementwise op. Here one kernel reads the
``[..., 2I]`` input and writes the ``[..., I]`` output; backward saves only
the input and recomputes everything in one more kernel. Values are loaded in
their storage dtype, computed in float32 and stored back in it, rounded to nearest even as torch
rounds (`optimized.ops._triton.cast_rne`). A NaN or an infinity in the input reaches the output
as torch's ops would give it: the clamps pass NaN on.
"""

from __future__ import annotations

import torch

from optimized.ops._triton import INTERPRETED, INTERPRETER_ELEMENTS, cast_rne, launch, tl, triton

BLOCK = INTERPRETER_ELEMENTS if INTERPRETED else 1024
"""Elements per program: 1024 compiled, `INTERPRETER_ELEMENTS` on the interpreter
(elementwise kernels: the same values, 30x faster at the tiny presets' shapes)."""
NAN = tl.constexpr(tl.PropagateNan.ALL)
"""The clamps pass a NaN on, as torch's ``clamp`` does (Triton's default minimum and maximum
return the other operand, on GPUs and on the interpreter alike)."""


@triton.jit
def _silu_and_mul_forward_kernel(x_ptr, out_ptr, n_elements, inner, BLOCK: tl.constexpr):
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = index < n_elements
    gate_index = (index // inner) * (2 * inner) + index % inner
    gate = tl.load(x_ptr + gate_index, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + gate_index + inner, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + index, cast_rne(out, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_backward_kernel(
    x_ptr, grad_out_ptr, grad_x_ptr, n_elements, inner, BLOCK: tl.constexpr
):
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = index < n_elements
    gate_index = (index // inner) * (2 * inner) + index % inner
    gate = tl.load(x_ptr + gate_index, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + gate_index + inner, mask=mask, other=0.0).to(tl.float32)
    grad_out = tl.load(grad_out_ptr + index, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    grad_gate = grad_out * up * sig * (1.0 + gate * (1.0 - sig))
    grad_up = grad_out * gate * sig
    dtype = grad_x_ptr.dtype.element_ty
    tl.store(grad_x_ptr + gate_index, cast_rne(grad_gate, dtype), mask=mask)
    tl.store(grad_x_ptr + gate_index + inner, cast_rne(grad_up, dtype), mask=mask)


@triton.jit
def _clamped_swiglu_forward_kernel(x_ptr, out_ptr, n_elements, alpha, limit, BLOCK: tl.constexpr):
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = index < n_elements
    gate = tl.load(x_ptr + 2 * index, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + 2 * index + 1, mask=mask, other=0.0).to(tl.float32)
    gate = tl.minimum(gate, limit, propagate_nan=NAN)
    up = tl.minimum(tl.maximum(up, -limit, propagate_nan=NAN), limit, propagate_nan=NAN)
    out = (up + 1.0) * gate * tl.sigmoid(alpha * gate)
    tl.store(out_ptr + index, cast_rne(out, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _clamped_swiglu_backward_kernel(
    x_ptr, grad_out_ptr, grad_x_ptr, n_elements, alpha, limit, BLOCK: tl.constexpr
):
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = index < n_elements
    gate_raw = tl.load(x_ptr + 2 * index, mask=mask, other=0.0).to(tl.float32)
    up_raw = tl.load(x_ptr + 2 * index + 1, mask=mask, other=0.0).to(tl.float32)
    grad_out = tl.load(grad_out_ptr + index, mask=mask, other=0.0).to(tl.float32)
    gate = tl.minimum(gate_raw, limit, propagate_nan=NAN)
    up = tl.minimum(tl.maximum(up_raw, -limit, propagate_nan=NAN), limit, propagate_nan=NAN)
    sig = tl.sigmoid(alpha * gate)
    glu = gate * sig
    # clamp passes the gradient where the input lies inside the bounds (inclusive).
    grad_gate = grad_out * (up + 1.0) * (sig + alpha * glu * (1.0 - sig))
    grad_gate = tl.where(gate_raw <= limit, grad_gate, 0.0)
    grad_up = tl.where((up_raw >= -limit) & (up_raw <= limit), grad_out * glu, 0.0)
    dtype = grad_x_ptr.dtype.element_ty
    tl.store(grad_x_ptr + 2 * index, cast_rne(grad_gate, dtype), mask=mask)
    tl.store(grad_x_ptr + 2 * index + 1, cast_rne(grad_up, dtype), mask=mask)


def _grid(n_elements: int) -> tuple[int]:
    return (triton.cdiv(n_elements, BLOCK),)


def _check_pairs(x: torch.Tensor, name: str) -> None:
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"{name}: the last dimension must be even; got shape {tuple(x.shape)}")


# The launches, given every tensor (contiguous; ``x [..., 2I]``, the others ``[..., I]`` or
# like ``x``). Each value is loaded in its tensor's dtype and stored in its output's, so the
# bfloat16 stores can be fed float32 values (tests feed a GPU's NaN bit patterns through them).
def launch_silu_and_mul(x: torch.Tensor, out: torch.Tensor) -> None:
    """``out = silu(gate) * up`` for ``x = [gate | up]``."""
    if out.numel():
        launch(_silu_and_mul_forward_kernel, _grid(out.numel()), x, out, out.numel(),
               x.shape[-1] // 2, BLOCK=BLOCK)  # fmt: skip


def launch_silu_and_mul_backward(x: torch.Tensor, grad_out: torch.Tensor, grad_x: torch.Tensor):
    """``grad_x``, the gradient of `launch_silu_and_mul` at ``x`` for ``grad_out``."""
    if grad_out.numel():
        launch(_silu_and_mul_backward_kernel, _grid(grad_out.numel()), x, grad_out, grad_x,
               grad_out.numel(), x.shape[-1] // 2, BLOCK=BLOCK)  # fmt: skip


def launch_clamped_swiglu(x: torch.Tensor, out: torch.Tensor, alpha: float, limit: float):
    """``out``: GPT-OSS's clamped SwiGLU of the interleaved gate/up columns of ``x``."""
    if out.numel():
        launch(_clamped_swiglu_forward_kernel, _grid(out.numel()), x, out, out.numel(),
               float(alpha), float(limit), BLOCK=BLOCK)  # fmt: skip


def launch_clamped_swiglu_backward(
    x: torch.Tensor, grad_out: torch.Tensor, grad_x: torch.Tensor, alpha: float, limit: float
) -> None:
    """``grad_x``, the gradient of `launch_clamped_swiglu` at ``x`` for ``grad_out``."""
    if grad_out.numel():
        launch(_clamped_swiglu_backward_kernel, _grid(grad_out.numel()), x, grad_out, grad_x,
               grad_out.numel(), float(alpha), float(limit), BLOCK=BLOCK)  # fmt: skip


class SiluAndMul(torch.autograd.Function):
    """``silu(gate) * up`` for ``x = [gate | up]``; saves only ``x``."""

    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        out = x.new_empty(tuple(x.shape[:-1]) + (x.shape[-1] // 2,))
        launch_silu_and_mul(x, out)
        ctx.save_for_backward(x)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        grad_x = torch.empty_like(x)
        launch_silu_and_mul_backward(x, grad_out.contiguous(), grad_x)
        return grad_x


class ClampedSwiGLU(torch.autograd.Function):
    """GPT-OSS's activation on interleaved gate/up columns; saves only ``x``."""

    @staticmethod
    def forward(ctx, x, alpha, limit):
        x = x.contiguous()
        out = x.new_empty(tuple(x.shape[:-1]) + (x.shape[-1] // 2,))
        launch_clamped_swiglu(x, out, alpha, limit)
        ctx.save_for_backward(x)
        ctx.alpha, ctx.limit = float(alpha), float(limit)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        grad_x = torch.empty_like(x)
        launch_clamped_swiglu_backward(x, grad_out.contiguous(), grad_x, ctx.alpha, ctx.limit)
        return grad_x, None, None


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``x = [gate | up]`` along the last dimension."""
    _check_pairs(x, "silu_and_mul")
    return SiluAndMul.apply(x)


def clamped_swiglu(x: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """``(up.clamp(-limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = gate.clamp(max=limit)``,
    with ``gate = x[..., ::2]`` and ``up = x[..., 1::2]`` (GPT-OSS's layout).
    """
    _check_pairs(x, "clamped_swiglu")
    return ClampedSwiGLU.apply(x, alpha, limit)
