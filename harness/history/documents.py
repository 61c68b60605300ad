"""The documents `diff`, `bench` and the dashboard read: a compare report, a `twinpipe bench`
history entry (wrapping one), or pytest-benchmark JSON; which one a parsed file is, whether
its sections have the shapes their readers need, the device its figures come from, and the
history folder's entries (`read_history`).
"""

from __future__ import annotations

import datetime as dt
import os
import sys
from pathlib import Path
from typing import Any

from harness.report import (
    ReportError,
    is_compare_report,
    read_json,
    report_device,
    report_problems,
)


class InputError(ValueError):
    """An input file is missing, not JSON, or not something `diff` understands."""


def load_document(path: str | Path) -> tuple[str, dict[str, Any]]:
    """Read ``path`` as ``("compare", report)`` or ``("bench", pytest-benchmark JSON)``."""
    path = Path(path)
    document = read_json(path, InputError)
    kind, payload = classify(document)
    if kind is None:
        raise InputError(
            f"{path}: not a compare report (an object with a boolean 'passed'), "
            "a `twinpipe bench` history entry, or pytest-benchmark JSON (with 'benchmarks')"
        )
    problems = report_problems(payload) if kind == "compare" else benchmark_problems(payload)
    if problems:
        raise InputError(f"{path}: malformed {kind} document:\n  " + "\n  ".join(problems))
    return kind, payload


def benchmark_problems(document: dict[str, Any]) -> list[str]:
    """Every benchmark entry whose shape `diff` would choke on; empty when well formed."""
    problems = []
    for i, bench in enumerate(document.get("benchmarks") or []):
        if not isinstance(bench, dict):
            problems.append(f"benchmarks[{i}] = {bench!r:.60}: expected an object")
            continue
        for key in ("stats", "extra_info"):
            if bench.get(key) is not None and not isinstance(bench[key], dict):
                problems.append(f"benchmarks[{i}].{key} = {bench[key]!r:.60}: expected an object")
    return problems


def classify(document: Any) -> tuple[str | None, dict[str, Any]]:
    """The kind of a parsed document and the part of it that is compared."""
    if not isinstance(document, dict):
        return None, {}
    if document.get("kind") == "compare" and is_compare_report(document.get("report")):
        return "compare", document["report"]
    if document.get("kind") == "bench" and is_benchmark_json(document.get("benchmark")):
        return "bench", document["benchmark"]
    if is_compare_report(document):
        return "compare", document
    if is_benchmark_json(document):
        return "bench", document
    return None, {}


def is_benchmark_json(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("benchmarks"), list)


def document_device(kind: str, payload: dict[str, Any]) -> tuple[str, str] | None:
    """``(type, name)`` of the device a document's figures were measured on: a compare
    report's ``device`` (`harness.report.report_device`: ``cpu`` for reports written before
    it was recorded), or the device its benchmarks name in ``extra_info`` (``cuda:0`` ->
    ``cuda``); None when a benchmark run names none."""
    if kind == "compare":
        return report_device(payload)
    kinds, names = set(), set()
    for bench in payload.get("benchmarks") or []:
        extra = bench.get("extra_info") or {}
        if isinstance(extra.get("device"), str) and extra["device"]:
            kinds.add(extra["device"].split(":")[0])
        if isinstance(extra.get("device_name"), str):
            names.add(extra["device_name"])
    if not kinds:
        return None
    return "+".join(sorted(kinds)), ", ".join(sorted(names))


def device_mismatch(old: tuple[str, str] | None, new: tuple[str, str] | None) -> str | None:
    """Why two documents' figures cannot be compared (measured on a CPU and on a GPU), or
    None. Times and peaks of different devices differ by their nature, not by a change."""
    if old is None or new is None or old[0] == new[0]:
        return None

    def named(device: tuple[str, str]) -> str:
        return f"{device[0]} ({device[1]})" if device[1] else device[0]

    return (
        f"the old document was measured on {named(old)} and the new one on {named(new)}; "
        "their times and peak memory are not comparable (different devices differ by their "
        "nature, not by a change): diff two documents of the same device"
    )


def read_history(history_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every entry in the history folder, oldest first; a file that cannot be read, is not
    text or not JSON, or is no entry is skipped with a warning naming it (one bad file
    never hides the rest of the history)."""
    entries = []
    for path in sorted(Path(history_dir).glob("*.json")):
        try:
            entry = read_json(path, ReportError)
        except ReportError as error:
            print(f"twinpipe: skipping {error}", file=sys.stderr)
            continue
        if isinstance(entry, dict) and entry.get("kind") == "compare":
            problems = report_problems(entry.get("report") or {})
            if problems:
                print(f"twinpipe: skipping {path}: {'; '.join(problems)}", file=sys.stderr)
                continue
        if not isinstance(entry, dict) or entry.get("kind") not in ("bench", "compare"):
            kind, payload = classify(entry)
            if kind is None:
                print(f"twinpipe: skipping {path}: not a history entry", file=sys.stderr)
                continue
            if kind == "compare" and report_problems(payload):
                problems = "; ".join(report_problems(payload))
                print(f"twinpipe: skipping {path}: {problems}", file=sys.stderr)
                continue
            # A bare report or benchmark JSON dropped into the folder: wrap it.
            entry = {
                "kind": kind,
                "git_commit": _bare_commit(kind, payload),
                "date": _bare_date(kind, payload, path),
                "machine": payload.get("machine") if kind == "compare" else None,
                ("benchmark" if kind == "bench" else "report"): payload,
            }
        entry["_file"] = path.name
        entries.append(entry)
    entries.sort(key=lambda e: (str(e.get("date") or ""), e["_file"]))
    return entries


def _bare_commit(kind: str, payload: dict[str, Any]) -> str:
    if kind == "compare":
        return str(payload.get("git_commit") or "unknown")
    commit_info = payload.get("commit_info") or {}
    return str(commit_info.get("id") or "unknown")[:12]


def _bare_date(kind: str, payload: dict[str, Any], path: Path) -> str:
    if kind == "bench" and payload.get("datetime"):
        return str(payload["datetime"])
    modified = dt.datetime.fromtimestamp(path.stat().st_mtime, dt.timezone.utc)
    return modified.strftime("%Y-%m-%dT%H:%M:%SZ")
