"""The measured results: one dated JSON file of figures measured by hand (``docs/results.json``
in the checkout), checked, listed as Markdown (``docs/results.md`` is generated from it) and
drawn by `twinpipe dashboard` as its "measured results" table.

A figure written into prose goes stale without anyone noticing: the code moves on and the
sentence keeps its number. Here every figure carries the date, the machine, the command and
the commit it belongs to, so a reader sees how old it is and how to measure it again, and
the docs link to it instead of repeating it.

The file::

    {"about": "...", "results": [RESULT, ...]}

Each RESULT has:

- ``id``: lower-case words joined by hyphens, unique: the anchor ``docs/results.md#ID``;
- ``topic``: one of `TOPICS` (the docs page it belongs to);
- ``what``: what was measured, in words;
- ``figure``: a number, or a list of numbers (one per rank, or per step, as ``what`` says);
- ``unit``: the figure's unit (``s``, ``GiB``, ``x``, ``tests``, ... ; ``1`` for a pure number);
- ``date``: ``YYYY-MM-DD``;
- ``date_basis``: ``measured`` (the run's own date) or ``recorded`` (the date of the commit
  that first wrote the figure down: the run was that day or shortly before);
- ``commit``: that commit, or the commit the text names as measured; null when unknown;
- ``command``: the command that measures it, or null when there is no single one;
- ``device``: ``cpu``, or the GPU (``cuda (NVIDIA H100 80GB HBM3)``);
- ``machine``: the machine in words (cores, memory);
- ``versions``: package -> version, where known (may be empty);
- ``notes`` (optional): conditions, caveats, what the figure was compared with.

``python -m harness.history.results`` rewrites ``docs/results.md`` from the JSON (``--check``
only compares, exit 1 when they differ).
"""

from __future__ import annotations

import argparse
import html
import json
import re
import sys
from pathlib import Path
from typing import Any

from harness.history.dashboard_tables import table

TOPICS = {
    "compare": "Compare and its verdict",
    "memory": "Memory",
    "communication": "Communication",
    "training": "Training",
    "checkpoints": "Checkpoints",
    "estimator": "The estimator and plan",
    "ops": "The ops",
    "gpus": "GPUs",
    "tests": "The tests",
}
"""topic -> its section title (the order of `docs/results.md`)."""
REQUIRED = ("id", "topic", "what", "figure", "unit", "date", "date_basis", "commit", "command",
            "device", "machine", "versions")  # fmt: skip
OPTIONAL = ("notes",)
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
ID = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")
ROOT = Path(__file__).resolve().parents[2]
DEFAULT_RESULTS = ROOT / "docs" / "results.json"
"""The checkout's results file (absent where twinpipe was installed without its docs)."""
DEFAULT_PAGE = ROOT / "docs" / "results.md"


class ResultsError(ValueError):
    """The results file is missing, not JSON, or has entries of the wrong shape."""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def result_problems(document: Any) -> list[str]:
    """Everything wrong with a parsed results file, one line each; empty when well formed."""
    if not isinstance(document, dict) or not isinstance(document.get("results"), list):
        return ["expected an object with a 'results' list"]
    problems, seen = [], set()
    for i, result in enumerate(document["results"]):
        if not isinstance(result, dict):
            problems.append(f"results[{i}]: expected an object")
            continue
        where = f"results[{i}] ({result.get('id', '?')})"
        missing = [key for key in REQUIRED if key not in result]
        unknown = sorted(set(result) - set(REQUIRED) - set(OPTIONAL))
        if missing:
            problems.append(f"{where}: missing {', '.join(missing)}")
        if unknown:
            problems.append(f"{where}: unknown fields {', '.join(unknown)}")
        rid = result.get("id")
        if not isinstance(rid, str) or not ID.fullmatch(rid):
            problems.append(f"{where}: id {rid!r}: lower-case words joined by hyphens")
        elif rid in seen:
            problems.append(f"{where}: id {rid!r} appears twice")
        seen.add(rid)
        if "topic" in result and result["topic"] not in TOPICS:
            problems.append(f"{where}: topic {result['topic']!r}; valid: {', '.join(TOPICS)}")
        figure = result.get("figure")
        if "figure" in result and not (
            _is_number(figure)
            or (isinstance(figure, list) and figure and all(map(_is_number, figure)))
        ):
            problems.append(f"{where}: figure {figure!r}: a number or a list of numbers")
        if "date" in result and not (
            isinstance(result["date"], str) and DATE.fullmatch(result["date"])
        ):
            problems.append(f"{where}: date {result['date']!r}: expected YYYY-MM-DD")
        if result.get("date_basis", "measured") not in ("measured", "recorded"):
            problems.append(f"{where}: date_basis {result['date_basis']!r}: measured or recorded")
        for key in ("what", "unit", "device", "machine"):
            if key in result and not (isinstance(result[key], str) and result[key]):
                problems.append(f"{where}: {key} must be a non-empty string")
        for key in ("commit", "command", "notes"):
            if result.get(key) is not None and not isinstance(result[key], str):
                problems.append(f"{where}: {key} must be a string or null")
        versions = result.get("versions", {})
        if not isinstance(versions, dict) or not all(isinstance(v, str) for v in versions.values()):
            problems.append(f"{where}: versions must map package names to version strings")
    return problems


