"""`twinpipe dashboard HISTORY_DIR --out site/`: a static page of speed, memory and agreement.

Reads the history that `twinpipe bench` writes (benchmark runs and compare
reports) and renders ``index.html`` with PNG figures beside it:

- per op, the optimized op against its plain counterpart over commits: median
  time and peak memory, and a table of the latest run with the speed-up and
  the memory ratio;
- per compare run, each rank's peak memory on both stacks, and the loss and
  gradient agreement, over commits; the latest run's expert load (layers x experts).

How benchmarks are paired: an op is the benchmark's ``group`` (or, without
one, ``extra_info["op"]``, or its test name less ``test_`` and the role word).
The plain counterpart is the benchmark whose ``extra_info["implementation"]``
(or ``"impl"``, ``"role"``), or else a parameter or name part, says ``plain``,
``reference``, ``torch``, ``baseline``, ``eager`` or ``naive``; every other
benchmark of the op is the optimized one. Other parameters (shapes) make
separate series, and so does the device: a variant measured on a GPU is its own series,
and compare runs get one section per device (`harness.history.dashboard_data`).
Peak memory is read from ``extra_info["peak_bytes"]`` or
``extra_info["peak_memory_bytes"]`` (what benchmarks/_common.py records), or
else the first ``extra_info`` key with ``bytes`` in its name.

The data lives in `harness.history.dashboard_data`, the figures in
`harness.history.dashboard_plots`; this module writes the page and runs the command.
"""

from __future__ import annotations

import argparse
import html
import math
import re
import sys
from pathlib import Path
from typing import Any

from harness.history.dashboard_data import (  # the data names are part of this command's API
    CompareRun,
    OpPoint,
    benchmark_implementation,
    benchmark_op_and_variant,
    benchmark_role,
    collect_compare,
    collect_ops,
    latest_load,
    peak_bytes,
)
from harness.history.dashboard_plots import (
    plot_compare_agreement,
    plot_compare_memory,
    plot_op,
    time_unit,
)
from harness.history.documents import read_history
from harness.report import format_bytes, plot_load

# ---------------------------------------------------------------------- page

__all__ = [
    "CompareRun",
    "OpPoint",
    "add_arguments",
    "benchmark_implementation",
    "benchmark_op_and_variant",
    "benchmark_role",
    "collect_compare",
    "collect_ops",
    "peak_bytes",
    "render",
    "run",
]


def _fmt_time(value: float | None) -> str:
    if value is None:
        return "-"
    scale, unit = time_unit(value)
    return f"{value / scale:.3g} {unit}"


def _fmt_ratio(value: float | None, good_below: bool) -> str:
    if value is None:
        return "-"
    good = value < 1 if good_below else value > 1
    css = "good" if good else ("bad" if value != 1 else "")
    return f'<span class="{css}">{value:.2f}x</span>'


