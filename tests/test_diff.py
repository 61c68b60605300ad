"""`twinpipe diff`: regressions in hand-made reports and benchmark runs, in words, exit codes."""

from __future__ import annotations

import copy
import json
import math
import pathlib
import subprocess
import sys

import pytest

from harness.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"


@pytest.fixture
def old() -> dict:
    return json.loads((DATA / "compare_report.json").read_text())


def _diff(tmp_path, old, new, *flags, capsys=None) -> tuple[int, str, str]:
    old_path, new_path = tmp_path / "old.json", tmp_path / "new.json"
    old_path.write_text(json.dumps(old))
    new_path.write_text(json.dumps(new))
    status = main(["diff", str(old_path), str(new_path), *flags])
    out, err = capsys.readouterr() if capsys else ("", "")
    return status, out, err


def _grow_peak(report: dict, rank: int, side: str, factor: float) -> None:
    entry = report["memory"]["ranks"][rank]
    entry[side]["total"] = int(entry[side]["total"] * factor)


def test_identical_reports_pass(tmp_path, old, capsys):
    status, out, _ = _diff(tmp_path, old, copy.deepcopy(old), capsys=capsys)
    assert status == 0
    assert "no regression" in out


def test_peak_memory_growth_beyond_one_percent_is_a_regression_in_words(tmp_path, old, capsys):
    new = copy.deepcopy(old)
    _grow_peak(new, 1, "candidate", 1.032)
    status, out, _ = _diff(tmp_path, old, new, capsys=capsys)
    assert status == 1
    assert (
        "regression: rank 1 candidate (optimized) peak memory grew 3.2% (50 MiB -> 51.6 MiB), "
        "limit 1%" in out
    )
    # A looser limit lets it through, reported as a change within the limit.
    status, out, _ = _diff(tmp_path, old, new, "--memory-tolerance", "0.05", capsys=capsys)
    assert status == 0
    assert "within 5%" in out


def test_small_memory_growth_and_shrinking_are_not_regressions(tmp_path, old, capsys):
    new = copy.deepcopy(old)
    _grow_peak(new, 0, "baseline", 1.005)
    _grow_peak(new, 0, "candidate", 0.9)
    status, out, _ = _diff(tmp_path, old, new, capsys=capsys)
    assert status == 0
    assert "rank 0 baseline (reference) peak memory grew 0.5%" in out
    assert "improvement: rank 0 candidate (optimized) peak memory shrank 10.0%" in out


def test_loss_and_gradient_errors_may_not_grow(tmp_path, old, capsys):
    new = copy.deepcopy(old)
    new["loss"]["rel_error"][4] *= 1.5
    new["grads"]["max_one_minus_cos"][0] = 9e-12
    status, out, _ = _diff(tmp_path, old, new, capsys=capsys)
    assert status == 1
    assert "loss relative error (max over steps) grew 50.0%" in out
    assert "gradient max 1-cos (max over steps) grew 200.0% (3e-12 -> 9e-12)" in out
    status, out, _ = _diff(tmp_path, old, new, "--error-tolerance", "2.5", capsys=capsys)
    assert status == 0


def test_nan_and_passed_turning_false_are_regressions(tmp_path, old, capsys):
    new = copy.deepcopy(old)
    new["passed"] = False
    new["grads"]["max_rel_error"][2] = math.nan
    status, out, _ = _diff(tmp_path, old, new, capsys=capsys)
    assert status == 1
    assert "regression: passed turned false" in out
    assert "gradient max relative error (max over steps) became NaN" in out


def test_time_regression_uses_the_noise_margin(tmp_path, old, capsys):
    new = copy.deepcopy(old)
    new["time"]["candidate"] = [t * 1.15 for t in old["time"]["candidate"]]
    status, out, _ = _diff(tmp_path, old, new, capsys=capsys)
    assert status == 1
    assert "candidate time per step (median) slowed 15.0%" in out and "limit 10%" in out
    assert _diff(tmp_path, old, new, "--time-tolerance", "0.2", capsys=capsys)[0] == 0


def test_loosened_tolerance_is_a_regression_config_change_is_information(tmp_path, old, capsys):
    new = copy.deepcopy(old)
    new["tolerance"]["loss_rel"] = 1e-4
    new["config"]["micro_batches"] = 8
    new["git_commit"] = "something-else"
    status, out, _ = _diff(tmp_path, old, new, capsys=capsys)
    assert status == 1
    assert "tolerance loss_rel loosened from 1e-05 to 0.0001" in out
    assert "change: report['config']['micro_batches']: 4 -> 8" in out
    assert "git_commit" not in out


