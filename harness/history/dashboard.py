"""`twinpipe dashboard HISTORY_DIR --out site/`: a static page of speed, memory and agreement.

Reads the history that `twinpipe bench` writes (benchmark runs and compare
reports) and renders ``index.html`` with PNG figures beside it:

- per op, the optimized op against its plain counterpart over commits: median
  time and peak memory, and a table of the latest run with the speed-up and
  the memory ratio;
- per compare run, each rank's peak memory on both stacks, and the loss and
  gradient agreement, over commits; the latest run's expert load (layers x experts);
- the measured results (``--results``, by default the checkout's ``docs/results.json``):
  figures measured by hand, each with its date, machine and command
  (`harness.history.results`).

A speed-up whose kernels ran through Triton's interpreter (every CPU run) is marked as no
speed measurement and left uncoloured (`harness.history.dashboard_tables`).

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
`harness.history.dashboard_plots`, the tables in `harness.history.dashboard_tables`; this
module writes the page and runs the command.
"""

from __future__ import annotations

import argparse
import html
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
)
from harness.history.dashboard_tables import (
    compare_table,
    op_history_table,
    ops_summary,
    slug,
    table,
)
from harness.history.dashboard_training import training_section
from harness.history.documents import read_history
from harness.history.results import DEFAULT_RESULTS, ResultsError, html_section, load_results
from harness.report import plot_expert_load

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


STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1150px; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { margin-top: 1.8em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 0.3em 0.7em; text-align: right; }
th { background: #f4f4f4; } td:first-child, th:first-child { text-align: left; }
.good { color: #2a7d2a; font-weight: 600; } .bad { color: #b22222; font-weight: 600; }
.meta { color: #666; } img { max-width: 100%; }
.neutral { color: #666; } .badge { background: #fff3cd; border: 1px solid #e0c96a;
  border-radius: 3px; padding: 0 0.3em; font-size: 0.85em; color: #5c4a00; }
.note { background: #fffbea; border-left: 3px solid #e0c96a; padding: 0.4em 0.8em; }
.results td, .results th { text-align: left; vertical-align: top; }
.results td:nth-child(3) { text-align: right; }
"""


def render(history_dir: str | Path, out_dir: str | Path, results: str | Path | None = None,
           training: list[str] | None = None) -> Path:  # fmt: skip
    """Write ``index.html`` and its PNGs into ``out_dir``; returns the page's path.

    ``results``: a measured-results file (`harness.history.results`) drawn as the page's last
    section; raises `ResultsError` when it is malformed, before anything is written.
    ``training``: `twinpipe train` metrics files, drawn as the training view
    (`harness.history.dashboard_training`)."""
    measured = load_results(results) if results is not None else None
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
        parts.append(ops_summary(ops))
        for op, variants in ops.items():
            image = f"op-{slug(op)}.png"
            plot_op(op, variants, bench_labels, out / image)
            parts.append(f"<h3 id='{slug(op)}'>{html.escape(op)}</h3>")
            parts.append(f"<img src='{image}' alt='{html.escape(op)} over commits'>")
            parts.append(op_history_table(variants))

    runs = collect_compare(entries)
    if runs:
        compare_labels = {r.run: _label(e) for r, e in zip(runs, compare_entries)}
        devices = sorted({r.device for r in runs}, key=lambda d: (d != "cpu", d))
        for device in devices:
            # One section per device: a GPU's peaks and a CPU's are never one series.
            on_device = [r for r in runs if r.device == device]
            suffix = "" if len(devices) == 1 else f"-{slug(device)}"
            where = f" on {html.escape(device)}" if suffix else ""
            parts.append(f"<h2>Compare runs: optimized against reference{where}</h2>")
            if any(r.ranks for r in on_device):
                image = f"compare-memory{suffix}.png"
                plot_compare_memory(on_device, compare_labels, out / image)
                parts.append(f"<img src='{image}' alt='peak memory per rank'>")
            image = f"compare-agreement{suffix}.png"
            plot_compare_agreement(on_device, compare_labels, out / image)
            parts.append(f"<img src='{image}' alt='loss and gradient agreement'>")
            parts.append(compare_table(on_device))
    load = latest_load(entries)
    if load is not None:  # the latest compare run's expert load (`twinpipe compare --out`)
        plot_expert_load(
            load["load"], out / "compare-load.png", layers=load["layers"], title="expert load"
        )
        parts.append(
            f"<h2>Expert load: the latest compare run ({html.escape(load['commit'])})"
            "</h2><img src='compare-load.png' alt='expert load, layers x experts'>"
        )
        rows = [[f"layer {layer}", f"{ratio:.2f}", str(low), str(high)]
                for layer, ratio, low, high in load["last_step"]]  # fmt: skip
        parts.append(table(["last step", "max/mean", "fewest copies", "most copies"], rows))
    parts += training_section(list(training or []), out)
    if measured is not None:
        parts.append(html_section(measured, str(results)))
    parts.append("</body></html>")
    page = out / "index.html"
    page.write_text("\n".join(parts))
    return page


def _label(entry: dict[str, Any]) -> str:
    commit = str(entry.get("git_commit") or "?")
    commit = commit[:7] + ("*" if commit.endswith("-dirty") else "")
    return f"{commit}\n{str(entry.get('date') or '')[:10]}"


# ---------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("history", help="history folder written by `twinpipe bench`")
    parser.add_argument("--out", default="site", help="output folder (default site/)")
    parser.add_argument(
        "--results",
        metavar="PATH",
        help="a measured-results JSON drawn as the page's last table (default: the checkout's "
        "docs/results.json, when there is one)",
    )
    parser.add_argument("--no-results", action="store_true", help="leave the measured results out")
    parser.add_argument(
        "--training", nargs="+", action="extend", default=[], metavar="METRICS",
        help="`twinpipe train` metrics files (--metrics-file) drawn as the training view: "
        "training and validation loss over steps",
    )  # fmt: skip


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
    results = args.results or (DEFAULT_RESULTS if DEFAULT_RESULTS.exists() else None)
    if args.no_results:
        results = None
    try:
        for path in args.training:
            if not Path(path).is_file():
                print(f"twinpipe dashboard: error: --training {path}: no such metrics file",
                      file=sys.stderr)  # fmt: skip
                return 2
        page = render(args.history, args.out, results, args.training)
    except ResultsError as error:
        print(f"twinpipe dashboard: error: --results {error}", file=sys.stderr)
        return 2
    print(f"twinpipe dashboard: wrote {page}")
    return 0
