"""Peak memory of the loss path, measured byte-exactly on CPU.

The path is the LM head and its loss: ``logits = hidden @ W.T``, the loss,
backward, in bfloat16 at 256 tokens x 32000 vocabulary. The figure is the peak
of live storage beyond ``hidden``, ``W`` and their gradients, in units of one
logits buffer. ``logits`` stays referenced through backward, as in a training
step that wrote ``logits = head(h); loss = ce(logits, y); loss.backward()``.

The storage counted is the CPU's, so the tests run on a CPU rank (`tests._ranks.on_cpu_rank`:
in place where this process interprets Triton, in one spawned CPU rank on a GPU machine).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from optimized.ops import cross_entropy, linear_cross_entropy
from tests._memtrack import StorageTracker
from tests._ranks import on_cpu_rank

TOKENS, VOCAB, HIDDEN = 256, 32000, 64


def loss_path_inputs():
    generator = torch.Generator().manual_seed(20)
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator).to(torch.bfloat16)
    weight = (torch.randn(VOCAB, HIDDEN, generator=generator) * 0.1).to(torch.bfloat16)
    target = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    target[::9] = -100
    return hidden, weight, target


def peak_in_logits_buffers(inputs, loss_fn) -> tuple[float, torch.Tensor]:
    hidden, weight, target = inputs
    hidden = hidden.clone().requires_grad_()
    weight = weight.clone().requires_grad_()
    with StorageTracker() as tracker:
        loss, logits = loss_fn(hidden, weight, target)
        loss.backward()
        del logits
    beyond = tracker.peak - hidden.grad.nbytes - weight.grad.nbytes
    return beyond / (TOKENS * VOCAB * torch.bfloat16.itemsize), loss.detach()


def fused_path(hidden, weight, target):
    logits = hidden @ weight.t()
    return cross_entropy(logits, target), logits


def plain_path(hidden, weight, target):
    logits = hidden @ weight.t()
    return F.cross_entropy(logits, target), logits


def plain_float32_path(hidden, weight, target):
    logits = hidden @ weight.t()
    return F.cross_entropy(logits.float(), target), logits


def chunked_path(hidden, weight, target):
    return linear_cross_entropy(hidden, weight, target), None


OPTIONS = {"label_smoothing": 0.1, "lse_square_scale": 1e-4}
"""Label smoothing and z-loss on: the options must not cost a logits-sized buffer."""


def per_token_upstream(loss: torch.Tensor) -> torch.Tensor:
    """``reduction="none"`` losses weighted per token, then summed: a per-row upstream."""
    weights = torch.linspace(0.5, 1.5, loss.numel(), dtype=torch.float32)
    return (loss * weights).sum()


def fused_options_path(hidden, weight, target):
    logits = hidden @ weight.t()
    loss = cross_entropy(logits, target, reduction="none", **OPTIONS)
    return per_token_upstream(loss), logits


def chunked_options_path(hidden, weight, target):
    loss = linear_cross_entropy(hidden, weight, target, reduction="none", **OPTIONS)
    return per_token_upstream(loss), None


@pytest.mark.slow
def test_loss_path_peak_memory():
    on_cpu_rank(_check_loss_path_peak_memory)


def _check_loss_path_peak_memory() -> None:
    inputs = loss_path_inputs()
    plain, plain_loss = peak_in_logits_buffers(inputs, plain_path)
    plain_float32, _ = peak_in_logits_buffers(inputs, plain_float32_path)
    fused, fused_loss = peak_in_logits_buffers(inputs, fused_path)
    chunked, chunked_loss = peak_in_logits_buffers(inputs, chunked_path)
    print(
        f"peak beyond hidden, W and grads, in logits buffers: F.cross_entropy {plain:.3f}, "
        f"with float32 upcast {plain_float32:.3f}, fused {fused:.3f}, linear {chunked:.3f}"
    )
    # The tracker sees what the plain op keeps (log-softmax, two gradients) ...
    assert plain >= 3.0 and plain_float32 >= 6.0
    # ... and the fused ops stay within their budgets.
    assert fused <= 1.10
    assert chunked <= 0.05
    assert abs(fused_loss.item() - plain_loss.item()) <= 1e-2 * abs(plain_loss.item())
    assert abs(chunked_loss.item() - plain_loss.item()) <= 1e-2 * abs(plain_loss.item())


@pytest.mark.slow
def test_loss_path_peak_memory_with_options():
    """``reduction="none"`` with a per-token upstream gradient, smoothing and z-loss on."""
    on_cpu_rank(_check_loss_path_peak_memory_with_options)


def _check_loss_path_peak_memory_with_options() -> None:
    inputs = loss_path_inputs()
    fused, fused_loss = peak_in_logits_buffers(inputs, fused_options_path)
    chunked, chunked_loss = peak_in_logits_buffers(inputs, chunked_options_path)
    print(f"with options, in logits buffers: fused {fused:.3f}, linear {chunked:.3f}")
    assert fused <= 1.10
    assert chunked <= 0.05
    assert abs(chunked_loss.item() - fused_loss.item()) <= 1e-2 * abs(fused_loss.item())
