"""The expert-load picture (matplotlib, PNG): how many tokens each expert of each MoE
layer got, step by step, so a router that collapses onto a few experts, or recovers, is
seen at a glance.

The data is a run's load, ``[step][layer][expert]`` copies routed (every token's top-k
choices): what `twinpipe train` records per step (``expert_load`` and ``moe_layers`` in its
metrics file, `load_from_metrics`), and what a compare run's stacks count. Drawn here, in
the report's package (which reads data and imports no stack), so the compare report, the
dashboard and the trainer's tests draw the same picture.

Top: every layer's max/mean load per step (1: balanced; ``E / k``: every token on the same
``k`` experts), with a ``target`` line when given. Below: one band per MoE layer, an
expert per row and a step per column, each cell the expert's load over the layer's mean
that step on a diverging scale: white balanced, red crowded, blue starved.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

LAYER_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")
"""A layer's line colour in the top panel, in turn."""


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def load_from_metrics(path: str | os.PathLike[str]) -> tuple[list[int], list[int], list]:
    """``(steps, layers, load)`` from a `twinpipe train` metrics file (JSON lines): the
    steps that recorded a load, the model's MoE layers, and ``load[step][layer][expert]``."""
    steps, layers, load = [], [], []
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            if record.get("expert_load"):
                steps.append(record["step"])
                layers = record.get("moe_layers") or list(range(len(record["expert_load"])))
                load.append(record["expert_load"])
    return steps, layers, load


def max_over_mean(load: Sequence[Sequence[Sequence[float]]]) -> list[list[float]]:
    """``[step][layer]`` busiest expert over the mean (the load's own figure)."""
    return [
        [max(row) * len(row) / sum(row) if sum(row) else float("nan") for row in step]
        for step in load
    ]


def plot_expert_load(
    load: Sequence[Sequence[Sequence[float]]],
    path: str | os.PathLike[str],
    *,
    layers: Sequence[int] | None = None,
    steps: Sequence[int] | None = None,
    title: str = "expert load",
    target: float | None = None,
) -> bool:
    """Draw ``load[step][layer][expert]`` (see the module docstring) to ``path``; ``layers``
    names the rows (default 0, 1, ...), ``steps`` the columns (default 1, 2, ...). False,
    and nothing written, when there is no load."""
    if not any(row for step in load for row in step):
        return False
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    plt = _pyplot()
    counts = np.asarray(load, dtype=np.float64)  # [steps, layers, experts]
    count, layer_count, experts = counts.shape
    layers = list(layers) if layers is not None else list(range(layer_count))
    steps = list(steps) if steps is not None else list(range(1, count + 1))
    mean = counts.mean(axis=2, keepdims=True)
    share = np.divide(counts, mean, out=np.zeros_like(counts), where=mean > 0)
    rows = share.transpose(1, 2, 0).reshape(layer_count * experts, count)  # (layer, expert)
    ratios = np.asarray(max_over_mean(load))
    height = min(14.0, max(3.0, 0.02 * layer_count * experts + 0.4 * layer_count))
    figure, (top, heat) = plt.subplots(
        2, 1, figsize=(8, 2.8 + height), sharex=True, layout="constrained",
        gridspec_kw={"height_ratios": [2.8, height]},
    )  # fmt: skip
    for index, layer in enumerate(layers):
        color = LAYER_COLORS[index % len(LAYER_COLORS)]
        top.plot(steps, ratios[:, index], color=color, linewidth=1.2, label=f"layer {layer}")
    if target is not None:
        top.axhline(target, color="#333333", linestyle="--", linewidth=1, label=f"{target:g}")
    top.set_ylabel("max / mean load")
    top.set_title(title)
    top.grid(alpha=0.3)
    top.legend(fontsize=8, ncol=min(6, len(layers) + 1), loc="upper right", frameon=False)
    vmax = max(2.0, float(rows.max()))
    image = heat.imshow(
        rows, aspect="auto", interpolation="nearest", cmap="RdBu_r",
        norm=TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=vmax),
        extent=(steps[0] - 0.5, steps[-1] + 0.5, layer_count * experts, 0),
    )  # fmt: skip
    for index in range(1, layer_count):
        heat.axhline(index * experts, color="black", linewidth=0.8)
    heat.set_yticks([(index + 0.5) * experts for index in range(layer_count)])
    heat.set_yticklabels([f"layer {layer}\n{experts} experts" for layer in layers], fontsize=8)
    heat.set_xlabel("step")
    colorbar = figure.colorbar(image, ax=[top, heat], fraction=0.04, pad=0.01, aspect=40)
    colorbar.set_label("expert load / layer mean")
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
