"""One rank of `twinpipe compare`: the stacks step by step, compared where they live.

**Lockstep** (the default for two pipeline stacks). Before each step the candidate
takes the baseline's parameters and optimizer state, so each step's verdict measures
that step's arithmetic: the loss, every gradient, the router scores, and the
parameters after the update. Free-running, AdamW turns rounding-level gradient
differences into parameter differences of order ``lr`` in its first steps; at real
widths in bfloat16 every check after the first update then measures that compounding,
and calls a correct stack wrong. How the state is shared or copied: `harness.compare.stacks`.

**Free** (``--trajectory free``): each stack follows its own trajectory; the comparison
of its later steps is information (against the oracle, the loss stays judged).

**Against the oracle** lockstep runs the other way round whichever side the oracle is: the
oracle holds the whole model, so the pipeline takes the rows of the oracle's state it holds
before each step (`oracle_step`); the oracle runs first and, at pinned routing, records the
expert choices the pipeline replays.

**The noise floor** (bfloat16 lockstep): the reference stack in float32 computes the
same step first (the same weights, batch and routing: it records the routing both
bfloat16 stacks replay), and each bfloat16 stack's error against that float32 truth is
measured per quantity (`harness.compare.noise_floor` judges them).

Each step on a rank, shared state (reference and optimized):

1. the truth's forward and backward (bfloat16 only); its gradients are spilled to a file
   (`harness.compare.spill`);
2. the baseline's forward and backward; its gradients are moved aside;
3. the candidate's forward and backward on the same parameters;
4. gradients compared in place (`harness.compare.inplace`), each against the other and the
   truth; the truth's released;
5. the candidate's update computed on the side (`harness.compare.stacks.shadow_update`), its
   gradients released as it goes; the baseline's update applied; parameters compared;
6. the candidate's expert-bias update, on its own biases (each stack keeps its own: the
   candidate takes the baseline's before the step, `harness.compare.stacks.copy_buffers`);
   each stack's balancing losses, load and biases read (`harness.compare.balancing`).

So the harness holds, beyond one stack's training state, one gradient-sized set of
tensors in the model dtype (the baseline's gradients during the candidate's backward,
the candidate's updated parameters during the baseline's update): `held` in the report.
The float32 truth's gradients wait in a file (`spilled` in the report) and are read back
one tensor at a time to be compared.
"""

from __future__ import annotations

import resource
import sys
import time
from typing import Any

import torch

from harness.compare.arithmetic import rank_arithmetic
from harness.compare.balancing import bias_change, bias_snapshot, stack_balance
from harness.compare.instruments import SIDES
from harness.compare.rank import Rank, RankPlan
from harness.compare.record import StepRecord
from harness.compare.spill import SpilledGradients
from harness.compare.stacks import (
    copy_buffers,
    copy_state,
    is_sharded,
    load_parameters,
    put_gradients,
    release_parameters,
    shadow_update,
    storage_bytes,
    take_gradients,
)
from models.runtime import synthetic_batch
from optimized.ops import first_step_kernels

__all__ = [
    "copied_step",
    "free_step",
    "oracle_step",
    "run_rank",
    "shared_step",
    "step_batches",
]


