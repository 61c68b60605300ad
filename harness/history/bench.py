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

``--device`` chooses where the benchmarks compute (`models.runtime.device`; the Triton kernels
are interpreted exactly on the CPU), ``--profile DIR`` writes a torch.profiler trace of
the run (the pytest plugin ``benchmarks/profiling.py`` profiles it, with
`optimized.train.profile_region`).
The history's entries are read by `harness.history.documents.read_history`.

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

from harness.history.documents import classify, read_history  # noqa: F401 - re-exported
from harness.report import (
    ReportError,
    git_commit,
    load_report,
    machine_description,
    read_json,
)
from models.runtime import write_or_rescue

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
    document = read_json(path)
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


PROFILE_PLUGIN = "benchmarks.profiling"
"""The pytest plugin that profiles a benchmark run, in the project's source tree."""
PROFILE_FILES = ("bench.trace.json", "bench.top_ops.md")


def profile_plugin_root() -> Path | None:
    """The source tree that holds `PROFILE_PLUGIN` (this checkout's root), or None when
    twinpipe runs from an installation without its ``benchmarks/``."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "benchmarks" / "profiling.py").exists() else None


def run_benchmarks(
    benchmarks: str | os.PathLike[str] = DEFAULT_BENCHMARKS,
    history_dir: str | os.PathLike[str] = DEFAULT_HISTORY,
    keyword: str | None = None,
    extra_pytest_args: list[str] | None = None,
    environment: dict[str, str] | None = None,
    profile_dir: str | os.PathLike[str] | None = None,
) -> tuple[int, Path | None]:
    """Run pytest-benchmark on ``benchmarks``; on success add its JSON to the history.

    ``environment``: what the run's environment holds beyond this one's (the device and
    Triton mode, `models.runtime.DevicePlan.rank_environment`); ``profile_dir``: where the
    benchmarks write a torch.profiler trace of the run and its top-ops table.

    Returns the command's exit code (0; 2 when nothing was collected or ``benchmarks``
    does not exist; 3 when pytest failed or the profile asked for was not written) and the
    history entry written (None on failure).
    """
    if not Path(benchmarks).exists():
        print(
            f"twinpipe bench: error: --benchmarks {benchmarks}: no such file or folder",
            file=sys.stderr,
        )
        return 2, None
    env = {**os.environ, **(environment or {})}
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
        if profile_dir is not None:  # the plugin, importable from the source tree's root
            root = str(profile_plugin_root())
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
            command += ["-p", PROFILE_PLUGIN, f"--profile-dir={Path(profile_dir).resolve()}"]
        command += list(extra_pytest_args or [])
        print("twinpipe bench: " + " ".join(command[2:]), flush=True)
        status = _run_forwarding_signals(command, env)
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
    if profile_dir is not None:
        files = [Path(profile_dir) / name for name in PROFILE_FILES]
        if not all(f.exists() for f in files):
            print(f"twinpipe bench: error: no profile in {profile_dir}", file=sys.stderr)
            return 3, entry
        print("twinpipe bench: profile written: " + ", ".join(str(f) for f in files))
    return (3 if rescued else 0), entry


def _run_forwarding_signals(command: list[str], env: dict[str, str] | None = None) -> int:
    """Run ``command``; SIGTERM and SIGINT sent to this process reach it too (a killed
    `twinpipe bench` must not leave pytest running). Its exit status, negative when a
    signal ended it."""
    import signal  # noqa: PLC0415

    child = subprocess.Popen(command, env=env)

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
        "--device",
        default="auto",
        help="where the benchmarks compute: auto (a GPU when there is one, else the CPU), "
        "cuda or cpu (models.runtime.device); the Triton kernels are interpreted exactly on the "
        "CPU",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="write a torch.profiler trace of the benchmark run (DIR/bench.trace.json, for "
        "Perfetto or chrome://tracing) and its top kernels and host ops (DIR/bench.top_ops.md)",
    )
    parser.add_argument(
        "--add-report",
        metavar="PATH",
        action="append",
        help="add a compare report.json to the history instead of running benchmarks (repeatable)",
    )


def run(args: argparse.Namespace) -> int:
    from models.runtime import BadInput, DeviceError, check_output_dir, resolve_device  # noqa: PLC0415

    try:
        check_output_dir(args.history, "--history")
        if args.profile is not None:
            if args.add_report:
                raise BadInput("--profile profiles a benchmark run; --add-report runs nothing")
            check_output_dir(args.profile, "--profile")
            if profile_plugin_root() is None:
                raise BadInput(
                    f"--profile needs the source tree's {PROFILE_PLUGIN} (a checkout of "
                    "twinpipe, as the benchmarks do)"
                )
        # The device, once, before any work: the benchmarks run in one process.
        device = resolve_device(args.device, 1)
    except (BadInput, DeviceError) as error:
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
    if device.note:
        print(device.note, file=sys.stderr, flush=True)
    extra = ["--gpu-shapes"] if args.gpu_shapes else []
    status, _ = run_benchmarks(
        args.benchmarks, args.history, args.keyword, extra, device.rank_environment(),
        args.profile,
    )  # fmt: skip
    return status