def load_results(path: str | Path = DEFAULT_RESULTS) -> dict[str, Any]:
    """The parsed results file; raises `ResultsError` naming the file and every problem."""
    path = Path(path)
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ResultsError(f"{path}: cannot read a results file ({error})") from error
    problems = result_problems(document)
    if problems:
        raise ResultsError(f"{path}: malformed results file:\n  " + "\n  ".join(problems))
    return document


def format_figure(result: dict[str, Any]) -> str:
    """``23.3 min``, ``3.99 / 3.97 / 2.66 / 2.62 GiB``; a unit of ``1`` is left out."""
    figure = result["figure"]
    numbers = figure if isinstance(figure, list) else [figure]
    text = " / ".join(f"{n:,}" if isinstance(n, int) else f"{n:.4g}" for n in numbers)
    return text if result["unit"] == "1" else f"{text} {result['unit']}"


def _when(result: dict[str, Any]) -> str:
    basis = "" if result["date_basis"] == "measured" else " (recorded)"
    return f"{result['date']}{basis}"


def _by_topic(document: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]]]]:
    return [
        (topic, [r for r in document["results"] if r["topic"] == topic])
        for topic in TOPICS
        if any(r["topic"] == topic for r in document["results"])
    ]


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(document: dict[str, Any], source: str = "results.json") -> str:
    """``docs/results.md``: one table per topic, every entry of the file, in its order."""
    lines = [
        "# Measured results",
        "",
        f"Generated from [{source}]({source}) by `python -m harness.history.results`; do not",
        "edit by hand. Each figure was measured once, on the machine and at the commit given:",
        "re-measure with its command before relying on it. A date marked *(recorded)* is the",
        "day the figure was first written down. `twinpipe dashboard` shows the same table.",
        "",
        _md(document.get("about") or ""),
    ]
    for topic, results in _by_topic(document):
        lines += ["", f"## {TOPICS[topic]}", ""]
        lines += ["| id | what | figure | date | device, machine | command |"]
        lines += ["|---|---|---|---|---|---|"]
        for r in results:
            what = r["what"] + (f" ({r['notes']})" if r.get("notes") else "")
            commit = f", {r['commit']}" if r.get("commit") else ""
            versions = ", ".join(f"{k} {v}" for k, v in r["versions"].items())
            machine = f"{r['device']}: {r['machine']}" + (f"; {versions}" if versions else "")
            command = f"`{r['command']}`" if r.get("command") else ""
            lines.append(
                f'| <a id="{r["id"]}"></a>`{r["id"]}` | {_md(what)} | '
                f"{_md(format_figure(r))} | {_when(r)}{commit} | {_md(machine)} | "
                f"{_md(command)} |"
            )
    return "\n".join(lines).rstrip() + "\n"


def html_section(document: dict[str, Any], source: str) -> str:
    """The dashboard's "measured results" section: one table per topic."""
    parts = [
        "<h2 id='measured-results'>Measured results</h2>",
        f"<p>Figures measured by hand, each once, on the machine and at the commit given "
        f"(from <code>{html.escape(source)}</code>; a date marked (recorded) is the day the "
        "figure was written down).</p>",
    ]
    header = ["id", "what", "figure", "date", "commit", "device", "machine", "command"]
    for topic, results in _by_topic(document):
        rows = [
            [
                html.escape(r["id"]),
                html.escape(r["what"] + (f" ({r['notes']})" if r.get("notes") else "")),
                html.escape(format_figure(r)),
                html.escape(_when(r)),
                html.escape(r.get("commit") or "-"),
                html.escape(r["device"]),
                html.escape(r["machine"]),
                f"<code>{html.escape(r['command'])}</code>" if r.get("command") else "-",
            ]
            for r in results
        ]
        parts.append(f"<h3>{html.escape(TOPICS[topic])}</h3>")
        parts.append(f"<div class='results'>{table(header, rows)}</div>")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m harness.history.results", description="write docs/results.md"
    )
    parser.add_argument("--results", default=str(DEFAULT_RESULTS), help="the results JSON")
    parser.add_argument("--page", default=str(DEFAULT_PAGE), help="the Markdown page")
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if stale")
    args = parser.parse_args(argv)
    try:
        document = load_results(args.results)
    except ResultsError as error:
        print(f"results: error: {error}", file=sys.stderr)
        return 2
    page = Path(args.page)
    text = render_markdown(document, Path(args.results).name)
    if args.check:
        same = page.exists() and page.read_text(encoding="utf-8") == text
        print(f"results: {page} is {'up to date' if same else 'stale'}")
        return 0 if same else 1
    page.write_text(text, encoding="utf-8")
    print(f"results: wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
