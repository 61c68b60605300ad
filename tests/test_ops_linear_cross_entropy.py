"""Chunked linear cross-entropy against F.cross_entropy(hidden @ weight.T) and float64, on
`compute_device` (compiled on a GPU, interpreted on the CPU). The peak test counts CPU
storage byte for byte, so it runs on a CPU rank (`tests._ranks.on_cpu_rank`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from optimized.ops import linear_cross_entropy
from optimized.ops.linear_cross_entropy import chunk_plan, default_chunk_vocab
from tests._memtrack import StorageTracker
from tests._ranks import on_cpu_rank

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    assert torch.isfinite(actual).all()
    return ((actual - expected).norm() / expected.norm().clamp(min=1e-30)).item()


def make_case(tokens, hidden_size, vocab, dtype, seed, device, ignored_every=4):
    """Drawn on the CPU (the same values on every device), then moved to ``device``."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=generator).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=generator) * 0.3).to(dtype)
    target = torch.randint(0, vocab, (tokens,), generator=generator)
    if ignored_every:
        target[::ignored_every] = -100
    return hidden.to(device), weight.to(device), target.to(device)


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
@pytest.mark.parametrize("chunk_vocab", [None, 37, 128])
def test_matches_float64_and_plain_op(dtype, reduction, chunk_vocab, compute_device):
    hidden, weight, target = make_case(50, 24, 301, dtype, seed=11, device=compute_device)
    got = fused(hidden, weight, target, reduction, chunk_vocab=chunk_vocab)
    expected = reference(hidden, weight, target, reduction)
    for actual, ref in zip(got, expected):
        assert rel_error(actual, ref) <= TOLERANCE[dtype]
    assert got[1].dtype == dtype and got[2].dtype == dtype
    if dtype == torch.float32:
        plain = reference(hidden, weight, target, reduction, dtype=torch.float32)
        for actual, ref in zip(got, plain):
            assert rel_error(actual, ref) <= 1e-5


def test_bfloat16_gradients_as_precise_as_plain_pytorch_over_many_chunks(compute_device):
    """32 vocabulary chunks: ``grad_hidden`` summed in float32 (the default) is as far from
    float64 as plain PyTorch's single matmul; summed in bfloat16 it drifts (2.2x here)."""
    hidden, weight, target = make_case(
        128, 64, 4096, torch.bfloat16, seed=12, device=compute_device, ignored_every=0
    )
    expected = reference(hidden, weight, target, "sum")
    plain = reference(hidden.clone(), weight.clone(), target, "sum", dtype=torch.bfloat16)
    got = fused(hidden, weight, target, "sum", chunk_vocab=128)
    # the loss: float32 from the bfloat16 logits
    float32_loss = F.cross_entropy((hidden @ weight.t()).float(), target, reduction="sum")
    assert rel_error(got[0], float32_loss) <= 1e-6
    for name, actual, ours_plain, ref in zip(("hidden", "weight"), got[1:], plain[1:],
                                             expected[1:]):  # fmt: skip
        assert actual.dtype == ours_plain.dtype == torch.bfloat16, name
        assert rel_error(actual, ref) <= 1.15 * rel_error(ours_plain, ref), name
    summed_in_bf16 = fused(hidden, weight, target, "sum", chunk_vocab=128,
                           accumulate_dtype=torch.bfloat16)  # fmt: skip
    assert rel_error(summed_in_bf16[1], expected[1]) > 1.5 * rel_error(plain[1], expected[1])


@pytest.mark.gpu
def test_seed_shape_on_cuda_matches_float64(gpu_device):
    """The seed's loss shape (4096 tokens, hidden 2048, 102400 vocabulary) in bfloat16 at the
    default chunks, where CUDA sums ``grad_hidden`` inside the matmul (float32 ``addmm``):
    loss and both gradients within bfloat16's tolerance of float64. The weight is drawn as
    the models initialise theirs (std 0.02), so the logits are of order one."""
    generator = torch.Generator().manual_seed(18)
    hidden = torch.randn(4096, 2048, generator=generator).to(gpu_device, torch.bfloat16)
    weight = torch.randn(102400, 2048, generator=generator) * 0.02
    weight = weight.to(gpu_device, torch.bfloat16)
    target = torch.randint(0, 102400, (4096,), generator=generator)
    target[::7] = -100
    target = target.to(gpu_device)
    got = fused(hidden, weight, target, "mean")
    expected = reference(hidden, weight, target, "mean")
    for name, actual, ref in zip(("loss", "grad hidden", "grad weight"), got, expected):
        assert rel_error(actual, ref) <= TOLERANCE[torch.bfloat16], name


