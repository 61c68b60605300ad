"""Every planted bug of `twinpipe compare --plant` fails the verdict; the same stack without
it passes.

Each bug (`harness.compare.planted`) is small: nothing crashes and the loss hardly moves. Tiny
presets, bfloat16, lockstep with the float32 noise floor; one launch per run (`RUNS`) runs
the correct stack and every bug the table (`PLANTED`) gives it (the bugs are planted and
removed in the ranks). At real widths: the `twinpipe compare --plant` commands of
docs/compare.md.

The routing controls' bugs (`harness.compare.planted_balancing`) leave the loss alone; they
fail float32 on what the verdict judges of the controls (the balancing losses' gradients,
the load, the expert biases), at PP2 DP2 EP2: DP for the two that show only across DP
ranks, PP for the stage whose first chunk is dense.

Adding a plant is adding one entry to `PLANTED` (and a run to `RUNS` when none fits);
`test_every_plant_is_in_the_table` fails until it is there.

Sizes: a bug in an op shows at any size, so the bfloat16 runs are PP1 with two
micro-batches of 32 tokens (longer than tiny GPT-OSS's sliding window, 16): half the CPU
of PP2 with four, which these tests ran at before (each plant measured failing at the new
size when it was cut). The two bugs that are statistics of many values keep their sizes:
the activation rounded toward zero (1024 tokens) and the bfloat16 expert counts (more than
256 copies an expert: 2048 tokens).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch

from harness.compare.planted import PLANTS, round_toward_zero
from harness.compare.planted_balancing import BALANCING_PLANTS, plant_problem
from harness.compare.planted_mtp import MTP_PLANTS
from models.network import preset
from models.runtime import ParallelConfig
from tests._compare import planted_reports
from tests._nonfinite import NONFINITE

PARALLEL = ParallelConfig(
    pp=1, dp=1, ep=1, micro_batches=2, micro_batch_size=1, seq_len=32, dtype="bfloat16"
)
"""Sequences of 32 tokens: longer than tiny GPT-OSS's sliding window (16)."""
WIDE = dataclasses.replace(PARALLEL, micro_batch_size=16)
"""1024 tokens a step: a rounding bias of 2e-3 stands out of the noise (``rel / sqrt(tokens)``
is 2.7e-4 here, 7.7e-4 at 128 tokens)."""

FLOAT32 = dataclasses.replace(PARALLEL, dtype="float32")

BALANCING_MODEL = dataclasses.replace(
    preset("tiny-deepseek-v2"), aux_loss="sequence", aux_loss_coef=0.1, expert_bias=True
)
"""Both controls a balancing plant breaks: DeepSeek's sequence loss, at a coefficient (0.1)
at which its gradient is a large share of the router gates', so a scaled one stands far out
of float32's gradient bound, and the expert bias. Its first layer is dense, so at PP 2 rank
0's first chunk holds no MoE layer."""
BALANCING_LAYOUT = ParallelConfig(
    pp=2, dp=2, ep=2, micro_batches=4, micro_batch_size=1, seq_len=16, dtype="float32"
)
"""`twinpipe compare`'s default layout (PP2 DP2 EP2, M = 4), one sequence of 16 tokens a
micro-batch (32 before: each of these plants was seen failing at 16 when it was cut; what
they break, a scale, a sum over ranks, an update's count or place, is no statistic of
many tokens)."""
COUNTS_PAST_BF16 = dataclasses.replace(BALANCING_LAYOUT, micro_batch_size=2, seq_len=128)
# Kept at 2048 tokens: the test below holds every expert's count past 256 (the mean is
# tokens * top-k / experts = tokens / 4 here), and `plant_problem` refuses a mean at or
# under 256 (1024 tokens), where bfloat16 would count exactly and the plant show nothing.
"""Sequences of 128 tokens: 512 copies per expert and step on average (bfloat16 holds
integers exactly to 256), over two DP ranks."""


class Run(NamedTuple):
    model: str
    parallel: ParallelConfig
    noise_floor: bool


RUNS = {
    "tiny-gpt-oss": Run("tiny-gpt-oss", PARALLEL, True),
    "tiny-gpt-oss, 1024 tokens": Run("tiny-gpt-oss", WIDE, True),
    "tiny-qwen3-moe": Run("tiny-qwen3-moe", PARALLEL, True),
    "tiny-qwen3-moe, float32": Run("tiny-qwen3-moe", FLOAT32, False),
    "tiny-deepseek-v3": Run("tiny-deepseek-v3", PARALLEL, True),
    "routing controls": Run("balancing", BALANCING_LAYOUT, False),
    "routing controls, 2048 tokens": Run("balancing", COUNTS_PAST_BF16, False),
}
"""One launch per run: the correct stack, then each bug `PLANTED` gives it, one step each."""


class Planted(NamedTuple):
    plant: str
    run: str
    names: tuple[str, ...] = ()
    """What names the bug among the verdict's problems (each must be in one)."""
    op: str | None = None
    """The op the ops audit (`harness.compare.ops_audit`, bfloat16 runs) fails; None: the
    audit passes (the bug lives in no op of `models.network.Ops`: the fused loss, the
    sinks' gradient, the router's group scores)."""


