"""The routing controls in `twinpipe compare`: what each stack did with them, and the verdict.

After every step a rank reads, of each stack (`stack_balance`): the step's load-balancing
loss and z-loss (``balancing_values()``: every rank's share summed, the same on every
rank), the load of each MoE layer it holds (``step_load()``: copies per expert, summed over
the layer's replicas) and each router's expert bias after the update. Around the
evaluation it measures how far the forward-only pass moved each stack's biases
(`bias_change`). These travel to the parent with the step's record (`StepRecord.balancing`),
where `balancing_section` judges them:

- **the losses**: the aux loss and the z-loss at DESIGN.md's loss bound for the dtype, at
  the steps whose loss is judged; a NaN or an infinity never passes, at any step;
- **the load**: at pinned (or balanced) routing both stacks route every token to the same
  experts, so each layer's counts must be *equal*, on every rank;
- **the bias**: its update is exact arithmetic on integer counts (``rate * sign(mean -
  count)``), so at pinned routing the biases after each step must be *equal*, on every
  rank (lockstep hands the candidate the baseline's biases before each step:
  `harness.compare.stacks.copy_buffers`); any difference fails;
- **the evaluation**: a forward-only pass changes no bias, in either stack.

With free routing (``--routing free``) a near-tie may route one token elsewhere: the load
and the bias are reported there, not judged. Pinned against the oracle, the pipeline
replays the oracle's choices, and both are judged exactly.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from harness.compare.mtp import stack_mtp
from models.runtime import moe_routers

JUDGED_ROUTING = ("pinned", "balanced")
"""The routing modes at which two pipeline stacks take the same expert choices."""


# ---------------------------------------------------------------------- on a rank
def _biases(side: Any) -> dict[int, torch.Tensor]:
    routers = moe_routers(side.part)
    return {
        layer: router.e_score_correction_bias
        for layer, router in routers.items()
        if router.e_score_correction_bias is not None
    }


def stack_balance(side: Any) -> dict[str, Any]:
    """A stack's routing controls after the step it just took: ``values`` ``[aux, z]``,
    ``load`` ``{layer: [copies per expert]}`` of the MoE layers it holds, ``bias`` ``{layer:
    [bias per expert]}``. Collectives on every rank (`models.runtime.PipelineRunner`)."""
    values = side.balancing_values().tolist()
    load = side.step_load()
    layers = list(moe_routers(side.part))
    rows = load.tolist() if load is not None and load.numel() else []
    return {
        "values": [float(v) for v in values],
        "load": dict(zip(layers, rows)),
        "bias": {layer: bias.tolist() for layer, bias in _biases(side).items()},
        "mtp": stack_mtp(side),  # judged beside the loss (`harness.compare.mtp`)
    }


def bias_snapshot(side: Any) -> dict[int, torch.Tensor]:
    """Copies of a stack's expert biases, to measure what a pass changed (`bias_change`)."""
    return {layer: bias.detach().clone() for layer, bias in _biases(side).items()}


def bias_change(side: Any, before: dict[int, torch.Tensor]) -> float:
    """The largest change of any expert bias since ``before`` (NaN when one is NaN)."""
    worst = 0.0
    for layer, bias in _biases(side).items():
        change = float((bias.detach() - before[layer]).abs().max()) if bias.numel() else 0.0
        worst = change if math.isnan(change) else max(worst, change)
        if math.isnan(worst):
            break
    return worst


# ---------------------------------------------------------------------- verdict
def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b != 0 else abs(a)


def _worse(a: float, b: float) -> float:
    """The larger of two differences, NaN winning."""
    return a if math.isnan(a) or a > b else b


def _max_over_mean(rows: list[list[int]]) -> float | None:
    ratios = [max(row) / (sum(row) / len(row)) for row in rows if row and sum(row) > 0]
    return max(ratios) if ratios else None


def _whole_load(per_rank: list[dict], step: int, key: str, layers: list[int]) -> list[list]:
    """``[layers][experts]`` of one side at one step, each layer from the lowest DP rank
    holding it (every replica holds the same sum)."""
    order = sorted(range(len(per_rank)), key=lambda r: (per_rank[r]["coords"][1], r))
    found: dict[int, list[int]] = {}
    for rank in order:
        for layer, row in per_rank[rank]["steps"][step].balancing[key]["load"].items():
            found.setdefault(layer, row)
    return [found.get(layer, []) for layer in layers]


