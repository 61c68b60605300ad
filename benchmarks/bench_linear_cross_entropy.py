"""Linear cross-entropy fused over vocabulary chunks vs ``F.cross_entropy(hidden @ W.T)``,
and vs Liger-Kernel's fused linear cross-entropy where it is installed (on CUDA).

Each records, beside the time, ``peak_above_inputs_bytes`` (the peak beyond hidden,
weight, target and their gradients) and ``logits_multiple``: that peak in units of one
``[tokens, vocab]`` logits buffer (the fused op: one chunk, 1/32 of it; plain: about 2.5).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks._common import DEVICE, bench, liger_installed, peak_above_inputs_bytes, pick
from optimized.ops import linear_cross_entropy

TOKENS, VOCAB, HIDDEN = pick(gpu=(4096, 102400, 2048), cpu=(64, 4096, 64))
DTYPE = torch.bfloat16
LOGITS_BYTES = TOKENS * VOCAB * DTYPE.itemsize
FLOPS = 3 * 2 * TOKENS * VOCAB * HIDDEN
"""The plain path's three matmuls (the fused op runs a fourth: it makes the logits twice)."""


def setup():
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator, device=DEVICE, dtype=DTYPE)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator, device=DEVICE, dtype=DTYPE)
    weight = (weight * HIDDEN**-0.5).requires_grad_()
    target = torch.randint(0, VOCAB, (TOKENS,), generator=generator, device=DEVICE)
    return (hidden.requires_grad_(), weight, target), {}


def optimized(hidden, weight, target):
    linear_cross_entropy(hidden, weight, target).backward()


def plain(hidden, weight, target):
    F.cross_entropy(hidden @ weight.t(), target).backward()


def optimized_options(hidden, weight, target):
    """reduction="none" (gradients made chunk by chunk in backward), smoothing, z-loss."""
    linear_cross_entropy(
        hidden, weight, target, reduction="none", label_smoothing=0.1, lse_square_scale=1e-4
    ).mean().backward()


def liger(hidden, weight, target):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # noqa: PLC0415

    LigerFusedLinearCrossEntropyLoss()(weight, hidden, target).backward()


IMPLEMENTATIONS = {
    "optimized": optimized,
    "plain": plain,
    "optimized_options": optimized_options,
    "liger": liger,
}


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
def test_linear_cross_entropy(benchmark, implementation):
    if implementation == "liger" and not liger_installed():
        pytest.skip("Liger-Kernel is not installed, or no GPU to run it")
    run = IMPLEMENTATIONS[implementation]
    above = peak_above_inputs_bytes(run, setup)
    bench(
        benchmark,
        run,
        setup,
        "linear_cross_entropy",
        implementation,
        flops=FLOPS,
        tokens=TOKENS,
        vocab=VOCAB,
        hidden=HIDDEN,
        dtype=DTYPE,
        peak_above_inputs_bytes=above,
        logits_multiple=above / LOGITS_BYTES,
    )
