"""`twinpipe bench` (history of runs) and `twinpipe dashboard` (the static page drawn from it)."""

from __future__ import annotations

import copy
import json
import pathlib

import pytest

from harness.cli import main
from harness.history import bench, dashboard

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


SAMPLE = '''"""A tiny benchmark suite shaped like benchmarks/: an op and its plain counterpart."""

import math

import pytest


def _softmax_fused(row):
    top = max(row)
    exp = [math.exp(x - top) for x in row]
    total = math.fsum(exp)
    return [e / total for e in exp]


def _softmax_plain(row):
    exp = [math.exp(x) for x in row]
    return [e / sum(exp) for e in exp]


@pytest.mark.benchmark(group="softmax")
@pytest.mark.parametrize("impl", ["optimized", "plain"])
def test_softmax(benchmark, impl):
    row = [math.sin(i) for i in range(128)]
    fn = _softmax_fused if impl == "optimized" else _softmax_plain
    out = benchmark.pedantic(fn, args=(row,), rounds=3, iterations=1, warmup_rounds=0)
    benchmark.extra_info["impl"] = impl
    benchmark.extra_info["peak_bytes"] = 8 * len(out) * (1 if impl == "optimized" else 2)
    assert abs(math.fsum(out) - 1) < 1e-9
'''
"""tests/data/bench_sample's suite without torch, for a folder outside the checkout: its
pytest then loads neither torch nor tests/conftest.py (2 s of CPU a run instead of 7)."""


def _sample(folder: pathlib.Path) -> str:
    folder.mkdir()
    (folder / "test_tiny_bench.py").write_text(SAMPLE)
    return str(folder)


@pytest.mark.slow
def test_bench_runs_pytest_benchmark_and_appends_to_the_history(tmp_path, capsys):
    history = tmp_path / "history"
    sample = _sample(tmp_path / "bench_sample")
    status = main(["bench", "--benchmarks", sample, "--history", str(history)])
    assert status == 0, capsys.readouterr()
    (entry_path,) = history.glob("bench-*.json")
    entry = json.loads(entry_path.read_text())
    assert entry["kind"] == "bench"
    assert entry["git_commit"] and entry["date"].endswith("Z") and "CPU cores" in entry["machine"]
    assert entry["git_commit"].split("-")[0] in entry_path.name
    names = sorted(b["name"] for b in entry["benchmark"]["benchmarks"])
    assert names == ["test_softmax[optimized]", "test_softmax[plain]"]
    assert all(b["extra_info"]["peak_bytes"] > 0 for b in entry["benchmark"]["benchmarks"])

    # A compare report joins the same history, stamped with its own commit.
    assert (
        main(
            ["bench", "--add-report", str(DATA / "compare_report.json"), "--history", str(history)]
        )
        == 0
    )
    (compare_path,) = history.glob("compare-*.json")
    assert "0c6fbe0d1e2f" in compare_path.name
    kinds = [e["kind"] for e in bench.read_history(history)]
    assert sorted(kinds) == ["bench", "compare"]

    # Nothing collected (-k matches nothing): non-zero exit, history unchanged.
    status = main(
        [
            "bench",
            "--benchmarks",
            sample,
            "--history",
            str(history),
            "-k",
            "no_such_benchmark",
        ]
    )
    assert status == 2  # bad input: the selection is empty (pytest's own code is 5)
    assert len(list(history.glob("*.json"))) == 2


