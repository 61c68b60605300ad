"""The dashboard as a person sees it: `twinpipe dashboard`'s page loaded in a real headless
browser (Chromium, `tests/_browser.py`). It loads without a console error or a missing
resource, its tables hold the history's figures, and every plot is an image the browser
decoded; a speed-up measured through Triton's interpreter is shown neutral, with its note,
and the checkout's measured results close the page.

Chromium comes from the system's package registry (Debian: ``apt-get install chromium``;
``.ci/run`` installs it). Without it the test is skipped, except where ``CI`` is set: there
a missing browser fails.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from harness.cli import main
from tests._browser import Browser, find_chromium

REPORT = Path(__file__).resolve().parent / "data" / "report_0cb0a31" / "report.json"
COMMITS = ("aaaaaaa1111", "bbbbbbb2222")


def _bench(name: str, group: str, impl: str, median: float, peak: int, launches: int) -> dict:
    """A CPU benchmark as `benchmarks/_common.py` records it: the Triton mode, and the kernels
    one run launched (the fused cross-entropy launches Triton kernels, the gather none)."""
    return {
        "name": f"{name}[{impl}]",
        "fullname": f"benchmarks/bench_{group}.py::{name}[{impl}]",
        "group": group,
        "params": {"impl": impl},
        "stats": {"median": median, "mean": median},
        "extra_info": {"peak_bytes": peak, "device": "cpu", "triton": "interpreter",
                       "triton_launches": launches},
    }  # fmt: skip


def _history(folder: Path) -> None:
    """Two commits of two ops on a CPU (the fused cross-entropy 10 ms, then 6 ms, against plain
    PyTorch's 25 ms, through Triton's interpreter; the gather 0.6 ms against 0.4 ms, plain
    torch), and a compare report of each commit: the real one of
    ``tests/data/report_0cb0a31``, then the same failed, its rank 1 candidate peak at 40 MB."""
    folder.mkdir()
    report = json.loads(REPORT.read_text())
    for i, commit in enumerate(COMMITS):
        benches = [
            _bench("test_cross_entropy", "cross_entropy", "optimized", 0.010 - 0.004 * i, 32 << 20,
                   2),
            _bench("test_cross_entropy", "cross_entropy", "plain", 0.025, 120 << 20, 0),
            _bench("test_gather", "gather_rows", "optimized", 0.0006, 1 << 20, 0),
            _bench("test_gather", "gather_rows", "plain", 0.0004, 2 << 20, 0),
        ]  # fmt: skip
        bench = {"kind": "bench", "git_commit": commit, "date": f"2026-11-2{i}T10:00:00Z",
                 "machine": "test machine", "benchmark": {"benchmarks": benches}}  # fmt: skip
        (folder / f"bench-{i}.json").write_text(json.dumps(bench))
        report["git_commit"] = commit
        if i:
            rank = report["memory"]["ranks"][1]
            rank["candidate"]["total"] = 40_000_000
            rank["ratio"] = 40_000_000 / rank["baseline"]["total"]
            report["passed"] = False
        compare = {"kind": "compare", "git_commit": commit, "date": f"2026-11-2{i}T11:00:00Z",
                   "machine": "test machine", "report": report}  # fmt: skip
        (folder / f"compare-{i}.json").write_text(json.dumps(compare))


@pytest.fixture(scope="module")
def chromium() -> str:
    found = find_chromium()
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("CI is set and chromium is not installed (.ci/run installs it)")
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    return found


TABLES = """[...document.querySelectorAll('table')].map(table =>
    [...table.rows].map(row => [...row.cells].map(cell => cell.textContent.trim())))"""
SPEEDUPS = """[...[...document.querySelectorAll('table')][0].querySelectorAll('tbody tr')]
    .map(row => { const cell = row.cells[4].querySelector('span');
      return [row.cells[0].textContent.trim(), cell.className, getComputedStyle(cell).color]; })"""
IMAGES = """[...document.images].map(image => ({src: image.getAttribute('src'),
    complete: image.complete, width: image.naturalWidth, height: image.naturalHeight}))"""


def test_the_dashboard_renders_in_a_browser(tmp_path, chromium, capsys):
    history, site = tmp_path / "history", tmp_path / "site"
    _history(history)
    assert main(["dashboard", str(history), "--out", str(site)]) == 0
    with Browser(chromium, tmp_path / "profile") as browser:
        page = browser.load((site / "index.html").as_uri())
        title = page.evaluate("document.title")
        tables = page.evaluate(TABLES)
        speedups = page.evaluate(SPEEDUPS)
        notes = page.evaluate("[...document.querySelectorAll('.note')].map(n => n.textContent)")
        headings = page.evaluate("[...document.querySelectorAll('h2')].map(h => h.textContent)")
        images = page.evaluate(IMAGES)
        errors = page.console_errors()
    assert errors == [], errors
    assert title == "twinpipe dashboard"

    # The latest run of each op, optimized against plain: times, speed-up, peaks, ratio.
    summary = {row[0]: row for row in tables[0][1:]}
    assert tables[0][0][:5] == ["op", "variant", "optimized time", "plain time", "speed-up"]
    interpreted = "4.17x Triton interpreter (CPU): not a speed measurement"
    assert summary["cross_entropy"][2:] == [
        "6 ms", "25 ms", interpreted, "32 MiB", "120 MiB", "0.27x", "bbbbbbb2222"
    ]  # fmt: skip
    assert summary["gather_rows"][2:] == [
        "600 us", "400 us", "0.67x", "1 MiB", "2 MiB", "0.50x", "bbbbbbb2222"
    ]  # fmt: skip
    # The interpreted speed-up is drawn neutral (grey), not as a gain or a regression; the
    # gather, which launched no Triton kernel, measured a real CPU time: red when slower.
    colours = {op: (css, colour) for op, css, colour in speedups}
    assert colours["cross_entropy"] == ("neutral", "rgb(102, 102, 102)")
    assert colours["gather_rows"] == ("bad", "rgb(178, 34, 34)")
    assert len(notes) == 1 and "Triton's interpreter" in notes[0] and "GPU" in notes[0]
    # Each op's history: one row per commit.
    assert [[row[0], row[3], row[5]] for row in tables[1][1:]] == [
        ["aaaaaaa1111", "10 ms", "2.50x Triton interpreter (CPU): not a speed measurement"],
        ["bbbbbbb2222", "6 ms", interpreted],
    ]  # fmt: skip
    assert [[row[0], row[3]] for row in tables[2][1:]] == [
        ["aaaaaaa1111", "600 us"], ["bbbbbbb2222", "600 us"]
    ]  # fmt: skip
    # The compare runs: verdict, agreement, each rank's peaks (and ratio) from the report.
    compare = tables[3]
    assert compare[0][:6] == ["commit", "date", "verdict", "loss rel err", "grad rel err",
                              "grad 1-cos"]  # fmt: skip
    agreement = ["1.16e-05", "0.0144", "0.000104"]
    assert compare[1][:7] == ["aaaaaaa1111", "2026-11-20T11:00:00Z", "passed", *agreement,
                              "4.25 MiB -> 1.98 MiB (0.47x)"]  # fmt: skip
    assert compare[2][:3] == ["bbbbbbb2222", "2026-11-21T11:00:00Z", "FAILED"]
    rank1 = compare[0].index("rank 1 peak (baseline -> candidate)")
    assert compare[1][rank1] == "4.24 MiB -> 1.98 MiB (0.47x)"
    assert compare[2][rank1] == "4.24 MiB -> 38.1 MiB (9.00x)"

    # The measured results of the checkout's docs/results.json, one table per topic.
    assert headings[-1] == "Measured results"
    results = {row[0]: row for table in tables[4:] for row in table[1:]}
    assert tables[4][0][:3] == ["id", "what", "figure"]
    assert results["suite-size"][2] == "1,188 tests"
    assert results["compare-default-wall-time"][3] == "2026-11-27"

    # Every plot is an image the browser decoded, with a size.
    sources = sorted(image["src"] for image in images)
    assert sources == [
        "compare-agreement.png", "compare-memory.png", "op-cross-entropy.png", "op-gather-rows.png"
    ]  # fmt: skip
    for image in images:
        assert image["complete"] and image["width"] > 100 and image["height"] > 100, image
