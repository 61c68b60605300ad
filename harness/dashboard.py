"""`twinpipe dashboard HISTORY_DIR --out site/`: a static page of speed, memory and agreement.

Reads the history that `twinpipe bench` writes (benchmark runs and compare
reports) and renders ``index.html`` with PNG figures beside it:

- per op, the optimized op against its plain counterpart over commits: median
  time and peak memory, and a table of the latest run with the speed-up and
  the memory ratio;
- per compare run, each rank's peak memory on both stacks, and the loss and
  gradient agreement, over commits.

How benchmarks are paired: an op is the benchmark's ``group`` (or, without
one, ``extra_info["op"]``, or its test name less ``test_`` and the role word).
The plain counterpart is the benchmark whose ``extra_info["implementation"]``
(or ``"impl"``, ``"role"``), or else a parameter or name part, says ``plain``,
``reference``, ``torch``, ``baseline``, ``eager`` or ``naive``; every other
benchmark of the op is the optimized one. Other parameters (shapes) make
separate series. Peak memory is read from ``extra_info["peak_bytes"]`` or
``extra_info["peak_memory_bytes"]`` (what benchmarks/_common.py records), or
else the first ``extra_info`` key with ``bytes`` in its name.
"""

from __future__ import annotations

import argparse
import html
import math
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.bench import read_history
from harness.report import format_bytes

PLAIN_WORDS = ("plain", "reference", "torch", "baseline", "eager", "naive")
OPTIMIZED_WORDS = ("optimized", "fused", "triton", "liger", "fast")
ROLE_KEYS = ("implementation", "impl", "role", "side", "provider")
PEAK_KEYS = ("peak_bytes", "peak_memory_bytes")
OPTIMIZED_COLOR, PLAIN_COLOR = "#c44e52", "#4c72b0"


# ---------------------------------------------------------------------- collecting


@dataclass
class OpPoint:
    """One op variant in one benchmark run."""

    run: int
    commit: str
    date: str
    optimized_time: float | None = None
    plain_time: float | None = None
    optimized_peak: float | None = None
    plain_peak: float | None = None
    # Further implementations of the op (e.g. a second plain one): name -> figures.
    others: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def speedup(self) -> float | None:
        if self.optimized_time and self.plain_time:
            return self.plain_time / self.optimized_time
        return None

    @property
    def memory_ratio(self) -> float | None:
        if self.optimized_peak is not None and self.plain_peak:
            return self.optimized_peak / self.plain_peak
        return None


@dataclass
class CompareRun:
    """The figures of one compare report drawn on the dashboard."""

    run: int
    commit: str
    date: str
    passed: bool
    loss_rel_error: float | None
    grad_one_minus_cos: float | None
    grad_rel_error: float | None
    ranks: dict[int, dict[str, float | None]] = field(default_factory=dict)
    tolerance: dict[str, Any] = field(default_factory=dict)


def _tokens(text: str) -> list[str]:
    return [t for t in re.split(r"[\[\]\-_,\s/.]+", text.lower()) if t]


def benchmark_implementation(bench: dict[str, Any]) -> str | None:
    """The implementation a benchmark names (``extra_info`` first, then its parameters)."""
    for source in (bench.get("extra_info") or {}, bench.get("params") or {}):
        for key in ROLE_KEYS:
            if isinstance(source.get(key), str):
                return source[key]
    return None


def benchmark_role(bench: dict[str, Any]) -> str:
    """'plain' for a plain counterpart, 'optimized' for everything else."""
    implementation = benchmark_implementation(bench)
    if implementation is not None:
        words = _tokens(implementation)
    else:
        params = bench.get("params") or {}
        words = [str(v).lower() for v in params.values()] + _tokens(str(bench.get("name", "")))
    return "plain" if any(word in PLAIN_WORDS for word in words) else "optimized"


def benchmark_op_and_variant(bench: dict[str, Any]) -> tuple[str, str]:
    """The op a benchmark measures and its variant (shape parameters).

    Role words, the implementation's name and the op's own name are left out of
    the variant, so ``test_act[silu-plain_float32]`` of op ``silu`` has variant ''.
    """
    name = str(bench.get("name") or bench.get("fullname") or "?")
    base, _, bracket = name.partition("[")
    role_words = set(PLAIN_WORDS) | set(OPTIMIZED_WORDS)
    group = bench.get("group") or (bench.get("extra_info") or {}).get("op")
    if group:
        op = str(group)
    else:
        base = base.removeprefix("test_")
        op = "_".join(t for t in base.split("_") if t.lower() not in role_words) or base
    skip = role_words | set(_tokens(op)) | set(_tokens(benchmark_implementation(bench) or ""))
    variant = "-".join(t for t in _tokens(bracket) if t not in skip)
    return op, variant


def peak_bytes(bench: dict[str, Any]) -> float | None:
    extra = bench.get("extra_info") or {}
    for key in PEAK_KEYS:
        if isinstance(extra.get(key), (int, float)) and not isinstance(extra[key], bool):
            return float(extra[key])
    for key, value in extra.items():
        if (
            "bytes" in key.lower()
            and isinstance(value, (int, float))
            and not isinstance(value, bool)
        ):
            return float(value)
    return None


