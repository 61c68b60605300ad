"""Running `twinpipe` as a user runs it, for the tests that need a real process: the
command in a subprocess (``python -m harness.cli``), the ranks it launched found by pid,
and a small data folder. A command refused before any rank starts runs in this process
instead (`twinpipe_here`: the same `harness.cli.main`, its exit code and output, without
an interpreter and torch to start, seconds each on two busy cores).

Subprocess timeouts catch a hang only; no test asserts how fast anything runs.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from contextlib import contextmanager, redirect_stderr, redirect_stdout, suppress
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HANG_GUARD_S = 600
REFERENCE_RUNNER = "reference.pipeline:ReferencePipeline"
"""``TWINPIPE_RUNNER`` for train runs on the reference stack: the trainer around it is the
same code, and the Triton interpreter would only be slower."""


def environment(**env: str | None) -> dict[str, str]:
    """This process's environment with ``env`` set (``None``: removed), and no fault."""
    merged = {**os.environ, "TWINPIPE_FAULT": "", **env}
    return {key: value for key, value in merged.items() if value is not None}


def twinpipe(*args: str, **env: str | None) -> subprocess.CompletedProcess:
    """``twinpipe ARGS`` to completion, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "harness.cli", *args], cwd=ROOT, capture_output=True,
        text=True, timeout=HANG_GUARD_S, env=environment(**env),
    )  # fmt: skip


def twinpipe_here(*args: str, **env: str | None) -> subprocess.CompletedProcess:
    """``twinpipe ARGS`` run by `harness.cli.main` in this process, with ``env`` as
    `twinpipe` would have it: its exit code (an argparse error's too) and what it wrote. For
    commands that end before any rank starts: `models.runtime.launch`, if reached, fails
    (an internal error, exit 3)."""
    import models.runtime  # noqa: PLC0415
    from harness.cli import main  # noqa: PLC0415

    def no_rank(*_args, **_kwargs):
        raise AssertionError("twinpipe_here: a rank was launched")

    saved, launch = dict(os.environ), models.runtime.launch
    out, err = io.StringIO(), io.StringIO()
    try:
        os.environ.clear()
        os.environ.update(environment(**env))
        models.runtime.launch = no_rank
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    finally:
        models.runtime.launch = launch
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(["twinpipe", *args], code, out.getvalue(), err.getvalue())


@contextmanager
def started(*args: str, **env: str | None):
    """``twinpipe ARGS`` running, its output piped. On the way out, whatever it left alive
    (the launcher, or a rank it left behind) is killed, so a failing test orphans nothing."""
    with subprocess.Popen(
        [sys.executable, "-m", "harness.cli", *args], cwd=ROOT, env=environment(**env),
        text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    ) as launcher:  # fmt: skip
        launcher.ranks = {}  # pid -> start time, filled by rank_pids()
        try:
            yield launcher
        finally:
            for pid, start in launcher.ranks.items():
                if alive(pid) and _start_time(pid) == start:  # that rank, not a reused pid
                    with suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            if launcher.poll() is None:
                launcher.kill()


def read_until(stream, prefix: str) -> list[str]:
    """Lines of ``stream`` up to and including the first that starts with ``prefix``
    (leading spaces ignored); fails if the stream ends first."""
    seen = []
    for line in stream:
        seen.append(line)
        if line.lstrip().startswith(prefix):
            return seen
    raise AssertionError(f"no line starting with {prefix!r}:\n{''.join(seen)}")


def _children(pid: int) -> list[int]:
    found = []
    with suppress(FileNotFoundError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with suppress(FileNotFoundError):
                found += Path(f"/proc/{pid}/task/{task}/children").read_text().split()
    return [int(child) for child in found]


def rank_pids(launcher: subprocess.Popen) -> list[int]:
    """The pids of the ranks ``launcher`` (from `started`) started, rank 0 first:
    `models.runtime.spawn` forks them in rank order, from the launcher itself (the `twinpipe`
    command: a rank's command line is the launcher's) or from its rank server (a child of the
    launcher, as is multiprocessing's resource tracker)."""
    own = _command_line(launcher.pid)
    children = _children(launcher.pid)
    servers = [pid for pid in children if "multiprocessing.forkserver" in _command_line(pid)]
    forked = [pid for pid in children if _command_line(pid) == own]
    started_at = {pid: _start_time(pid) for pid in forked}
    started_at.update({pid: _start_time(pid) for server in servers for pid in _children(server)})
    ranks = sorted(started_at, key=lambda pid: (int(started_at[pid] or 0), pid))
    launcher.ranks.update({pid: started_at[pid] for pid in ranks})
    return ranks


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def _stat(pid: int) -> list[str]:
    """``/proc/PID/stat`` from the state on (the command name may hold spaces)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return []


def _start_time(pid: int) -> str | None:
    fields = _stat(pid)
    return fields[19] if fields else None


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie has ended)."""
    fields = _stat(pid)
    return bool(fields) and fields[0] != "Z"


def small_data(root: Path) -> str:
    """A prepared byte-token folder of a few thousand tokens under ``root``."""
    from optimized.data.preparation import prepare_data  # noqa: PLC0415
    from optimized.data.tokenizers import ByteTokenizer  # noqa: PLC0415

    (root / "text.txt").write_text("a few words of text to train on, again and again. " * 300)
    prepare_data([root / "text.txt"], ByteTokenizer(), root / "data", progress=False)
    return str(root / "data")
