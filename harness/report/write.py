"""A compare report's files: ``report.json``, its plots and ``report.md`` beside them."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from harness.report.plots import plot_loss, plot_memory, plot_report_load
from harness.report.render import render_markdown
from harness.report.schema import ReportError, is_compare_report


def write_report(report: dict[str, Any], out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Write report.json, report.md and the plots into ``out_dir``; returns name -> path."""
    if not is_compare_report(report):
        raise ReportError("write_report: the report needs a boolean 'passed'")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    json_path = out / "report.json"
    json_path.write_text(json.dumps(report, indent=2, sort_keys=False, default=_json_default))
    written["report.json"] = json_path
    images = []
    plots = (("loss.png", plot_loss), ("memory.png", plot_memory), ("load.png", plot_report_load))
    for name, plot in plots:
        if plot(report, out / name):
            written[name] = out / name
            images.append(name)
    markdown_path = out / "report.md"
    markdown_path.write_text(render_markdown(report, images))
    written["report.md"] = markdown_path
    return written


def _json_default(value: Any) -> Any:
    """Tensors, numpy scalars and paths become plain JSON."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)
