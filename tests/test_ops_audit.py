"""The ops audit (`harness.compare.ops_audit`) at real widths: the optimized ops pass, the planted
bugs that pass the step verdict at mid width (an activation stored toward zero, one token
computed by the wrong expert) fail it, by name and by the figure that gives them away.

Shapes are mid-qwen3-moe's (hidden 2048, expert width 768, 128-dim heads, 32 query heads
over 4 key/value heads) with a few hundred rows, so the op runs as at real width. The planted
bugs need no such width: what gives them away is per row (the wrong expert's row) or per
activation element (the bias, over 256 x 768 of them), so they run with hidden 256 (an
eighth of the grouped products' work; each still fails at it, as its test asserts). The ops
run on `compute_device` (compiled on a GPU, interpreted on the CPU), from inputs drawn on
the CPU."""

from __future__ import annotations

import math

import pytest
import torch

from harness.compare.op_checks import error_stats, nonfinite_problem
from harness.compare.ops_audit import OpsAudit
from harness.compare.planted import planted
from harness.compare.record import StepRecord
from optimized.ops import OptimizedOps

HIDDEN, INNER, ROWS = 2048, 768, 256
PLANT_HIDDEN = 256
"""The planted bugs' hidden size (their figures do not depend on it)."""


def _audited(plant: str | None, calls) -> list[dict]:
    """The audit's rows for ``calls(ops)`` on OptimizedOps, with ``plant`` in place."""
    with planted(plant):
        audit = OpsAudit(OptimizedOps)
        record = StepRecord()
        with audit.installed():
            audit.start_step()
            with audit.region("candidate", "forward-backward", 0):
                calls(OptimizedOps())
            audit.end_step(record)
        return record.ops_audit


def _moe(ops, device: torch.device, hidden: int = HIDDEN) -> None:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(ROWS, hidden, generator=g).to(device, torch.bfloat16)
    expert_ids = torch.randint(0, 4, (ROWS,), generator=g).to(device)
    grouped, layout = ops.to_expert_order(tokens, expert_ids, 4)
    weight = torch.randn(4, hidden, 2 * INNER, generator=g) / math.sqrt(hidden)
    h = ops.grouped_linear(grouped, weight.to(device, torch.bfloat16), layout.offsets)
    a = ops.silu_and_mul(h)
    ops.from_expert_order(a, layout)
    ops.gather_rows(tokens, torch.randint(0, ROWS, (2 * ROWS,), generator=g).to(device))


def _attention(ops, device: torch.device) -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 32, 128, 128, generator=g).to(device, torch.bfloat16)
    k = torch.randn(1, 4, 128, 128, generator=g).to(device, torch.bfloat16)
    v = torch.randn(1, 4, 128, 128, generator=g).to(device, torch.bfloat16)
    ops.attention(q, k, v, 128**-0.5)


def _by_op(rows: list[dict]) -> dict[str, dict]:
    return {row["op"]: row for row in rows}


@pytest.mark.slow
def test_the_optimized_ops_pass_at_real_width(compute_device):
    rows = _audited(None, lambda ops: (_moe(ops, compute_device), _attention(ops, compute_device)))
    ops = _by_op(rows)
    assert set(ops) == {
        "to_expert_order", "grouped_linear", "silu_and_mul", "from_expert_order",
        "gather_rows", "attention",
    }  # fmt: skip
    for row in rows:
        assert row["passed"], row
    # Rounded to nearest: no bias beyond the sampling noise of N elements.
    assert abs(ops["silu_and_mul"]["bias"]) < 6 / math.sqrt(ops["silu_and_mul"]["elements"])


@pytest.mark.slow
def test_an_activation_stored_toward_zero_fails_by_its_bias(compute_device):
    moe = lambda ops: _moe(ops, compute_device, PLANT_HIDDEN)  # noqa: E731
    ops = _by_op(_audited("activation-round-to-zero", moe))
    row = ops["silu_and_mul"]
    assert not row["passed"]
    assert "biased" in row["problem"]
    assert row["bias"] == pytest.approx(-math.sqrt(3) / 2, abs=0.03)
    assert ops["grouped_linear"]["passed"]


