"""`twinpipe compare` with the routing controls on: the flags, the lockstep's bias copy, the
verdict on the balancing losses, the load and the expert biases, and the load picture.

The verdict's rules are held on records written by hand (one quantity out of bounds at a
time); the real stacks run in one launch at the default layout, every control on in turn,
float32 and one bfloat16 case, and against the oracle. The planted peer bugs are
`tests/test_planted.py`'s.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from harness.cli import main
from harness.compare.rank import RankPlan
from harness.compare.record import StepRecord
from harness.compare.verdict import build_report
from harness.report import load_report, plot_expert_load, render_markdown, write_report
from models.network import SeededWeights, preset
from models.runtime import OptimizerConfig, ParallelConfig, launch
from tests._compare import compare_in_one_launch

DATA = Path(__file__).resolve().parent / "data"

# ---------------------------------------------------------------------- the verdict
LAYERS = (1, 2)


def _sides(bias: float = 0.0, load: int = 0, aux: float = 0.3) -> dict:
    """One rank's `StepRecord.balancing`: the candidate's bias, load and aux off by these."""
    base = {
        "values": [0.3, 0.01],
        "load": {layer: [100, 140, 60, 100] for layer in LAYERS},
        "bias": {layer: [0.001, -0.001, 0.001, 0.0] for layer in LAYERS},
    }
    cand = {
        "values": [aux, 0.01],
        "load": {layer: [100 + load, 140, 60, 100] for layer in LAYERS},
        "bias": {layer: [0.001 + bias, -0.001, 0.001, 0.0] for layer in LAYERS},
    }
    return {"baseline": base, "candidate": cand}


def _verdict(rank1: dict, baseline="reference", routing="pinned", eval_change=0.0) -> dict:
    """Two DP ranks, one step; rank 0 agrees, rank 1 holds ``rank1`` (the balancing losses
    are the same on every rank, summed over them: rank 0's are read)."""
    model = dataclasses.replace(preset("tiny-deepseek-v2"), expert_bias=True)
    plan = RankPlan(
        model, ParallelConfig(pp=1, dp=2, ep=1), None, baseline, "optimized", 1,
        OptimizerConfig(), routing=routing, track_memory=False,
    )  # fmt: skip
    ranks = []
    first = _sides()
    first["candidate"]["values"] = rank1["candidate"]["values"]
    for coords, sides in (((0, 0, 0), first), ((0, 1, 0), rank1)):
        record = StepRecord(loss={"baseline": 2.0, "candidate": 2.0}, grads={}, params={})
        record.balancing = sides
        change = {"baseline": 0.0, "candidate": eval_change}
        evaluation = {"loss": {"baseline": 2.0, "candidate": 2.0}, "routing": {},
                      "bias_change": change}  # fmt: skip
        ranks.append({"steps": [record], "eval": evaluation, "lockstep": baseline != "oracle",
                      "coords": coords})  # fmt: skip
    return build_report(plan, ranks)


def test_equal_controls_pass_and_are_reported():
    report = _verdict(_sides())
    assert report["passed"], report["problems"]
    balancing = report["balancing"]
    assert balancing["layers"] == [1, 2] and balancing["controls"]["expert_bias"]
    assert balancing["load"]["baseline"] == [[[100, 140, 60, 100]] * 2]
    assert balancing["max_over_mean"]["baseline"] == [1.4]
    assert balancing["bias"]["range"] == [[[-0.001, 0.001]] * 2]
    assert balancing["judged"]["load"] and balancing["judged"]["bias"]


@pytest.mark.parametrize(
    ("rank1", "eval_change", "needle"),
    [
        (_sides(bias=2**-20), 0.0, "expert bias of layer 1 differs"),
        (_sides(bias=math.nan), 0.0, "expert bias of layer 1 differs from the baseline's by nan"),
        (_sides(load=1), 0.0, "expert load differs from the baseline's by up to 1 copies"),
        (_sides(aux=0.3 * (1 + 1e-4)), 0.0, "load-balancing loss differs by"),
        (_sides(aux=math.nan), 0.0, "the load-balancing loss is not finite"),
        (_sides(), 1e-3, "the forward-only pass moved the candidate's expert bias by 0.001"),
    ],
)
def test_one_quantity_on_one_rank_out_of_bounds_fails(rank1, eval_change, needle):
    """A bias a millionth off on the second DP rank only, a NaN, one copy, the aux loss 1e-4
    off (float32 pipelines: 1e-5) or NaN, a bias moved by the evaluation."""
    report = _verdict(rank1, eval_change=eval_change)
    assert not report["passed"]
    assert any(needle in problem for problem in report["problems"]), report["problems"]


def test_free_routing_reports_the_load_and_the_bias_without_judging_them():
    report = _verdict(_sides(bias=1e-3, load=1), baseline="oracle", routing="free")
    assert report["passed"], report["problems"]
    assert not report["balancing"]["judged"]["load"]
    assert report["balancing"]["load"]["max_abs_diff"] == [1]
    # The losses are judged whatever the routing (against the oracle: 1e-6).
    failed = _verdict(_sides(aux=0.3 * (1 + 1e-5)), baseline="oracle", routing="free")
    assert not failed["passed"]


# ---------------------------------------------------------------------- the flags
@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--aux-loss-coef", "-1"], "--aux-loss-coef=-1.0 is invalid"),
        (["--z-loss-coef", "nan"], "--z-loss-coef=nan is invalid"),
        (["--aux-loss", "pooled"], "--aux-loss='pooled' needs a positive coefficient"),
        (["--aux-loss-coef", "0.1"], "--aux-loss-coef=0.1 changes nothing"),
        (["--expert-bias-rate", "0.01"], "--expert-bias-rate=0.01 changes nothing"),
        (["--plant", "bias-every-micro-batch"], "add --expert-bias"),
        (
            [
                "--plant",
                "aux-grad-scaled-by-dp",
                "--aux-loss",
                "layer",
                "--aux-loss-coef",
                "1",
                "--dp",
                "1",
                "--ep",
                "1",
            ],
            "shows only across DP ranks",
        ),  # fmt: skip
        (["--plant", "bias-counts-bf16", "--expert-bias"], "raise --seq-len"),
        (
            [
                "--plant",
                "bias-skipped-on-stage-without-moe",
                "--expert-bias",
                "--model",
                "tiny-qwen3-moe",
            ],
            "every pipeline rank's first chunk holds an MoE layer",
        ),  # fmt: skip
    ],
)
def test_a_bad_routing_control_exits_2_naming_the_flag(argv, needle, capsys):
    assert main(["compare", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_a_form_the_flags_do_not_know_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "--aux-loss", "global"])
    assert exit_info.value.code == 2
    assert "--aux-loss: invalid choice: 'global'" in capsys.readouterr().err


