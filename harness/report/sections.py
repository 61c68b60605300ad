"""The parts of a compare report that say why: problems, the device, the trajectory, the
routing, the noise floor, the ops audit, the harness's own memory, and the largest tensors at each
rank's peak (`harness.report.render` lays them out).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from harness.report.formatting import format_bytes, format_number, side_names, table_lines


def problem_lines(report: dict[str, Any]) -> list[str]:
    """Every reason the run failed, one per line."""
    return [f"- {problem}" for problem in report.get("problems") or []]


def products_line(report: dict[str, Any]) -> str:
    """One line when the ranks computed bfloat16 products as float32 products
    (`models.runtime.cpu_gemm`), saying why; ``""`` otherwise."""
    device = report.get("device")
    if not isinstance(device, dict) or not device.get("float32_products"):
        return ""
    why = device.get("float32_products_why") or "bfloat16 products computed as float32 products"
    return f"note: {why} (both stacks alike)"


def trajectory_line(report: dict[str, Any]) -> str:
    trajectory = report.get("trajectory") or {}
    mode = trajectory.get("mode")
    if mode == "lockstep":
        oracle = "oracle" in (report.get("baseline"), report.get("candidate"))
        who = "the pipeline starts every step from the oracle's"
        if not oracle:
            who = "the candidate starts every step from the baseline's"
        return f"trajectory: lockstep ({who} parameters and optimizer state; every step is judged)"
    if mode == "free":
        judged = trajectory.get("judged_steps") or []
        if len(judged) == len((report.get("loss") or {}).get("baseline") or []):
            return "trajectory: free (each side its own; every step judged)"
        return (
            "trajectory: free (each side its own; step 0 judged, later steps are information: "
            "loss curves and divergence per step)"
        )
    return ""


def routing_lines(report: dict[str, Any]) -> list[str]:
    """How the two sides routed: pinned (with the replay's swaps) or free."""
    routing = report.get("routing")
    if not routing:
        return []
    if routing.get("mode") == "balanced":
        return ["routing: balanced (both sides took token t to experts (t k + i) mod E)"]
    if routing.get("mode") != "pinned":
        return ["routing: free (each side chose its own experts)"]
    sources = {"truth": "the float32 truth", "oracle": "the oracle (the pipeline replays)"}
    source = sources.get(routing.get("recorded_by"), "the baseline")
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


def _ratio(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}"


def _bounds(group: dict[str, Any]) -> str:
    if "radial_low" not in group:  # a report written before the signed bounds
        return format_number(group["radial_limit"])
    return f"{format_number(group['radial_low'])}..{format_number(group['radial_high'])}"


def noise_floor_rows(step: dict[str, Any], limit: int | None) -> tuple[list[str], list[list[str]]]:
    """One step's noise-floor verdict: the loss, each gradient group, each router."""
    header = ["quantity", "reference err", "candidate err", "ratio", "limit", "radial ref",
              "radial cand", "radial bounds", "ok"]  # fmt: skip
    rows = []
    loss = step["loss"]
    rows.append(["loss", format_number(loss["baseline"]), format_number(loss["candidate"]),
                 _ratio(loss["ratio"]), format_number(loss["limit"]), "", "", "",
                 "yes" if loss["passed"] else "NO"])  # fmt: skip
    groups = step["groups"] if limit is None else step["groups"][:limit]
    for g in groups:
        rows.append(
            [g["group"], format_number(g["baseline"]), format_number(g["candidate"]),
             _ratio(g["ratio"]), format_number(g["limit"]), format_number(g["radial_baseline"]),
             format_number(g["radial_candidate"]), _bounds(g),
             "yes" if g["passed"] else "NO"]
        )  # fmt: skip
    routers = step["routers"] if limit is None else step["routers"][:2]
    for r in routers:
        rows.append(["router " + r["router"], format_number(r["baseline"]),
                     format_number(r["candidate"]), _ratio(r["ratio"]), format_number(r["limit"]),
                     "", "", "", "yes" if r["passed"] else "NO"])  # fmt: skip
    return header, rows


def noise_floor_lines(report: dict[str, Any], markdown: bool) -> list[str]:
    floor = report.get("noise_floor")
    if not floor:
        return []
    settings = floor.get("settings") or {}
    lines = [
        "noise floor: each bfloat16 stack's error against a float32 run of the same step; the "
        f"candidate may be k={settings.get('k')} times the reference's (+ slack "
        f"{settings.get('slack_rel')} on gradients, {settings.get('slack_loss')} on the loss, "
        f"{settings.get('slack_router')} on router scores; radial (scale) part: of all "
        "gradients, at most k times the reference's; of each group, its distance from its "
        "own stack's scale at most k times the reference's; each widened by "
        f"{settings.get('z')} standard deviations of rounding noise + "
        f"{settings.get('radial_share', 0):.3g} of the reference's error)"
    ]
    steps = floor.get("steps") or []
    shown = range(len(steps)) if markdown else [len(steps) - 1] if steps else []
    for index in shown:
        header, rows = noise_floor_rows(steps[index], None if markdown else 6)
        title = f"step {index}" + ("" if markdown else " (worst 6 groups; report.md has all)")
        lines += ["", f"### {title}" if markdown else title, ""] if markdown else ["", title]
        lines += table_lines(header, rows, markdown)
    return lines


def ops_audit_lines(report: dict[str, Any], markdown: bool) -> list[str]:
    """The candidate's ops against plain PyTorch on the run's own inputs
    (`harness.compare.ops_audit`)."""
    audit = report.get("ops_audit")
    if not audit:
        return []
    s = audit.get("settings") or {}
    lines = [
        f"ops audit: {'passed' if audit.get('passed') else 'FAILED'}: index ops exact; numeric "
        f"ops within k={s.get('k')} of plain PyTorch's error against float32, and their bias "
        f"(mean error toward the truth's sign, in bfloat16 units in the last place, over its "
        f"RMS) within plain PyTorch's + {s.get('z')}/sqrt(N) + {s.get('slack_bias')}"
    ]
    header = ["op", "kind", "calls", "failed", "worst error / plain", "worst bias (limit)"]
    rows = []
    for name, op in (audit.get("ops") or {}).items():
        bias = op.get("worst_bias")
        rows.append([
            name, op["kind"], str(op["calls"]), str(op["failed"]),
            _ratio(op.get("worst_error_ratio")) if op["kind"] == "numeric" else "exact",
            f"{bias[0]:+.3f} ({bias[1]:.3f})" if bias else "",
        ])  # fmt: skip
    return lines + [""] + table_lines(header, rows, markdown)


def harness_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Per rank: what the harness held beside the running stack, against one copy of the
    rank's parameters, what it spilled to a file (the float32 truth's gradients), and the
    rank's peak resident memory."""
    header = [
        "rank", "held by the harness", "parameters (1 copy)", "held / copy",
        "spilled to a file", "peak RSS",
    ]  # fmt: skip
    ranks = (report.get("memory") or {}).get("ranks") or []
    truth = any("truth_step_bytes" in (entry.get("harness") or {}) for entry in ranks)
    if truth:
        header += ["float32 truth's step (rank total)", "over the larger stack / copy"]
    rows = []
    for entry in ranks:
        harness = entry.get("harness") or {}
        row = [
            str(entry.get("rank", "?")),
            format_bytes(harness.get("held_bytes")),
            format_bytes(harness.get("parameter_bytes")),
            _ratio(harness.get("held_per_parameter_copy")),
            format_bytes(harness.get("spilled_bytes") or 0),
            format_bytes(harness.get("rss_peak_bytes")),
        ]
        if truth:
            row += [
                format_bytes(harness.get("truth_step_bytes")),
                _ratio(harness.get("truth_step_added_per_parameter_copy")),
            ]
        rows.append(row)
    return header, rows


def top_tensor_lines(report: dict[str, Any]) -> list[str]:
    """Per rank and stack: the five largest live tensors at the peak (report.md)."""
    lines: list[str] = []
    names = dict(zip(("baseline", "candidate"), side_names(report), strict=True))
    for entry in (report.get("memory") or {}).get("ranks") or []:
        for side in ("baseline", "candidate"):
            figures = entry.get(side) or {}
            top: Sequence[dict[str, Any]] = figures.get("top_tensors") or []
            if not top:
                continue
            moment = figures.get("peak_moment") or {}
            lines += [
                "",
                f"### rank {entry.get('rank')}, {names[side]} (peak "
                f"{format_bytes(figures.get('total'))} at {moment.get('phase')}, "
                f"{moment.get('region', 'step')})",
                "",
            ]
            rows = [
                [f"`{t['what']}`", "x".join(str(d) for d in t["shape"]) or "scalar", t["dtype"],
                 format_bytes(t["bytes"]), t["category"]]
                for t in top
            ]  # fmt: skip
            header = ["tensor (name or op)", "shape", "dtype", "bytes", "category"]
            lines += table_lines(header, rows, True)
    return lines
