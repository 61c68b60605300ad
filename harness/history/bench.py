"""`twinpipe bench`: run the benchmarks and keep their results in a history.

Each run of ``pytest benchmarks/ --benchmark-json`` becomes one file in the
history folder, stamped with the commit, the date and the machine, so the
dashboard can draw every op's speed and memory over commits and `twinpipe
diff` can compare any two runs. Compare reports join the same history
(``--add-report``), so a trainer's side-by-side runs are drawn next to the
benchmarks.

History entry (one JSON file each, ``bench-<UTC time>-<commit>.json`` or
``compare-<UTC time>-<commit>.json``)::

    {"kind": "bench" | "compare",
     "git_commit": "0c6fbe0d1e2f",          # '-dirty' when tracked files had changes
     "date": "2026-11-22T05:01:02Z",        # UTC, when the entry was written
     "machine": "x86_64, 2 CPU cores, no GPU, torch 2.13.0+cpu, Python 3.11.7",
     "benchmark": {...pytest-benchmark JSON...}      # kind "bench"
     "report": {...compare report...}}               # kind "compare"

Benchmarks report memory through ``benchmark.extra_info`` (``peak_bytes``, or
any key with ``bytes`` in its name) and are paired with their plain
counterpart by ``group`` (see `harness.history.dashboard`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness.history.documents import classify
from harness.report import (
    ReportError,
    git_commit,
    load_report,
    machine_description,
    report_problems,
)
from models.inputs import write_or_rescue

DEFAULT_HISTORY = "history"
DEFAULT_BENCHMARKS = "benchmarks"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0)


def _write_entry(history_dir: str | os.PathLike[str], entry: dict[str, Any]) -> Path:
    history = Path(history_dir)
    history.mkdir(parents=True, exist_ok=True)
    stamp = entry["date"].replace("-", "").replace(":", "")
    commit = "".join(c for c in str(entry["git_commit"]) if c.isalnum() or c in "-_") or "unknown"
    path = history / f"{entry['kind']}-{stamp}-{commit}.json"
    counter = 1
    while path.exists():  # two runs in one second on one commit
        counter += 1
        path = history / f"{entry['kind']}-{stamp}-{commit}-{counter}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(entry, indent=1))
    tmp.replace(path)
    return path


def make_entry(kind: str, payload: dict[str, Any], commit: str | None = None) -> dict[str, Any]:
    """A history entry for a pytest-benchmark JSON (``bench``) or compare report (``compare``)."""
    if kind not in ("bench", "compare"):
        raise ValueError(f"history entry kind={kind!r}; valid kinds: 'bench', 'compare'")
    return {
        "kind": kind,
        "git_commit": commit or git_commit(),
        "date": _now().strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine_description(),
        ("benchmark" if kind == "bench" else "report"): payload,
    }


def add_benchmark_json(
    benchmark_json: str | os.PathLike[str], history_dir: str | os.PathLike[str]
) -> Path:
    """Append a pytest-benchmark JSON file to the history; returns the entry's path."""
    path = Path(benchmark_json)
    document = json.loads(path.read_text())
    kind, payload = classify(document)
    if kind != "bench":
        raise ValueError(f"{path}: not pytest-benchmark JSON (no 'benchmarks' list)")
    return _write_entry(history_dir, make_entry("bench", payload))


def add_compare_report(
    report_path: str | os.PathLike[str], history_dir: str | os.PathLike[str]
) -> Path:
    """Append a compare report (report.json) to the history; returns the entry's path.

    The entry carries the report's own ``git_commit`` when it has one: the
    commit the comparison ran on, not the one adding it.
    """
    report = load_report(report_path)
    entry = make_entry("compare", report, commit=report.get("git_commit") or None)
    if report.get("machine"):
        entry["machine"] = report["machine"]
    return _write_entry(history_dir, entry)


