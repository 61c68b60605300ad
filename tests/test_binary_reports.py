"""Binary files given to the harness's readers of JSON: an exit 2 naming the file and what
was expected, or, in a folder of many entries (the dashboard's history), a warned skip;
never an internal error (exit 3). With real binary bytes, through `harness.cli.main` in this
process (`twinpipe_here`: its exit code and what it wrote, as the command line has them; a
subprocess of the dashboard cost 15 s of CPU to import what this process already has)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests._cli import ROOT, twinpipe_here

DATA = ROOT / "tests" / "data"
PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"


def _binaries(folder: Path) -> dict[str, Path]:
    """Random bytes, and a PNG header followed by random bytes, each named ``*.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {"random": folder / "random.json", "png": folder / "image.json"}
    files["random"].write_bytes(os.urandom(256))
    files["png"].write_bytes(PNG + os.urandom(256))
    return files


def _refused(result, path: Path) -> None:
    assert result.returncode == 2, result.stderr
    assert str(path) in result.stderr, result.stderr
    assert "expected a JSON file" in result.stderr, result.stderr
    assert "internal error" not in result.stderr and "Traceback" not in result.stderr


def test_diff_refuses_a_binary_file_naming_it(tmp_path):
    binaries = _binaries(tmp_path)
    report = str(DATA / "compare_report.json")
    _refused(twinpipe_here("diff", str(binaries["random"]), report), binaries["random"])
    _refused(twinpipe_here("diff", report, str(binaries["png"])), binaries["png"])


def test_bench_add_report_refuses_a_binary_file_naming_it(tmp_path):
    binaries = _binaries(tmp_path)
    history = tmp_path / "history"
    for binary in binaries.values():
        result = twinpipe_here("bench", "--add-report", str(binary), "--history", str(history))
        _refused(result, binary)
    assert not history.exists() or not list(history.iterdir())  # nothing was added


@pytest.mark.slow
def test_the_dashboard_skips_binary_history_entries_and_draws_the_rest(tmp_path):
    history = tmp_path / "history"
    binaries = _binaries(history)
    good = json.loads((DATA / "compare_report.json").read_text())
    entry = {"kind": "compare", "git_commit": "abcdef123456", "date": "2026-11-20T10:00:00Z",
             "machine": "test machine", "report": good}  # fmt: skip
    (history / "compare-1.json").write_text(json.dumps(entry))
    result = twinpipe_here("dashboard", str(history), "--out", str(tmp_path / "site"))
    assert result.returncode == 0, result.stderr
    for path in binaries.values():
        assert f"skipping {path}: not a text file" in result.stderr, result.stderr
    page = (tmp_path / "site" / "index.html").read_text()
    assert "abcdef1" in page  # the good entry is drawn
