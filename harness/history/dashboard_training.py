"""The dashboard's training view: each ``twinpipe train`` metrics file given with
``--training`` (JSON lines, one record per logged step: `optimized.train.metrics`) drawn as its
training loss and its validation loss over steps, with a table of the evaluated steps
(validation loss and perplexity)."""

from __future__ import annotations

import html
import json
import os
from pathlib import Path

from harness.history.dashboard_tables import slug, table


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics file, in step order (a line that is not a JSON object with
    an integer ``step`` is skipped, as a resumed run's reader skips it)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return sorted(records, key=lambda r: r["step"])


def plot_training(records: list[dict], path: str | os.PathLike, title: str) -> None:
    """Training loss per logged step, and the validation loss at the evaluated steps."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    figure, axis = plt.subplots(figsize=(7, 3.5))
    trained = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    held = [(r["step"], r["validation_loss"]) for r in records
            if r.get("validation_loss") is not None]  # fmt: skip
    if trained:
        axis.plot(*zip(*trained), label="training loss", linewidth=1)
    if held:
        axis.plot(*zip(*held), "o-", label="validation loss")
    axis.set_xlabel("step")
    axis.set_ylabel("loss")
    axis.set_title(title)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def training_section(paths: list[str], out: Path) -> list[str]:
    """The page's "Training runs" parts: per metrics file, its plot and evaluated steps."""
    parts = ["<h2>Training runs</h2>"] if paths else []
    for number, path in enumerate(paths):
        records = read_metrics(path)
        name = Path(path).name
        image = f"training-{number}-{slug(name)}.png"
        plot_training(records, out / image, name)
        parts.append(f"<h3>{html.escape(str(path))}</h3>")
        parts.append(f"<img src='{image}' alt='training and validation loss of {name}'>")
        rows = [[str(r["step"]), f"{r['loss']:.4f}", f"{r['validation_loss']:.4f}",
                 f"{r.get('validation_perplexity') or float('nan'):.4g}"]
                for r in records if r.get("validation_loss") is not None]  # fmt: skip
        if rows:
            parts.append(table(["step", "training loss", "validation loss", "perplexity"], rows))
        else:
            parts.append("<p>No held-out evaluation in this run (--eval-data or --split).</p>")
    return parts
