"""compare's communication section (`harness.compare.communication`) and its tables, built
from counts shaped like a run's, beside the estimator's prediction for the same layout."""

from __future__ import annotations

import json

import pytest

from harness.cli import main
from harness.compare.communication import communication_section
from harness.report import format_table, render_markdown
from models.hf import resolve_model
from models.runtime import ParallelConfig, Traffic
from optimized.estimator.communication import predict_ranks
from optimized.estimator.config import EstimateConfig

MODEL = resolve_model("tiny-deepseek-v2")
PARALLEL = ParallelConfig(pp=1, dp=2, ep=2, micro_batch_size=1, micro_batches=2, seq_len=16)


def _predicted(stack: str):
    config = EstimateConfig(
        MODEL, pp=1, dp=2, ep=2, micro_batch_size=1, seq_len=16, num_microbatches=2,
        stack="optimized", fsdp=stack == "optimized-fsdp",
        shard_optimizer=stack == "optimized-fsdp",
    )  # fmt: skip
    return list(predict_ranks(config))


def _copy(counts):
    return {k: Traffic(t.calls, t.sent, t.received) for k, t in counts.items()}


def _per_rank(skew: int = 0):
    """Two ranks whose counts are the prediction (two steps each); ``skew`` extra bytes sent
    by rank 0's all-to-all in the second step."""
    base, cand = _predicted("optimized"), _predicted("optimized-fsdp")
    ranks = []
    for rank in range(2):
        second = _copy(cand[rank])
        if rank == 0:
            second[("all_to_all", "ep")].sent += skew
        ranks.append(
            {
                "optimized": {"communication": [_copy(base[rank]), _copy(base[rank])]},
                "optimized-fsdp": {"communication": [_copy(cand[rank]), second]},
            }
        )
    return ranks


def test_section_exact_when_counts_are_as_predicted():
    section = communication_section(
        _per_rank(), MODEL, PARALLEL, ("optimized", "optimized-fsdp"), "balanced"
    )
    assert section["exact"] and section["steps"] == 2 and section["routing"] == "balanced"
    rank0 = section["ranks"][0]
    assert "reduce_scatter" in rank0["candidate"] and "reduce_scatter" not in rank0["baseline"]
    rs = rank0["candidate"]["reduce_scatter"]
    assert rs["calls"] == rs["predicted_calls"] > 0 and rs["error"] == 0
    assert rs["bytes"] == rs["bytes_sent"] + rs["bytes_received"] == rs["predicted_bytes"]
    assert set(rs["groups"]) == {"dp"}
    totals = section["total_bytes"]
    assert totals["candidate"] == totals["candidate_predicted"] > totals["baseline"] > 0
    report = {"passed": True, "baseline": "optimized", "candidate": "optimized-fsdp",
              "communication": section}  # fmt: skip
    table = format_table(report)
    assert "communication per rank" in table and "every kind as predicted" in table
    markdown = render_markdown(report)
    assert "## Communication per rank" in markdown and "reduce_scatter" in markdown


def test_section_shows_a_difference_as_the_mean_per_step_and_its_error():
    """8 more bytes in one of two steps: half of them per step, the kind's error non-zero,
    the section not exact, and the tables say so."""
    section = communication_section(
        _per_rank(skew=8), MODEL, PARALLEL, ("optimized", "optimized-fsdp"), "pinned"
    )
    assert not section["exact"]
    a2a = section["ranks"][0]["candidate"]["all_to_all"]
    assert a2a["bytes"] == a2a["predicted_bytes"] + 4
    assert a2a["error"] > 0
    assert section["ranks"][1]["candidate"]["all_to_all"]["error"] == 0
    report = {"passed": True, "baseline": "optimized", "candidate": "optimized-fsdp",
              "communication": section}  # fmt: skip
    assert "routing's skew" in format_table(report)