# ---------------------------------------------------------------------- steps
def step_batches(
    plan: RankPlan, step: int, device: torch.device | None = None
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each stack's own copy of a step's batch on the rank's ``device``, made before any
    stack runs: a stack may keep its last micro-batches alive until its next step, and a
    shared batch would then be counted in the other stack's peak."""
    ids, labels = synthetic_batch(plan.model, plan.parallel, step, device)
    sides = ("truth", "baseline", "candidate")
    return {side: (ids.clone(), labels.clone()) for side in sides}


def _truth_step(rank: Rank, batches: dict, record: StepRecord) -> SpilledGradients | None:
    truth = rank.truth
    if truth is None:
        return None
    load_parameters(truth, rank.baseline)
    # The bf16 parameters are exact in float32: free them while the truth runs.
    plain = rank.baseline if not is_sharded(rank.baseline) else None
    if plain is not None:
        release_parameters(plain.part)
        # AdamW's moments wait in a file meanwhile: they are needed again only at the
        # update, and they are two more copies of the parameters.
        rank.spill.park(plain.optimizer)
    # Its own region; held: what the bf16 stacks keep meanwhile (`harness.compare.verdict`
    # adds it).
    start = time.perf_counter()
    with rank.region("truth", "truth", rank.footprint(rank.baseline, rank.candidate)):
        record.loss["truth"] = truth.forward_backward(*batches.pop("truth"))
    record.time["truth"] = time.perf_counter() - start
    # Spilled to a file while the bfloat16 stacks run: held, they would be two more copies
    # of the rank's bfloat16 parameters beside the stacks.
    spilled = rank.spill.spill(take_gradients(truth.part))
    if plain is not None:
        load_parameters(plain, truth)
    release_parameters(truth.part)
    rank.spill.restore()
    return spilled


def _compare_truth(
    rank: Rank, record: StepRecord, spilled: SpilledGradients | None, grads: dict
) -> None:
    if spilled is None:
        return
    truth = rank.spilled_grads(rank.truth, spilled)
    record.grads_truth = {
        key: rank.comparer.compare(grads[key], truth) for key in ("baseline", "candidate")
    }
    spilled.close()


def _baseline_step(rank: Rank, batches: dict, record: StepRecord) -> SpilledGradients | None:
    """The float32 truth's step (bfloat16 with the noise floor), then the baseline's forward
    and backward; the truth's gradients, spilled until both sides are compared with them."""
    spilled = _truth_step(rank, batches, record)
    start = time.perf_counter()
    with rank.region("baseline", "forward-backward"):
        record.loss["baseline"] = rank.baseline.forward_backward(*batches.pop("baseline"))
    record.time["baseline"] = time.perf_counter() - start
    return spilled


def shared_step(rank: Rank, batches: dict, record: StepRecord) -> None:
    """A lockstep step of two stacks on the baseline's parameters and optimizer (`Rank.shared`:
    the candidate's update computed on the side, the baseline's kept)."""
    base, cand = rank.baseline, rank.candidate
    copy_buffers(base, cand)
    spilled = _baseline_step(rank, batches, record)
    grads_base = take_gradients(base.part)
    held = storage_bytes(grads_base) + rank.truth_held()
    start = time.perf_counter()
    with rank.region("candidate", "forward-backward", held):
        record.loss["candidate"] = cand.forward_backward(*batches.pop("candidate"))
    record.time["candidate"] = time.perf_counter() - start
    record.held = held
    grads_cand = take_gradients(cand.part)
    grads = {"baseline": rank.grads(base, grads_base), "candidate": rank.grads(cand, grads_cand)}
    record.grads = rank.comparer.compare(grads["candidate"], grads["baseline"])
    _compare_truth(rank, record, spilled, grads)
    del spilled, grads
    after = shadow_update(base.optimizer, base.part, grads_cand)
    put_gradients(base.part, grads_base)
    del grads_base
    start = time.perf_counter()
    with rank.region("baseline", "update", storage_bytes(after)):
        base.optimizer_step()
    update = time.perf_counter() - start
    record.time["baseline"] += update
    record.time["candidate"] += update
    record.held = max(record.held, storage_bytes(after))
    record.params = rank.comparer.compare(rank.params(cand, after), rank.params(base))
    del after
    rank.memory.share_update()
    base.optimizer.zero_grad(set_to_none=True)
    with rank.region("candidate", "update (expert bias)"):
        cand.update_expert_biases()  # the optimizer step is shared; the biases are not


def copied_step(rank: Rank, batches: dict, record: StepRecord) -> None:
    """One side is FSDP2-sharded: the candidate copies the baseline's state, then both
    run their own update."""
    base, cand = rank.baseline, rank.candidate
    spilled = _baseline_step(rank, batches, record)
    copy_state(base, cand)
    held = rank.footprint(base) + rank.truth_held()
    start = time.perf_counter()
    with rank.region("candidate", "forward-backward", held):
        record.loss["candidate"] = cand.forward_backward(*batches.pop("candidate"))
    record.held = held
    grads = {"baseline": rank.grads(base), "candidate": rank.grads(cand)}
    record.grads = rank.comparer.compare(grads["candidate"], grads["baseline"])
    _compare_truth(rank, record, spilled, grads)
    del spilled, grads
    with rank.region("candidate", "update", rank.footprint(base)):
        cand.optimizer_step()
    record.time["candidate"] = time.perf_counter() - start
    start = time.perf_counter()
    with rank.region("baseline", "update", rank.footprint(cand)):
        base.optimizer_step()
    record.time["baseline"] += time.perf_counter() - start
    record.params = rank.comparer.compare(rank.params(cand), rank.params(base))


def oracle_step(rank: Rank, batches: dict, record: StepRecord) -> None:
    """A lockstep step against the oracle: the pipeline side takes the oracle's parameters,
    AdamW state and expert biases (the rows of them it holds), then each runs its own step,
    the oracle first (it records the routing the pipeline replays)."""
    pipeline = rank.candidate if rank.oracle is rank.baseline else rank.baseline
    copy_state(rank.oracle, pipeline)
    free_step(rank, batches, record)


def _order(rank: Rank) -> tuple[str, str]:
    """The sides in the order they run: the oracle first where it is one."""
    return ("candidate", "baseline") if rank.plan.candidate == "oracle" else SIDES


def free_step(rank: Rank, batches: dict, record: StepRecord) -> None:
    """Each stack its own step, on its own trajectory."""
    for key in _order(rank):
        side = getattr(rank, key)
        other = rank.candidate if key == "baseline" else rank.baseline
        start = time.perf_counter()
        with rank.region(key, "step", rank.footprint(other)):
            record.loss[key] = side.forward_backward(*batches.pop(key))
            side.optimizer_step()
        record.time[key] = time.perf_counter() - start
    record.held = max(rank.footprint(rank.baseline), rank.footprint(rank.candidate))
    record.grads = rank.compare(rank.grads(rank.candidate), rank.grads(rank.baseline))
    record.params = rank.compare(rank.params(rank.candidate), rank.params(rank.baseline))


def _evaluate(rank: Rank, batches: dict) -> dict:
    out: dict[str, Any] = {"loss": {}, "routing": {}}
    if rank.oracle is not None and rank.lockstep:
        oracle = rank.oracle is rank.baseline
        copy_state(rank.oracle, rank.candidate if oracle else rank.baseline)
    elif rank.lockstep:
        (copy_buffers if rank.shared else copy_state)(rank.baseline, rank.candidate)
    sides = {"baseline": rank.baseline, "candidate": rank.candidate}
    before = {key: bias_snapshot(side) for key, side in sides.items()}
    if rank.tapes is not None:
        rank.tapes.attach()
    if rank.truth is not None:
        load_parameters(rank.truth, rank.baseline)
        out["loss"]["truth"] = rank.truth.evaluate(*batches.pop("truth"))
        release_parameters(rank.truth.part)
    for key in _order(rank):
        out["loss"][key] = getattr(rank, key).evaluate(*batches.pop(key))
    if rank.tapes is not None:
        out["routing"] = rank.tapes.results()
    # A forward-only pass changes nothing (`harness.compare.balancing`).
    out["bias_change"] = {key: bias_change(side, before[key]) for key, side in sides.items()}
    return out


def run_rank(plan: RankPlan) -> dict[str, Any]:
    """Run ``plan`` on this rank (inside a launched world), on the device its launcher
    handed it, TF32 off, bfloat16 products as a GPU's, deterministic if asked
    (`harness.compare.arithmetic`); the per-step records (the comparisons on rank 0 only;
    every rank computed the same), each rank's memory, times and routing replays, and the
    device section of the report."""
    from harness.compare.planted import planted  # noqa: PLC0415

    dtype = plan.parallel.torch_dtype
    with rank_arithmetic(dtype, plan.deterministic) as arithmetic, planted(plan.plant):
        rank = Rank(plan, arithmetic.device)
        rank.prepare()  # communicators up, kernels tuned: before step 1 (docs/gpus.md)
        with rank.installed():
            return {**_run_steps(plan, rank), "device": arithmetic.section}


def _run_steps(plan: RankPlan, rank: Rank) -> dict[str, Any]:
    step_function = free_step
    if rank.lockstep:
        step_function = shared_step if rank.shared else copied_step
        step_function = oracle_step if rank.oracle is not None else step_function
    steps = []
    for step in range(plan.steps):
        batches = step_batches(plan, step, rank.device)
        record = StepRecord()
        rank.start_step()
        step_function(rank, batches, record)
        if step == 0:  # every kernel launched before it (optimized.ops.precompile)
            first_in_step = first_step_kernels(rank.layout.rank)
        del batches
        sides = {"baseline": rank.baseline, "candidate": rank.candidate}
        record.balancing = {key: stack_balance(side) for key, side in sides.items()}
        rank.end_step(record)
        if rank.layout.rank != 0:  # the same scalars are on every rank: keep one copy
            record.drop_shared()
        steps.append(record)
        if plan.progress and rank.layout.rank == 0:
            losses = "  ".join(f"{k} {v:.6f}" for k, v in record.loss.items())
            print(f"  step {step + 1}/{plan.steps}  {losses}", file=sys.stderr)
    evaluation = _evaluate(rank, step_batches(plan, plan.steps, rank.device))
    sides = {
        key: {"memory": [s.memory[key] for s in steps if s.memory[key]]}
        for key in ("baseline", "candidate")
    }
    rank.finish(sides)
    layout = rank.layout
    return {
        # by stack name, as the estimate and communication sections read them
        **{getattr(plan, key): figures for key, figures in sides.items()},
        "coords": (layout.pp_rank, layout.dp_rank, layout.ep_rank),
        "steps": steps,
        "eval": evaluation,
        "param_bytes": rank.param_bytes,
        "param_elements": sum(p.numel() for p in rank.baseline.part.parameters()),
        "shared_state": rank.shared,
        "lockstep": rank.lockstep,
        "rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "sharded": {k: is_sharded(getattr(rank, k)) for k in ("baseline", "candidate")},
        "kernels_first_in_step": first_in_step if plan.steps else [],
    }