def test_missing_sections_do_not_break_the_diff(tmp_path, old, capsys):
    """Sections absent from both reports are not judged; figures the new report lacks
    are regressions (#19: a missing figure never passes)."""
    new = copy.deepcopy(old)
    del new["memory"], new["time"]
    status, out, _ = _diff(tmp_path, {"passed": True}, {"passed": True}, capsys=capsys)
    assert status == 0
    status, out, _ = _diff(tmp_path, old, new, capsys=capsys)
    assert status == 1
    assert "rank 0: memory figures are missing from the new report" in out
    assert "candidate time per step (median) is missing from the new document" in out


def test_json_output(tmp_path, old, capsys):
    new = copy.deepcopy(old)
    _grow_peak(new, 0, "candidate", 1.1)
    status, out, _ = _diff(tmp_path, old, new, "--json", capsys=capsys)
    result = json.loads(out)
    assert status == 1 and result["passed"] is False and result["kind"] == "compare"
    assert len(result["regressions"]) == 1 and "rank 0" in result["regressions"][0]


def test_bad_input_exits_2_and_names_the_file(tmp_path, old, capsys):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(old))
    missing = tmp_path / "missing.json"
    assert main(["diff", str(good), str(missing)]) == 2
    assert "missing.json: cannot read" in capsys.readouterr().err
    garbage = tmp_path / "garbage.json"
    garbage.write_text("not json at all")
    assert main(["diff", str(garbage), str(good)]) == 2
    assert "garbage.json: not JSON" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text('{"hello": 1}')
    assert main(["diff", str(good), str(other)]) == 2
    assert "other.json: not a compare report" in capsys.readouterr().err
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"benchmarks": []}))
    assert main(["diff", str(good), str(bench)]) == 2
    assert "like with like" in capsys.readouterr().err


def _benchmark_json(median: float, peak: int, extra_bench: bool = False) -> dict:
    benches = [
        {
            "name": "test_ce[optimized]",
            "fullname": "benchmarks/test_ce.py::test_ce[optimized]",
            "group": "cross_entropy",
            "stats": {"median": median, "mean": median},
            "extra_info": {"peak_bytes": peak, "max_rel_error": 1e-3, "impl": "optimized"},
        },
        {
            "name": "test_ce[plain]",
            "fullname": "benchmarks/test_ce.py::test_ce[plain]",
            "group": "cross_entropy",
            "stats": {"median": 0.02, "mean": 0.02},
            "extra_info": {"peak_bytes": 4_000_000, "impl": "plain"},
        },
    ]
    if extra_bench:
        benches.append(
            {"name": "test_new", "fullname": "benchmarks/x.py::test_new", "stats": {"median": 1.0}}
        )
    return {"machine_info": {"node": "a"}, "benchmarks": benches}


def test_benchmark_runs_time_and_memory(tmp_path, capsys):
    old = _benchmark_json(0.010, 1_000_000)
    new = _benchmark_json(0.0125, 1_020_000, extra_bench=True)
    status, out, _ = _diff(tmp_path, old, new, capsys=capsys)
    assert status == 1
    assert "benchmarks/test_ce.py::test_ce[optimized] median time slowed 25.0%" in out
    assert "test_ce[optimized] peak_bytes grew 2.0% (977 KiB -> 996 KiB), limit 1%" in out
    assert "change: benchmark benchmarks/x.py::test_new added" in out
    faster = _benchmark_json(0.008, 1_000_000)
    status, out, _ = _diff(tmp_path, old, faster, capsys=capsys)
    assert status == 0 and "sped up 20.0%" in out


def test_history_entries_diff_like_their_contents(tmp_path, old, capsys):
    old_entry = {"kind": "bench", "git_commit": "a", "benchmark": _benchmark_json(0.01, 10)}
    new_entry = {"kind": "bench", "git_commit": "b", "benchmark": _benchmark_json(0.01, 20)}
    status, out, _ = _diff(tmp_path, old_entry, new_entry, capsys=capsys)
    assert status == 1 and "peak_bytes grew 100.0%" in out
    report_entry = {"kind": "compare", "git_commit": "a", "report": old}
    assert _diff(tmp_path, report_entry, old, capsys=capsys)[0] == 0


@pytest.mark.slow
def test_cli_subprocess_exit_code(tmp_path, old):
    new = copy.deepcopy(old)
    new["passed"] = False
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(new))
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness.cli",
            "diff",
            str(tmp_path / "old.json"),
            str(tmp_path / "new.json"),
        ],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard only
    )
    assert completed.returncode == 1, completed.stderr
    assert "passed turned false" in completed.stdout
