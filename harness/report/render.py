"""A compare report as text: the side-by-side table a compare run prints in the terminal,
and ``report.md``. The verdict, the per-step and per-rank tables are laid out here; the
sections that say why (`harness.report.sections`) and the communication tables
(`harness.report.communication`) are laid out where they live.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.report import sections
from harness.report.balancing import balancing_lines
from harness.report.communication import communication_lines
from harness.report.formatting import (
    CATEGORY_LABELS,
    format_bytes,
    format_moment,
    format_number,
    side_names,
    table_lines,
)
from harness.report.provenance import device_line
from harness.report.schema import CATEGORIES


def _pick(sequence: Sequence[Any] | None, index: int) -> Any:
    if not sequence or index >= len(sequence):
        return None
    return sequence[index]


def _step_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    base, cand = side_names(report)
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
    base, cand = side_names(report)
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


def _verdict(report: dict[str, Any]) -> str:
    base, cand = side_names(report)
    word = "PASSED" if report.get("passed") else "FAILED"
    return f"{word}: {cand} vs {base}"


def format_table(report: dict[str, Any]) -> str:
    """The side-by-side table a compare run prints in the terminal."""
    lines = [_verdict(report), *sections.problem_lines(report)]
    device, products = device_line(report.get("device")), sections.products_line(report)
    lines += [f"device: {device}"] * bool(device) + [products] * bool(products)
    trajectory = sections.trajectory_line(report)
    if trajectory:
        lines += ["", trajectory]
    header, rows = _step_rows(report)
    if rows:
        lines += ["", *table_lines(header, rows, markdown=False)]
    header, rows = _memory_rows(report)
    if rows:
        lines += ["", "peak memory per rank", *table_lines(header, rows, markdown=False)]
    header, rows = _worst_rows(report)
    if rows:
        lines += ["", "worst gradients", *table_lines(header, rows, markdown=False)]
    lines += communication_lines(report, markdown=False)
    tolerance = report.get("tolerance")
    if tolerance:
        lines += ["", "tolerance: " + ", ".join(f"{k}={v}" for k, v in tolerance.items())]
    routing = sections.routing_lines(report)
    if routing:
        lines += ["", *routing]
    balancing = balancing_lines(report, markdown=False)
    lines += ["", *balancing] if balancing else []
    for part in (sections.noise_floor_lines(report, False),
                 sections.ops_audit_lines(report, False)):  # fmt: skip
        lines += ["", *part] if part else []
    header, rows = sections.harness_rows(report)
    if rows:
        title = "memory the harness held beside the running stack"
        lines += ["", title, *table_lines(header, rows, False)]
    return "\n".join(lines)


def render_markdown(report: dict[str, Any], images: Sequence[str] = ()) -> str:
    """``report.md``: the verdict, configuration, per-step and per-rank tables, the plots."""
    lines = [f"# twinpipe compare: {_verdict(report)}", ""]
    facts = [("commit", report.get("git_commit")), ("machine", report.get("machine")),
             ("device", device_line(report.get("device")))]  # fmt: skip
    lines += [f"- {key}: `{value}`" for key, value in facts if value]
    products = sections.products_line(report)
    lines += [f"- {products}"] if products else []
    if report.get("problems"):
        lines += ["", "## Why it failed", "", *sections.problem_lines(report)]
    trajectory = sections.trajectory_line(report)
    if trajectory:
        lines += ["", f"- {trajectory}"]
    if report.get("config"):
        config = report["config"]
        lines += ["", "## Configuration", ""]
        lines += table_lines(
            ["field", "value"], [[str(k), f"`{v}`"] for k, v in config.items()], True
        )
    if report.get("tolerance"):
        lines += ["", "## Tolerance", ""]
        rows = [[str(k), str(v)] for k, v in report["tolerance"].items()]
        lines += table_lines(["check", "limit"], rows, True)
    routing = sections.routing_lines(report)
    if routing:
        lines += ["", "## Routing", ""] + [f"- {line}" for line in routing]
    header, rows = _step_rows(report)
    if rows:
        lines += ["", "## Per step", "", *table_lines(header, rows, True)]
    balancing = balancing_lines(report, markdown=True)
    if balancing:
        lines += ["", "## Routing controls: balancing losses, load, expert bias", "", *balancing]
        if "load.png" in images:  # the load picture belongs here, not with the other plots
            lines += ["", "![expert load per step](load.png)"]
            images = [image for image in images if image != "load.png"]
    header, rows = _memory_rows(report)
    if rows:
        lines += ["", "## Peak memory per rank", "", *table_lines(header, rows, True)]
    header, rows = _worst_rows(report)
    if rows:
        lines += ["", "## Worst gradients", "", *table_lines(header, rows, True)]
    for title, part in (("Noise floor", sections.noise_floor_lines(report, True)),
                        ("Ops audit", sections.ops_audit_lines(report, True))):  # fmt: skip
        lines += ["", f"## {title}", "", *part] if part else []
    header, rows = sections.harness_rows(report)
    if rows:
        lines += ["", "## Memory the harness held", "", *table_lines(header, rows, True)]
    top = sections.top_tensor_lines(report)
    if top:
        lines += ["", "## Largest tensors at each rank's peak", *top]
    lines += communication_lines(report, markdown=True)
    if images:
        lines += ["", "## Plots", ""]
        lines += [f"![{Path(image).stem}]({image})" for image in images]
    return "\n".join(lines) + "\n"
