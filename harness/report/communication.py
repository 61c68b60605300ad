"""The communication tables of a compare report (terminal and Markdown): per rank and stack,
the bytes moved per step beside the estimator's prediction, and the calls of each kind.

The section's schema is in `harness.compare.communication`; a report without it prints
nothing here.
"""

from __future__ import annotations

from typing import Any

from harness.report.formatting import format_bytes, format_number, side_names, table_lines

SHORT = {
    "send": "send",
    "recv": "recv",
    "all_to_all": "a2a",
    "all_gather": "ag",
    "reduce_scatter": "rs",
    "all_reduce": "ar",
    "broadcast": "bcast",
}


def _sides(report: dict[str, Any]):
    base, cand = side_names(report)
    return (("baseline", base), ("candidate", cand))


def _error(measured: float, predicted: float | None) -> str:
    if not predicted:
        return "-"
    return f"{measured / predicted - 1:+.2%}"


def summary_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """One row per rank and stack: bytes per step, predicted, error, calls by kind."""
    section = report.get("communication") or {}
    header = ["rank", "stack", "bytes/step", "predicted", "error", "calls per step"]
    rows = []
    for entry in section.get("ranks") or []:
        for key, name in _sides(report):
            kinds = entry.get(key) or {}
            measured = sum(k["bytes"] for k in kinds.values())
            predicted = sum(k.get("predicted_bytes", 0) for k in kinds.values())
            calls = ", ".join(
                f"{SHORT.get(kind, kind)} {format_number(k['calls'])}" for kind, k in kinds.items()
            )
            rows.append(
                [
                    str(entry.get("rank", "?")),
                    name,
                    format_bytes(measured),
                    format_bytes(predicted) if predicted else "-",
                    _error(measured, predicted),
                    calls,
                ]
            )
    return header, rows


def detail_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """One row per rank, stack and kind: calls and bytes, measured and predicted."""
    section = report.get("communication") or {}
    header = ["rank", "stack", "kind", "calls", "predicted", "bytes", "predicted", "error"]
    rows = []
    for entry in section.get("ranks") or []:
        for key, name in _sides(report):
            for kind, k in (entry.get(key) or {}).items():
                rows.append(
                    [
                        str(entry.get("rank", "?")),
                        name,
                        kind,
                        format_number(k["calls"]),
                        format_number(k.get("predicted_calls")),
                        f"{k['bytes']:,}",
                        f"{k['predicted_bytes']:,}" if "predicted_bytes" in k else "-",
                        _error(k["bytes"], k.get("predicted_bytes")),
                    ]
                )
    return header, rows


def headline(report: dict[str, Any]) -> str:
    """All ranks' bytes per step of each stack, predicted beside, and whether exact."""
    section = report.get("communication") or {}
    totals = section.get("total_bytes") or {}
    parts = []
    for key, name in _sides(report):
        if key in totals:
            predicted = totals.get(f"{key}_predicted")
            text = f"{name} {format_bytes(totals[key])}"
            if predicted:
                text += f" (predicted {format_bytes(predicted)})"
            parts.append(text)
    routing = section.get("routing", "?")
    verdict = "every kind as predicted" if section.get("exact") else "not all as predicted"
    observed = section.get("estimate_routing") == "observed"
    if routing != "balanced" and not section.get("exact") and not observed:
        verdict += " (real routing: the all-to-all rows move with the routing's skew)"
    if observed:
        routing += ", predicted from the routing it saw"
    return f"bytes per step, all ranks: {'; '.join(parts)}; routing {routing}: {verdict}"


def communication_lines(report: dict[str, Any], markdown: bool) -> list[str]:
    """The section's lines for the terminal table or report.md; none without the section."""
    if not report.get("communication"):
        return []
    header, rows = summary_rows(report)
    if markdown:
        lines = ["", "## Communication per rank", "", headline(report), ""]
        lines += table_lines(header, rows, True)
        header, rows = detail_rows(report)
        lines += ["", "### By kind", "", *table_lines(header, rows, True)]
        return lines
    return [
        "",
        "communication per rank (per step)",
        *table_lines(header, rows, False),
        headline(report),
    ]
