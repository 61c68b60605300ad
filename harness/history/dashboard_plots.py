"""The dashboard's figures (matplotlib, PNG): per op over commits, and per compare run."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from harness.history.dashboard_data import OPTIMIZED_COLOR, PLAIN_COLOR, CompareRun, OpPoint


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


def byte_unit(largest: float) -> tuple[float, str]:
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if largest >= scale:
            return float(scale), unit
    return 1.0, "B"


def time_unit(largest: float) -> tuple[float, str]:
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
    t_scale, t_unit = time_unit(max(times, default=1.0))
    peaks = [m for p in points for m in (p.optimized_peak, p.plain_peak) if m]
    m_scale, m_unit = byte_unit(max(peaks, default=1.0))
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
    if any(p.interpreted for p in points):  # no kernel's speed: say so where it is drawn
        axes[0][0].set_title(f"{op}: time, Triton interpreted (CPU): not a speed", fontsize=9)
    else:
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
    scale, unit = byte_unit(max(totals, default=1.0))
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
