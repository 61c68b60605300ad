"""torch.profiler over chosen steps: a Chrome trace and a table of the top ops, per rank.

`twinpipe train --profile DIR` profiles ``--profile-steps`` (default: two steady-state
steps) on every rank: ``DIR/rank{r}.trace.json`` is a Chrome trace (open it in Perfetto,
https://ui.perfetto.dev, or chrome://tracing) of the host's ops and, on a GPU rank, its
kernels and copies, with each step marked ``step N``; ``DIR/rank{r}.top_ops.md`` lists the
ops that took the most self time: the device kernels (GPU ranks) and the host ops. Self
time is an op's own time without the ops it called, so the rows add up to the busy time.

Why these steps: the first step of a run pays for allocator growth, Triton compilation and
lazy initialisation, which a steady-state step does not; two steps show what repeats.

`profile_region` is the reusable part (a region of any code: ``twinpipe bench`` profiles
its benchmarks with it); `StepProfiler` opens one around the chosen steps of a loop;
`top_ops_table` turns a profile into the Markdown table.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

TOP_ROWS = 25
"""Rows of each table: enough to cover nearly all of a step's time at real width."""


def parse_steps(spec: str | None, start: int, steps: int) -> range:
    """The 1-based steps to profile of a run that does steps ``start + 1 .. steps``.

    ``spec`` is ``N`` or ``A-B`` (inclusive); None: the second and third steps this run
    does (its first pays for warm-up), or its last two when it does fewer than three.
    Steps outside the run are an error naming the value."""
    if spec is None:
        first = start + 2 if steps - start >= 3 else max(start + 1, steps - 1)
        return range(first, min(first + 1, steps) + 1)
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", spec)
    if not match:
        raise ValueError(
            f"logging.profile_steps = {spec!r} is invalid: expected N or A-B (1-based steps)"
        )
    first = int(match[1])
    last = int(match[2]) if match[2] else first
    if not 1 <= first <= last <= steps:
        raise ValueError(
            f"logging.profile_steps = {spec!r} is invalid: expected steps within 1..{steps} "
            "(the run's steps), first <= last"
        )
    return range(first, last + 1)


def _activities(device: torch.device) -> list[ProfilerActivity]:
    """The host always; the device's kernels and copies when the rank computes on a GPU."""
    if device.type == "cuda":
        return [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    return [ProfilerActivity.CPU]


@contextlib.contextmanager
def profile_region(
    out_dir: str | os.PathLike, label: str, device: torch.device, title: str | None = None
) -> Iterator[profile]:
    """Profile the code inside; on exit write ``out_dir/{label}.trace.json`` (Chrome trace
    format) and ``out_dir/{label}.top_ops.md`` (`top_ops_table`). ``device`` is where the
    profiled code computes (CUDA activities are recorded for a GPU)."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    with profile(activities=_activities(device)) as prof:
        try:
            yield prof
        finally:
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the region's kernels end inside the profile
    prof.export_chrome_trace(str(folder / f"{label}.trace.json"))
    table = top_ops_table(prof.key_averages(), title or label, device.type == "cuda")
    (folder / f"{label}.top_ops.md").write_text(table)


def _ms(microseconds: float) -> str:
    return f"{microseconds / 1000:.3f}"


def top_ops_table(events, title: str, device_kernels: bool, rows: int = TOP_ROWS) -> str:
    """Markdown: the device kernels by self device time (when ``device_kernels``), then the
    host ops by self CPU time (``record_function`` annotations such as ``step N`` left out:
    their self time is the Python between ops), each with its calls and share of the
    table's total."""
    lines = [f"# Top ops: {title}", ""]
    if device_kernels:
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
        busy = sum(e.self_device_time_total for e in kernels) or 1.0
        lines += [
            f"## Device kernels and copies by self time (device busy {_ms(busy)} ms)",
            "",
            "| kernel | calls | self ms | share |",
            "|---|---:|---:|---:|",
        ]
        lines += [
            f"| `{_cell(e.key)}` | {e.count} | {_ms(e.self_device_time_total)} | "
            f"{e.self_device_time_total / busy:.1%} |"
            for e in kernels[:rows]
        ]
        lines.append("")
    host = [e for e in events if e.device_type == DeviceType.CPU and not e.is_user_annotation]
    host.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in host) or 1.0
    lines += [
        f"## Host ops by self CPU time (ops' self time {_ms(total)} ms)",
        "",
        "| op | calls | self CPU ms | CPU total ms | share |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| `{_cell(e.key)}` | {e.count} | {_ms(e.self_cpu_time_total)} | "
        f"{_ms(e.cpu_time_total)} | {e.self_cpu_time_total / total:.1%} |"
        for e in host[:rows]
    ]
    return "\n".join(lines) + "\n"


def _cell(name: str) -> str:
    """A kernel name fit for one Markdown cell (templated CUDA names carry ``|`` and are
    long)."""
    name = name.replace("|", "\\|").replace("`", "'")
    return name if len(name) <= 120 else name[:117] + "..."


class StepProfiler:
    """Profiles the steps in ``steps`` (1-based) of a loop on this rank: call `begin` and
    `end` around every step, `close` when the loop stops (an early stop closes an open
    profile and writes what it recorded). A resumed run starts at the first chosen step
    it does."""

    def __init__(
        self, out_dir: str | os.PathLike | None, steps: range, rank: int, device: torch.device
    ) -> None:
        """``out_dir`` None: profile nothing."""
        steps = steps if out_dir is not None else range(0)
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.steps, self.rank, self.device = steps, rank, device
        self._region = contextlib.ExitStack()
        self._step = contextlib.ExitStack()
        self._open = False
        self.written: list[Path] = []
        """The files written, once the profile is closed."""

    def begin(self, step: int) -> None:
        if step not in self.steps:
            return
        if not self._open:
            title = f"rank {self.rank}, steps {self.steps.start}-{self.steps[-1]}"
            label = f"rank{self.rank}"
            self._region.enter_context(profile_region(self.out_dir, label, self.device, title))
            self._open = True
        self._step.enter_context(record_function(f"step {step}"))

    def end(self, step: int) -> None:
        if step not in self.steps:
            return
        self._step.close()
        if step == self.steps[-1]:
            self.close()

    def close(self) -> None:
        if not self._open:
            return
        self._step.close()
        self._region.close()
        self._open = False
        self.written = [self.out_dir / f"rank{self.rank}.{kind}" for kind in
                        ("trace.json", "top_ops.md")]  # fmt: skip
