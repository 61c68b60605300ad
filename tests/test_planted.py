"""Planted bugs fail the bfloat16 verdict; the same stack without them passes.

Each bug (`harness.compare.planted`) is small: nothing crashes and the loss hardly moves. Tiny
presets, bfloat16, lockstep with the float32 noise floor; one launch per model runs the
correct stack and every bug that applies (the bugs are planted and removed in the ranks).
At real widths: the `twinpipe compare --plant` commands of docs/compare.md.

The routing controls' bugs (`harness.compare.planted_balancing`) leave the loss alone; they
fail float32 on what the verdict judges of the controls (the balancing losses' gradients,
the load, the expert biases), in one launch of their own.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness.compare.planted import round_toward_zero
from models.network import preset
from models.runtime import ParallelConfig
from tests._compare import planted_reports
from tests._nonfinite import NONFINITE

PARALLEL = ParallelConfig(
    pp=2, dp=1, ep=1, micro_batches=4, micro_batch_size=1, seq_len=32, dtype="bfloat16"
)
"""Sequences of 32 tokens: longer than tiny GPT-OSS's sliding window (16)."""
WIDE = dataclasses.replace(PARALLEL, micro_batch_size=8)
"""1024 tokens a step: a rounding bias of 2e-3 stands out of the noise (``rel / sqrt(tokens)``
is 2.7e-4 here, 7.7e-4 at 128 tokens)."""

RUNS = {
    "tiny-gpt-oss": (
        "tiny-gpt-oss",
        PARALLEL,
        (
            "attention-drops-sink",
            "attention-drops-window",
            "attention-frozen-sink",
            "dispatch-wrong-expert",
        ),
    ),
    "tiny-qwen3-moe": (
        "tiny-qwen3-moe",
        PARALLEL,
        ("cross-entropy-grad-1.01", "dispatch-wrong-expert", "nan-to-zero-store"),
    ),
    "tiny-gpt-oss, 1024 tokens": ("tiny-gpt-oss", WIDE, ("activation-round-to-zero",)),
}
"""One launch per run: the correct stack and each bug, planted and removed in the ranks."""


_REPORTS: dict = {}


def _reports(run: str) -> dict:
    if run not in _REPORTS:
        name, parallel, plants = RUNS[run]
        _REPORTS[run] = planted_reports(preset(name), parallel, plants, name, noise_floor=True)
    return _REPORTS[run]


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", list(RUNS))
def test_the_correct_stack_passes(run):
    report = _reports(run)[None]
    assert report["passed"], report["problems"]
    assert report["noise_floor"]["steps"][0]["passed"]
    assert report["ops_audit"]["passed"], report["ops_audit"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("run", "plant"),
    [(run, plant) for run, (_, _, plants) in RUNS.items() for plant in plants],
)
def test_a_planted_bug_fails(run, plant):
    report = _reports(run)[plant]
    assert not report["passed"]
    assert report["config"]["plant"] == plant
    # The noise floor names what is wrong (the fixed backstop alone misses the subtle ones).
    floor = report["noise_floor"]["steps"][0]
    assert not floor["passed"], floor["problems"]
    # The ops audit (`harness.compare.ops_audit`) names the op too, for every bug that lives in one:
    # the fused loss is not an op of `models.network.Ops`, its gradient bug only the step shows.
    audit = report["ops_audit"]
    if plant == "cross-entropy-grad-1.01":
        assert audit["passed"]
    elif plant == "nan-to-zero-store":
        # The reference's NaN against the planted stack's finite loss, and the op that lost it.
        assert "step 0: loss not finite (baseline nan; the other side finite)" in report["problems"]
        assert audit["ops"]["silu_and_mul"]["failed"] > 0, audit
        assert any("NaN or infinity lost" in p for p in report["problems"]), report["problems"]
    elif plant == "attention-frozen-sink":
        # The audit checks each op's forward; the sinks' missing gradient is the step's to see,
        # and it names them: their gradient is zero, 1 - cos = 1, at any width.
        assert audit["passed"]
        assert any("sinks" in problem for problem in floor["problems"]), floor["problems"]
    else:
        op = {"activation": "clamped_swiglu", "attention": "attention"}.get(
            plant.split("-")[0], "to_expert_order"
        )
        assert audit["ops"][op]["failed"] > 0, audit


DOWN = "model.layers.*.mlp.experts.down_proj"


@pytest.mark.multiprocess
def test_an_activation_rounded_toward_zero_fails_on_the_down_projection():
    """The bias of an activation rounded toward zero (-2^-9 relative, on average) reaches
    the down projection's gradient coherently: about -2.5e-3 off its stack's scale, where
    the reference's is within 5e-4 of its own. By size it would hide under the loss's
    scale error (`harness.compare.noise_floor`); relative to its stack it fails, by name."""
    reports = _reports("tiny-gpt-oss, 1024 tokens")
    floor = reports["activation-round-to-zero"]["noise_floor"]["steps"][0]
    down = next(g for g in floor["groups"] if g["group"] == DOWN)
    assert not down["passed"]
    assert down["radial_candidate"] - down["radial_scale_candidate"] < -1.5e-3
    assert any(DOWN in problem for problem in floor["problems"])
    right = reports[None]["noise_floor"]["steps"][0]
    correct = next(g for g in right["groups"] if g["group"] == DOWN)
    assert correct["passed"]
    assert abs(correct["radial_candidate"] - correct["radial_scale_candidate"]) < 1e-3


