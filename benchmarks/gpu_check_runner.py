"""How the GPU check (`benchmarks.gpu_check`) runs a part, and reads what pytest says of it.

- A part is a command started in a process group of its own (a new session). At its limit
  the whole group gets SIGTERM, then SIGKILL after a grace period; whatever of the group is
  still running when the command exits is stopped the same way. A timed-out part's compiler
  or ranks cannot run on into the next part and skew its figures.
- Its output goes to a log file (no pipe to fill, nothing lost when it is long); the result
  keeps the log's tail for the reader.
- A pytest part is read from pytest's own JUnit XML file (``--junitxml``), not from the tail
  of its output: passed, failed, errored and skipped counts, the failures' names and the
  skip reasons. It passes only when pytest exited 0 and at least one test passed: a part
  whose tests were all skipped (no GPU seen, an inherited ``TRITON_INTERPRET=1``) failed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRACE_S = 10.0
"""Seconds between SIGTERM and SIGKILL: a rank saves nothing here, it only has to exit."""
TAIL_CHARS = 3000


def group_members(group: int) -> list[int]:
    """The live processes of process group ``group`` (zombies, which only wait to be reaped,
    are not running), read from ``/proc``."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (command)": state, ppid, pgrp
        if int(fields[2]) == group and fields[0] not in ("Z", "X"):
            members.append(int(entry))
    return members


def _signal_group(group: int, signum: int) -> None:
    try:
        os.killpg(group, signum)
    except ProcessLookupError:
        pass


def stop_group(group: int, grace_s: float = GRACE_S) -> dict:
    """Stop every process of ``group``: SIGTERM, then SIGKILL to what is left after
    ``grace_s``. Returns the pids found running and those that needed SIGKILL."""
    found = group_members(group)
    if not found:
        return {"stopped": [], "killed": []}
    _signal_group(group, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while group_members(group) and time.monotonic() < deadline:
        time.sleep(0.1)
    killed = group_members(group)
    if killed:
        _signal_group(group, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while group_members(group) and time.monotonic() < deadline:
            time.sleep(0.05)
    return {"stopped": found, "killed": killed}


def run_part(
    command: list[str],
    limit_s: float,
    log: Path,
    env: dict[str, str] | None = None,
    grace_s: float = GRACE_S,
) -> dict:
    """``command`` in a process group of its own, to completion or ``limit_s``; then nothing
    of its group is left running. Exit code (None when it ran out of time), seconds, the
    log's path and tail, and what had to be stopped."""
    start = time.monotonic()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as output:
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,  # its own process group: the group id is its pid
        )  # fmt: skip
        code = None
        try:
            code = process.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            pass
        finally:  # also when this process is being stopped: its part goes with it
            stopped = stop_group(process.pid, grace_s)
            if process.poll() is None:  # stopped by the group's signal: reap it
                process.wait()
    return {
        "command": " ".join(command),
        "exit_code": code,
        "timed_out": code is None,
        "seconds": round(time.monotonic() - start, 1),
        "log": str(log),
        "tail": log.read_bytes()[-TAIL_CHARS:].decode(errors="replace"),
        "left_running": stopped["stopped"] if code is not None else [],
        "killed": stopped["killed"],
    }


def junit_summary(path: Path) -> dict | None:
    """pytest's JUnit XML file as counts, failed test names and skip reasons (most common
    first); None when pytest wrote none (it crashed, or was stopped before the end)."""
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts = Counter()
    for suite in suites:
        for key in ("tests", "failures", "errors", "skipped"):
            counts[key] += int(suite.get(key, 0))
    reasons, failed = Counter(), []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        for skipped in case.findall("skipped"):
            reasons[skipped.get("message", "") or "(no reason)"] += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(name)
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {
        "tests": counts["tests"], "passed": passed, "failed": counts["failures"],
        "errors": counts["errors"], "skipped": counts["skipped"], "failed_tests": failed[:20],
        "skip_reasons": [[reason, n] for reason, n in reasons.most_common(5)],
    }  # fmt: skip


def pytest_part(args: list[str], limit_s: float, out: Path, name: str, env=None) -> dict:
    """``python -m pytest args`` as a part (`run_part`), judged from its JUnit file: passed
    when pytest exited 0 and at least one test passed."""
    junit = out / f"{name}.junit.xml"
    junit.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               f"--junitxml={junit}", *args]  # fmt: skip
    run = run_part(command, limit_s, out / "logs" / f"{name}.log", env)
    summary = junit_summary(junit)
    run["junit"] = summary
    if summary is None:
        run["why"] = "timed out: pytest wrote no results" if run["timed_out"] else (
            "pytest wrote no results")  # fmt: skip
        run["passed"] = False
        return run
    run["passed"] = run["exit_code"] == 0 and summary["passed"] > 0
    if summary["passed"] == 0:
        run["why"] = "no test passed" + (
            f" (all {summary['skipped']} skipped)" if summary["skipped"] == summary["tests"] else ""
        )
    return run


def pytest_figures(summary: dict | None) -> str:
    """``3 passed, 1 failed, 0 errors, 2 skipped`` (or why there are no counts)."""
    if summary is None:
        return "no results"
    return (
        f"{summary['passed']} passed, {summary['failed']} failed, {summary['errors']} errors, "
        f"{summary['skipped']} skipped"
    )


__all__ = [
    "GRACE_S", "group_members", "junit_summary", "pytest_figures", "pytest_part", "run_part",
    "stop_group",
]  # fmt: skip
