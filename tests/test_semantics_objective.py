"""The training objective held to plain torch in float64, on logits that exercise it.

Label smoothing subtracts ``eps * mean(logits)`` per row: on logits drawn with mean zero
that term is about zero whatever its normalisation, so a mean over ``V + 1`` columns
instead of ``V`` passed every earlier test (issue 33). Here every row has its own offset
(means from -20 to +25) and its own scale (0.1 to 10), so the mean, the log-sum-exp and
the z-loss ``s * lse**2`` are all far from their zero-mean values, and each
implementation the trainer can use is held to `F.cross_entropy(label_smoothing=...)` and
the z-loss formula in float64: the fused cross-entropy, the fused linear cross-entropy,
the trainer's summed output-layer loss (`SummedLinearCrossEntropy`), and both stacks'
plain ``Ops.cross_entropy``.

Rows are compared one by one (a mean over rows could hide a per-row error), and so are
the gradient's row sums: the smoothed target sums to 1, so without z-loss each row of
``d loss / d logits`` sums to 0 and with it to ``2 s lse``; a uniform term of ``eps / (V
+ 1)`` leaves ``eps / (V + 1)`` in every row.

The losses run on `compute_device` (compiled on a GPU, interpreted on the CPU), from
inputs drawn on the CPU; the float64 truth runs on the same device.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.network import IGNORE_INDEX
from optimized.ops import OptimizedOps, cross_entropy, linear_cross_entropy
from optimized.pipeline.dualpipev import SummedLinearCrossEntropy
from reference.ops import ReferenceOps

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
CASES = [(0.1, 0.0), (0.0, 1e-3), (0.3, 1e-4)]
"""``(label_smoothing, z-loss weight)``: each alone, then both."""
VOCAB = 1003
"""Not a power of two: the kernel's last vocabulary block is partly masked."""