@pytest.mark.multiprocess
def test_a_scaled_cross_entropy_gradient_fails_in_float32():
    """float32 judges each gradient's relative L2 error as well as its direction: a
    gradient scaled as a whole keeps 1 - cos at rounding level."""
    model = preset("tiny-qwen3-moe")
    parallel = dataclasses.replace(PARALLEL, dtype="float32")
    reports = planted_reports(model, parallel, ("cross-entropy-grad-1.01",))
    right, planted = reports[None], reports["cross-entropy-grad-1.01"]
    assert right["passed"], right["problems"]
    assert not planted["passed"]
    assert max(planted["grads"]["max_one_minus_cos"]) <= planted["tolerance"]["grad_one_minus_cos"]
    assert any("relative error" in problem for problem in planted["problems"])


def test_the_truncating_plant_keeps_nan_and_infinity():
    """The planted truncation drops the low 16 bits; a NaN whose payload lies there would
    come out infinite, so NaN is kept as NaN: the plant rounds, it does not invent values."""
    cut = round_toward_zero(NONFINITE)
    assert torch.equal(cut.isnan(), NONFINITE.isnan())
    assert torch.equal(cut.isinf(), NONFINITE.isinf())
    assert cut[-2] == float("inf") and cut[-1] == float("-inf")
    assert round_toward_zero(torch.tensor([1.0 + 2**-8 + 2**-9])) == 1.0 + 2**-8


# ---------------------------------------------------------------- the routing controls' bugs
BALANCING_MODEL = dataclasses.replace(
    preset("tiny-deepseek-v2"), aux_loss="sequence", aux_loss_coef=0.1, expert_bias=True
)
"""Both controls a balancing plant breaks: DeepSeek's sequence loss, at a coefficient (0.1)
at which its gradient is a large share of the router gates', so a scaled one stands far out
of float32's gradient bound, and the expert bias. Its first layer is dense, so at PP 2 rank
0's first chunk holds no MoE layer."""
BALANCING_LAYOUT = ParallelConfig(
    pp=2, dp=2, ep=2, micro_batches=4, micro_batch_size=2, seq_len=128, dtype="float32"
)
"""`twinpipe compare`'s default layout with sequences of 128 tokens: 512 copies per expert
and step on average (bfloat16 holds integers exactly to 256), over two DP ranks."""
CAUGHT_BY = {
    "bias-every-micro-batch": "expert bias of layer",
    "bias-counts-not-summed-over-dp": "expert load differs",
    "bias-counts-bf16": "expert load differs",
    "aux-grad-scaled-by-1/M-twice": "mlp.gate.weight relative error",
    "aux-grad-scaled-by-dp": "mlp.gate.weight relative error",
    "bias-skipped-on-stage-without-moe": "expert bias of layer 3",
    "forward-only-updates-bias": "the forward-only pass moved the candidate's expert bias",
}
"""What names each bug in the verdict's problems; its keys are the bugs this test expects
`harness.compare.planted_balancing` to plant (checked against its list below)."""
BALANCING_PLANTS = tuple(CAUGHT_BY)

_BALANCING_REPORTS: dict = {}


def _balancing_reports() -> dict:
    """One launch: the correct stack, then each plant, one step each."""
    if not _BALANCING_REPORTS:
        _BALANCING_REPORTS.update(
            planted_reports(BALANCING_MODEL, BALANCING_LAYOUT, BALANCING_PLANTS, "tiny-deepseek-v2")
        )
    return _BALANCING_REPORTS


def test_every_balancing_plant_is_listed_and_shows_at_the_test_s_settings():
    from harness.compare import planted_balancing
    from harness.compare.planted import PLANTS
    from harness.compare.planted_balancing import plant_problem

    assert set(BALANCING_PLANTS) <= set(PLANTS)
    assert set(BALANCING_PLANTS) == set(planted_balancing.BALANCING_PLANTS)
    for plant in BALANCING_PLANTS:
        assert plant_problem(plant, BALANCING_MODEL, BALANCING_LAYOUT, None) is None, plant


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_correct_stack_passes_with_the_routing_controls_on():
    report = _balancing_reports()[None]
    assert report["passed"], report["problems"]
    assert report["balancing"]["judged"]["bias"]
    assert min(min(row) for row in report["balancing"]["load"]["baseline"][0]) > 256


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("plant", BALANCING_PLANTS)
def test_a_planted_balancing_bug_fails(plant):
    report = _balancing_reports()[plant]
    assert not report["passed"]
    assert report["config"]["plant"] == plant
    assert any(CAUGHT_BY[plant] in problem for problem in report["problems"]), report["problems"]
    # Each leaves the loss where it was: only the controls' figures show it.
    assert report["loss"]["rel_error"][0] <= report["tolerance"]["loss_rel"]
