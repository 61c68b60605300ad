"""Peak memory of the loss path, measured byte-exactly on CPU.

The path is the LM head and its loss: ``logits = hidden @ W.T``, the loss,
backward, in bfloat16. The figure is the peak of live storage beyond ``hidden``,
``W`` and their gradients, in units of one logits buffer. ``logits`` stays
referenced through backward, as in a training step that wrote
``logits = head(h); loss = ce(logits, y); loss.backward()``.

Two shapes, each the smallest whose ratio is the property's and not the size's:
- the plain and fused cross-entropy at 128 tokens x 4096 words: what they keep is
  whole logits-sized buffers plus a few floats a row (8 bytes against a row's
  8192), so the ratio is the same at any vocabulary (256 x 32000 gave the same
  figures); plain PyTorch's ratio creeps down below 128 tokens (2.98 at 64).
- the chunked linear cross-entropy at 32 tokens x 32000 words: its default chunk
  is ``max(vocab / 32, 1024)`` columns, so the vocabulary must be about 32768 for
  a chunk to be the 1/32 the 0.05 budget holds; few tokens make a stray
  vocabulary-sized float32 buffer cost 4 / (2 x 32) = 0.06 logits buffers, over
  the budget (at 256 tokens it would hide under it).

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

TOKENS, VOCAB, HIDDEN = 128, 4096, 64
"""The plain and fused cross-entropy's shape."""
CHUNKED_TOKENS, CHUNKED_VOCAB = 32, 32000
"""The chunked linear cross-entropy's shape: a default chunk of 1024 columns is 1/31."""


def loss_path_inputs(tokens: int = TOKENS, vocab: int = VOCAB):
    generator = torch.Generator().manual_seed(20)
    hidden = torch.randn(tokens, HIDDEN, generator=generator).to(torch.bfloat16)
    weight = (torch.randn(vocab, HIDDEN, generator=generator) * 0.1).to(torch.bfloat16)
    target = torch.randint(0, vocab, (tokens,), generator=generator)
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
    logits_bytes = target.numel() * weight.shape[0] * torch.bfloat16.itemsize
    return beyond / logits_bytes, loss.detach()


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
    chunked_inputs = loss_path_inputs(CHUNKED_TOKENS, CHUNKED_VOCAB)
    chunked, chunked_loss = peak_in_logits_buffers(chunked_inputs, chunked_path)
    with torch.no_grad():
        chunked_plain_loss = plain_path(*chunked_inputs)[0]
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
    assert abs(chunked_loss.item() - chunked_plain_loss.item()) <= 1e-2 * abs(
        chunked_plain_loss.item()
    )


@pytest.mark.slow
def test_loss_path_peak_memory_with_options():
    """``reduction="none"`` with a per-token upstream gradient, smoothing and z-loss on."""
    on_cpu_rank(_check_loss_path_peak_memory_with_options)


def _check_loss_path_peak_memory_with_options() -> None:
    fused, _ = peak_in_logits_buffers(loss_path_inputs(), fused_options_path)
    chunked_inputs = loss_path_inputs(CHUNKED_TOKENS, CHUNKED_VOCAB)
    chunked, chunked_loss = peak_in_logits_buffers(chunked_inputs, chunked_options_path)
    with torch.no_grad():
        fused_loss = fused_options_path(*chunked_inputs)[0]
    print(f"with options, in logits buffers: fused {fused:.3f}, linear {chunked:.3f}")
    assert fused <= 1.10
    assert chunked <= 0.05
    assert abs(chunked_loss.item() - fused_loss.item()) <= 1e-2 * abs(fused_loss.item())
