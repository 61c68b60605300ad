"""The ``communication`` section of a compare report: what each rank moved, per kind, beside
the estimator's prediction.

Each pipeline side's training steps (``forward_backward`` and ``optimizer_step``) run under
a `models.communication.CommunicationCounter`; nothing else is counted (gathering the
gradients for the comparison, the evaluation pass). The estimator
(`optimized.estimator.communication`) predicts the same figures from the config; with
``--routing balanced`` they must agree to the byte, with real routing the all-to-all rows
differ by the routing's skew.

Schema (per step: the mean over the run's steps, an integer when they agree)::

    "communication": {
      "routing": "balanced" | "pinned" | "free",
      "steps": int,
      "ranks": [
        {"rank": 0,
         "baseline":  {kind: {"calls", "bytes", "bytes_sent", "bytes_received",
                              "predicted_calls", "predicted_bytes", "error",
                              "groups": {group: {"calls", "bytes"}}}},
         "candidate": {...}},
        ...],
      "total_bytes": {"baseline": int, "candidate": int,
                      "baseline_predicted": int, "candidate_predicted": int},
      "exact": bool        # every side, rank and kind: calls and bytes as predicted
    }

``error`` is ``bytes / predicted_bytes - 1`` (None where nothing was predicted).
"""

from __future__ import annotations

import sys
from typing import Any

from models.communication import KINDS, Counts


def _mean(values: list[int]) -> int | float:
    total = sum(values)
    return total // len(values) if total % len(values) == 0 else total / len(values)


def _per_step(measured: list[Counts], kind: str, field: str, group: str | None = None):
    """The mean over steps of one field of ``kind`` (on ``group``, or on every group)."""
    return _mean(
        [
            sum(getattr(t, field) for (k, g), t in step.items() if k == kind and group in (None, g))
            for step in measured
        ]
    )


def _side(measured: list[Counts], predicted: Counts | None) -> dict[str, Any]:
    """One rank and side: kind -> figures, measured per step beside the prediction."""
    out: dict[str, Any] = {}
    for kind in KINDS:
        groups = {g for step in measured for (k, g) in step if k == kind}
        groups |= {g for (k, g) in predicted or {} if k == kind}
        if not groups:
            continue
        entry: dict[str, Any] = {
            "calls": _per_step(measured, kind, "calls"),
            "bytes": _per_step(measured, kind, "bytes"),
            "bytes_sent": _per_step(measured, kind, "sent"),
            "bytes_received": _per_step(measured, kind, "received"),
            "groups": {
                g: {
                    "calls": _per_step(measured, kind, "calls", g),
                    "bytes": _per_step(measured, kind, "bytes", g),
                }
                for g in sorted(groups)
            },
        }
        if predicted is not None:
            mine = [t for (k, _), t in predicted.items() if k == kind]
            entry["predicted_calls"] = sum(t.calls for t in mine)
            entry["predicted_bytes"] = sum(t.bytes for t in mine)
            entry["error"] = (
                entry["bytes"] / entry["predicted_bytes"] - 1 if entry["predicted_bytes"] else None
            )
        out[kind] = entry
    return out


def _estimate_config(model, parallel, stack: str):
    from optimized.estimator import EstimateConfig  # noqa: PLC0415

    return EstimateConfig(
        model, pp=parallel.pp, dp=parallel.dp, ep=parallel.ep,
        micro_batch_size=parallel.micro_batch_size, seq_len=parallel.seq_len,
        num_microbatches=parallel.micro_batches, dtype=parallel.dtype,
        stack="reference" if stack == "reference" else "optimized",
        fsdp=stack == "optimized-fsdp", shard_optimizer=stack == "optimized-fsdp",
        grad_sync=parallel.grad_sync, reshard_after_forward=parallel.reshard_after_forward,
    )  # fmt: skip


def _predictions(model, parallel, stack: str) -> list[Counts] | None:
    try:
        from optimized.estimator import predict_ranks  # noqa: PLC0415

        return list(predict_ranks(_estimate_config(model, parallel, stack)))
    except (ValueError, TypeError) as error:
        print(f"  communication estimate for {stack} unavailable: {error}", file=sys.stderr)
        return None


def communication_section(
    per_rank: list[dict], model, parallel, sides: tuple[str, str], routing: str
) -> dict[str, Any] | None:
    """The report's ``communication`` section (see the module docstring), or None when a side
    was not counted (the oracle)."""
    if any("communication" not in per_rank[0].get(side, {}) for side in sides):
        return None
    predictions = {side: _predictions(model, parallel, side) for side in sides}
    ranks, totals, exact = [], {}, True
    for rank, result in enumerate(per_rank):
        entry: dict[str, Any] = {"rank": rank}
        for key, side in zip(("baseline", "candidate"), sides):
            predicted = predictions[side][rank] if predictions[side] else None
            figures = _side(result[side]["communication"], predicted)
            entry[key] = figures
            totals[key] = totals.get(key, 0) + sum(f["bytes"] for f in figures.values())
            if predicted is not None:
                totals[f"{key}_predicted"] = totals.get(f"{key}_predicted", 0) + sum(
                    t.bytes for t in predicted.values()
                )
            exact = (
                exact
                and predicted is not None
                and all(
                    f["bytes"] == f["predicted_bytes"] and f["calls"] == f["predicted_calls"]
                    for f in figures.values()
                )
            )
        ranks.append(entry)
    steps = len(per_rank[0][sides[0]]["communication"])
    return {
        "routing": routing,
        "steps": steps,
        "ranks": ranks,
        "total_bytes": totals,
        "exact": exact,
    }