def collect_ops(entries: list[dict[str, Any]]) -> dict[str, dict[str, list[OpPoint]]]:
    """op -> variant -> one point per benchmark run that measured it.

    Of several implementations with one role (``plain`` and ``plain_float32``),
    the one named after the role, else the first, is the pair's; the rest are
    kept in ``OpPoint.others``.
    """
    ops: dict[str, dict[str, list[OpPoint]]] = defaultdict(lambda: defaultdict(list))
    runs = [e for e in entries if e.get("kind") == "bench"]
    for run, entry in enumerate(runs):
        by_key: dict[tuple[str, str], dict[str, list[dict[str, Any]]]] = defaultdict(
            lambda: {"optimized": [], "plain": []}
        )
        for bench in (entry.get("benchmark") or {}).get("benchmarks") or []:
            if isinstance(bench, dict):
                by_key[benchmark_op_and_variant(bench)][benchmark_role(bench)].append(bench)
        for (op, variant), roles in by_key.items():
            point = OpPoint(run, str(entry.get("git_commit")), str(entry.get("date")))
            for role, benches in roles.items():
                benches = sorted(
                    benches, key=lambda b: (benchmark_implementation(b) or role).lower() != role
                )
                for index, bench in enumerate(benches):
                    median = (bench.get("stats") or {}).get("median")
                    if index == 0:
                        setattr(point, f"{role}_time", median)
                        setattr(point, f"{role}_peak", peak_bytes(bench))
                    else:
                        name = benchmark_implementation(bench) or str(bench.get("name"))
                        point.others[name] = {
                            "role": role,
                            "time": median,
                            "peak": peak_bytes(bench),
                        }
            ops[op][variant].append(point)
    return {op: dict(variants) for op, variants in sorted(ops.items())}


def _max(values: Any) -> float | None:
    if not isinstance(values, list):
        return None
    numbers = [float(v) for v in values if isinstance(v, (int, float))]
    if any(math.isnan(v) for v in numbers):
        return math.nan
    return max(numbers) if numbers else None


def collect_compare(entries: list[dict[str, Any]]) -> list[CompareRun]:
    runs = []
    for entry in (e for e in entries if e.get("kind") == "compare"):
        report = entry.get("report") or {}
        ranks = {}
        for index, rank in enumerate((report.get("memory") or {}).get("ranks") or []):
            ranks[int(rank.get("rank", index))] = {
                "baseline": (rank.get("baseline") or {}).get("total"),
                "candidate": (rank.get("candidate") or {}).get("total"),
                "ratio": rank.get("ratio"),
            }
        runs.append(
            CompareRun(
                run=len(runs),
                commit=str(entry.get("git_commit") or report.get("git_commit")),
                date=str(entry.get("date")),
                passed=bool(report.get("passed")),
                loss_rel_error=_max((report.get("loss") or {}).get("rel_error")),
                grad_one_minus_cos=_max((report.get("grads") or {}).get("max_one_minus_cos")),
                grad_rel_error=_max((report.get("grads") or {}).get("max_rel_error")),
                ranks=ranks,
                tolerance=dict(report.get("tolerance") or {}),
            )
        )
    return runs


# ---------------------------------------------------------------------- plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _commit_axis(axis, points: list[Any], labels: dict[int, str]) -> None:
    runs = sorted(labels)
    axis.set_xticks(runs)
    axis.set_xticklabels([labels[r] for r in runs], rotation=30, ha="right", fontsize=8)
    axis.set_xlim(min(runs) - 0.5, max(runs) + 0.5)
    axis.grid(alpha=0.3)


def _byte_unit(largest: float) -> tuple[float, str]:
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if largest >= scale:
            return float(scale), unit
    return 1.0, "B"


def _time_unit(largest: float) -> tuple[float, str]:
    if largest >= 1:
        return 1.0, "s"
    if largest >= 1e-3:
        return 1e-3, "ms"
    return 1e-6, "us"


