"""The compare report: what a `twinpipe compare` run leaves, read by `diff`, `bench` and the
dashboard.

- `schema`: the report's keys (the JSON a run writes), `load_report` and the shape checks
  its readers rely on;
- `formatting`: bytes, numbers and moments as a table shows them, and the tables
  themselves (terminal and Markdown); public, for every section and the history's pages;
- `render`: the terminal table and ``report.md``: the verdict, per step, per rank;
- `sections`: the parts that say why: problems, trajectory, routing, noise floor, ops
  audit, the harness's own memory, the largest tensors at each peak;
- `communication`: the communication tables (the section's schema: `harness.compare`);
- `plots`: loss per step, peak memory per rank by category, and a compare report's expert
  load (matplotlib);
- `expert_load`: the expert-load picture, layers x experts over steps (matplotlib), from a
  compare run's load or a training run's metrics file;
- `balancing`: the routing controls' section: losses, load and expert biases per step;
- `write`: ``report.json``, the plots and ``report.md`` into a folder;
- `provenance`: the commit, the machine and the device a figure comes from.

May import `models` only; never another `harness` subpackage, `optimized` or `reference`:
reports are read where no stack runs.
"""

from harness.report.expert_load import load_from_metrics, max_over_mean, plot_expert_load
from harness.report.formatting import format_bytes, format_moment, format_number
from harness.report.plots import plot_report_load
from harness.report.provenance import (
    cpu_name,
    device_description,
    device_line,
    git_commit,
    machine_description,
    machine_line,
)
from harness.report.render import format_table, render_markdown
from harness.report.schema import (
    CATEGORIES,
    ReportError,
    is_compare_report,
    load_report,
    read_json,
    report_device,
    report_problems,
)
from harness.report.write import write_report

__all__ = [
    "CATEGORIES",
    "ReportError",
    "cpu_name",
    "device_description",
    "device_line",
    "format_bytes",
    "format_moment",
    "format_number",
    "format_table",
    "git_commit",
    "is_compare_report",
    "load_from_metrics",
    "load_report",
    "machine_description",
    "machine_line",
    "max_over_mean",
    "plot_expert_load",
    "plot_report_load",
    "read_json",
    "render_markdown",
    "report_device",
    "report_problems",
    "write_report",
]
