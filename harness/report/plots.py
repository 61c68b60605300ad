"""The compare report's figures (matplotlib, PNG): loss per step, peak memory per rank
split by category, and the expert load as layers x experts over steps (drawn by
`harness.report.expert_load`, which a training run's metrics feed too).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from harness.report.expert_load import plot_expert_load
from harness.report.formatting import CATEGORY_LABELS, side_names
from harness.report.schema import CATEGORIES

CATEGORY_COLORS = {
    "parameters": "#4c72b0",
    "gradients": "#dd8452",
    "optimizer_state": "#55a868",
    "activations": "#c44e52",
}
"""A memory category's bar colour."""


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss(report: dict[str, Any], path: str | os.PathLike[str]) -> bool:
    """Loss per step for both stacks, and their relative error below; False if no losses."""
    loss = report.get("loss") or {}
    if not loss.get("baseline") and not loss.get("candidate"):
        return False
    plt = _pyplot()
    base, cand = side_names(report)
    has_error = bool(loss.get("rel_error"))
    figure, axes = plt.subplots(
        2 if has_error else 1,
        1,
        figsize=(7, 5.5 if has_error else 3.5),
        sharex=True,
        squeeze=False,
        gridspec_kw={"height_ratios": [2, 1]} if has_error else None,
    )
    top = axes[0][0]
    for values, name, style in (
        (loss.get("baseline"), base, {"color": "#4c72b0", "linewidth": 3, "alpha": 0.5}),
        (loss.get("candidate"), cand, {"color": "#c44e52", "linewidth": 1.2, "marker": "."}),
    ):
        if values:
            top.plot(range(len(values)), _floats(values), label=name, **style)
    top.set_ylabel("loss")
    top.set_title(f"loss per step: {cand} vs {base}")
    top.legend()
    top.grid(alpha=0.3)
    if has_error:
        bottom = axes[1][0]
        errors = [max(v, 1e-300) if v is not None else math.nan for v in _floats(loss["rel_error"])]
        bottom.semilogy(range(len(errors)), errors, color="#55a868", marker=".")
        limit = (report.get("tolerance") or {}).get("loss_rel")
        if isinstance(limit, (int, float)) and limit > 0:
            bottom.axhline(limit, color="#c44e52", linestyle="--", label=f"limit {limit:g}")
            bottom.legend()
        bottom.set_ylabel("relative error")
        bottom.grid(alpha=0.3, which="both")
    axes[-1][0].set_xlabel("step")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def plot_memory(report: dict[str, Any], path: str | os.PathLike[str]) -> bool:
    """Peak memory per rank, stacked by category, baseline and candidate side by side."""
    ranks = [r for r in (report.get("memory") or {}).get("ranks") or [] if isinstance(r, dict)]
    if not ranks:
        return False
    plt = _pyplot()
    base, cand = side_names(report)
    largest = max(
        (r.get(s) or {}).get("total") or 0 for r in ranks for s in ("baseline", "candidate")
    )
    scale, unit = _byte_scale(largest)
    figure, axis = plt.subplots(figsize=(max(5.5, 2.2 * len(ranks) + 2.5), 4.8))
    width = 0.4
    ticks, tick_labels = [], []
    for index, entry in enumerate(ranks):
        for offset, side, name in ((-width / 2, "baseline", base), (width / 2, "candidate", cand)):
            figures = entry.get(side) or {}
            if not figures:
                continue
            x = index + offset
            ticks.append(x)
            tick_labels.append(name)
            bottom = 0.0
            for category in CATEGORIES:
                height = (figures.get(category) or 0) / scale
                axis.bar(
                    x,
                    height,
                    width * 0.92,
                    bottom=bottom,
                    color=CATEGORY_COLORS[category],
                    edgecolor="white",
                    label=CATEGORY_LABELS[category] if not ticks[:-1] else None,
                )
                bottom += height
            total = (figures.get("total") or 0) / scale
            axis.text(x, total, f"{total:.3g}", ha="center", va="bottom", fontsize=9)
        label = f"rank {entry.get('rank', index)}"
        if entry.get("ratio") is not None:
            label += f"\npeak x{entry['ratio']:.2f}"
        if entry.get("activation_ratio") is not None:
            label += f", activations x{entry['activation_ratio']:.2f}"
        axis.text(
            index,
            -0.13,
            label,
            ha="center",
            va="top",
            fontsize=9,
            transform=axis.get_xaxis_transform(),
        )
    axis.set_xticks(ticks)
    axis.set_xticklabels(tick_labels, fontsize=8)
    axis.set_ylabel(f"peak memory ({unit})")
    axis.set_title(f"Peak memory per rank: {cand} vs {base}")
    axis.margins(y=0.1)
    axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    axis.grid(axis="y", alpha=0.3)
    axis.set_axisbelow(True)
    figure.tight_layout()
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return True


def plot_report_load(report: dict[str, Any], path: str | os.PathLike[str]) -> bool:
    """A compare report's expert load (the baseline's: at pinned routing the candidate's is
    the same, and any difference is in the report's problems); False when it has none."""
    balancing = report.get("balancing")
    if not isinstance(balancing, dict):
        return False
    load = (balancing.get("load") or {}).get("baseline")
    if not isinstance(load, list):
        return False
    base, _ = side_names(report)
    title = f"expert load per step ({base}): copies per expert over the layer's mean"
    return plot_expert_load(load, path, layers=balancing.get("layers"), title=title)


def _byte_scale(largest: float) -> tuple[float, str]:
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if largest >= scale:
            return float(scale), unit
    return 1.0, "B"


def _floats(values: Sequence[Any]) -> list[float]:
    return [float(v) if isinstance(v, (int, float)) else math.nan for v in values]
