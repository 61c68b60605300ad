"""How a report's figures read in a table: bytes, numbers, moments, and the tables
themselves (aligned text for the terminal, Markdown for report.md). Every section of the
report (`harness.report.render`, `sections`, `communication`, `plots`) and the
benchmark history's pages format through these.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

CATEGORY_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer",
    "activations": "activations",
}
"""A memory category's column or legend label."""


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


def side_names(report: dict[str, Any]) -> tuple[str, str]:
    """The names of the report's two stacks: (baseline, candidate)."""
    return str(report.get("baseline", "baseline")), str(report.get("candidate", "candidate"))


def table_lines(header: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool) -> list[str]:
    """A table's lines: Markdown, or columns aligned with spaces for the terminal."""
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return lines
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(header, widths)).rstrip()]
    lines.append("  ".join("-" * width for width in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return lines