def shifted_logits(
    tokens: int, vocab: int, seed: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[tokens, vocab]`` float32 logits whose rows have means spread over [-20, 25] and
    scales over [0.1, 10]; targets with every fifth row ignored (on ``device``)."""
    generator = torch.Generator().manual_seed(seed)
    means = torch.linspace(-20.0, 25.0, tokens)[torch.randperm(tokens, generator=generator)]
    scales = torch.logspace(-1, 1, tokens)[torch.randperm(tokens, generator=generator)]
    noise = torch.randn(tokens, vocab, generator=generator)
    logits = means[:, None] + scales[:, None] * noise
    target = torch.randint(0, vocab, (tokens,), generator=generator)
    target[::5] = IGNORE_INDEX
    return logits.to(device), target.to(device)


def float64_rows(logits: torch.Tensor, target: torch.Tensor, eps: float, s: float):
    """Per-row ``(loss, z-loss)`` in float64: `F.cross_entropy`'s smoothing plus
    ``s * logsumexp**2`` (0 on ignored rows)."""
    logits = logits.double()
    rows = F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="none",
                           label_smoothing=eps)  # fmt: skip
    z_loss = s * torch.logsumexp(logits, dim=-1).square() * (target != IGNORE_INDEX)
    return rows + z_loss, z_loss


def assert_rows_close(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    """Each row within ``rel`` of its float64 value (relative to the row's magnitude)."""
    actual = actual.double()
    assert torch.isfinite(actual).all()
    error = (actual - expected).abs()
    bound = rel * expected.abs().clamp(min=1.0)
    worst = int((error / bound).argmax())
    assert bool((error <= bound).all()), (
        f"row {worst}: {actual[worst].item()!r} vs float64 {expected[worst].item()!r}"
    )


def assert_gradient_rows(grad: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    """Each row of ``d loss / d logits`` within ``rel`` of float64 (L2), and its sum within
    ``rel`` of the float64 row sum (0 without z-loss)."""
    grad, expected = grad.double(), expected.double()
    row_error = (grad - expected).norm(dim=1) / expected.norm(dim=1).clamp(min=1e-30)
    valid = expected.abs().sum(dim=1) > 0
    assert bool((row_error[valid] <= rel).all()), f"worst row error {row_error.max().item():.3e}"
    assert torch.equal(grad[~valid], torch.zeros_like(grad[~valid]))  # ignored rows
    sums, expected_sums = grad.sum(dim=1), expected.sum(dim=1)
    bound = rel * expected.abs().sum(dim=1)  # the row's scale: the sum of |gradient|
    worst = int(((sums - expected_sums).abs() - bound).argmax())
    assert bool(((sums - expected_sums).abs() <= bound).all()), (
        f"row {worst} of the gradient sums to {sums[worst].item():.3e}, float64 "
        f"{expected_sums[worst].item():.3e}"
    )


def test_the_logits_exercise_the_smoothing_term():
    """The inputs are what makes the test able to fail: ``eps * mean`` over ``V`` and
    over ``V + 1`` columns differ by more than the tolerance in most rows, and by more
    than ten times it in some."""
    logits, target = shifted_logits(40, VOCAB, seed=1)
    right, _ = float64_rows(logits, target, 0.1, 0.0)
    means = logits.double().mean(dim=1)
    wrong = right + 0.1 * means - 0.1 * means * VOCAB / (VOCAB + 1)
    valid = target != IGNORE_INDEX
    shift = ((wrong - right).abs() / right.abs())[valid]
    assert float((shift > TOLERANCE[torch.float32]).float().mean()) > 0.75
    assert float(shift.max()) > 10 * TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("eps", "s"), CASES)
def test_fused_cross_entropy_rows_match_float64(dtype, eps, s, compute_device):
    logits, target = shifted_logits(40, VOCAB, seed=2, device=compute_device)
    logits = logits.to(dtype)
    leaf = logits.clone().requires_grad_()
    loss, z_loss = cross_entropy(leaf * 1, target, reduction="none", label_smoothing=eps,
                                 lse_square_scale=s, return_z_loss=True)  # fmt: skip
    upstream = torch.ones_like(loss)
    loss.backward(upstream)
    reference = logits.double().requires_grad_()
    expected, expected_z = float64_rows(reference, target, eps, s)
    expected.sum().backward()
    # bf16 logits are exact in float64: only the kernel's float32 arithmetic differs, so
    # float32's bound holds for the loss; the gradient is stored in bf16.
    assert_rows_close(loss, expected.detach(), TOLERANCE[torch.float32])
    assert_rows_close(z_loss, expected_z.detach(), TOLERANCE[torch.float32])
    assert_gradient_rows(leaf.grad, reference.grad, TOLERANCE[dtype])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fused_cross_entropy_reductions_match_float64(reduction, compute_device):
    """``mean`` divides by the non-ignored rows only; ``sum`` adds them (both options)."""
    eps, s = CASES[-1]
    logits, target = shifted_logits(40, VOCAB, seed=3, device=compute_device)
    leaf = logits.clone().requires_grad_()
    loss, z_loss = cross_entropy(leaf * 1, target, reduction=reduction, label_smoothing=eps,
                                 lse_square_scale=s, return_z_loss=True)  # fmt: skip
    loss.backward()
    reference = logits.double().requires_grad_()
    rows, z_rows = float64_rows(reference, target, eps, s)
    count = int((target != IGNORE_INDEX).sum())
    divide = count if reduction == "mean" else 1
    expected = rows.sum() / divide
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-6 * abs(expected.item())
    assert abs(z_loss.item() - z_rows.sum().item() / divide) <= 1e-5 * abs(z_loss.item()) + 1e-12
    assert_gradient_rows(leaf.grad, reference.grad, TOLERANCE[torch.float32])


def offset_output_layer(
    tokens: int, hidden: int, vocab: int, seed: int, dtype: torch.dtype, device: torch.device
):
    """Hidden states, an output weight whose rows share a component (so every token's
    logits have a mean of its own, -10 to 25: they do not cancel in a sum), and targets
    with ignored rows (drawn on the CPU, returned on ``device``)."""
    generator = torch.Generator().manual_seed(seed)
    states = torch.randn(tokens, hidden, generator=generator)
    shared = torch.randn(hidden, generator=generator)
    states = states * torch.logspace(-1, 0.5, tokens)[:, None]  # a spread of logit scales
    shared = shared / shared.norm()
    states += torch.linspace(-10, 25, tokens)[:, None] * shared  # the per-token means
    weight = torch.randn(vocab, hidden, generator=generator) * 0.5 + shared
    target = torch.randint(0, vocab, (tokens,), generator=generator)
    target[1::4] = IGNORE_INDEX
    return states.to(device, dtype), weight.to(device, dtype), target.to(device)


@pytest.mark.parametrize(
    ("dtype", "eps", "s"),
    [(torch.float32, *case) for case in CASES] + [(torch.bfloat16, *CASES[-1])],
)
def test_linear_cross_entropy_rows_match_float64(dtype, eps, s, compute_device):
    """The fused output layer, 300 vocabulary columns at a time (four chunks, the last one
    ragged: the log-sum-exp, the smoothing sum and the z-loss are carried across chunks, and
    the backward recomputes each chunk)."""
    states, weight, target = offset_output_layer(33, 24, VOCAB, 4, dtype, compute_device)
    logits = states.double() @ weight.double().t()
    assert logits.mean(dim=1).abs().max() > 10  # what the smoothing term needs
    h, w = states.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, z_loss = linear_cross_entropy(h, w, target, reduction="none", chunk_vocab=300,
                                        label_smoothing=eps, lse_square_scale=s,
                                        return_z_loss=True)  # fmt: skip
    loss.sum().backward()
    h64, w64 = states.double().requires_grad_(), weight.double().requires_grad_()
    expected, expected_z = float64_rows(h64 @ w64.t(), target, eps, s)
    expected.sum().backward()
    rel = TOLERANCE[dtype] if dtype == torch.bfloat16 else 1e-5
    assert_rows_close(loss, expected.detach(), rel)
    assert_rows_close(z_loss, expected_z.detach(), rel)
    for grad, truth in ((h.grad, h64.grad), (w.grad, w64.grad)):
        error = (grad.double() - truth).norm() / truth.norm()
        assert error <= TOLERANCE[dtype], float(error)


@pytest.mark.parametrize(("eps", "s"), CASES)
def test_the_trainer_s_output_layer_loss_matches_float64(eps, s, compute_device):
    """`SummedLinearCrossEntropy`, what the optimized stack's loss stage calls with the
    trainer's ``loss.label_smoothing`` and ``loss.z_loss``: the sum over tokens (the
    schedule divides by the global batch's labelled tokens) and the z-loss part."""
    states, weight, target = offset_output_layer(40, 24, VOCAB, 5, torch.float32, compute_device)
    h, w = states.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, z_loss = SummedLinearCrossEntropy(eps, s)(h, w, target)
    loss.backward()
    h64, w64 = states.double().requires_grad_(), weight.double().requires_grad_()
    rows, z_rows = float64_rows(h64 @ w64.t(), target, eps, s)
    rows.sum().backward()
    assert abs(loss.item() - rows.sum().item()) <= 1e-6 * abs(rows.sum().item())
    assert abs(z_loss.item() - z_rows.sum().item()) <= 1e-5 * abs(z_rows.sum().item()) + 1e-12
    assert not z_loss.requires_grad
    for grad, truth in ((h.grad, h64.grad), (w.grad, w64.grad)):
        assert (grad.double() - truth).norm() / truth.norm() <= 1e-5


@pytest.mark.parametrize("ops", [ReferenceOps(), OptimizedOps()], ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_stack_s_plain_loss_matches_float64(ops, dtype, compute_device):
    """``Ops.cross_entropy`` of both stacks (the summed token loss both schedules divide
    by the labelled-token count) on the shifted logits, with ignored rows."""
    logits, target = shifted_logits(40, VOCAB, seed=6, device=compute_device)
    logits = logits.to(dtype)
    leaf = logits.clone().requires_grad_()
    loss = ops.cross_entropy(leaf * 1, target, ignore_index=IGNORE_INDEX, reduction="sum")
    loss.backward()
    reference = logits.double().requires_grad_()
    expected, _ = float64_rows(reference, target, 0.0, 0.0)
    expected.sum().backward()
    assert loss.dtype == torch.float32
    assert abs(loss.item() - expected.sum().item()) <= 1e-5 * abs(expected.sum().item())
    assert_gradient_rows(leaf.grad, reference.grad, TOLERANCE[dtype])