PLANTED = [
    Planted("attention-drops-sink", "tiny-gpt-oss", op="attention"),
    Planted("attention-drops-window", "tiny-gpt-oss", op="attention"),
    # The audit checks each op's forward; the sinks' missing gradient is the step's to see,
    # and it names them: their gradient is zero, 1 - cos = 1, at any width.
    Planted("attention-frozen-sink", "tiny-gpt-oss", ("sinks",)),
    Planted("activation-round-to-zero", "tiny-gpt-oss, 1024 tokens", op="clamped_swiglu"),
    Planted("cross-entropy-grad-1.01", "tiny-qwen3-moe"),
    Planted("dispatch-wrong-expert", "tiny-qwen3-moe", op="to_expert_order"),
    # The reference's NaN against the planted stack's finite loss, and the op that lost it.
    Planted(
        "nan-to-zero-store",
        "tiny-qwen3-moe",
        ("step 0: loss not finite (baseline nan; the other side finite)", "NaN or infinity lost"),
        op="silu_and_mul",
    ),
    # float32 judges each gradient's relative L2 error as well as its direction.
    Planted("cross-entropy-grad-1.01", "tiny-qwen3-moe, float32", ("relative error",)),
    # Routing is pinned, so the bug moves no number of the candidate's step (it replays the
    # truth's experts): the replay catches it, where the candidate's group scores differ
    # from the truth's far beyond the noise floor.
    Planted("group-score-from-max", "tiny-deepseek-v3", ("(its group scores)", "router")),
    Planted("bias-every-micro-batch", "routing controls", ("expert bias of layer",)),
    Planted("bias-counts-not-summed-over-dp", "routing controls", ("expert load differs",)),
    Planted("bias-counts-bf16", "routing controls, 2048 tokens", ("expert load differs",)),
    Planted(
        "aux-grad-scaled-by-1/M-twice", "routing controls", ("mlp.gate.weight relative error",)
    ),
    Planted("aux-grad-scaled-by-dp", "routing controls", ("mlp.gate.weight relative error",)),
    Planted("bias-skipped-on-stage-without-moe", "routing controls", ("expert bias of layer 3",)),
    Planted(
        "forward-only-updates-bias",
        "routing controls",
        ("the forward-only pass moved the candidate's expert bias",),
    ),
]
"""Each plant, the run that fails it, and what the verdict names."""

_REPORTS: dict = {}


def _model(run: Run):
    return BALANCING_MODEL if run.model == "balancing" else preset(run.model)


def _reports(name: str) -> dict:
    if name not in _REPORTS:
        run = RUNS[name]
        plants = tuple(case.plant for case in PLANTED if case.run == name)
        label = "tiny-deepseek-v2" if run.model == "balancing" else run.model
        _REPORTS[name] = planted_reports(
            _model(run), run.parallel, plants, label, noise_floor=run.noise_floor
        )
    return _REPORTS[name]


def test_every_plant_is_in_the_table_and_shows_at_its_run_s_settings():
    # Multi-token prediction's plants need an MTP model: tests/test_planted_mtp.py runs them
    # (its own table, held to MTP_PLANTS there); every other plant is in this table.
    assert {case.plant for case in PLANTED} == set(PLANTS) - set(MTP_PLANTS)
    assert set(BALANCING_PLANTS) <= set(PLANTS)
    for case in PLANTED:
        run = RUNS[case.run]
        assert plant_problem(case.plant, _model(run), run.parallel, None) is None, case


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(RUNS))
def test_the_correct_stack_passes(name):
    report = _reports(name)[None]
    assert report["passed"], report["problems"]
    if RUNS[name].noise_floor:
        assert report["noise_floor"]["steps"][0]["passed"]
        assert report["ops_audit"]["passed"], report["ops_audit"]
    if RUNS[name].model == "balancing":
        assert report["balancing"]["judged"]["bias"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", PLANTED, ids=[f"{c.run}: {c.plant}" for c in PLANTED])
def test_a_planted_bug_fails(case):
    report = _reports(case.run)[case.plant]
    assert not report["passed"]
    assert report["config"]["plant"] == case.plant
    for name in case.names:
        assert any(name in problem for problem in report["problems"]), (name, report["problems"])
    if RUNS[case.run].noise_floor:
        # The noise floor names what is wrong (the fixed backstop alone misses the subtle ones).
        floor = report["noise_floor"]["steps"][0]
        assert not floor["passed"], floor["problems"]
        audit = report["ops_audit"]
        if case.op is None:
            assert audit["passed"], audit
        else:
            assert audit["ops"][case.op]["failed"] > 0, audit
    if case.plant in BALANCING_PLANTS:
        # Each leaves the loss where it was: only the controls' figures show it.
        assert report["loss"]["rel_error"][0] <= report["tolerance"]["loss_rel"]


DOWN = "model.layers.*.mlp.experts.down_proj"


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_scaled_cross_entropy_gradient_fails_in_float32_by_its_size_alone():
    """A gradient scaled as a whole keeps 1 - cos at rounding level: float32 fails it on
    each gradient's relative L2 error."""
    planted = _reports("tiny-qwen3-moe, float32")["cross-entropy-grad-1.01"]
    assert max(planted["grads"]["max_one_minus_cos"]) <= planted["tolerance"]["grad_one_minus_cos"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_deepseek_v3_replay_finds_no_group_score_of_the_correct_stack():
    assert _reports("tiny-deepseek-v3")[None]["routing"]["problems"] == []


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_counts_run_routes_past_what_bfloat16_holds_exactly():
    report = _reports("routing controls, 2048 tokens")[None]
    assert min(min(row) for row in report["balancing"]["load"]["baseline"][0]) > 256


def test_the_truncating_plant_keeps_nan_and_infinity():
    """The planted truncation drops the low 16 bits; a NaN whose payload lies there would
    come out infinite, so NaN is kept as NaN: the plant rounds, it does not invent values."""
    cut = round_toward_zero(NONFINITE)
    assert torch.equal(cut.isnan(), NONFINITE.isnan())
    assert torch.equal(cut.isinf(), NONFINITE.isinf())
    assert cut[-2] == float("inf") and cut[-1] == float("-inf")
    assert round_toward_zero(torch.tensor([1.0 + 2**-8 + 2**-9])) == 1.0 + 2**-8
