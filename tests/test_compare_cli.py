"""`twinpipe compare` end to end: exit codes, the JSON report, the report folder."""

import json

import pytest

import harness.compare.tolerances as tolerances
from harness.cli import main

SMALL = [
    "--model",
    "tiny-qwen3-moe",
    "--pp",
    "1",
    "--dp",
    "2",
    "--ep",
    "2",
    "--micro-batches",
    "2",
    "--micro-batch-size",
    "1",
    "--seq-len",
    "16",
    "--steps",
    "2",
]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_reference_against_oracle_passes_and_writes_the_report(tmp_path):
    out = tmp_path / "report"
    code = main(
        [
            "compare",
            *SMALL,
            "--baseline",
            "oracle",
            "--candidate",
            "reference",
            "--json",
            str(tmp_path / "out.json"),
            "--out",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["passed"] is True
    assert report["baseline"] == "oracle" and report["candidate"] == "reference"
    assert len(report["loss"]["baseline"]) == len(report["loss"]["candidate"]) == 2
    assert max(report["loss"]["rel_error"]) <= 1e-6
    assert max(report["grads"]["max_one_minus_cos"]) <= report["tolerance"]["grad_one_minus_cos"]
    assert report["config"]["dp"] == 2 and report["config"]["ep"] == 2
    # Pinned and lockstep (the defaults) against the oracle too: the pipeline replays the
    # oracle's expert choices and starts every step from its state.
    assert report["routing"]["mode"] == "pinned" and report["routing"]["recorded_by"] == "oracle"
    assert report["config"]["trajectory"] == "lockstep"
    for name in ("report.json", "report.md", "loss.png"):
        assert (out / name).stat().st_size > 0


@pytest.mark.slow
@pytest.mark.multiprocess
def test_outside_the_tolerance_exits_1(monkeypatch, capsys):
    # An impossible bound: any rounding difference at all is outside it.
    monkeypatch.setitem(tolerances.TOLERANCES, ("oracle", "float32"), (0.0, 0.0, 0.0))
    code = main(
        [
            "compare",
            *SMALL,
            "--steps",
            "1",
            "--baseline",
            "oracle",
            "--candidate",
            "reference",
            "--no-memory",
        ]
    )
    assert code == 1
    assert "FAILED" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--baseline", "nope"], "--baseline='nope'"),
        (["--baseline", "reference", "--candidate", "reference"], "both 'reference'"),
        (["--model", "no-such-model"], "no-such-model"),
        (["--ep", "3"], "ParallelConfig.ep=3"),
        (["--steps", "0"], "--steps=0"),
        (
            [
                "--baseline",
                "oracle",
                "--candidate",
                "reference",
                "--plant",
                "dispatch-wrong-expert",
            ],
            "plants a bug in the optimized stack",
        ),
    ],
)
def test_bad_input_exits_2_before_any_rank_starts(argv, needle, capsys):
    assert main(["compare", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_bad_recompute_exits_2_naming_the_flag_the_value_and_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "--recompute", "bogus"])
    assert exit_info.value.code == 2
    assert "--recompute: invalid choice: 'bogus' (choose from 'on', 'off')" in (
        capsys.readouterr().err
    )


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fsdp_sharding_changes_nothing_beyond_rounding(tmp_path):
    """The harness holds `twinpipe train`'s sharded optimized stack (FSDP2 on every module,
    the experts over their replicas: DP / EP = 2 here) beside the unsharded one: losses
    and gradients within the pipeline tolerance, parameters and AdamW state halved."""
    small = list(SMALL)
    small[small.index("--ep") + 1] = "1"
    code = main(
        [
            "compare", *small, "--baseline", "optimized", "--candidate", "optimized-fsdp",
            # shards only between uses (the default holds gathered parameters for the step)
            "--reshard-after-forward", "on", "--json", str(tmp_path / "out.json"),
            "--out", str(tmp_path / "report"),
        ]
    )  # fmt: skip
    report = json.loads((tmp_path / "out.json").read_text())
    assert code == 0 and report["passed"] is True
    # The FSDP2 settings the run used are in the config section, and in report.md's table.
    assert report["config"]["grad_sync"] == "step"
    assert report["config"]["reshard_after_forward"] is True
    table = (tmp_path / "report" / "report.md").read_text()
    assert "| grad_sync | `step` |" in table and "| reshard_after_forward | `True` |" in table
    assert max(report["loss"]["rel_error"]) <= 1e-5
    routing = report["routing"]  # float32: the replay finds no choice made differently
    assert routing["mode"] == "pinned" and routing["choices"] > 0 and routing["swaps"] == 0
    for rank in report["memory"]["ranks"]:
        whole, sharded = rank["baseline"], rank["candidate"]
        for category in ("parameters", "optimizer_state"):
            assert 0 < sharded[category] <= 0.51 * whole[category], (rank["rank"], category)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_bfloat16_compares_at_the_baselines_expert_choices_under_the_noise_floor(tmp_path, capsys):
    """bfloat16, reference against optimized on the preset whose router is most sensitive:
    the optimized side replays the reference's routing; its router scores agree within
    bf16's bound, the choices it would have made differently are counted and are all
    near-ties; report.md says so. Each step is judged against a float32 run of it: both
    stacks' errors and their ratio per parameter group, in report.json and report.md; per
    rank the harness's own memory and the five largest tensors at each stack's peak.
    (One run: these were two, the second at EP 1.)"""
    out = tmp_path / "report"
    code = main(
        ["compare", *SMALL, "--dtype", "bfloat16", "--json", str(tmp_path / "out.json"),
         "--out", str(out)]
    )  # fmt: skip
    report = json.loads((tmp_path / "out.json").read_text())
    assert code == 0 and report["passed"] is True
    routing = report["routing"]
    assert routing["mode"] == "pinned" and routing["problems"] == []
    # ranks x M x tokens x top-k x MoE layers, for 2 training steps and the evaluation
    assert routing["choices"] == 2 * 2 * 16 * 2 * 4 * (2 + 1)
    # Under the noise floor each router's limit is k x the reference's own drift + slack,
    # per step; the summary holds each router's tightest.
    for step in routing["steps"]:
        assert set(step["drift_limit"]) == set(step["router_drift"])
        for router, drift in step["router_drift"].items():
            assert 0 < drift <= step["drift_limit"][router]
            assert routing["drift_limit"][router] <= step["drift_limit"][router]
    assert routing["recorded_by"] == "truth"  # the float32 run of each step routes
    assert "routing: pinned" in capsys.readouterr().out
    markdown = (out / "report.md").read_text()
    assert "## Routing" in markdown
    assert report["trajectory"] == {
        "mode": "lockstep", "judged_steps": [0, 1], "divergence": report["trajectory"]["divergence"]
    }  # fmt: skip
    floor = report["noise_floor"]
    assert floor["settings"]["k"] == 2.0 and len(floor["steps"]) == 2
    groups = {g["group"]: g for g in floor["steps"][0]["groups"]}
    q_proj = groups["model.layers.*.self_attn.q_proj.weight"]
    assert 0 < q_proj["baseline"] < 0.1 and 0 < q_proj["candidate"] < 0.1
    assert q_proj["ratio"] == pytest.approx(q_proj["candidate"] / q_proj["baseline"])
    assert "(all gradients)" in groups and all(g["passed"] for g in groups.values())
    assert len(report["loss"]["truth"]) == 2
    for rank in report["memory"]["ranks"]:
        held = rank["harness"]
        assert held["held_bytes"] >= held["parameter_bytes"] > 0  # at least the gradients
        assert held["rss_peak_bytes"] > 0
        # The float32 truth's step, measured: one micro-batch at a time, with the bf16
        # stacks' parameters freed and their moments parked, it adds less than a copy.
        assert held["truth_step_bytes"] > held["truth_step_added_bytes"]
        assert held["truth_step_added_bytes"] <= held["parameter_bytes"], held
        top = rank["candidate"]["top_tensors"]
        assert len(top) == 5 and top[0]["bytes"] >= top[-1]["bytes"] > 0
        assert {"what", "shape", "dtype", "bytes", "category"} <= set(top[0])
    for section in ("## Noise floor", "## Memory the harness held", "## Largest tensors"):
        assert section in markdown
    assert "float32 truth's step (rank total)" in markdown


@pytest.mark.slow
@pytest.mark.multiprocess
def test_free_trajectory_is_judged_at_step_0_only(tmp_path):
    """--trajectory free: each side follows its own trajectory; later steps are shown
    (loss curves, divergence) but not judged, so an impossible bound after step 0 does
    not fail the run. One rank: which steps are judged depends on no layout (DP 2 / EP 2
    runs in the other tests of this file)."""
    one_rank = list(SMALL)
    one_rank[one_rank.index("--dp") + 1] = one_rank[one_rank.index("--ep") + 1] = "1"
    code = main(
        ["compare", *one_rank, "--steps", "3", "--trajectory", "free", "--no-memory",
         "--json", str(tmp_path / "out.json")]
    )  # fmt: skip
    report = json.loads((tmp_path / "out.json").read_text())
    assert code == 0 and report["passed"]
    assert report["trajectory"]["mode"] == "free" and report["trajectory"]["judged_steps"] == [0]
    assert len(report["trajectory"]["divergence"]["loss_rel"]) == 3
    assert report["loss"]["baseline"][2] != report["loss"]["baseline"][0]