# ---------------------------------------------------------------------- the picture
def test_the_load_picture_takes_a_plain_nested_list(tmp_path):
    load = [[[10, 30, 20, 20], [20, 20, 20, 20]] for _ in range(11)]
    assert plot_expert_load(load, tmp_path / "load.png", layers=[1, 3])
    assert (tmp_path / "load.png").read_bytes()[:4] == b"\x89PNG"
    assert not plot_expert_load([], tmp_path / "none.png")
    assert not plot_expert_load([[[]]], tmp_path / "empty.png")


# ---------------------------------------------------------------------- real stacks
LAYOUT = ParallelConfig(pp=2, dp=2, ep=2, micro_batches=4, micro_batch_size=1, seq_len=32)
"""`twinpipe compare`'s default layout (PP2 DP2 EP2, M = 4) at one sequence of 32 tokens a
micro-batch (the default's is two of 64: a quarter of the tokens, nothing here depends on
how many; 32 is past tiny GPT-OSS's sliding window, 16)."""

RUNS = {
    "pooled and z-loss, tiny-qwen3-moe": (
        "tiny-qwen3-moe", dict(aux_loss="pooled", aux_loss_coef=0.1, router_z_loss_coef=1e-3),
        "reference", 1, "float32",
    ),
    "sequence and expert bias, tiny-deepseek-v2": (
        "tiny-deepseek-v2", dict(aux_loss="sequence", aux_loss_coef=0.1, expert_bias=True,
                                 expert_bias_rate=1e-2), "reference", 2, "float32",
    ),
    "layer and expert bias, tiny-gpt-oss": (
        "tiny-gpt-oss", dict(aux_loss="layer", aux_loss_coef=0.1, expert_bias=True,
                             expert_bias_rate=1e-2), "reference", 1, "float32",
    ),
    "everything, bfloat16, tiny-deepseek-v2": (
        "tiny-deepseek-v2", dict(aux_loss="sequence", aux_loss_coef=0.1, router_z_loss_coef=1e-3,
                                 expert_bias=True, expert_bias_rate=1e-2), "reference", 1,
        "bfloat16",
    ),
    "pooled, z-loss and expert bias against the oracle": (
        "tiny-qwen3-moe", dict(aux_loss="pooled", aux_loss_coef=0.1, router_z_loss_coef=1e-3,
                               expert_bias=True), "oracle", 2, "float32",
    ),
}  # fmt: skip
"""name -> (preset, routing controls, baseline, steps, dtype); the candidate: ``optimized``,
or ``reference`` against the oracle. A second step routes with the biases the first moved:
held against the reference on tiny-deepseek-v2 in float32 and against the oracle (tiny
GPT-OSS and the bfloat16 run ran two steps before; each step costs as much as the first)."""