def _fmt_error(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isnan(value):
        return '<span class="bad">NaN</span>'
    return f"{value:.3g}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "op"


STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1150px; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { margin-top: 1.8em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 0.3em 0.7em; text-align: right; }
th { background: #f4f4f4; } td:first-child, th:first-child { text-align: left; }
.good { color: #2a7d2a; font-weight: 600; } .bad { color: #b22222; font-weight: 600; }
.meta { color: #666; } img { max-width: 100%; }
"""


def render(history_dir: str | Path, out_dir: str | Path) -> Path:
    """Write ``index.html`` and its PNGs into ``out_dir``; returns the page's path."""
    entries = read_history(history_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        "<title>twinpipe dashboard</title>",
        f"<style>{STYLE}</style></head><body>",
        "<h1>twinpipe dashboard</h1>",
    ]
    bench_runs = [e for e in entries if e.get("kind") == "bench"]
    compare_entries = [e for e in entries if e.get("kind") == "compare"]
    machines = sorted({str(e.get("machine")) for e in entries if e.get("machine")})
    parts.append(
        f"<p class='meta'>{len(bench_runs)} benchmark runs and {len(compare_entries)} compare "
        f"runs from {html.escape(str(history_dir))}"
        + (
            f"; latest commit <code>{html.escape(str(entries[-1]['git_commit']))}</code>"
            if entries
            else ""
        )
        + "</p>"
    )
    if machines:
        parts.append("<p class='meta'>machines: " + "; ".join(map(html.escape, machines)) + "</p>")
    if not entries:
        parts.append("<p>The history is empty: run <code>twinpipe bench</code> first.</p>")

    ops = collect_ops(entries)
    if ops:
        bench_labels = {i: _label(e) for i, e in enumerate(bench_runs)}
        parts.append("<h2>Ops: optimized against plain</h2>")
        parts.append(_ops_summary(ops))
        for op, variants in ops.items():
            image = f"op-{_slug(op)}.png"
            plot_op(op, variants, bench_labels, out / image)
            parts.append(f"<h3 id='{_slug(op)}'>{html.escape(op)}</h3>")
            parts.append(f"<img src='{image}' alt='{html.escape(op)} over commits'>")
            parts.append(_op_history_table(variants))

    runs = collect_compare(entries)
    if runs:
        compare_labels = {r.run: _label(e) for r, e in zip(runs, compare_entries)}
        devices = sorted({r.device for r in runs}, key=lambda d: (d != "cpu", d))
        for device in devices:
            # One section per device: a GPU's peaks and a CPU's are never one series.
            on_device = [r for r in runs if r.device == device]
            suffix = "" if len(devices) == 1 else f"-{_slug(device)}"
            where = f" on {html.escape(device)}" if suffix else ""
            parts.append(f"<h2>Compare runs: optimized against reference{where}</h2>")
            if any(r.ranks for r in on_device):
                image = f"compare-memory{suffix}.png"
                plot_compare_memory(on_device, compare_labels, out / image)
                parts.append(f"<img src='{image}' alt='peak memory per rank'>")
            image = f"compare-agreement{suffix}.png"
            plot_compare_agreement(on_device, compare_labels, out / image)
            parts.append(f"<img src='{image}' alt='loss and gradient agreement'>")
            parts.append(_compare_table(on_device))
    load = latest_load(entries)
    if load is not None:  # the latest compare run's expert load (`twinpipe compare --out`)
        plot_load(load["load"], out / "compare-load.png", load["layers"], title="expert load")
        parts.append(
            f"<h2>Expert load: the latest compare run ({html.escape(load['commit'])})"
            "</h2><img src='compare-load.png' alt='expert load, layers x experts'>"
        )
        rows = [[f"layer {layer}", f"{ratio:.2f}", str(low), str(high)]
                for layer, ratio, low, high in load["last_step"]]  # fmt: skip
        parts.append(_table(["last step", "max/mean", "fewest copies", "most copies"], rows))
    parts.append("</body></html>")
    page = out / "index.html"
    page.write_text("\n".join(parts))
    return page


def _label(entry: dict[str, Any]) -> str:
    commit = str(entry.get("git_commit") or "?")
    commit = commit[:7] + ("*" if commit.endswith("-dirty") else "")
    return f"{commit}\n{str(entry.get('date') or '')[:10]}"


def _ops_summary(ops: dict[str, dict[str, list[OpPoint]]]) -> str:
    rows = []
    for op, variants in ops.items():
        for variant, series in sorted(variants.items()):
            latest = series[-1]
            rows.append(
                [
                    f"<a href='#{_slug(op)}'>{html.escape(op)}</a>",
                    html.escape(variant or "-"),
                    _fmt_time(latest.optimized_time),
                    _fmt_time(latest.plain_time),
                    _fmt_ratio(latest.speedup, good_below=False),
                    format_bytes(latest.optimized_peak),
                    format_bytes(latest.plain_peak),
                    _fmt_ratio(latest.memory_ratio, good_below=True),
                    html.escape(latest.commit),
                ]
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
                        f"<a href='#{_slug(op)}'>{html.escape(op)}</a>",
                        html.escape(f"{variant or '-'} ({name})"),
                        _fmt_time(latest.optimized_time if is_plain else time_value),
                        _fmt_time(time_value if is_plain else latest.plain_time),
                        _fmt_ratio(speedup, good_below=False),
                        format_bytes(latest.optimized_peak if is_plain else peak),
                        format_bytes(peak if is_plain else latest.plain_peak),
                        _fmt_ratio(ratio, good_below=True),
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
        "ratio = optimized / plain).</p>" + _table(header, rows)
    )


def _op_history_table(variants: dict[str, list[OpPoint]]) -> str:
    rows = []
    for variant, series in sorted(variants.items()):
        for point in series:
            rows.append(
                [
                    html.escape(point.commit),
                    html.escape(point.date),
                    html.escape(variant or "-"),
                    _fmt_time(point.optimized_time),
                    _fmt_time(point.plain_time),
                    _fmt_ratio(point.speedup, good_below=False),
                    format_bytes(point.optimized_peak),
                    format_bytes(point.plain_peak),
                    _fmt_ratio(point.memory_ratio, good_below=True),
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
    return _table(header, rows)


def _compare_table(runs: list[CompareRun]) -> str:
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
            _fmt_error(r.loss_rel_error),
            _fmt_error(r.grad_rel_error),
            _fmt_error(r.grad_one_minus_cos),
        ]
        for rank in all_ranks:
            figures = r.ranks.get(rank)
            if not figures:
                row.append("-")
                continue
            ratio = figures.get("ratio")
            row.append(
                f"{format_bytes(figures['baseline'])} -> {format_bytes(figures['candidate'])}"
                + (f" ({_fmt_ratio(ratio, good_below=True)})" if ratio is not None else "")
            )
        rows.append(row)
    return _table(header, rows)


# ---------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("history", help="history folder written by `twinpipe bench`")
    parser.add_argument("--out", default="site", help="output folder (default site/)")


def run(args: argparse.Namespace) -> int:
    from models.runtime import BadInput, check_output_dir  # noqa: PLC0415

    if not Path(args.history).is_dir():
        print(f"twinpipe dashboard: error: {args.history}: no such history folder", file=sys.stderr)
        return 2
    try:
        check_output_dir(args.out, "--out")
    except BadInput as error:
        print(f"twinpipe dashboard: error: {error}", file=sys.stderr)
        return 2
    page = render(args.history, args.out)
    print(f"twinpipe dashboard: wrote {page}")
    return 0