def test_chunk_plan_blocks_fit_in_pass_one_buffer():
    """At the seed's shape: 32 chunks of 3200 columns, three token blocks, and the block's
    logits plus its float32 accumulator inside the one ``[tokens, chunk]`` buffer."""
    plan = chunk_plan(4096, 102400, 2048, default_chunk_vocab(102400, 2048), 2, 4)
    assert plan.chunk_vocab == 3200 and plan.block_tokens == 1366
    assert plan.buffer_elements == 4096 * 3200  # 1/32 of the logits
    assert plan.accumulator_offset >= plan.block_tokens * plan.chunk_vocab
    assert plan.accumulator_offset % 8 == 0  # 16-byte aligned in bf16
    end = plan.accumulator_offset + plan.block_tokens * 2048 * 2
    assert end <= plan.buffer_elements
    # float32 inputs sum in grad_hidden itself: one block, no accumulator
    plan32 = chunk_plan(4096, 102400, 2048, 3200, 4, 0)
    assert (plan32.block_tokens, plan32.accumulator_offset) == (4096, 0)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_ignored_gives_zero_loss_and_zero_gradients(reduction, compute_device):
    hidden, weight, target = make_case(
        20, 8, 50, torch.float32, seed=13, device=compute_device, ignored_every=None
    )
    target[:] = -100
    loss, grad_hidden, grad_weight = fused(hidden, weight, target, reduction, chunk_vocab=16)
    assert loss.item() == 0.0
    assert torch.equal(grad_hidden, torch.zeros_like(grad_hidden))
    assert torch.equal(grad_weight, torch.zeros_like(grad_weight))


def test_leading_dimensions_and_incoming_gradient(compute_device):
    hidden, weight, target = make_case(24, 8, 40, torch.float32, seed=14, device=compute_device)
    h = hidden.view(4, 6, 8).clone().requires_grad_()
    w = weight.clone().requires_grad_()
    (3.0 * linear_cross_entropy(h, w, target.view(4, 6), chunk_vocab=5)).backward()
    _, grad_hidden, grad_weight = reference(hidden, weight, target, "mean")
    assert rel_error(h.grad.view(24, 8), 3.0 * grad_hidden) <= 1e-5
    assert rel_error(w.grad, 3.0 * grad_weight) <= 1e-5


def test_only_weight_requires_grad(compute_device):
    hidden, weight, target = make_case(16, 8, 40, torch.float32, seed=15, device=compute_device)
    w = weight.clone().requires_grad_()
    linear_cross_entropy(hidden, w, target, chunk_vocab=5).backward()
    assert rel_error(w.grad, reference(hidden, weight, target, "mean")[2]) <= 1e-5


def test_default_chunk_is_a_32nd_of_the_vocabulary_or_the_hidden_size():
    assert default_chunk_vocab(102400, 2048) == 3200  # 102400 / 32
    assert default_chunk_vocab(151936, 2048) == 4864  # 4748 rounded up to 128s
    assert default_chunk_vocab(32000, 2048) == 2048  # the hidden size is wider
    assert default_chunk_vocab(3200, 64) == 1024  # at least 1024 columns
    assert default_chunk_vocab(512, 64) == 512  # never wider than the vocabulary


PEAK_TOKENS, PEAK_HIDDEN, PEAK_VOCAB = 16, 128, 32768
"""A default chunk of 1024 columns is 1/32 of the vocabulary; in bfloat16 the float32
accumulator of a token block (8 x 128 x 4 bytes) shares that chunk's buffer over two
blocks, and would exceed the bound's 24 bytes a token if it were allocated apart. (The
seed's vocabulary-to-hidden ratio, hidden 655, gave the same figures at five times the
emulated bfloat16 matmul time; three blocks are `test_matches_float64_and_plain_op`'s.)"""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peak_above_inputs_is_at_most_a_20th_of_the_logits(dtype):
    """Measured by storage: what the op holds beyond hidden, weight and their gradients,
    forward and backward, is one chunk of logits (1/32 of them; the bfloat16 run's float32
    ``grad_hidden`` accumulator lives inside that chunk's buffer), under the issue's 0.05x.
    The losses and statistics add 24 bytes a token. Counted on CPU storage: a CPU rank."""
    on_cpu_rank(_check_peak_above_inputs, dtype)


def _check_peak_above_inputs(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(17)
    hidden = torch.randn(PEAK_TOKENS, PEAK_HIDDEN, generator=generator).to(dtype)
    weight = (torch.randn(PEAK_VOCAB, PEAK_HIDDEN, generator=generator) * 0.05).to(dtype)
    target = torch.randint(0, PEAK_VOCAB, (PEAK_TOKENS,), generator=generator)
    hidden.requires_grad_()
    weight.requires_grad_()
    with StorageTracker() as tracker:
        linear_cross_entropy(hidden, weight, target).backward()
    beyond = tracker.peak - hidden.grad.nbytes - weight.grad.nbytes
    logits = PEAK_TOKENS * PEAK_VOCAB * hidden.element_size()
    assert beyond / logits <= 0.05
    chunk = PEAK_TOKENS * default_chunk_vocab(PEAK_VOCAB, PEAK_HIDDEN) * hidden.element_size()
    assert beyond <= chunk + 24 * PEAK_TOKENS + 64
    assert rel_error(hidden.grad, reference(hidden.detach(), weight.detach(), target,
                                            "mean")[1]) <= TOLERANCE[dtype]  # fmt: skip


def test_bad_input_names_the_problem(compute_device):
    hidden, weight, target = make_case(4, 8, 10, torch.float32, seed=16, device=compute_device)
    with pytest.raises(ValueError, match="weight must be"):
        linear_cross_entropy(hidden, weight.t(), target)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(hidden, weight, target, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing=-0.1 is invalid"):
        linear_cross_entropy(hidden, weight, target, label_smoothing=-0.1)