def test_bench_bad_inputs(tmp_path, capsys):
    assert main(["bench", "--benchmarks", str(tmp_path / "nowhere")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    not_report = tmp_path / "x.json"
    not_report.write_text("[]")
    assert main(["bench", "--add-report", str(not_report), "--history", str(tmp_path)]) == 2
    assert "x.json: not a compare report" in capsys.readouterr().err


def _bench(name: str, group: str, impl: str, median: float, peak: int) -> dict:
    return {
        "name": f"{name}[{impl}-256x32000]",
        "fullname": f"benchmarks/test_{group}.py::{name}[{impl}-256x32000]",
        "group": group,
        "params": {"impl": impl, "shape": "256x32000"},
        "stats": {"median": median, "mean": median},
        "extra_info": {"peak_bytes": peak},
    }


def _write_history(history: pathlib.Path) -> None:
    """Three commits: the fused cross-entropy speeds up, the third compare run fails."""
    history.mkdir()
    report = json.loads((DATA / "compare_report.json").read_text())
    for i, commit in enumerate(["aaaaaaa1111", "bbbbbbb2222", "ccccccc3333"]):
        benches = [
            _bench(
                "test_cross_entropy", "cross_entropy", "optimized", 0.010 - 0.002 * i, 32_768_000
            ),
            _bench("test_cross_entropy", "cross_entropy", "plain", 0.025, 122_880_000),
            _bench("test_gather", "padded_gather", "optimized", 0.0004, 1_048_576),
            _bench("test_gather", "padded_gather", "torch", 0.0006, 2_097_152),
        ]
        entry = {
            "kind": "bench",
            "git_commit": commit,
            "date": f"2026-11-2{i}T10:00:00Z",
            "machine": "test machine",
            "benchmark": {"benchmarks": benches},
        }
        (history / f"bench-{i}.json").write_text(json.dumps(entry))
        compare = copy.deepcopy(report)
        compare["git_commit"] = commit
        compare["memory"]["ranks"][1]["candidate"]["total"] = 50_000_000 + i * 1_000_000
        compare["passed"] = i != 2
        entry = {
            "kind": "compare",
            "git_commit": commit,
            "date": f"2026-11-2{i}T11:00:00Z",
            "machine": "test machine",
            "report": compare,
        }
        (history / f"compare-{i}.json").write_text(json.dumps(entry))
    (history / "notes.json").write_text('{"unrelated": true}')  # skipped, not fatal


def test_pairing_of_benchmarks_by_op_and_role():
    optimized = _bench("test_ce", "cross_entropy", "optimized", 1.0, 1)
    plain = _bench("test_ce", "cross_entropy", "plain", 1.0, 1)
    assert dashboard.benchmark_role(optimized) == "optimized"
    assert dashboard.benchmark_role(plain) == "plain"
    assert dashboard.benchmark_op_and_variant(optimized) == ("cross_entropy", "256x32000")
    assert dashboard.benchmark_op_and_variant(plain) == ("cross_entropy", "256x32000")
    no_group = {"name": "test_gather_torch", "stats": {"median": 1.0}}
    assert dashboard.benchmark_op_and_variant(no_group) == ("gather", "")
    assert dashboard.benchmark_role(no_group) == "plain"
    # The convention of benchmarks/_common.py: group = op, extra_info implementation and peak.
    theirs = {
        "name": "test_gather_rows[plain]",
        "group": "gather_rows",
        "params": {},
        "extra_info": {
            "op": "gather_rows",
            "implementation": "plain",
            "peak_memory_bytes": 4096,
            "hidden": 256,
        },
    }
    assert dashboard.benchmark_op_and_variant(theirs) == ("gather_rows", "")
    assert dashboard.benchmark_role(theirs) == "plain"
    assert dashboard.peak_bytes(theirs) == 4096
    # A second plain implementation is kept beside the pair, not mixed into it.
    second = {
        "name": "test_gather_rows[plain_float32]",
        "group": "gather_rows",
        "stats": {"median": 3.0},
        "extra_info": {"implementation": "plain_float32"},
    }
    assert dashboard.benchmark_role(second) == "plain"
    runs = [
        {
            "kind": "bench",
            "git_commit": "c",
            "date": "d",
            "benchmark": {
                "benchmarks": [
                    dict(theirs, stats={"median": 2.0}),
                    second,
                    {
                        "name": "test_gather_rows[optimized]",
                        "group": "gather_rows",
                        "stats": {"median": 1.0},
                        "extra_info": {"implementation": "optimized", "peak_memory_bytes": 1024},
                    },
                ]
            },
        }
    ]
    (point,) = dashboard.collect_ops(runs)["gather_rows"][""]
    assert (point.optimized_time, point.plain_time, point.speedup) == (1.0, 2.0, 2.0)
    assert point.memory_ratio == 0.25
    assert point.others == {"plain_float32": {"role": "plain", "time": 3.0, "peak": None}}
    by_extra = {"name": "test_x", "extra_info": {"impl": "reference", "memory_bytes": 7}}
    assert dashboard.benchmark_role(by_extra) == "plain"
    assert dashboard.peak_bytes(by_extra) == 7


@pytest.mark.slow
def test_dashboard_page_holds_the_figures_it_was_given(tmp_path, capsys):
    history = tmp_path / "history"
    _write_history(history)
    site = tmp_path / "site"
    assert main(["dashboard", str(history), "--out", str(site)]) == 0
    page = (site / "index.html").read_text()

    assert "3 benchmark runs and 3 compare runs" in page
    # Latest cross-entropy: 6 ms optimized vs 25 ms plain, 31.2 MiB vs 117 MiB.
    assert "cross_entropy" in page and "padded_gather" in page
    assert "<td>6 ms</td><td>25 ms</td>" in page
    assert "4.17x" in page  # 25 / 6
    assert "31.2 MiB" in page and "117 MiB" in page and "0.27x" in page
    assert "1.50x" in page  # padded_gather: 0.6 ms / 0.4 ms
    # Every commit appears; the failed compare run is marked.
    for commit in ("aaaaaaa1111", "bbbbbbb2222", "ccccccc3333"):
        assert commit in page
    assert "FAILED" in page and "passed" in page
    assert "56 MiB -> 49.6 MiB" in page  # rank 1 candidate peak of the third run: 52,000,000 bytes

    images = {
        "op-cross-entropy.png",
        "op-padded-gather.png",
        "compare-memory.png",
        "compare-agreement.png",
    }
    for image in images:
        assert f"src='{image}'" in page
        data = (site / image).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    assert "notes.json" in capsys.readouterr().err


@pytest.mark.slow
def test_a_gpu_run_is_its_own_series(tmp_path):
    """A history that holds CPU runs and one GPU run: the GPU's op figures form a series of
    their own, named after the device, and its compare run gets its own section; no CPU
    series holds a GPU figure."""
    history = tmp_path / "history"
    _write_history(history)
    gpu = {"device": "cuda:0", "device_name": "NVIDIA H100 80GB HBM3"}
    benches = [
        dict(_bench("test_cross_entropy", "cross_entropy", impl, median, 1), extra_info=gpu)
        for impl, median in (("optimized", 0.0008), ("plain", 0.0016))
    ]
    entry = {"kind": "bench", "git_commit": "ddddddd4444", "date": "2026-11-27T10:00:00Z",
             "machine": "gpu machine", "benchmark": {"benchmarks": benches}}  # fmt: skip
    (history / "bench-3.json").write_text(json.dumps(entry))
    report = json.loads((DATA / "compare_report.json").read_text())
    report["device"] = {"type": "cuda", "name": "NVIDIA H100 80GB HBM3"}
    entry = {"kind": "compare", "git_commit": "ddddddd4444", "date": "2026-11-27T11:00:00Z",
             "machine": "gpu machine", "report": report}  # fmt: skip
    (history / "compare-3.json").write_text(json.dumps(entry))

    entries = bench.read_history(history)
    series = dashboard.collect_ops(entries)["cross_entropy"]
    on_gpu = "256x32000 on cuda (NVIDIA H100 80GB HBM3)"
    assert sorted(series) == ["256x32000", on_gpu]
    assert [p.commit for p in series["256x32000"]] == ["aaaaaaa1111", "bbbbbbb2222", "ccccccc3333"]
    (point,) = series[on_gpu]
    assert (point.optimized_time, point.plain_time, point.speedup) == (0.0008, 0.0016, 2.0)
    runs = dashboard.collect_compare(entries)
    assert [r.device for r in runs] == ["cpu"] * 3 + ["cuda (NVIDIA H100 80GB HBM3)"]

    site = tmp_path / "site"
    assert main(["dashboard", str(history), "--out", str(site)]) == 0
    page = (site / "index.html").read_text()
    assert "Compare runs: optimized against reference on cpu</h2>" in page
    assert "on cuda (NVIDIA H100 80GB HBM3)</h2>" in page
    for image in ("compare-memory-cpu.png", "compare-memory-cuda-nvidia-h100-80gb-hbm3.png"):
        assert f"src='{image}'" in page
        assert (site / image).read_bytes().startswith(PNG_MAGIC)
    # The CPU section's table lists the three CPU commits only.
    cpu_section = page.split("on cpu</h2>")[1].split("<h2>")[0]
    assert "ccccccc3333" in cpu_section and "ddddddd4444" not in cpu_section


def test_dashboard_of_an_empty_or_missing_history(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["dashboard", str(tmp_path / "empty"), "--out", str(tmp_path / "site")]) == 0
    assert "history is empty" in (tmp_path / "site" / "index.html").read_text()
    assert main(["dashboard", str(tmp_path / "missing"), "--out", str(tmp_path / "s")]) == 2
    assert "no such history folder" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["bench", "compare"])
def test_history_reads_bare_files_dropped_into_the_folder(tmp_path, kind):
    if kind == "bench":
        payload = {
            "benchmarks": [],
            "datetime": "2026-01-01T00:00:00",
            "commit_info": {"id": "0123456789abcdef"},
        }
    else:
        payload = json.loads((DATA / "compare_report.json").read_text())
    (tmp_path / "bare.json").write_text(json.dumps(payload))
    (entry,) = bench.read_history(tmp_path)
    assert entry["kind"] == kind
    assert entry["git_commit"] in ("0123456789ab", "0c6fbe0d1e2f")


def _op_run(commit: str, date: str, extra: dict, optimized: float, plain: float) -> dict:
    benches = [
        dict(_bench("test_cross_entropy", "cross_entropy", impl, median, 1), extra_info=extra)
        for impl, median in (("optimized", optimized), ("plain", plain))
    ]
    return {"kind": "bench", "git_commit": commit, "date": date, "machine": "m",
            "benchmark": {"benchmarks": benches}}  # fmt: skip


def test_a_speedup_measured_through_the_interpreter_is_marked_not_coloured(tmp_path):
    """On a CPU the fused cross-entropy's Triton kernels ran through the interpreter: its
    0.02x is no slowdown, so it is drawn neutral with the badge and the page says why. A GPU
    run of the same op is the real comparison: its 0.5x is a regression, in red. A CPU op
    that launched no kernel (plain torch) measured a real CPU time, coloured; a run recorded
    before the Triton mode was is presumed interpreted when it ran on the CPU."""
    history = tmp_path / "history"
    history.mkdir()
    cpu = {"device": "cpu", "triton": "interpreter", "triton_launches": 4}
    gpu = {"device": "cuda:0", "device_name": "NVIDIA H100 80GB HBM3", "triton": "compiled",
           "triton_launches": 4}  # fmt: skip
    runs = [
        _op_run("aaaaaaa1111", "2026-11-20T10:00:00Z", cpu, 1.0, 0.02),
        _op_run("bbbbbbb2222", "2026-11-21T10:00:00Z", gpu, 0.002, 0.001),
    ]
    for i, run in enumerate(runs):
        (history / f"bench-{i}.json").write_text(json.dumps(run))
    entries = bench.read_history(history)
    series = dashboard.collect_ops(entries)["cross_entropy"]
    (on_cpu,) = series["256x32000"]
    (on_gpu,) = series["256x32000 on cuda (NVIDIA H100 80GB HBM3)"]
    assert on_cpu.interpreted and not on_gpu.interpreted
    assert (on_cpu.speedup, on_gpu.speedup) == (0.02, 0.5)

    site = tmp_path / "site"
    assert main(["dashboard", str(history), "--out", str(site), "--no-results"]) == 0
    page = (site / "index.html").read_text()
    summary = page.split("<h3")[0]
    assert "<p class='note'>" in summary and "Triton's interpreter" in summary
    badge = "Triton interpreter (CPU): not a speed measurement"
    assert f'<span class="neutral">0.02x</span> <span class="badge">{badge}</span>' in summary
    assert '<span class="bad">0.50x</span>' in summary  # the GPU's regression stays red
    assert '<span class="bad">0.02x</span>' not in page

    from harness.history.dashboard_data import triton_interpreted

    assert not triton_interpreted({"extra_info": dict(cpu, triton_launches=0)}, "cpu")
    assert triton_interpreted({"extra_info": {}}, "cpu")  # recorded before the mode was
    assert not triton_interpreted({"extra_info": {}}, "cuda (NVIDIA H100 80GB HBM3)")


def test_a_gpu_only_history_has_no_interpreter_note(tmp_path):
    history = tmp_path / "history"
    history.mkdir()
    gpu = {"device": "cuda:0", "device_name": "H100", "triton": "compiled", "triton_launches": 2}
    (history / "b.json").write_text(json.dumps(_op_run("c", "2026-11-21T10:00:00Z", gpu, 1, 2)))
    site = tmp_path / "site"
    assert main(["dashboard", str(history), "--out", str(site), "--no-results"]) == 0
    page = (site / "index.html").read_text()
    assert "class='note'" not in page and "badge" not in page.split("</style>")[1]
    assert '<span class="good">2.00x</span>' in page


def test_the_benchmarks_record_the_triton_kernels_an_op_launched():
    """What the dashboard keys off: a fused op launches Triton kernels, a plain one none."""
    import torch
    import torch.nn.functional as F

    from benchmarks._common import counting_triton_launches, triton_mode
    from optimized.ops import silu_and_mul

    x = torch.randn(4, 16)
    with counting_triton_launches() as fused:
        silu_and_mul(x)
    with counting_triton_launches() as plain:
        F.silu(x[:, :8]) * x[:, 8:]
    assert fused[0] >= 1 and plain[0] == 0
    assert triton_mode() == ("interpreter" if x.device.type == "cpu" else "compiled")


def _results(path: pathlib.Path, **change) -> pathlib.Path:
    entry = {
        "id": "suite-time", "topic": "tests", "what": "the whole suite's wall time",
        "figure": [23.3, 18.65], "unit": "min", "date": "2026-11-27", "date_basis": "measured",
        "commit": "6ba4c65", "command": "python -m pytest -q", "device": "cpu",
        "machine": "2-core CPU machine", "versions": {"torch": "2.13.0+cpu"}, **change,
    }  # fmt: skip
    path.write_text(json.dumps({"about": "test", "results": [entry]}))
    return path


def test_the_dashboard_shows_the_measured_results(tmp_path, capsys):
    history = tmp_path / "history"
    history.mkdir()
    results = _results(tmp_path / "results.json")
    site = tmp_path / "site"
    assert main(["dashboard", str(history), "--out", str(site), "--results", str(results)]) == 0
    page = (site / "index.html").read_text()
    section = page.split("<h2 id='measured-results'>Measured results</h2>")[1]
    assert "<h3>The tests</h3>" in section
    row = ("<td>suite-time</td><td>the whole suite&#x27;s wall time</td><td>23.3 / 18.65 min</td>"
           "<td>2026-11-27</td><td>6ba4c65</td><td>cpu</td><td>2-core CPU machine</td>"
           "<td><code>python -m pytest -q</code></td>")  # fmt: skip
    assert row in section
    # Without --results the checkout's docs/results.json is drawn; --no-results leaves it out.
    assert main(["dashboard", str(history), "--out", str(site)]) == 0
    assert "docs/results.json" in (site / "index.html").read_text()
    assert main(["dashboard", str(history), "--out", str(site), "--no-results"]) == 0
    assert "Measured results" not in (site / "index.html").read_text()
    # A malformed results file is bad input, named, and nothing is written.
    bad = _results(tmp_path / "bad.json", date="yesterday")
    assert (
        main(["dashboard", str(history), "--out", str(tmp_path / "s2"), "--results", str(bad)]) == 2
    )
    assert "date 'yesterday': expected YYYY-MM-DD" in capsys.readouterr().err
    assert not (tmp_path / "s2").exists()


def test_the_results_page_lists_every_result(tmp_path):
    from harness.history import results as measured

    document = measured.load_results(_results(tmp_path / "results.json"))
    document["about"] = "a | b"
    page = measured.render_markdown(document)
    assert page.startswith("# Measured results\n")
    assert '| <a id="suite-time"></a>`suite-time` |' in page and "a \\| b" in page
    assert "| 23.3 / 18.65 min | 2026-11-27, 6ba4c65 |" in page
    recorded = dict(document["results"][0], date_basis="recorded", figure=1188, unit="tests")
    assert "| 1,188 tests | 2026-11-27 (recorded), 6ba4c65 |" in measured.render_markdown(
        {"results": [recorded]}
    )
