"""Multi-token prediction in `twinpipe compare`: each stack's MTP losses, judged beside the
main loss (`models.network.mtp`).

After every step a rank reads each stack's ``mtp_values()`` (`stack_mtp`: ``[2, D]``, each
depth's loss ``L_k`` and its top-1 accuracy, the same on every rank), which travel with
the step's record (`harness.compare.record.StepRecord.balancing`). `mtp_section` judges
them: each depth's loss at DESIGN.md's loss bound at the steps whose loss is judged, and
nothing non-finite at any step. The accuracies are reported, not judged (an argmax flips
at a near-tie of two logits).
"""

from __future__ import annotations

import math
from typing import Any


def stack_mtp(side: Any) -> list[list[float]] | None:
    """A stack's MTP figures of the step it just took (collectives on every rank); None
    without MTP."""
    values = getattr(side, "mtp_values", lambda: None)()
    return None if values is None else [[float(v) for v in row] for row in values.tolist()]


def mtp_section(
    plan: Any, records: list, judged: list[int], loss_bound: float
) -> tuple[dict[str, Any] | None, list[str]]:
    """The report's ``mtp`` section and its problems (None without MTP)."""
    depths = plan.model.num_mtp_layers
    if not depths or not records or "mtp" not in records[0].balancing.get("baseline", {}):
        return None, []
    section: dict[str, Any] = {"depths": depths, "loss_coef": plan.model.mtp_loss_coef}
    problems: list[str] = []
    for key in ("baseline", "candidate"):
        figures = [r.balancing[key]["mtp"] for r in records]
        section[key] = {
            "loss": [f[0] if f else None for f in figures],
            "accuracy": [f[1] if f else None for f in figures],
        }
    base, cand = section["baseline"]["loss"], section["candidate"]["loss"]
    rel = []
    for step in range(len(records)):
        if base[step] is None or cand[step] is None:
            problems.append(f"step {step}: a stack reported no MTP loss")
            rel.append([math.nan] * depths)
            continue
        row = [abs(c - b) / abs(b) if b else abs(c) for b, c in zip(base[step], cand[step])]
        rel.append(row)
        for depth, (b, c, r) in enumerate(zip(base[step], cand[step], row), start=1):
            if not all(math.isfinite(v) for v in (b, c, r)):
                problems.append(f"step {step}: the MTP loss of depth {depth} is not finite")
            elif step in judged and r > loss_bound:
                problems.append(
                    f"step {step}: the MTP loss of depth {depth} differs by {r:.3g} (relative)"
                )
    section["rel_error"] = rel
    return section, problems