def read_history(history_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every entry in the history folder, oldest first; unreadable files are skipped."""
    entries = []
    for path in sorted(Path(history_dir).glob("*.json")):
        try:
            entry = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            print(f"twinpipe: skipping {path}: {error}", file=sys.stderr)
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


def run_benchmarks(
    benchmarks: str | os.PathLike[str] = DEFAULT_BENCHMARKS,
    history_dir: str | os.PathLike[str] = DEFAULT_HISTORY,
    keyword: str | None = None,
    extra_pytest_args: list[str] | None = None,
) -> tuple[int, Path | None]:
    """Run pytest-benchmark on ``benchmarks``; on success add its JSON to the history.

    Returns the command's exit code (0; 2 when nothing was collected or ``benchmarks``
    does not exist; 3 when pytest failed) and the history entry written (None on failure).
    """
    if not Path(benchmarks).exists():
        print(
            f"twinpipe bench: error: --benchmarks {benchmarks}: no such file or folder",
            file=sys.stderr,
        )
        return 2, None
    with tempfile.TemporaryDirectory(prefix="twinpipe-bench-") as tmp:
        json_path = Path(tmp) / "benchmark.json"
        command = [
            sys.executable,
            "-m",
            "pytest",
            str(benchmarks),
            f"--benchmark-json={json_path}",
            "--benchmark-only",
            "-p",
            "no:cacheprovider",
            "-q",
        ]
        if keyword:
            command += ["-k", keyword]
        command += list(extra_pytest_args or [])
        print("twinpipe bench: " + " ".join(command[2:]), flush=True)
        status = _run_forwarding_signals(command)
        if status < 0 or status >= 128:  # stopped by a signal, ours or pytest's
            print("twinpipe bench: stopped by a signal; history unchanged", file=sys.stderr)
            return 128 + abs(status) % 128, None
        if status != 0:
            # pytest's 5 (nothing collected) is a -k or --benchmarks that selects nothing:
            # bad input (2); any other failure is a crash (3), never 1, which means regressed.
            reason = "no benchmark was collected" if status == 5 else "pytest failed"
            print(f"twinpipe bench: {reason} (exit {status}); history unchanged", file=sys.stderr)
            return (2 if status == 5 else 3), None
        if not json_path.exists():
            print(
                "twinpipe bench: pytest wrote no benchmark JSON; history unchanged", file=sys.stderr
            )
            return 3, None
        entry, rescued = write_or_rescue(
            history_dir, lambda folder: add_benchmark_json(json_path, folder),
            "the benchmark results", "bench",
        )  # fmt: skip
    print(f"twinpipe bench: added {entry}")
    return (3 if rescued else 0), entry


def _run_forwarding_signals(command: list[str]) -> int:
    """Run ``command``; SIGTERM and SIGINT sent to this process reach it too (a killed
    `twinpipe bench` must not leave pytest running). Its exit status, negative when a
    signal ended it."""
    import signal  # noqa: PLC0415

    child = subprocess.Popen(command)

    def forward(signum, frame):
        child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--history",
        default=DEFAULT_HISTORY,
        help=f"history folder, one JSON file per run (default {DEFAULT_HISTORY}/)",
    )
    parser.add_argument(
        "--benchmarks",
        default=DEFAULT_BENCHMARKS,
        help=f"benchmark folder or file given to pytest (default {DEFAULT_BENCHMARKS}/)",
    )
    parser.add_argument("-k", dest="keyword", metavar="EXPR", help="pytest -k expression")
    parser.add_argument(
        "--gpu-shapes",
        action="store_true",
        help="benchmark at the GPU shapes (4096 tokens x 102400 vocabulary, bf16, ...) even "
        "without CUDA (on the CPU interpreter: minutes per op)",
    )
    parser.add_argument(
        "--add-report",
        metavar="PATH",
        action="append",
        help="add a compare report.json to the history instead of running benchmarks (repeatable)",
    )


def run(args: argparse.Namespace) -> int:
    from models.inputs import BadInput, check_output_dir  # noqa: PLC0415

    try:
        check_output_dir(args.history, "--history")
    except BadInput as error:
        print(f"twinpipe bench: error: {error}", file=sys.stderr)
        return 2
    if args.add_report:
        try:  # every report is checked before the first is added
            for report_path in args.add_report:
                load_report(report_path)
        except ReportError as error:
            print(f"twinpipe bench: error: --add-report {error}", file=sys.stderr)
            return 2
        for report_path in args.add_report:
            try:
                entry = add_compare_report(report_path, args.history)
            except ReportError as error:
                print(f"twinpipe bench: error: {error}", file=sys.stderr)
                return 2
            print(f"twinpipe bench: added {entry}")
        return 0
    extra = ["--gpu-shapes"] if args.gpu_shapes else []
    status, _ = run_benchmarks(args.benchmarks, args.history, args.keyword, extra)
    return status