@pytest.mark.slow
def test_one_token_sent_to_the_wrong_expert_fails_exactly(compute_device):
    moe = lambda ops: _moe(ops, compute_device, PLANT_HIDDEN)  # noqa: E731
    ops = _by_op(_audited("dispatch-wrong-expert", moe))
    row = ops["to_expert_order"]
    assert not row["passed"]
    assert row["problem"].startswith(f"1 of {ROWS} rows in another expert's group")


@pytest.mark.parametrize("plant", ["attention-drops-sink", "attention-drops-window"])
def test_attention_that_drops_the_sink_or_the_window_fails(plant, compute_device):
    g = torch.Generator().manual_seed(2)

    def call(ops):
        q = torch.randn(1, 8, 64, 64, generator=g).to(compute_device, torch.bfloat16)
        k = torch.randn(1, 1, 64, 64, generator=g).to(compute_device, torch.bfloat16)
        v = torch.randn(1, 1, 64, 64, generator=g).to(compute_device, torch.bfloat16)
        sinks = torch.randn(8, generator=g).to(compute_device, torch.bfloat16)
        ops.attention(q, k, v, 0.125, 16, sinks)

    row = _by_op(_audited(plant, call))["attention"]
    assert not row["passed"]
    assert row["rel_error"] > 50 * row["reference_rel_error"]


def test_float32_runs_and_inactive_steps_are_not_audited(compute_device):
    x = torch.randn(8, 2 * INNER, device=compute_device)
    assert _audited(None, lambda ops: ops.silu_and_mul(x)) == []
    audit = OpsAudit(OptimizedOps)
    record = StepRecord()
    with audit.installed():
        audit.start_step()
        with audit.region("baseline", "forward-backward", 0):  # not the candidate's turn
            OptimizedOps().silu_and_mul(x.to(torch.bfloat16))
        audit.end_step(record)
    assert record.ops_audit == []
    assert OptimizedOps.silu_and_mul is not None and not hasattr(
        OptimizedOps.silu_and_mul, "__wrapped__"
    )


def test_the_bias_statistic():
    """Rounding toward zero gives -sqrt(3)/2 whatever the magnitudes; to nearest, about 0."""
    g = torch.Generator().manual_seed(3)
    truth = torch.randn(100_000, generator=g) * torch.exp(4 * torch.randn(100_000, generator=g))
    nearest = truth.to(torch.bfloat16).float()
    bits = truth.view(torch.int32) & -65536
    toward_zero = bits.view(torch.float32)
    assert abs(error_stats(nearest, truth)[1]) < 0.02
    assert error_stats(toward_zero, truth)[1] == pytest.approx(-math.sqrt(3) / 2, abs=0.01)


def test_an_activation_that_zeroes_a_nan_fails(compute_device):
    """``nan-to-zero-store``: a NaN is born in the activation's input on both sides and the
    planted store writes it as zero. The candidate's output is finite where the float32 truth
    is NaN: lost, whatever its error on the other elements."""
    x = torch.randn(64, 2 * INNER, generator=torch.Generator().manual_seed(3))
    x = x.to(compute_device, torch.bfloat16)
    row = _by_op(_audited("nan-to-zero-store", lambda ops: ops.silu_and_mul(x)))["silu_and_mul"]
    assert not row["passed"]
    assert row["problem"].startswith("finite output where the float32 truth is NaN"), row


def test_nonfinite_elements_are_judged_by_place():
    """Non-finite where the truth is finite (made) or finite where it is not (lost) fails;
    the same non-finite places on both sides leave the finite elements to be judged."""
    truth = torch.tensor([1.0, float("nan"), float("inf"), 2.0])
    assert nonfinite_problem(truth.clone(), truth) is None
    lost = torch.tensor([1.0, 0.0, float("inf"), 2.0])
    assert "1 elements: a NaN or infinity lost" in nonfinite_problem(lost, truth)
    made = torch.tensor([1.0, float("nan"), float("inf"), float("nan")])
    assert nonfinite_problem(made, truth).startswith("non-finite output where the float32 truth")
