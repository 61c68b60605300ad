"""`twinpipe diff OLD.json NEW.json`: did this change make anything worse?

What a kernel author runs before merging: a compare report (or a benchmark run)
from main against one from the branch. Inputs may be compare reports,
history entries written by `twinpipe bench`, or pytest-benchmark JSON; both
files must be of the same kind.

A regression is:

- ``passed`` turning false;
- a loss, gradient or parameter error (largest over steps) growing by more than
  ``--error-tolerance`` (relative; 0 by default: errors may not grow at all),
  or becoming NaN;
- a tolerance being loosened (the numerics policy never loosens one to pass);
- a rank's peak memory, on either stack, growing by more than
  ``--memory-tolerance`` (1% by default); in benchmarks, any ``extra_info``
  figure whose name says bytes or memory;
- time per step (median over steps) or a benchmark's median time growing by
  more than ``--time-tolerance`` (10% by default, the noise margin);
- a figure the old document has and the new one lacks (a memory, time or error
  figure, a rank's memory, a whole benchmark): what was not measured cannot pass.

Everything else that changed (configuration, machine, benchmarks or figures added,
improvements) is reported as information. Two documents measured on different
devices (a CPU report and a CUDA one, or benchmark runs whose ``extra_info`` name a CPU
and a GPU) are refused: a GPU's times and peaks against a CPU's say nothing about a change.

Exit status: 1 on a regression, 0 otherwise, 2 when an input is missing, not a text or
JSON file, not a report, malformed (a section of the wrong shape), or of another device
than the other; a crash is 3 (`harness.cli`), never 1.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.history.diff_judge import (  # noqa: F401 - Tolerances and DiffResult are part of this API
    DiffResult,
    Tolerances,
    as_number,
    change_lines,
    format_seconds,
    judge,
    series_max,
)
from harness.history.documents import (
    InputError,
    device_mismatch,
    document_device,
    load_document,
)
from harness.report import format_bytes

EXIT_OK, EXIT_REGRESSION, EXIT_BAD_INPUT = 0, 1, 2

# (section, field, words) of the error series checked in a compare report.
ERROR_SERIES = (
    ("loss", "rel_error", "loss relative error"),
    ("grads", "max_rel_error", "gradient max relative error"),
    ("grads", "max_one_minus_cos", "gradient max 1-cos"),
    ("params", "max_rel_error", "parameter max relative error"),
)
# Sections whose numbers are judged by rules here, not listed as plain changes.
JUDGED_SECTIONS = ("passed", "loss", "grads", "params", "memory", "time", "tolerance")
IGNORED_FIELDS = ("git_commit", "date", "datetime")


# ---------------------------------------------------------------------- compare reports


def diff_reports(old: dict[str, Any], new: dict[str, Any], tol: Tolerances) -> DiffResult:
    """Judge two compare reports."""
    result = DiffResult("compare")
    if old.get("passed") and not new.get("passed"):
        result.regressions.append("passed turned false: the new report fails its own checks")
    elif not old.get("passed") and new.get("passed"):
        result.improvements.append("passed turned true")

    for section, name, words in ERROR_SERIES:
        old_max = series_max((old.get(section) or {}).get(name))
        new_max = series_max((new.get(section) or {}).get(name))
        judge(result, f"{words} (max over steps)", old_max, new_max, tol.error)

    _judge_tolerances(result, old.get("tolerance") or {}, new.get("tolerance") or {})
    _judge_memory(result, old, new, tol)
    _judge_time(result, old, new, tol)

    rest_old = {k: v for k, v in old.items() if k not in JUDGED_SECTIONS + IGNORED_FIELDS}
    rest_new = {k: v for k, v in new.items() if k not in JUDGED_SECTIONS + IGNORED_FIELDS}
    result.changes += change_lines(rest_old, rest_new, "report")
    return result


def _judge_tolerances(result: DiffResult, old: dict[str, Any], new: dict[str, Any]) -> None:
    for key in sorted(set(old) | set(new)):
        old_value, new_value = as_number(old.get(key)), as_number(new.get(key))
        if old_value is None or new_value is None:
            if old.get(key) != new.get(key):
                result.changes.append(f"tolerance {key}: {old.get(key)!r} -> {new.get(key)!r}")
        elif new_value > old_value:
            result.regressions.append(
                f"tolerance {key} loosened from {old_value:g} to {new_value:g}"
            )
        elif new_value < old_value:
            result.improvements.append(
                f"tolerance {key} tightened from {old_value:g} to {new_value:g}"
            )


def _memory_by_rank(report: dict[str, Any]) -> dict[Any, dict[str, Any]]:
    ranks = (report.get("memory") or {}).get("ranks") or []
    return {entry.get("rank", i): entry for i, entry in enumerate(ranks) if isinstance(entry, dict)}


def _judge_memory(result: DiffResult, old: dict, new: dict, tol: Tolerances) -> None:
    old_ranks, new_ranks = _memory_by_rank(old), _memory_by_rank(new)
    names = {"baseline": new.get("baseline", "baseline"), "candidate": new.get("candidate")}
    for rank in sorted(set(old_ranks) | set(new_ranks), key=str):
        if rank not in new_ranks:
            result.regressions.append(
                f"rank {rank}: memory figures are missing from the new report "
                "(what was not measured cannot pass)"
            )
            continue
        if rank not in old_ranks:
            result.changes.append(f"rank {rank}: memory figures added")
            continue
        for side in ("baseline", "candidate"):
            old_total = as_number((old_ranks[rank].get(side) or {}).get("total"))
            new_total = as_number((new_ranks[rank].get(side) or {}).get("total"))
            label = side if names[side] in (None, side) else f"{side} ({names[side]})"
            judge(
                result,
                f"rank {rank} {label} peak memory",
                old_total,
                new_total,
                tol.memory,
                show=format_bytes,
            )


def _judge_time(result: DiffResult, old: dict, new: dict, tol: Tolerances) -> None:
    old_time, new_time = old.get("time") or {}, new.get("time") or {}
    for side in ("baseline", "candidate"):
        old_median, new_median = _median(old_time.get(side)), _median(new_time.get(side))
        judge(
            result,
            f"{side} time per step (median)",
            old_median,
            new_median,
            tol.time,
            show=format_seconds,
            verb=("slowed", "sped up"),
        )


def _median(values: Any) -> float | None:
    if not isinstance(values, list):
        return None
    numbers = [v for v in (as_number(x) for x in values) if v is not None and not math.isnan(v)]
    return statistics.median(numbers) if numbers else None


# ---------------------------------------------------------------------- benchmarks


def _benchmarks_by_name(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found = {}
    for bench in document.get("benchmarks") or []:
        if isinstance(bench, dict):
            found[str(bench.get("fullname") or bench.get("name"))] = bench
    return found


def _is_memory_key(key: str) -> bool:
    key = key.lower()
    return "bytes" in key or "memory" in key or key.endswith("_mem")


def _is_error_key(key: str) -> bool:
    key = key.lower()
    return "error" in key or "one_minus_cos" in key


def diff_benchmarks(old: dict[str, Any], new: dict[str, Any], tol: Tolerances) -> DiffResult:
    """Judge two pytest-benchmark runs: median time, memory and errors in ``extra_info``."""
    result = DiffResult("bench")
    old_benches, new_benches = _benchmarks_by_name(old), _benchmarks_by_name(new)
    for name in sorted(set(old_benches) - set(new_benches)):
        result.regressions.append(
            f"benchmark {name} is missing from the new run (what was not measured cannot pass)"
        )
    for name in sorted(set(new_benches) - set(old_benches)):
        result.changes.append(f"benchmark {name} added")
    for name in sorted(set(old_benches) & set(new_benches)):
        old_bench, new_bench = old_benches[name], new_benches[name]
        judge(
            result,
            f"{name} median time",
            as_number((old_bench.get("stats") or {}).get("median")),
            as_number((new_bench.get("stats") or {}).get("median")),
            tol.time,
            show=format_seconds,
            verb=("slowed", "sped up"),
        )
        old_extra, new_extra = old_bench.get("extra_info") or {}, new_bench.get("extra_info") or {}
        for key in sorted(set(old_extra) | set(new_extra)):
            old_value, new_value = as_number(old_extra.get(key)), as_number(new_extra.get(key))
            if _is_memory_key(key):
                judge(result, f"{name} {key}", old_value, new_value, tol.memory, format_bytes)
            elif _is_error_key(key):
                judge(result, f"{name} {key}", old_value, new_value, tol.error)
            elif old_extra.get(key) != new_extra.get(key):
                result.changes.append(
                    f"{name} {key}: {old_extra.get(key)!r} -> {new_extra.get(key)!r}"
                )
    if old.get("machine_info") != new.get("machine_info"):
        result.changes += change_lines(
            old.get("machine_info") or {}, new.get("machine_info") or {}, "machine_info"
        )
    return result


# ---------------------------------------------------------------------- entry points


def diff_files(old_path: str | Path, new_path: str | Path, tol: Tolerances) -> DiffResult:
    """Load and judge two files; raises InputError on bad input or mismatched kinds."""
    old_kind, old = load_document(old_path)
    new_kind, new = load_document(new_path)
    if old_kind != new_kind:
        raise InputError(
            f"{old_path} is a {old_kind} document but {new_path} is a {new_kind} document; "
            "diff compares like with like"
        )
    mismatch = device_mismatch(document_device(old_kind, old), document_device(new_kind, new))
    if mismatch:
        raise InputError(f"{old_path} -> {new_path}: {mismatch}")
    if old_kind == "compare":
        return diff_reports(old, new, tol)
    return diff_benchmarks(old, new, tol)


def format_result(result: DiffResult, old_path: Any = "OLD", new_path: Any = "NEW") -> str:
    count = len(result.regressions)
    verdict = f"{count} regression{'s' if count != 1 else ''}" if count else "no regression"
    lines = [f"twinpipe diff ({result.kind}): {old_path} -> {new_path}: {verdict}"]
    lines += [f"  regression: {line}" for line in result.regressions]
    lines += [f"  improvement: {line}" for line in result.improvements]
    lines += [f"  change: {line}" for line in result.changes]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("old", help="report or benchmark JSON from before the change (e.g. main)")
    parser.add_argument("new", help="report or benchmark JSON from after the change")
    parser.add_argument(
        "--memory-tolerance",
        type=_fraction("--memory-tolerance"),
        default=0.01,
        help="relative growth of peak memory allowed (default 0.01 = 1%%)",
    )
    parser.add_argument(
        "--time-tolerance",
        type=_fraction("--time-tolerance"),
        default=0.10,
        help="relative growth of time allowed, the noise margin (default 0.10 = 10%%)",
    )
    parser.add_argument(
        "--error-tolerance",
        type=_fraction("--error-tolerance"),
        default=0.0,
        help="relative growth of loss/gradient errors allowed (default 0: may not grow)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def _fraction(flag: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag}={text!r} is not a number") from None
        if not value >= 0 or math.isinf(value):
            raise argparse.ArgumentTypeError(
                f"{flag}={text!r}: must be a finite fraction >= 0, e.g. 0.01 for 1%"
            )
        return value

    return parse


def run(args: argparse.Namespace) -> int:
    tol = Tolerances(
        memory=args.memory_tolerance, time=args.time_tolerance, error=args.error_tolerance
    )
    try:
        result = diff_files(args.old, args.new, tol)
    except InputError as error:
        print(f"twinpipe diff: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print(format_result(result, args.old, args.new))
    return EXIT_OK if result.passed else EXIT_REGRESSION


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - convenience
    parser = argparse.ArgumentParser(prog="twinpipe diff")
    add_arguments(parser)
    return run(parser.parse_args(argv))
