"""harness.report: report.json, report.md, loss.png, memory.png and the terminal table."""

from __future__ import annotations

import copy
import json
import pathlib

import pytest

from harness.report import (
    ReportError,
    format_bytes,
    format_table,
    load_report,
    write_report,
)

DATA = pathlib.Path(__file__).resolve().parent / "data"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def report() -> dict:
    return json.loads((DATA / "compare_report.json").read_text())


def test_write_report_writes_json_markdown_and_both_plots(report, tmp_path):
    written = write_report(report, tmp_path / "out")
    assert set(written) == {"report.json", "report.md", "loss.png", "memory.png"}
    assert json.loads((tmp_path / "out" / "report.json").read_text()) == report
    for name in ("loss.png", "memory.png"):
        data = (tmp_path / "out" / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "PASSED: optimized vs reference" in markdown
    assert "| 0 | optimized | 10 MiB | 10 MiB | 20 MiB | 20 MiB | 60 MiB | nF0B1F1B0 mb2 |" in (
        markdown
    )
    assert "0.857 (act 0.667)" in markdown
    assert "layers.1.mlp.experts.down_proj" in markdown
    assert "![memory](memory.png)" in markdown
    assert "`tiny-deepseek-v2`" in markdown


def test_format_table_sets_both_stacks_side_by_side(report):
    table = format_table(report)
    lines = table.splitlines()
    assert lines[0] == "PASSED: optimized vs reference"
    header = next(line for line in lines if line.startswith("step"))
    assert "loss reference" in header and "loss optimized" in header
    step0 = next(line for line in lines if line.startswith("0 "))
    assert "10.434" in step0 and "1.703e-06" in step0
    rank1 = [line for line in lines if line.startswith("1  ")]
    assert any("nF0F1 mb1" in line and "0.893" in line for line in rank1)


def test_a_report_with_only_a_verdict_still_renders(tmp_path):
    minimal = {"passed": False}
    written = write_report(minimal, tmp_path)
    assert set(written) == {"report.json", "report.md"}
    assert format_table(minimal) == "FAILED: candidate vs baseline"
    assert "FAILED" in (tmp_path / "report.md").read_text()


def test_missing_memory_and_partial_sections(report, tmp_path):
    partial = copy.deepcopy(report)
    del partial["memory"], partial["time"], partial["grads"]["worst"]
    partial["loss"]["candidate"][2] = float("nan")
    partial["loss"]["rel_error"][2] = float("nan")
    written = write_report(partial, tmp_path)
    assert "memory.png" not in written and "loss.png" in written
    table = format_table(partial)
    assert "NaN" in table and "peak memory" not in table and "s/step" not in table

    one_sided = copy.deepcopy(report)
    del one_sided["memory"]["ranks"][0]["candidate"], one_sided["memory"]["ranks"][0]["ratio"]
    assert "memory.png" in write_report(one_sided, tmp_path / "one")


def test_load_report_names_the_file_when_it_is_not_a_report(tmp_path):
    missing = tmp_path / "missing.json"
    with pytest.raises(ReportError, match="missing.json: cannot read"):
        load_report(missing)
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    with pytest.raises(ReportError, match="garbage.json: not JSON"):
        load_report(garbage)
    other = tmp_path / "other.json"
    other.write_text('{"benchmarks": []}')
    with pytest.raises(ReportError, match="other.json: not a compare report"):
        load_report(other)
    with pytest.raises(ReportError):
        write_report({"loss": {}}, tmp_path)


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (10 * 2**20, "10 MiB"), (None, "-")],
)
def test_format_bytes(nbytes, text):
    assert format_bytes(nbytes) == text


def test_routing_lines_say_how_the_sides_routed():
    from harness.report.sections import routing_lines as _routing_lines

    assert _routing_lines({}) == []
    assert _routing_lines({"routing": {"mode": "free"}}) == [
        "routing: free (each side chose its own experts)"
    ]
    pinned = {"mode": "pinned", "choices": 1000, "swaps": 0, "max_gap": 0.0,
              "score_drift": 1e-7, "drift_limit": 1e-5, "problems": []}  # fmt: skip
    (line,) = _routing_lines({"routing": pinned})
    assert "1,000 expert choices" in line and line.endswith("chose the same everywhere")
    swapped = dict(pinned, swaps=3, max_gap=0.002, problems=["rank 0: scores differ"])
    lines = _routing_lines({"routing": swapped})
    assert "would have chosen 3 differently (worst gap 0.002)" in lines[0]
    assert "near-ties" not in lines[0]  # not claimed when the replay found problems
    assert lines[1] == "routing problem: rank 0: scores differ"
