"""Fused cross-entropy vs F.cross_entropy on the LM-head path (logits from a matmul), and vs
Liger-Kernel's cross-entropy where it is installed (on CUDA).

Each records, beside the time, ``peak_above_inputs_bytes`` (the peak beyond hidden,
weight, target and their gradients) and ``logits_multiple``: that peak in units of one
``[tokens, vocab]`` logits buffer (the fused loss: 1.00x, it writes the gradient over it).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks._common import DEVICE, bench, liger_installed, peak_above_inputs_bytes, pick
from optimized.ops import cross_entropy

TOKENS, VOCAB, HIDDEN = pick(gpu=(4096, 102400, 2048), cpu=(64, 4096, 64))
DTYPE = torch.bfloat16
LOGITS_BYTES = TOKENS * VOCAB * DTYPE.itemsize
FLOPS = 3 * 2 * TOKENS * VOCAB * HIDDEN
"""The LM-head matmul, forward and both gradients (the loss itself is memory-bound)."""


def setup():
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator, device=DEVICE, dtype=DTYPE)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator, device=DEVICE, dtype=DTYPE)
    weight = (weight * HIDDEN**-0.5).requires_grad_()
    target = torch.randint(0, VOCAB, (TOKENS,), generator=generator, device=DEVICE)
    return (hidden.requires_grad_(), weight, target), {}


def liger(logits, target):
    from liger_kernel.transformers import LigerCrossEntropyLoss  # noqa: PLC0415

    return LigerCrossEntropyLoss()(logits, target)


IMPLEMENTATIONS = {
    "optimized": cross_entropy,
    "plain": F.cross_entropy,
    "plain_float32": lambda logits, target: F.cross_entropy(logits.float(), target),
    # reduction="none" (a per-token upstream gradient), label smoothing and z-loss on
    "optimized_options": lambda logits, target: cross_entropy(
        logits, target, reduction="none", label_smoothing=0.1, lse_square_scale=1e-4
    ).mean(),
    "plain_options": lambda logits, target: (
        F.cross_entropy(logits, target, reduction="none", label_smoothing=0.1)
        + 1e-4 * torch.logsumexp(logits.float(), dim=-1).square()
    ).mean(),
    "liger": liger,
}


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
def test_cross_entropy(benchmark, implementation):
    if implementation == "liger" and not liger_installed():
        pytest.skip("Liger-Kernel is not installed, or no GPU to run it")
    loss_fn = IMPLEMENTATIONS[implementation]

    def run(hidden, weight, target):
        logits = hidden @ weight.t()
        loss_fn(logits, target).backward()

    above = peak_above_inputs_bytes(run, setup)
    bench(
        benchmark,
        run,
        setup,
        "cross_entropy",
        implementation,
        flops=FLOPS,
        tokens=TOKENS,
        vocab=VOCAB,
        hidden=HIDDEN,
        dtype=DTYPE,
        peak_above_inputs_bytes=above,
        logits_multiple=above / LOGITS_BYTES,
    )
