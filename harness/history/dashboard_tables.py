"""The dashboard's tables (HTML): each op's latest run and its history, the compare runs, and
the cell formats they share (`harness.history.dashboard` assembles the page).

A ratio is coloured good or bad only where it measures what its header says. A speed-up
whose optimized side ran Triton kernels through Triton's interpreter (on a CPU: the kernels
run in numpy, hundreds of times slower than compiled) is not a speed measurement: it is
shown in a neutral colour with `INTERPRETER_BADGE`, and the page says why above the table.
Its memory figures are real, and on a GPU the same table is the real comparison.
"""

from __future__ import annotations

import html
import math
import re

from harness.history.dashboard_data import CompareRun, OpPoint
from harness.history.dashboard_plots import time_unit
from harness.report import format_bytes

INTERPRETER_BADGE = "Triton interpreter (CPU): not a speed measurement"
INTERPRETER_NOTE = (
    "<p class='note'>Rows marked <span class='badge'>" + INTERPRETER_BADGE + "</span> ran "
    "the optimized op's Triton kernels through Triton's interpreter, as every CPU run does: "
    "the kernels execute in numpy, one program at a time, so their time and speed-up say "
    "nothing about the kernels' speed and are not coloured as a regression. Their memory "
    "figures are real. Runs on a GPU compile the kernels; there the same table is the "
    "real comparison.</p>"
)


def format_time(value: float | None) -> str:
    if value is None:
        return "-"
    scale, unit = time_unit(value)
    return f"{value / scale:.3g} {unit}"


def format_ratio(value: float | None, good_below: bool) -> str:
    if value is None:
        return "-"
    good = value < 1 if good_below else value > 1
    css = "good" if good else ("bad" if value != 1 else "")
    return f'<span class="{css}">{value:.2f}x</span>'


def format_speedup(value: float | None, interpreted: bool) -> str:
    """A speed-up cell: coloured, or neutral with the badge when the kernels were
    interpreted."""
    if value is None or not interpreted:
        return format_ratio(value, good_below=False)
    return (
        f'<span class="neutral">{value:.2f}x</span> '
        f'<span class="badge">{html.escape(INTERPRETER_BADGE)}</span>'
    )


def format_error(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isnan(value):
        return '<span class="bad">NaN</span>'
    return f"{value:.3g}"


def table(header: list[str], rows: list[list[str]]) -> str:
    """An HTML table; ``header`` is escaped here, the cells are HTML already."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "op"


def _figures(point: OpPoint) -> list[str]:
    """A point's cells: optimized and plain time, speed-up, optimized and plain peak, and
    memory ratio."""
    return [
        format_time(point.optimized_time),
        format_time(point.plain_time),
        format_speedup(point.speedup, point.interpreted),
        format_bytes(point.optimized_peak),
        format_bytes(point.plain_peak),
        format_ratio(point.memory_ratio, good_below=True),
    ]


def ops_summary(ops: dict[str, dict[str, list[OpPoint]]]) -> str:
    """The latest run of each op variant, optimized against plain (and any further
    implementation beside the pair)."""
    rows, interpreted = [], False
    for op, variants in ops.items():
        link = f"<a href='#{slug(op)}'>{html.escape(op)}</a>"
        for variant, series in sorted(variants.items()):
            latest = series[-1]
            interpreted |= latest.interpreted
            rows.append(
                [link, html.escape(variant or "-"), *_figures(latest), html.escape(latest.commit)]
            )
            for name, figures in sorted(latest.others.items()):
                is_plain = figures["role"] == "plain"
                time_value, peak = figures["time"], figures["peak"]
                speedup = (
                    time_value / latest.optimized_time
                    if is_plain and time_value and latest.optimized_time
                    else None
                )
                ratio = (
                    latest.optimized_peak / peak
                    if is_plain and peak and latest.optimized_peak is not None
                    else None
                )
                rows.append(
                    [
                        link,
                        html.escape(f"{variant or '-'} ({name})"),
                        format_time(latest.optimized_time if is_plain else time_value),
                        format_time(time_value if is_plain else latest.plain_time),
                        format_speedup(speedup, latest.interpreted),
                        format_bytes(latest.optimized_peak if is_plain else peak),
                        format_bytes(peak if is_plain else latest.plain_peak),
                        format_ratio(ratio, good_below=True),
                        html.escape(latest.commit),
                    ]
                )
    header = [
        "op",
        "variant",
        "optimized time",
        "plain time",
        "speed-up",
        "optimized peak",
        "plain peak",
        "memory ratio",
        "commit",
    ]
    return (
        "<p>Latest run of each op (median time; speed-up = plain / optimized; memory "
        "ratio = optimized / plain).</p>"
        + (INTERPRETER_NOTE if interpreted else "")
        + table(header, rows)
    )


def op_history_table(variants: dict[str, list[OpPoint]]) -> str:
    rows = []
    for variant, series in sorted(variants.items()):
        for point in series:
            rows.append(
                [
                    html.escape(point.commit),
                    html.escape(point.date),
                    html.escape(variant or "-"),
                    *_figures(point),
                ]
            )
    header = [
        "commit",
        "date",
        "variant",
        "optimized",
        "plain",
        "speed-up",
        "optimized peak",
        "plain peak",
        "memory ratio",
    ]
    return table(header, rows)


def compare_table(runs: list[CompareRun]) -> str:
    all_ranks = sorted({rank for r in runs for rank in r.ranks})
    header = ["commit", "date", "verdict", "loss rel err", "grad rel err", "grad 1-cos"]
    header += [f"rank {rank} peak (baseline -> candidate)" for rank in all_ranks]
    rows = []
    for r in runs:
        verdict = (
            "<span class='good'>passed</span>" if r.passed else "<span class='bad'>FAILED</span>"
        )
        row = [
            html.escape(r.commit),
            html.escape(r.date),
            verdict,
            format_error(r.loss_rel_error),
            format_error(r.grad_rel_error),
            format_error(r.grad_one_minus_cos),
        ]
        for rank in all_ranks:
            figures = r.ranks.get(rank)
            if not figures:
                row.append("-")
                continue
            ratio = figures.get("ratio")
            row.append(
                f"{format_bytes(figures['baseline'])} -> {format_bytes(figures['candidate'])}"
                + (f" ({format_ratio(ratio, good_below=True)})" if ratio is not None else "")
            )
        rows.append(row)
    return table(header, rows)