def _plans() -> list[RankPlan]:
    plans = []
    for name, controls, baseline, steps, dtype in RUNS.values():
        model = dataclasses.replace(preset(name), **controls)
        candidate = "reference" if baseline == "oracle" else "optimized"
        parallel = dataclasses.replace(LAYOUT, dtype=dtype)
        plans.append(RankPlan(
            model, parallel, SeededWeights(model), baseline, candidate, steps, OptimizerConfig(),
            noise_floor=dtype == "bfloat16", track_memory=False, progress=False,
        ))  # fmt: skip
    return plans


_REPORTS: dict = {}


def _reports() -> dict[str, dict]:
    if not _REPORTS:
        reports = compare_in_one_launch(_plans(), [run[0] for run in RUNS.values()])
        _REPORTS.update(zip(RUNS, reports, strict=True))
    return _REPORTS


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("run", list(RUNS))
def test_each_routing_control_passes_and_is_reported(run):
    report = _reports()[run]
    assert report["passed"], report["problems"]
    balancing = report["balancing"]
    _, controls, baseline, steps, dtype = RUNS[run]
    model = preset(RUNS[run][0])
    tokens = LAYOUT.global_batch * LAYOUT.seq_len
    assert balancing["layers"] == [i for i in range(4) if model.is_moe_layer(i)]
    for load in balancing["load"]["baseline"]:  # every routed copy counted once, per layer
        assert [sum(row) for row in load] == [tokens * model.num_experts_per_tok] * len(load)
    # Pinned (the default) against the oracle too: the same choices, the same load.
    assert balancing["load"]["candidate"] == balancing["load"]["baseline"]
    assert balancing["aux"]["baseline"][0] > 0 and balancing["aux"]["rel_error"][0] <= 1e-2
    if controls.get("router_z_loss_coef"):
        assert balancing["z"]["baseline"][0] > 0
    assert balancing["judged"]["bias"]
    if controls.get("expert_bias"):
        rate = controls.get("expert_bias_rate", 1e-3)
        first, last = balancing["bias"]["range"][0], balancing["bias"]["range"][-1]
        assert all(low < high for low, high in first), first  # step 0 moved every layer's
        reach = steps * rate * (1 + 1e-6)  # each step moves an expert's bias by rate at most
        assert all(-reach <= low <= high <= reach for low, high in last), last
        assert all(d == 0 for step in balancing["bias"]["max_abs_diff"] for d in step)
    assert balancing["bias"]["eval_change"] == {"baseline": 0.0, "candidate": 0.0}
    if dtype == "bfloat16":
        assert report["noise_floor"]["steps"][-1]["passed"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_report_keeps_the_new_fields_and_draws_the_load(tmp_path):
    report = json.loads(json.dumps(_reports()["sequence and expert bias, tiny-deepseek-v2"]))
    written = write_report(report, tmp_path)
    assert "load.png" in written and written["load.png"].stat().st_size > 0
    markdown = (tmp_path / "report.md").read_text()
    assert "![expert load per step](load.png)" in markdown
    assert "routing controls: aux loss sequence (coef 0.1)" in markdown
    assert "expert bias on (rate 0.01)" in markdown
    again = load_report(tmp_path / "report.json")
    assert again["balancing"]["load"] == report["balancing"]["load"]
    images = [name for name in written if name.endswith(".png")]
    assert render_markdown(again, images) == markdown


# ---------------------------------------------------------------------- the bias copy
def _bias_copy_worker(plan: RankPlan) -> list[bool]:
    """Two lockstep steps with the candidate's biases knocked off the baseline's first:
    whether the two stacks' biases are equal after each (the second with no copy)."""
    import harness.compare.lockstep as lockstep  # noqa: PLC0415
    from harness.compare.rank import Rank  # noqa: PLC0415
    from harness.compare.stacks import stack_buffers  # noqa: PLC0415

    rank = Rank(plan, torch.device("cpu"))
    assert rank.shared
    equal = []
    with rank.installed():
        for step in range(2):
            if step == 1:
                lockstep.copy_buffers = lambda source, target: None  # what a harness without it did
            with torch.no_grad():
                for bias in stack_buffers(rank.candidate).values():
                    bias.uniform_(-0.5, 0.5)
            batches = lockstep.step_batches(plan, step)
            record = StepRecord()
            rank.start_step()
            lockstep.shared_step(rank, batches, record)
            rank.end_step(record)
            base, cand = stack_buffers(rank.baseline), stack_buffers(rank.candidate)
            assert base and set(base) == set(cand)
            equal.append(all(torch.equal(base[name], cand[name]) for name in base))
    return equal


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_lockstep_hands_the_candidate_the_baseline_s_expert_biases():
    model = dataclasses.replace(preset("tiny-deepseek-v2"), expert_bias=True)
    parallel = ParallelConfig(pp=1, dp=1, ep=1, micro_batches=2, micro_batch_size=1, seq_len=16)
    plan = RankPlan(
        model, parallel, SeededWeights(model), "reference", "optimized", 2, OptimizerConfig(),
        track_memory=False, progress=False,
    )  # fmt: skip
    (equal,) = launch(_bias_copy_worker, 1, (plan,))
    assert equal == [True, False]


def test_the_dashboard_shows_the_latest_compare_run_s_load(tmp_path):
    """A history whose latest compare report holds a load: the page draws it and tables its
    last step; the report from before the controls (tests/data/report_0cb0a31) has none."""
    old = json.loads((DATA / "report_0cb0a31" / "report.json").read_text())
    history, site = tmp_path / "history", tmp_path / "site"
    assert main(["bench", "--add-report", str(DATA / "report_0cb0a31" / "report.json"),
                 "--history", str(history)]) == 0  # fmt: skip
    assert main(["dashboard", str(history), "--out", str(site)]) == 0
    assert "compare-load.png" not in (site / "index.html").read_text()
    new = {**old, "balancing": _verdict(_sides())["balancing"], "git_commit": "feedface0000"}
    (tmp_path / "new.json").write_text(json.dumps(new))
    assert (
        main(["bench", "--add-report", str(tmp_path / "new.json"), "--history", str(history)]) == 0
    )
    assert main(["dashboard", str(history), "--out", str(site)]) == 0
    page = (site / "index.html").read_text()
    assert "Expert load: the latest compare run (feedface0000)" in page
    assert "<td>layer 2</td><td>1.40</td><td>60</td><td>140</td>" in page
    assert (site / "compare-load.png").stat().st_size > 0
