"""The ``communication`` section of a compare report: what each rank moved, per kind, beside
the estimator's prediction.

Each pipeline side's training steps (``forward_backward`` and ``optimizer_step``) run under
a `models.runtime.CommunicationCounter`; nothing else is counted (gathering the
gradients for the comparison, the evaluation pass). The estimator
(`optimized.estimator.communication`) predicts the same figures from the config; with
``--routing balanced`` they must agree to the byte, with real routing the all-to-all rows
differ by the routing's skew. When the run counted each router call's choices
(``--estimate-routing observed``, `harness.compare.routing_counts`), the prediction is given
the rows each rank's dispatches sent to and received from its EP peers in each step
(``routed=`` of `predict_traffic`), which removes the skew: real routing is then predicted to
the byte too, and the balanced prediction is kept beside it.

Schema (per step: the mean over the run's steps, an integer when they agree)::

    "communication": {
      "routing": "balanced" | "pinned" | "free",
      "estimate_routing": "balanced" | "observed",   # the routing the prediction assumes
      "steps": int,
      "ranks": [
        {"rank": 0,
         "baseline":  {kind: {"calls", "bytes", "bytes_sent", "bytes_received",
                              "predicted_calls", "predicted_bytes", "error",
                              # observed only: the balanced prediction beside it
                              "balanced_predicted_bytes", "balanced_error",
                              "groups": {group: {"calls", "bytes"}}}},
         "candidate": {...}},
        ...],
      "total_bytes": {"baseline": int, "candidate": int,
                      "baseline_predicted": int, "candidate_predicted": int,
                      # observed only
                      "baseline_balanced_predicted": int, "candidate_balanced_predicted": int},
      "exact": bool        # every side, rank and kind: calls and bytes as predicted
    }

``error`` is ``bytes / predicted_bytes - 1`` (None where nothing was predicted). Predictions
from observed routing differ from step to step; like the measured figures they are the
mean over the steps.
"""

from __future__ import annotations

import sys
from typing import Any

from models.runtime import KINDS, Counts


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


def _predicted_sum(predicted: list[Counts], kind: str, field: str) -> int | float:
    """The mean over steps of the prediction's ``field`` summed over ``kind``'s groups."""
    return _mean(
        [sum(getattr(t, field) for (k, _), t in step.items() if k == kind) for step in predicted]
    )


def _side(
    measured: list[Counts], predicted: list[Counts] | None, balanced: list[Counts] | None = None
) -> dict[str, Any]:
    """One rank and side: kind -> figures, measured per step beside the prediction (one
    `Counts` per step) and, when that was of the observed routing, the balanced one."""
    out: dict[str, Any] = {}
    for kind in KINDS:
        groups = {g for step in measured for (k, g) in step if k == kind}
        groups |= {g for step in predicted or [] for (k, g) in step if k == kind}
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
            entry["predicted_calls"] = _predicted_sum(predicted, kind, "calls")
            entry["predicted_bytes"] = _predicted_sum(predicted, kind, "bytes")
            entry["error"] = _error(entry["bytes"], entry["predicted_bytes"])
        if balanced is not None:
            entry["balanced_predicted_bytes"] = _predicted_sum(balanced, kind, "bytes")
            entry["balanced_error"] = _error(entry["bytes"], entry["balanced_predicted_bytes"])
        out[kind] = entry
    return out


def _error(measured, predicted) -> float | None:
    return measured / predicted - 1 if predicted else None


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


def routed_rows(
    histograms: dict[int, dict[tuple[int, int], list[int]]], dp: int, ep: int, num_experts: int
) -> dict[int, tuple[int, int]]:
    """Per global rank, the routed copies its dispatches sent to other EP ranks' experts and
    received from its EP peers over one step, from every rank's expert histograms
    (`harness.compare.routing_counts`; EP groups as `optimized.estimator.received_loads` has
    them)."""
    local = num_experts // ep
    out = {}
    for rank in histograms:
        pp_rank, dp_rank = divmod(rank, dp)
        block, ep_rank = divmod(dp_rank, ep)
        mine = slice(ep_rank * local, (ep_rank + 1) * local)
        peers = [pp_rank * dp + block * ep + e for e in range(ep) if e != ep_rank]
        sent = sum(sum(h) - sum(h[mine]) for h in histograms[rank].values())
        received = sum(sum(h[mine]) for peer in peers for h in histograms[peer].values())
        out[rank] = (int(sent), int(received))
    return out


def _predictions(
    model, parallel, stack: str, per_rank: list[dict] | None = None
) -> list[list[Counts]] | None:
    """Per rank, one predicted `Counts` per step: of balanced routing (``per_rank`` None),
    or of the rows each step's routing counts say every rank sent and received."""
    try:
        from optimized.estimator import (  # noqa: PLC0415
            predict_ranks,
            predict_traffic,
            runner_partition,
        )

        config = _estimate_config(model, parallel, stack)
        if per_rank is None:
            return [[counts] for counts in predict_ranks(config)]
        partition = runner_partition(config)
        steps = len(per_rank[0][stack]["routing_counts"])
        rows = [
            routed_rows(
                {r: result[stack]["routing_counts"][step] for r, result in enumerate(per_rank)},
                parallel.dp,
                parallel.ep,
                model.num_experts,
            )
            for step in range(steps)
        ]
        return [
            [
                predict_traffic(config, rank, partition, routed=rows[step][rank])
                for step in range(steps)
            ]
            for rank in range(len(per_rank))
        ]
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
    observed = all("routing_counts" in per_rank[0][side] for side in sides)
    balanced = {side: _predictions(model, parallel, side) for side in sides}
    predictions = (
        {side: _predictions(model, parallel, side, per_rank) for side in sides}
        if observed
        else balanced
    )
    ranks, totals, exact = [], {}, True
    for rank, result in enumerate(per_rank):
        entry: dict[str, Any] = {"rank": rank}
        for key, side in zip(("baseline", "candidate"), sides):
            predicted = predictions[side][rank] if predictions[side] else None
            beside = balanced[side][rank] if observed and balanced[side] else None
            figures = _side(result[side]["communication"], predicted, beside)
            entry[key] = figures
            totals[key] = totals.get(key, 0) + sum(f["bytes"] for f in figures.values())
            for name, field in (("predicted", "predicted_bytes"),
                                ("balanced_predicted", "balanced_predicted_bytes")):  # fmt: skip
                if figures and all(field in f for f in figures.values()):
                    totals[f"{key}_{name}"] = totals.get(f"{key}_{name}", 0) + sum(
                        f[field] for f in figures.values()
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
        "estimate_routing": "observed" if observed else "balanced",
        "steps": steps,
        "ranks": ranks,
        "total_bytes": totals,
        "exact": exact,
    }
