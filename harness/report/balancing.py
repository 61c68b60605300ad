"""The report's routing-controls section as text: which controls ran, and per step each
stack's load-balancing loss and z-loss, the load's agreement and balance, and the expert
biases' agreement and range (the section's keys: `harness.report.schema`).
"""

from __future__ import annotations

from typing import Any

from harness.report.formatting import format_number, side_names, table_lines


def controls_line(balancing: dict[str, Any]) -> str:
    """The routing controls a run trained with, in one line."""
    controls = balancing.get("controls") or {}
    aux = controls.get("aux_loss") or "none"
    parts = ["aux loss " + (f"{aux} (coef {controls.get('aux_loss_coef'):g})" if aux != "none"
                            else "off")]  # fmt: skip
    z = controls.get("z_loss_coef") or 0
    parts.append(f"z-loss coef {z:g}" if z else "z-loss off")
    if controls.get("expert_bias"):
        parts.append(f"expert bias on (rate {controls.get('expert_bias_rate'):g})")
    else:
        parts.append("expert bias off")
    return "routing controls: " + ", ".join(parts)


def _at(values: Any, step: int) -> Any:
    return values[step] if isinstance(values, list) and step < len(values) else None


def _worst(values: Any) -> Any:
    """The largest of a step's per-layer figures (NaN first)."""
    if not isinstance(values, list) or not values:
        return values
    numbers = [v for v in values if isinstance(v, (int, float))]
    if any(v != v for v in numbers):
        return float("nan")
    return max(numbers, default=None)


def _range(ranges: Any) -> str:
    pairs = [r for r in ranges or [] if isinstance(r, list) and len(r) == 2]
    if not pairs:
        return "-"
    return f"{min(p[0] for p in pairs):.3g} .. {max(p[1] for p in pairs):.3g}"


def balancing_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Per step: the balancing losses of both stacks and their relative error, the largest
    load difference (copies), the worst layer's max/mean load, the largest bias difference
    and the baseline's bias range."""
    balancing = report.get("balancing")
    if not isinstance(balancing, dict):
        return [], []
    base, cand = side_names(report)
    aux, z = balancing.get("aux") or {}, balancing.get("z") or {}
    load, bias = balancing.get("load") or {}, balancing.get("bias") or {}
    ratio = (balancing.get("max_over_mean") or {}).get("baseline")
    header = [
        "step", f"aux {base}", f"aux {cand}", "aux rel err", f"z {base}", f"z {cand}",
        "z rel err", "load max diff", "max/mean", "bias max diff", "bias range",
    ]  # fmt: skip
    steps = len(aux.get("baseline") or load.get("max_abs_diff") or [])
    rows = []
    for step in range(steps):
        figures = [
            _at(aux.get("baseline"), step), _at(aux.get("candidate"), step),
            _at(aux.get("rel_error"), step), _at(z.get("baseline"), step),
            _at(z.get("candidate"), step), _at(z.get("rel_error"), step),
            _at(load.get("max_abs_diff"), step), _at(ratio, step),
            _worst(_at(bias.get("max_abs_diff"), step)),
        ]  # fmt: skip
        cells = [format_number(v, 5 if i in (0, 1, 3, 4) else 3) for i, v in enumerate(figures)]
        rows.append([str(step), *cells, _range(_at(bias.get("range"), step))])
    return header, rows


def balancing_lines(report: dict[str, Any], markdown: bool) -> list[str]:
    """The section: the controls, whether the load and the bias were judged, the per-step
    table, and what the forward-only evaluation did to the biases."""
    balancing = report.get("balancing")
    if not isinstance(balancing, dict):
        return []
    lines = [controls_line(balancing)]
    judged = balancing.get("judged") or {}
    if judged.get("load"):
        lines.append("load and expert bias: judged (pinned choices: both must be equal)")
    else:
        lines.append("load and expert bias: reported, not judged (free routing)")
    change = (balancing.get("bias") or {}).get("eval_change") or {}
    if change:
        moved = ", ".join(f"{key} {format_number(value)}" for key, value in change.items())
        lines.append(f"expert bias moved by the forward-only evaluation: {moved}")
    header, rows = balancing_rows(report)
    if markdown:
        lines = [f"- {line}" for line in lines]
    if rows:
        lines += ["", *table_lines(header, rows, markdown)]
    return lines