def plot_op(op: str, variants: dict[str, list[OpPoint]], labels: dict[int, str], path: Path):
    """Median time and peak memory of the optimized op and the plain one, over commits."""
    plt = _pyplot()
    points = [p for series in variants.values() for p in series]
    has_memory = any(p.optimized_peak is not None or p.plain_peak is not None for p in points)
    figure, axes = plt.subplots(
        1, 2 if has_memory else 1, figsize=(11 if has_memory else 6, 3.6), squeeze=False
    )
    times = [t for p in points for t in (p.optimized_time, p.plain_time) if t]
    t_scale, t_unit = _time_unit(max(times, default=1.0))
    peaks = [m for p in points for m in (p.optimized_peak, p.plain_peak) if m]
    m_scale, m_unit = _byte_unit(max(peaks, default=1.0))
    markers = "osD^v<>p*h"
    for number, (variant, series) in enumerate(sorted(variants.items())):
        marker = markers[number % len(markers)]
        suffix = f" [{variant}]" if variant else ""
        runs = [p.run for p in series]
        panels = [(axes[0][0], "time", t_scale)]
        if has_memory:
            panels.append((axes[0][1], "peak", m_scale))
        for axis, what, scale in panels:
            for side, color, style in (
                ("optimized", OPTIMIZED_COLOR, "-"),
                ("plain", PLAIN_COLOR, "--"),
            ):
                values = [getattr(p, f"{side}_{what}") for p in series]
                values = [v / scale if v is not None else math.nan for v in values]
                if any(not math.isnan(v) for v in values):
                    axis.plot(
                        runs,
                        values,
                        style,
                        color=color,
                        marker=marker,
                        label=f"{side}{suffix}",
                        alpha=0.9,
                    )
            names = sorted({name for p in series for name in p.others})
            for name in names:
                values = [(p.others.get(name) or {}).get(what) for p in series]
                values = [v / scale if v is not None else math.nan for v in values]
                role = next(p.others[name]["role"] for p in series if name in p.others)
                color = PLAIN_COLOR if role == "plain" else OPTIMIZED_COLOR
                axis.plot(
                    runs,
                    values,
                    ":",
                    color=color,
                    marker=marker,
                    alpha=0.7,
                    label=f"{name}{suffix}",
                )
    axes[0][0].set_ylabel(f"median time ({t_unit})")
    axes[0][0].set_title(f"{op}: time, lower is better")
    if has_memory:
        axes[0][1].set_ylabel(f"peak memory ({m_unit})")
        axes[0][1].set_title(f"{op}: peak memory, lower is better")
    for axis in axes[0]:
        _commit_axis(axis, points, labels)
        axis.set_ylim(bottom=0)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def plot_compare_memory(runs: list[CompareRun], labels: dict[int, str], path: Path) -> None:
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(8, 3.8))
    totals = [
        v
        for r in runs
        for rank in r.ranks.values()
        for v in (rank["baseline"], rank["candidate"])
        if v
    ]
    scale, unit = _byte_unit(max(totals, default=1.0))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    all_ranks = sorted({rank for r in runs for rank in r.ranks})
    for number, rank in enumerate(all_ranks):
        color = colors[number % len(colors)]
        for side, style in (("baseline", "--"), ("candidate", "-")):
            xs = [r.run for r in runs if rank in r.ranks]
            ys = [(r.ranks[rank][side] or math.nan) / scale for r in runs if rank in r.ranks]
            axis.plot(xs, ys, style, marker="o", color=color, label=f"rank {rank} {side}")
    axis.set_ylabel(f"peak memory ({unit})")
    axis.set_title("compare runs: peak memory per rank (dashed: baseline, solid: candidate)")
    _commit_axis(axis, runs, labels)
    axis.set_ylim(bottom=0)
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def plot_compare_agreement(runs: list[CompareRun], labels: dict[int, str], path: Path) -> None:
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(8, 3.6))
    latest_tolerance = runs[-1].tolerance
    for attribute, label, color, tolerance_key in (
        ("loss_rel_error", "loss relative error", "#55a868", "loss_rel"),
        ("grad_rel_error", "gradient max relative error", "#dd8452", "grad_rel"),
        ("grad_one_minus_cos", "gradient max 1-cos", "#8172b3", "grad_one_minus_cos"),
    ):
        values = [getattr(r, attribute) for r in runs]
        if all(v is None for v in values):
            continue
        ys = [max(v, 1e-300) if v is not None else math.nan for v in values]
        axis.semilogy([r.run for r in runs], ys, marker="o", color=color, label=label)
        limit = latest_tolerance.get(tolerance_key)
        if isinstance(limit, (int, float)) and limit > 0:
            axis.axhline(
                limit,
                color=color,
                linestyle=":",
                linewidth=1.2,
                label=f"limit {tolerance_key} {limit:g}",
            )
    for r in runs:
        if not r.passed:
            axis.axvspan(r.run - 0.4, r.run + 0.4, color="#c44e52", alpha=0.15, linewidth=0)
    axis.set_title("compare runs: agreement of candidate with baseline (red band: failed)")
    axis.set_ylabel("largest over steps")
    _commit_axis(axis, runs, labels)
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    axis.grid(alpha=0.3, which="both")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# ---------------------------------------------------------------------- page


def _fmt_time(value: float | None) -> str:
    if value is None:
        return "-"
    scale, unit = _time_unit(value)
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
        parts.append("<h2>Compare runs: optimized against reference</h2>")
        if any(r.ranks for r in runs):
            plot_compare_memory(runs, compare_labels, out / "compare-memory.png")
            parts.append("<img src='compare-memory.png' alt='peak memory per rank'>")
        plot_compare_agreement(runs, compare_labels, out / "compare-agreement.png")
        parts.append("<img src='compare-agreement.png' alt='loss and gradient agreement'>")
        parts.append(_compare_table(runs))
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
    if not Path(args.history).is_dir():
        print(f"twinpipe dashboard: error: {args.history}: no such history folder", file=sys.stderr)
        return 2
    page = render(args.history, args.out)
    print(f"twinpipe dashboard: wrote {page}")
    return 0
