"""Compare reports: schema, rendering, plots, provenance."""

from harness.report.render import (
    CATEGORIES,
    CATEGORY_COLORS,
    CATEGORY_LABELS,
    ReportError,
    format_bytes,
    format_moment,
    format_number,
    format_table,
    git_commit,
    is_compare_report,
    load_report,
    machine_description,
    read_json,
    render_markdown,
    report_problems,
    write_report,
)

__all__ = [
    "CATEGORIES",
    "CATEGORY_COLORS",
    "CATEGORY_LABELS",
    "ReportError",
    "format_bytes",
    "format_moment",
    "format_number",
    "format_table",
    "git_commit",
    "is_compare_report",
    "load_report",
    "machine_description",
    "read_json",
    "render_markdown",
    "report_problems",
    "write_report",
]