def _differences(per_rank: list[dict], step: int, layers: list[int]) -> tuple[int, dict]:
    """The largest load difference (copies) and each layer's largest bias difference over
    every rank, candidate against baseline, where both hold the layer."""
    load_diff, bias_diff = 0, {layer: 0.0 for layer in layers}
    for result in per_rank:
        sides = result["steps"][step].balancing
        base, cand = sides["baseline"], sides["candidate"]
        for layer in set(base["load"]) & set(cand["load"]):
            pairs = zip(base["load"][layer], cand["load"][layer], strict=True)
            load_diff = max([load_diff] + [abs(b - c) for b, c in pairs])
        for layer in set(base["bias"]) & set(cand["bias"]):
            pairs = zip(base["bias"][layer], cand["bias"][layer], strict=True)
            for b, c in pairs:
                bias_diff[layer] = _worse(abs(c - b), bias_diff[layer])
    return load_diff, bias_diff


def _values(records: list, key: str, index: int) -> list[float]:
    return [r.balancing[key]["values"][index] for r in records]


def balancing_section(
    plan: Any, per_rank: list[dict], judged: list[int], loss_bound: float
) -> tuple[dict[str, Any] | None, list[str]]:
    """The report's ``balancing`` section (`harness.report.schema`) and its problems; None
    when the stacks recorded none (no MoE layer, or ranks of an older harness)."""
    records = per_rank[0]["steps"]
    if not records or not getattr(records[0], "balancing", None):
        return None, []
    controls = plan.model.balancing()
    layers = sorted(
        {layer for r in per_rank for layer in r["steps"][0].balancing["baseline"]["load"]}
    )
    section: dict[str, Any] = {
        "controls": {
            "aux_loss": controls.aux_form if controls.aux else "none",
            "aux_loss_coef": controls.aux_coef,
            "z_loss_coef": controls.z_coef,
            "expert_bias": controls.expert_bias,
            "expert_bias_rate": controls.bias_rate,
        },
        "layers": layers,
        "experts": plan.model.num_experts,
    }
    problems: list[str] = []
    for name, index, words in (("aux", 0, "load-balancing loss"), ("z", 1, "router z-loss")):
        base, cand = _values(records, "baseline", index), _values(records, "candidate", index)
        rel = [_rel(c, b) for b, c in zip(base, cand, strict=True)]
        section[name] = {"baseline": base, "candidate": cand, "rel_error": rel}
        for step in range(plan.steps):  # nothing non-finite passes, judged step or not
            if not all(math.isfinite(v) for v in (base[step], cand[step], rel[step])):
                problems.append(f"step {step}: the {words} is not finite")
            elif step in judged and rel[step] > loss_bound:
                problems.append(f"step {step}: {words} differs by {rel[step]:.3g} (relative)")
    sides = ("baseline", "candidate")
    load = {
        key: [_whole_load(per_rank, s, key, layers) for s in range(plan.steps)] for key in sides
    }
    # Pinned against the oracle too: the pipeline replays the oracle's choices.
    exact = plan.routing in JUDGED_ROUTING
    section["judged"] = {"values": judged, "load": exact, "bias": exact}
    load_diffs, bias_diffs = [], []
    for step in range(plan.steps):
        load_diff, bias_diff = _differences(per_rank, step, layers)
        load_diffs.append(load_diff)
        bias_diffs.append([bias_diff[layer] for layer in layers])
        if exact and load_diff:
            problems.append(
                f"step {step}: expert load differs from the baseline's by up to {load_diff} "
                "copies (the choices are pinned: the counts must be equal)"
            )
        unequal = [(d, layer) for layer, d in bias_diff.items() if d != 0]  # NaN != 0
        if exact and unequal:
            worst, layer = max(unequal, key=lambda w: math.inf if math.isnan(w[0]) else w[0])
            problems.append(
                f"step {step}: expert bias of layer {layer} differs from the baseline's by "
                f"{worst:.3g} (the update is exact arithmetic on counts: it must be equal)"
            )
    section["load"] = {**load, "max_abs_diff": load_diffs}
    section["max_over_mean"] = {key: [_max_over_mean(rows) for rows in load[key]] for key in sides}
    ranges = []
    for step in range(plan.steps):
        found: dict[int, list[float]] = {}
        for result in per_rank:
            found.update(result["steps"][step].balancing["baseline"]["bias"])
        ranges.append([[min(found[l]), max(found[l])] if found.get(l) else None for l in layers])
    change = {
        key: max((r["eval"].get("bias_change", {}).get(key, 0.0) for r in per_rank), key=_nan_first)
        for key in sides
    }
    section["bias"] = {"max_abs_diff": bias_diffs, "range": ranges, "eval_change": change}
    for key in sides:
        if change[key] != 0:  # NaN != 0
            problems.append(
                f"evaluation: the forward-only pass moved the {key}'s expert bias by "
                f"{change[key]:.3g} (a forward-only pass must change nothing)"
            )
    return section, problems


def _nan_first(value: float) -> float:
    return math.inf if math.isnan(value) else value