def test_no_section_without_counts():
    per_rank = [{"optimized": {"loss": []}, "reference": {"loss": []}}]
    assert (
        communication_section(per_rank, MODEL, PARALLEL, ("reference", "optimized"), "free") is None
    )


def _compare(tmp_path, *argv) -> dict:
    """`twinpipe compare` in this process (its ranks are processes), one step, no memory
    tracking; its report.json."""
    out = tmp_path / "report"
    common = ["--micro-batch-size", "1", "--steps", "1", "--no-memory", "--out", str(out)]
    assert main(["compare", *argv, *common]) == 0
    assert "## Communication per rank" in (out / "report.md").read_text()
    return json.loads((out / "report.json").read_text())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_compare_reports_every_ranks_communication_exactly_with_balanced_routing(tmp_path):
    """PP=2 DP=2 EP=2 (p2p, all-to-all, FSDP and plain reductions), reference against the
    FSDP stack, balanced routing: report.json's section has every rank, both stacks, each
    kind's calls, bytes and prediction, all exact."""
    report = _compare(
        tmp_path, "--model", "tiny-deepseek-v2", "--pp", "2", "--dp", "2", "--ep", "2",
        "--micro-batches", "4", "--seq-len", "13", "--routing", "balanced",
        "--baseline", "reference", "--candidate", "optimized-fsdp",
    )  # fmt: skip
    section = report["communication"]
    assert section["routing"] == "balanced" and section["estimate_routing"] == "balanced"
    assert section["steps"] == 1 and [r["rank"] for r in section["ranks"]] == [0, 1, 2, 3]
    for rank in section["ranks"]:
        for side in ("baseline", "candidate"):
            kinds = rank[side]
            assert {"send", "recv", "all_to_all", "all_reduce"} <= set(kinds), (rank, side)
            for kind, figures in kinds.items():
                assert figures["calls"] == figures["predicted_calls"] > 0, (rank, side, kind)
                assert figures["bytes"] == figures["predicted_bytes"] > 0, (rank, side, kind)
        assert {"all_gather", "reduce_scatter"} <= set(rank["candidate"])
        assert "reduce_scatter" not in rank["baseline"]
    totals = section["total_bytes"]
    assert totals["baseline"] == totals["baseline_predicted"]
    assert totals["candidate"] == totals["candidate_predicted"]
    assert section["exact"] is True


@pytest.mark.slow
@pytest.mark.multiprocess
def test_observed_routing_predicts_real_routing_to_the_byte(tmp_path):
    """Real routing (the candidate replays the baseline's choices), PP=1 DP=2 EP=2, with
    ``--estimate-routing observed``: each rank's all-to-all is predicted to the byte from
    the rows its routing counts say it sent and received; the balanced prediction beside it
    misses by the routing's skew on some rank."""
    report = _compare(
        tmp_path, "--model", "tiny-qwen3-moe", "--pp", "1", "--dp", "2", "--ep", "2",
        "--micro-batches", "2", "--seq-len", "16", "--estimate-routing", "observed",
        "--baseline", "optimized", "--candidate", "reference",
    )  # fmt: skip
    section = report["communication"]
    assert section["routing"] == "pinned" and section["estimate_routing"] == "observed"
    skews = []
    for rank in section["ranks"]:
        for side in ("baseline", "candidate"):
            a2a = rank[side]["all_to_all"]
            assert a2a["calls"] == a2a["predicted_calls"] > 0
            assert a2a["bytes"] == a2a["predicted_bytes"] and a2a["error"] == 0, (rank, side)
            skews.append(a2a["bytes"] - a2a["balanced_predicted_bytes"])
            others = {k: f for k, f in rank[side].items() if k != "all_to_all"}
            for kind, figures in others.items():
                assert figures["bytes"] == figures["balanced_predicted_bytes"], (rank, kind)
    assert any(skews), "the routers' own choices were perfectly balanced: no skew exercised"
    assert section["exact"] is True
