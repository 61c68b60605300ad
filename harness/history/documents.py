"""The documents `diff`, `bench` and the dashboard read: a compare report, a `twinpipe bench`
history entry (wrapping one), or pytest-benchmark JSON; which one a parsed file is, and
whether its sections have the shapes their readers need.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.report import is_compare_report, read_json, report_problems


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
