"""The memory estimator held against the harness's measured per-rank peaks (shared by
the tests/test_estimator_vs_measured*.py files).

`measure_cases` (and `measure_launch`, its one-model-set form) runs both stacks as
`twinpipe compare` measures them (lockstep, pinned routing, each router call's choices
counted) on one set of gloo ranks, several cases a launch; `check_estimates`
holds, per rank, the estimate of the step with the higher peak, from the routing that step
saw, against the measured peak (within ``tolerance``), and its weights (parameters and
buffers), optimizer state and every gradient against the tracker's figures exactly.
"""

from __future__ import annotations

import torch

from harness.compare.estimates import stack_estimate
from harness.compare.lockstep import run_rank
from harness.compare.rank import RankPlan
from models.network import SeededWeights
from models.runtime import OptimizerConfig, launch
from optimized.estimator import estimate_for_compare
from optimized.estimator.routing import received_loads

STACKS = ("reference", "optimized")


def _rank_cases(cases, states, optimizer):
    """Each of ``cases`` (``(key, model, parallel)``) in turn on this rank, both stacks (one
    launch for all: starting the ranks costs more than a tiny model's steps), two steps
    with recompute on, one with it off. The ops audit runs with recompute on only: it is
    not in the measured peak (`harness.compare.ops_audit`), and recompute off changes none
    of the ops it checks."""
    return {
        key: run_rank(
            RankPlan(
                model,
                parallel,
                states[key],
                *STACKS,
                2 if parallel.recompute else 1,
                optimizer,
                progress=False,
                count_routing=True,
                ops_audit=parallel.recompute,
            )
        )
        for key, model, parallel in cases
    }


def measure_cases(cases: list) -> dict:
    """``{key: per rank run_rank's result}`` for ``cases`` (``(key, model config,
    ParallelConfig)``, all of one world size, each its own model and layout), one launch
    in the order given."""
    worlds = {parallel.world_size for _, _, parallel in cases}
    assert len(worlds) == 1, f"one launch runs one world size, not {sorted(worlds)}"
    states = {key: SeededWeights(model) for key, model, _ in cases}
    per_rank = launch(_rank_cases, worlds.pop(), (cases, states, OptimizerConfig()))
    return {key: [result[key] for result in per_rank] for key, _, _ in cases}


def measure_launch(models: dict, parallels: list) -> list[list[dict]]:
    """Per entry of ``parallels`` (``(ParallelConfig, model names)``, all of one world size),
    per rank, ``{model name: run_rank's result}``: `measure_cases` of every model named."""
    cases = [
        ((index, name), model, parallel)
        for index, (parallel, names) in enumerate(parallels)
        for name, model in models.items()
        if name in names
    ]
    results = measure_cases(cases)
    return [
        [
            {name: per_rank[rank] for (i, name), per_rank in results.items() if i == index}
            for rank in range(parallel.world_size)
        ]
        for index, (parallel, _) in enumerate(parallels)
    ]


def _element_size(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def layout_fields(parallel) -> dict:
    """The `estimate_for_compare` layout of a `ParallelConfig`."""
    return dict(
        pp=parallel.pp, dp=parallel.dp, ep=parallel.ep,
        micro_batch_size=parallel.micro_batch_size, seq_len=parallel.seq_len,
        num_microbatches=parallel.micro_batches, dtype=parallel.dtype,
        recompute=parallel.recompute,
    )  # fmt: skip


def peak_steps(per_rank: list[dict], stack: str) -> list[int]:
    """Per rank, the step whose measured peak is the higher."""
    return [
        max(range(len(r[stack]["memory"])), key=lambda s: r[stack]["memory"][s]["total"])
        for r in per_rank
    ]


def observed_estimates(model, parallel, per_rank: list[dict], stack: str) -> dict[int, dict]:
    """Per global rank, the estimate of the step it peaked in from the routing that step saw,
    as `twinpipe compare` estimates ``stack`` (any compare side, ``optimized-fsdp`` too)."""
    steps = peak_steps(per_rank, stack)
    observed = {}
    for step in set(steps):
        counts = {rank: r[stack]["routing_counts"][step] for rank, r in enumerate(per_rank)}
        loads = received_loads(counts, parallel.dp, parallel.ep, model.num_experts)
        mine = {rank: loads[rank] for rank in range(len(per_rank)) if steps[rank] == step}
        report = stack_estimate(model, layout_fields(parallel), stack, parallel, step == 0, mine)
        observed.update(report["observed_ranks"])
    return observed


def check_estimates(
    model, parallel, per_rank: list[dict], stack: str, tolerance: float, beside=None
) -> tuple[list[str], list[str]]:
    """(a line per rank, failures): the observed-routing estimate of each rank's peak step
    against the measured peak within ``tolerance``; weights, optimizer state and every
    gradient exactly. Printed beside it: the balanced-routing estimate, or with ``beside``
    (``(label, model config)``) that model's estimate under the same routing."""
    steps = peak_steps(per_rank, stack)
    observed = observed_estimates(model, parallel, per_rank, stack)
    if beside is None:
        label = "balanced routing"
        balanced = estimate_for_compare(
            model, layout_fields(parallel), stack, first_step=max(steps) == 0
        )
        others = {
            rank: balanced["ranks"][result["coords"][0]] for rank, result in enumerate(per_rank)
        }
    else:
        label, other_model = beside
        others = observed_estimates(other_model, parallel, per_rank, stack)
    rows, failures = [], []
    for rank, result in enumerate(per_rank):
        measured = result[stack]["memory"][steps[rank]]
        est = observed[rank]
        error = est["peak_bytes"] / measured["total"] - 1
        other = others[rank]["peak_bytes"] / measured["total"] - 1
        rows.append(
            f"{result['coords']}: est {est['peak_bytes']:,} measured {measured['total']:,} "
            f"({error:+.2%}; {label} {other:+.2%}) at {measured['peak_moment']}"
        )
        static = (("weights_bytes", "parameters"), ("optimizer_bytes", "optimizer_state"))
        for ours, theirs in static:
            if est[ours] != measured[theirs]:
                failures.append(f"{result['coords']} {ours} {est[ours]:,} != {measured[theirs]:,}")
        # Gradients: every parameter's, once the backward is done, equal exactly (at the peak
        # itself only some exist, and which depends on where inside an action the peak falls).
        # Both stacks run on the same parameters (lockstep), whose gradients have their size.
        measured_grads = result["param_elements"] * _element_size(parallel.dtype)
        if est["all_gradients_bytes"] != measured_grads:
            failures.append(
                f"{result['coords']} all_gradients_bytes {est['all_gradients_bytes']:,} "
                f"!= {measured_grads:,}"
            )
        if abs(error) > tolerance:
            failures.append(f"{result['coords']} peak off by {error:+.2%}")
    return rows, failures
