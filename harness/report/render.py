"""Compare reports: the JSON a compare run leaves, its Markdown twin, its plots, its table.

A compare report is one JSON object. Only ``passed`` is required; every other
section is optional (an oracle side has no memory figures, a run may skip
timing) and every reader here copes with its absence.

.. code-block:: text

    {
      "passed": true,                       # every check within tolerance, nothing NaN
      "config": {...},                      # preset, pp, dp, ep, micro-batches, dtype, steps,
                                            # grad_sync, reshard_after_forward (optimized-fsdp)
      "baseline": "reference",              # name of the stack compared against
      "candidate": "optimized",             # name of the stack under test
      "loss": {
        "baseline":  [float, ...],          # loss per step
        "candidate": [float, ...],
        "rel_error": [float, ...]           # |candidate - baseline| / |baseline| per step
      },
      "grads": {
        "max_rel_error":     [float, ...],  # per step, worst parameter's ||dg|| / ||g||
        "max_one_minus_cos": [float, ...],  # per step, worst parameter's 1 - cos(g_c, g_b)
        "worst": [[name, rel, one_minus_cos], ...]   # worst parameters over the run
      },
      "params": {"max_rel_error": [float, ...]},      # after each optimizer step
      "memory": {
        "ranks": [
          {
            "rank": 0,
            "baseline":  {"parameters": int, "gradients": int, "optimizer_state": int,
                          "activations": int, "total": int,            # bytes at the peak
                          "peak_moment": {"phase": str, "micro_batch": int | null}},
            "candidate": {...same keys...},
            "ratio": float,                 # candidate total / baseline total
            "activation_ratio": float       # candidate activations / baseline activations
          }, ...
        ]
      },
      "time": {"baseline": [float, ...], "candidate": [float, ...]},   # seconds per step
      "communication": {...},               # per rank and kind: calls, bytes, predicted
                                            # (schema: harness.compare_communication)
      "tolerance": {"loss_rel": float, "grad_one_minus_cos": float, "grad_rel": float | None},
      "git_commit": str,
      "machine": str
    }

Files written by :func:`write_report`: ``report.json``, ``report.md``,
``loss.png`` (when losses are present) and ``memory.png`` (when memory is).

The figures live in `harness.report_plots`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations")
CATEGORY_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer",
    "activations": "activations",
}
CATEGORY_COLORS = {
    "parameters": "#4c72b0",
    "gradients": "#dd8452",
    "optimizer_state": "#55a868",
    "activations": "#c44e52",
}


class ReportError(ValueError):
    """A file or object is not a compare report."""


# ---------------------------------------------------------------------- formatting helpers


def format_bytes(nbytes: float | None) -> str:
    """``1536 -> '1.5 KiB'``; binary units, three significant digits."""
    if nbytes is None or (isinstance(nbytes, float) and math.isnan(nbytes)):
        return "-"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    return f"{value:.3g} TiB"  # pragma: no cover


def format_number(value: Any, digits: int = 3) -> str:
    """A float in a table: scientific for errors, plain for losses; '-' when missing."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if value == 0:
            return "0"
        if abs(value) < 1e-3 or abs(value) >= 1e5:
            return f"{value:.{digits}e}"
        return f"{value:.{digits + 3}g}"
    return str(value)


def format_moment(moment: dict[str, Any] | None) -> str:
    if not moment:
        return "-"
    phase = moment.get("phase")
    micro_batch = moment.get("micro_batch")
    return f"{phase} mb{micro_batch}" if micro_batch is not None else str(phase)


def _pick(sequence: Sequence[Any] | None, index: int) -> Any:
    if not sequence or index >= len(sequence):
        return None
    return sequence[index]


def _names(report: dict[str, Any]) -> tuple[str, str]:
    return str(report.get("baseline", "baseline")), str(report.get("candidate", "candidate"))


def read_json(path: str | os.PathLike[str], error: type[Exception] = ValueError) -> Any:
    """The JSON in ``path``; ``error`` names the file when it cannot be read or parsed."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as cause:
        raise error(f"{path}: cannot read: {cause.strerror or cause}") from cause
    try:
        return json.loads(text)
    except json.JSONDecodeError as cause:
        raise error(f"{path}: not JSON ({cause.msg} at line {cause.lineno})") from cause


def load_report(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a compare report, with an error that names the file when it is not one, or
    when a section has the wrong shape (`report_problems`)."""
    report = read_json(path, ReportError)
    if not is_compare_report(report):
        raise ReportError(f"{path}: not a compare report (an object with a boolean 'passed')")
    problems = report_problems(report)
    if problems:
        raise ReportError(f"{path}: malformed compare report:\n  " + "\n  ".join(problems))
    return report


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _series_problem(where: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(v is None or _is_number(v) for v in value):
        return f"{where} = {value!r:.60}: expected a list of numbers (one per step)"
    return None


def report_problems(report: dict[str, Any]) -> list[str]:
    """Every section of a compare report whose shape its readers (`twinpipe diff`, the
    dashboard) would choke on; empty when the report is well formed. Sections are
    optional; a present one must have the documented shape."""
    problems: list[str] = []

    def section(name: str) -> dict[str, Any]:
        value = report.get(name)
        if value is not None and not isinstance(value, dict):
            problems.append(f"{name} = {value!r:.60}: expected an object")
            return {}
        return value or {}

    for name, keys in (
        ("loss", ("baseline", "candidate", "rel_error")),
        ("grads", ("max_rel_error", "max_one_minus_cos")),
        ("params", ("max_rel_error",)),
        ("time", ("baseline", "candidate")),
    ):
        values = section(name)
        problems += [p for k in keys if (p := _series_problem(f"{name}.{k}", values.get(k)))]
    tolerance = section("tolerance")
    problems += [
        f"tolerance.{k} = {v!r:.60}: expected a number"
        for k, v in tolerance.items()
        if not (_is_number(v) or isinstance(v, (str, bool)) or v is None)
    ]
    section("config")
    ranks = section("memory").get("ranks")
    if ranks is not None and not isinstance(ranks, list):
        problems.append(f"memory.ranks = {ranks!r:.60}: expected a list, one entry per rank")
        ranks = []
    for i, entry in enumerate(ranks or []):
        if not isinstance(entry, dict):
            problems.append(f"memory.ranks[{i}] = {entry!r:.60}: expected an object")
            continue
        if not (entry.get("rank") is None or isinstance(entry.get("rank"), int)):
            problems.append(f"memory.ranks[{i}].rank = {entry['rank']!r:.60}: expected an int")
        for side in ("baseline", "candidate"):
            figures = entry.get(side)
            if figures is None:
                continue
            if not isinstance(figures, dict):
                problems.append(f"memory.ranks[{i}].{side} = {figures!r:.60}: expected an object")
                continue
            problems += [
                f"memory.ranks[{i}].{side}.{k} = {figures[k]!r:.60}: expected a number of bytes"
                for k in ("total", *CATEGORIES)
                if figures.get(k) is not None and not _is_number(figures[k])
            ]
        for k in ("ratio", "activation_ratio"):
            if entry.get(k) is not None and not _is_number(entry[k]):
                problems.append(f"memory.ranks[{i}].{k} = {entry[k]!r:.60}: expected a number")
    return problems


def is_compare_report(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("passed"), bool)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool) -> list[str]:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return lines
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(header, widths)).rstrip()]
    lines.append("  ".join("-" * width for width in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return lines


# ---------------------------------------------------------------------- tables


def _step_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    base, cand = _names(report)
    loss = report.get("loss") or {}
    grads = report.get("grads") or {}
    params = report.get("params") or {}
    timing = report.get("time") or {}
    columns: list[tuple[str, Sequence[Any] | None]] = [
        (f"loss {base}", loss.get("baseline")),
        (f"loss {cand}", loss.get("candidate")),
        ("loss rel err", loss.get("rel_error")),
        ("grad max rel err", grads.get("max_rel_error")),
        ("grad max 1-cos", grads.get("max_one_minus_cos")),
        ("param max rel err", params.get("max_rel_error")),
        (f"s/step {base}", timing.get("baseline")),
        (f"s/step {cand}", timing.get("candidate")),
    ]
    columns = [(name, values) for name, values in columns if values]
    steps = max((len(values) for _, values in columns), default=0)
    header = ["step"] + [name for name, _ in columns]
    digits = [5 if name.startswith("loss ") and "err" not in name else 3 for name, _ in columns]
    rows = [
        [str(step)]
        + [format_number(_pick(values, step), d) for (_, values), d in zip(columns, digits)]
        for step in range(steps)
    ]
    return header, rows


def _memory_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    base, cand = _names(report)
    header = ["rank", "stack", *(CATEGORY_LABELS[c] for c in CATEGORIES), "peak", "at", "ratio"]
    rows = []
    for entry in (report.get("memory") or {}).get("ranks") or []:
        for side, name in (("baseline", base), ("candidate", cand)):
            figures = entry.get(side)
            if not figures:
                continue
            ratio = ""
            if side == "candidate" and entry.get("ratio") is not None:
                ratio = f"{entry['ratio']:.3f}"
                if entry.get("activation_ratio") is not None:
                    ratio += f" (act {entry['activation_ratio']:.3f})"
            rows.append(
                [
                    str(entry.get("rank", "?")),
                    name,
                    *(format_bytes(figures.get(category)) for category in CATEGORIES),
                    format_bytes(figures.get("total")),
                    format_moment(figures.get("peak_moment")),
                    ratio,
                ]
            )
    return header, rows


def _worst_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    worst = (report.get("grads") or {}).get("worst") or []
    rows = [[str(w[0]), format_number(_pick(w, 1)), format_number(_pick(w, 2))] for w in worst]
    return ["parameter", "rel err", "1-cos"], rows


def _routing_lines(report: dict[str, Any]) -> list[str]:
    """How the two sides routed: pinned (with the replay's swaps) or free."""
    routing = report.get("routing")
    if not routing:
        return []
    if routing.get("mode") == "balanced":
        return ["routing: balanced (both sides took token t to experts (t k + i) mod E)"]
    if routing.get("mode") != "pinned":
        return ["routing: free (each side chose its own experts)"]
    source = "the float32 truth" if routing.get("recorded_by") == "truth" else "the baseline"
    limit = "the noise floor" if routing.get("recorded_by") == "truth" else None
    line = (
        f"routing: pinned: {routing['choices']:,} expert choices replayed from {source}; "
        f"router scores agree to {format_number(routing['score_drift'])} (limit "
        f"{limit or format_number(routing['drift_limit'])}); the candidate would have chosen "
        f"{routing['swaps']} differently, all near-ties (worst gap "
        f"{format_number(routing['max_gap'])})"
    )
    if not routing["swaps"]:
        line = line.split("; the candidate would")[0] + "; the candidate chose the same everywhere"
    elif routing.get("problems"):
        line = line.replace(", all near-ties (", " (")
    return [line] + [f"routing problem: {p}" for p in routing.get("problems", [])]


def _communication_lines(report: dict[str, Any], markdown: bool) -> list[str]:
    from harness.report.communication import communication_lines  # noqa: PLC0415 (uses this)

    return communication_lines(report, markdown)


def _verdict(report: dict[str, Any]) -> str:
    base, cand = _names(report)
    word = "PASSED" if report.get("passed") else "FAILED"
    return f"{word}: {cand} vs {base}"


def format_table(report: dict[str, Any]) -> str:
    """The side-by-side table a compare run prints in the terminal."""
    from harness.report import sections  # noqa: PLC0415 (it builds on this module)

    lines = [_verdict(report), *sections.problem_lines(report)]
    trajectory = sections.trajectory_line(report)
    if trajectory:
        lines += ["", trajectory]
    header, rows = _step_rows(report)
    if rows:
        lines += ["", *_table(header, rows, markdown=False)]
    header, rows = _memory_rows(report)
    if rows:
        lines += ["", "peak memory per rank", *_table(header, rows, markdown=False)]
    header, rows = _worst_rows(report)
    if rows:
        lines += ["", "worst gradients", *_table(header, rows, markdown=False)]
    lines += _communication_lines(report, markdown=False)
    tolerance = report.get("tolerance")
    if tolerance:
        lines += ["", "tolerance: " + ", ".join(f"{k}={v}" for k, v in tolerance.items())]
    routing = _routing_lines(report)
    if routing:
        lines += ["", *routing]
    for part in (sections.noise_floor_lines(report, False),
                 sections.ops_audit_lines(report, False)):  # fmt: skip
        lines += ["", *part] if part else []
    header, rows = sections.harness_rows(report)
    if rows:
        title = "memory the harness held beside the running stack"
        lines += ["", title, *_table(header, rows, False)]
    return "\n".join(lines)


def render_markdown(report: dict[str, Any], images: Sequence[str] = ()) -> str:
    """``report.md``: the verdict, configuration, per-step and per-rank tables, the plots."""
    from harness.report import sections  # noqa: PLC0415 (it builds on this module)

    lines = [f"# twinpipe compare: {_verdict(report)}", ""]
    facts = [("commit", report.get("git_commit")), ("machine", report.get("machine"))]
    lines += [f"- {key}: `{value}`" for key, value in facts if value]
    if report.get("problems"):
        lines += ["", "## Why it failed", "", *sections.problem_lines(report)]
    trajectory = sections.trajectory_line(report)
    if trajectory:
        lines += ["", f"- {trajectory}"]
    if report.get("config"):
        config = report["config"]
        lines += ["", "## Configuration", ""]
        lines += _table(["field", "value"], [[str(k), f"`{v}`"] for k, v in config.items()], True)
    if report.get("tolerance"):
        lines += ["", "## Tolerance", ""]
        rows = [[str(k), str(v)] for k, v in report["tolerance"].items()]
        lines += _table(["check", "limit"], rows, True)
    routing = _routing_lines(report)
    if routing:
        lines += ["", "## Routing", ""] + [f"- {line}" for line in routing]
    header, rows = _step_rows(report)
    if rows:
        lines += ["", "## Per step", "", *_table(header, rows, True)]
    header, rows = _memory_rows(report)
    if rows:
        lines += ["", "## Peak memory per rank", "", *_table(header, rows, True)]
    header, rows = _worst_rows(report)
    if rows:
        lines += ["", "## Worst gradients", "", *_table(header, rows, True)]
    for title, part in (("Noise floor", sections.noise_floor_lines(report, True)),
                        ("Ops audit", sections.ops_audit_lines(report, True))):  # fmt: skip
        lines += ["", f"## {title}", "", *part] if part else []
    header, rows = sections.harness_rows(report)
    if rows:
        lines += ["", "## Memory the harness held", "", *_table(header, rows, True)]
    top = sections.top_tensor_lines(report)
    if top:
        lines += ["", "## Largest tensors at each rank's peak", *top]
    lines += _communication_lines(report, markdown=True)
    if images:
        lines += ["", "## Plots", ""]
        lines += [f"![{Path(image).stem}]({image})" for image in images]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- writing


def write_report(report: dict[str, Any], out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Write report.json, report.md and the plots into ``out_dir``; returns name -> path."""
    if not is_compare_report(report):
        raise ReportError("write_report: the report needs a boolean 'passed'")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    json_path = out / "report.json"
    json_path.write_text(json.dumps(report, indent=2, sort_keys=False, default=_json_default))
    written["report.json"] = json_path
    # Imported here: reading and checking reports needs no matplotlib, and the plots
    # module builds on this one's names.
    from harness.report.plots import plot_loss, plot_memory  # noqa: PLC0415

    images = []
    for name, plot in (("loss.png", plot_loss), ("memory.png", plot_memory)):
        if plot(report, out / name):
            written[name] = out / name
            images.append(name)
    markdown_path = out / "report.md"
    markdown_path.write_text(render_markdown(report, images))
    written["report.md"] = markdown_path
    return written


def _json_default(value: Any) -> Any:
    """Tensors, numpy scalars and paths become plain JSON."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)


# ---------------------------------------------------------------------- run metadata


def git_commit(cwd: str | os.PathLike[str] | None = None) -> str:
    """Short commit of the checkout, with ``-dirty`` when tracked files changed; or 'unknown'."""
    import subprocess

    def git(*args: str) -> str:
        completed = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30, check=True
        )
        return completed.stdout.strip()

    try:
        commit = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{commit}-dirty" if dirty else commit


def machine_description() -> str:
    """One line: CPU architecture and cores, the GPU if any, torch version."""
    import platform

    parts = [f"{platform.machine() or 'cpu'}, {os.cpu_count()} CPU cores"]
    try:
        import torch

        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            parts.append(f"{count} x {torch.cuda.get_device_name(0)}")
        else:
            parts.append("no GPU")
        parts.append(f"torch {torch.__version__}")
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    parts.append(f"Python {platform.python_version()}")
    return ", ".join(parts)
