"""One rank of `twinpipe compare`: the stacks step by step, compared where they live.

**Lockstep** (the default for two pipeline stacks). Before each step the candidate
takes the baseline's parameters and optimizer state, so each step's verdict measures
that step's arithmetic: the loss, every gradient, the router scores, and the
parameters after the update. Free-running, AdamW turns rounding-level gradient
differences into parameter differences of order ``lr`` in its first steps; at real
widths in bfloat16 every check after the first update then measures that compounding,
and calls a correct stack wrong. How the state is shared or copied: `harness.compare.stacks`.

**Free** (``--trajectory free``, and always against the oracle): each stack follows its
own trajectory; the comparison of its later steps is information.

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
   gradients released as it goes; the baseline's update applied; parameters compared.

So the harness holds, beyond one stack's training state, one gradient-sized set of
tensors in the model dtype (the baseline's gradients during the candidate's backward,
the candidate's updated parameters during the baseline's update): `held` in the report.
The float32 truth's gradients wait in a file (`spilled` in the report) and are read back
one tensor at a time to be compared.
"""

from __future__ import annotations

import dataclasses
import resource
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from harness.compare.inplace import Comparer, RankPlace, pieces
from harness.compare.meter import Meter
from harness.compare.ops_audit import OpsAudit, ops_class
from harness.compare.spill import LoadedPieces, ParkedTensors, SpilledGradients
from harness.compare.stacks import (
    copy_state,
    is_sharded,
    load_parameters,
    put_gradients,
    release_parameters,
    shadow_update,
    share_parameters,
    shares_state,
    stack_class,
    storage_bytes,
    take_gradients,
)
from models.config import ModelConfig
from models.distributed import ParallelConfig, make_layout
from models.training import OptimizerConfig, synthetic_batch


@dataclass(slots=True)
class RankPlan:
    """What every rank of a compare run does; sent to each rank, so it is small."""

    model: ModelConfig
    """The model config."""
    parallel: ParallelConfig
    """Layout, micro-batches, dtype and seed."""
    weights: Any
    """Where the weights come from: what the stacks' constructors take."""
    baseline: str
    """The stack compared against (`harness.compare.stacks.SIDES`)."""
    candidate: str
    """The stack under test."""
    steps: int
    """Training steps."""
    optimizer: OptimizerConfig
    """AdamW settings shared by every stack."""
    trajectory: str = "lockstep"
    """``lockstep``: the candidate starts each step from the baseline's state; ``free``."""
    routing: str = "pinned"
    """``pinned``: later stacks replay the first one's expert choices; ``free``."""
    noise_floor: bool = False
    """Run the float32 truth of each step (bfloat16 lockstep)."""
    track_memory: bool = True
    """Measure each stack's peak memory per step."""
    progress: bool = True
    """Print each step's losses from rank 0."""
    stages: list[list[int]] | None = None
    """Layers per stage, the same for both stacks; None: each stack chooses."""
    plant: str | None = None
    """A known bug to plant in the optimized stack (`harness.compare.planted`), to see it caught."""
    count_routing: bool = False
    """Count each step's expert choices per router call (for the observed-routing estimate)."""
    ops_audit: bool = True
    """Audit the candidate's ops on the run's own inputs against plain PyTorch
    (`harness.compare.ops_audit`; bfloat16 pipeline runs only)."""


def _build(name: str, plan: RankPlan, layout, dtype: str | None = None) -> Any:
    parallel = dataclasses.replace(plan.parallel, dtype=dtype or plan.parallel.dtype)
    torch.manual_seed(parallel.seed)
    if name == "oracle":
        from reference.oracle import Oracle  # noqa: PLC0415

        return Oracle(plan.model, plan.weights, plan.optimizer, parallel.torch_dtype)
    cls = stack_class(name)
    return cls(plan.model, parallel, layout, plan.weights, plan.optimizer, stages=plan.stages)


class _Rank:
    """The stacks of one rank and what they have measured."""

    def __init__(self, plan: RankPlan) -> None:
        self.plan = plan
        self.layout = make_layout(plan.parallel)
        layout = self.layout
        self.comparer = Comparer()
        self.place = RankPlace(layout.dp_rank, layout.ep)
        self.whole = RankPlace(layout.dp_rank, layout.ep, whole=True)
        self.baseline = _build(plan.baseline, plan, layout)
        self.candidate = _build(plan.candidate, plan, layout)
        pipelines = "oracle" not in (plan.baseline, plan.candidate)
        self.lockstep = plan.trajectory == "lockstep" and pipelines
        self.shared = self.lockstep and shares_state(self.baseline, self.candidate)
        if self.shared:
            share_parameters(self.baseline, self.candidate)
        self.truth = None
        if self.lockstep and plan.noise_floor:
            self.truth = _build("reference", plan, layout, dtype="float32")
            # One micro-batch in flight: float32 activations of the DualPipeV order would
            # be twice what the bf16 stacks hold (`ReferenceDualPipeV.sequential`).
            self.truth.schedule.sequential = True
        self.pin = plan.routing == "pinned" and pipelines
        if plan.routing == "balanced" and pipelines:
            from models.routing import BalancedRouting, attach_routing_tape  # noqa: PLC0415

            for side in (self.baseline, self.candidate, self.truth):
                if side is not None:
                    attach_routing_tape(side.part, BalancedRouting())
        self.meters = {
            "baseline": Meter(self.baseline, plan.track_memory),
            "candidate": Meter(self.candidate, plan.track_memory),
        }
        if self.truth is not None:  # its step is the harness's too: measured, reported
            self.meters["truth"] = Meter(self.truth, plan.track_memory)
        self.param_bytes = storage_bytes([p for p in self.baseline.part.parameters()])
        # Per stack, per step, as `harness.compare.communication` and the observed-routing
        # estimate read them: collective and p2p counts, expert choices.
        self.counted = pipelines
        self.communication: dict[str, list] = {"baseline": [], "candidate": []}
        self.counters = {}
        if plan.count_routing and pipelines:
            from harness.compare.routing_counts import RoutingCounter  # noqa: PLC0415

            for key in ("baseline", "candidate"):
                side = getattr(self, key)
                self.counters[key] = RoutingCounter(side.part, plan.model.num_experts)
        self.routing_counts: dict[str, list] = {key: [] for key in self.counters}
        self.audit = None
        audited = ops_class(plan.candidate)
        if plan.ops_audit and pipelines and audited and plan.parallel.dtype == "bfloat16":
            self.audit = OpsAudit(audited)

    @contextmanager
    def region(self, key: str, phase: str, held: int = 0) -> Iterator[None]:
        """A stack's own work: its memory region, its communication counted into this
        step's figure (a step may have several regions)."""
        if not self.counted:
            with self.meters[key].region(phase, held):
                yield
            return
        from models.communication import counted_step  # noqa: PLC0415

        counts: list = []
        with self.meters[key].region(phase, held), counted_step(self.layout, counts):
            if self.audit is not None:
                self.audit.active = key == "candidate"
            try:
                yield
            finally:
                if self.audit is not None:
                    self.audit.active = False
        mine = self.communication[key][-1]
        for what, traffic in counts[0].items():
            if what in mine:
                mine[what].add(traffic)
            else:
                mine[what] = traffic

    def start_step(self) -> None:
        for key in self.communication:
            self.communication[key].append({})
        for counter in self.counters.values():
            counter.start_step()
        if self.audit is not None:
            self.audit.start_step()

    def end_step(self, record: dict) -> None:
        for key, counter in self.counters.items():
            self.routing_counts[key].append(counter.end_step())
        if self.audit is not None:
            record["ops_audit"] = self.audit.end_step()

    # ------------------------------------------------------------------ helpers
    def _place(self, side: Any) -> RankPlace:
        return self.whole if side.name == "oracle" else self.place

    def grads(self, side: Any, held: dict | None = None) -> dict:
        if held is None:
            return pieces(side.part, self._place(side), lambda name, p: p.grad)
        return pieces(side.part, self._place(side), lambda name, p: held.get(name))

    def spilled_grads(self, side: Any, spilled: SpilledGradients) -> LoadedPieces:
        """A side's spilled gradients as pieces, each read back when compared."""
        shapes = pieces(side.part, self._place(side), lambda name, p: spilled.placeholder(name))
        return LoadedPieces(shapes, spilled)

    def params(self, side: Any, values: dict | None = None) -> dict:
        if values is None:
            return pieces(side.part, self._place(side), lambda name, p: p)
        return pieces(side.part, self._place(side), lambda name, p: values.get(name))

    def compare(self, candidate: dict, baseline: dict) -> dict:
        """`Comparer.compare`; the oracle holds the whole model, of which this rank compares
        what the pipeline side holds here."""
        if self.plan.baseline == "oracle":
            baseline = {name: baseline[name] for name in candidate}
        if self.plan.candidate == "oracle":
            candidate = {name: candidate[name] for name in baseline}
        return self.comparer.compare(candidate, baseline)

    def tapes(self) -> tuple[Any, dict[str, Any]]:
        """This step's routing tapes: who records, who replays (none when free)."""
        if not self.pin:
            return None, {}
        from models.routing import RoutingTape, attach_routing_tape  # noqa: PLC0415

        record = RoutingTape()
        recorder = self.truth if self.truth is not None else self.baseline
        attach_routing_tape(recorder.part, record)
        replays = {"candidate": record.replay()}
        if self.truth is not None:
            replays["baseline"] = record.replay()
        for key, tape in replays.items():
            attach_routing_tape(getattr(self, key).part, tape)
        return record, replays

    def detach_tapes(self) -> None:
        if not self.pin:
            return
        from models.routing import attach_routing_tape  # noqa: PLC0415

        for side in (self.baseline, self.candidate, self.truth):
            if side is not None:
                attach_routing_tape(side.part, None)

    def truth_held(self) -> int:
        return storage_bytes([p for p in self.truth.part.parameters()]) if self.truth else 0

    def footprint(self, *sides: Any) -> int:
        """Bytes of the stacks' parameters, gradients and optimizer state (shared: once)."""
        tensors = []
        for side in sides:
            tensors += [p for p in side.part.parameters()]
            tensors += [p.grad for p in side.part.parameters() if p.grad is not None]
            optimizer = getattr(side, "optimizer", None)
            state = getattr(optimizer, "state", {}) if optimizer is not None else {}
            tensors += [v for s in state.values() for v in s.values() if torch.is_tensor(v)]
        return storage_bytes(tensors)


# ---------------------------------------------------------------------- steps
def _batches(plan: RankPlan, step: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each stack's own copy of a step's batch, made before any stack runs: a stack may keep
    its last micro-batches alive until its next step, and a shared batch would then be
    counted in the other stack's peak."""
    ids, labels = synthetic_batch(plan.model, plan.parallel, step)
    sides = ("truth", "baseline", "candidate")
    return {side: (ids.clone(), labels.clone()) for side in sides}


def _truth_step(rank: _Rank, batches: dict, record: dict) -> SpilledGradients | None:
    truth = rank.truth
    if truth is None:
        return None
    load_parameters(truth, rank.baseline)
    # The bf16 parameters are exact in float32: free them while the truth runs.
    plain = rank.baseline if not is_sharded(rank.baseline) else None
    parked = None
    if plain is not None:
        release_parameters(plain.part)
        # AdamW's moments wait in a file meanwhile (`ParkedTensors`): they are needed again
        # only at the update, and they are two more copies of the parameters.
        state = getattr(plain.optimizer, "state", {})
        moments = [
            (s, k) for s in state.values() for k, v in s.items()
            if k != "step" and type(v) is torch.Tensor and v.numel() > 1
        ]  # fmt: skip
        parked = ParkedTensors(moments) if moments else None
    # Its own region; held: what the bf16 stacks keep meanwhile (`harness.compare.verdict` adds it).
    start = time.perf_counter()
    with rank.meters["truth"].region("truth", rank.footprint(rank.baseline, rank.candidate)):
        record["loss"]["truth"] = truth.forward_backward(*batches.pop("truth"))
    record["time"]["truth"] = time.perf_counter() - start
    # Spilled to a file while the bfloat16 stacks run (`harness.compare.spill`): held, they would
    # be two more copies of the rank's bfloat16 parameters beside the stacks.
    spilled = SpilledGradients(take_gradients(truth.part))
    record["spilled"] = spilled.nbytes
    if plain is not None:
        load_parameters(plain, truth)
    release_parameters(truth.part)
    if parked is not None:
        record["parked"] = parked.nbytes
        parked.restore()
    return spilled


def _compare_truth(
    rank: _Rank, record: dict, spilled: SpilledGradients | None, grads: dict
) -> None:
    if spilled is None:
        return
    truth = rank.spilled_grads(rank.truth, spilled)
    record["grads_truth"] = {
        key: rank.comparer.compare(grads[key], truth) for key in ("baseline", "candidate")
    }
    spilled.close()


def _baseline_step(rank: _Rank, batches: dict, record: dict) -> SpilledGradients | None:
    """The float32 truth's step (bfloat16 with the noise floor), then the baseline's forward
    and backward; the truth's gradients, spilled until both sides are compared with them."""
    spilled = _truth_step(rank, batches, record)
    start = time.perf_counter()
    with rank.region("baseline", "forward-backward"):
        record["loss"]["baseline"] = rank.baseline.forward_backward(*batches.pop("baseline"))
    record["time"]["baseline"] = time.perf_counter() - start
    return spilled


def _lockstep_shared(rank: _Rank, batches: dict, record: dict) -> None:
    base, cand = rank.baseline, rank.candidate
    spilled = _baseline_step(rank, batches, record)
    grads_base = take_gradients(base.part)
    held = storage_bytes(grads_base) + rank.truth_held()
    start = time.perf_counter()
    with rank.region("candidate", "forward-backward", held):
        record["loss"]["candidate"] = cand.forward_backward(*batches.pop("candidate"))
    record["time"]["candidate"] = time.perf_counter() - start
    record["held"] = held
    grads_cand = take_gradients(cand.part)
    grads = {"baseline": rank.grads(base, grads_base), "candidate": rank.grads(cand, grads_cand)}
    record["grads"] = rank.comparer.compare(grads["candidate"], grads["baseline"])
    _compare_truth(rank, record, spilled, grads)
    del spilled, grads
    after = shadow_update(base.optimizer, base.part, grads_cand)
    put_gradients(base.part, grads_base)
    del grads_base
    start = time.perf_counter()
    with rank.region("baseline", "update", storage_bytes(after)):
        base.optimizer_step()
    update = time.perf_counter() - start
    record["time"]["baseline"] += update
    record["time"]["candidate"] += update
    record["held"] = max(record["held"], storage_bytes(after))
    record["params"] = rank.comparer.compare(rank.params(cand, after), rank.params(base))
    del after
    rank.meters["candidate"].add_shared_update(rank.meters["baseline"].last("update"))
    base.optimizer.zero_grad(set_to_none=True)


def _lockstep_copied(rank: _Rank, batches: dict, record: dict) -> None:
    """One side is FSDP2-sharded: the candidate copies the baseline's state, then both
    run their own update."""
    base, cand = rank.baseline, rank.candidate
    spilled = _baseline_step(rank, batches, record)
    copy_state(base, cand)
    held = rank.footprint(base) + rank.truth_held()
    start = time.perf_counter()
    with rank.region("candidate", "forward-backward", held):
        record["loss"]["candidate"] = cand.forward_backward(*batches.pop("candidate"))
    record["held"] = held
    grads = {"baseline": rank.grads(base), "candidate": rank.grads(cand)}
    record["grads"] = rank.comparer.compare(grads["candidate"], grads["baseline"])
    _compare_truth(rank, record, spilled, grads)
    del spilled, grads
    with rank.region("candidate", "update", rank.footprint(base)):
        cand.optimizer_step()
    record["time"]["candidate"] = time.perf_counter() - start
    start = time.perf_counter()
    with rank.region("baseline", "update", rank.footprint(cand)):
        base.optimizer_step()
    record["time"]["baseline"] += time.perf_counter() - start
    record["params"] = rank.comparer.compare(rank.params(cand), rank.params(base))


def _free(rank: _Rank, batches: dict, record: dict) -> None:
    for key in ("baseline", "candidate"):
        side = getattr(rank, key)
        other = rank.candidate if key == "baseline" else rank.baseline
        start = time.perf_counter()
        with rank.region(key, "step", rank.footprint(other)):
            record["loss"][key] = side.forward_backward(*batches.pop(key))
            side.optimizer_step()
        record["time"][key] = time.perf_counter() - start
    record["held"] = max(rank.footprint(rank.baseline), rank.footprint(rank.candidate))
    record["grads"] = rank.compare(rank.grads(rank.candidate), rank.grads(rank.baseline))
    record["params"] = rank.compare(rank.params(rank.candidate), rank.params(rank.baseline))


def _evaluate(rank: _Rank, batches: dict) -> dict:
    out: dict[str, Any] = {"loss": {}, "routing": {}}
    if rank.lockstep and not rank.shared:
        copy_state(rank.baseline, rank.candidate)
    _, replays = rank.tapes()
    if rank.truth is not None:
        load_parameters(rank.truth, rank.baseline)
        out["loss"]["truth"] = rank.truth.evaluate(*batches.pop("truth"))
        release_parameters(rank.truth.part)
    out["loss"]["baseline"] = rank.baseline.evaluate(*batches.pop("baseline"))
    out["loss"]["candidate"] = rank.candidate.evaluate(*batches.pop("candidate"))
    out["routing"] = {key: tape.result() for key, tape in replays.items()}
    rank.detach_tapes()
    return out


def run_rank(plan: RankPlan) -> dict[str, Any]:
    """Run ``plan`` on this rank (inside a launched world); the per-step scalars (on rank
    0; every rank computed the same), each rank's memory, times and routing replays."""
    from harness.compare.planted import planted  # noqa: PLC0415

    with planted(plan.plant):
        return _run(plan)


def _run(plan: RankPlan) -> dict[str, Any]:
    rank = _Rank(plan)
    with rank.audit.installed() if rank.audit is not None else nullcontext():
        return _run_steps(plan, rank)


def _run_steps(plan: RankPlan, rank: _Rank) -> dict[str, Any]:
    step_function = _free
    if rank.lockstep:
        step_function = _lockstep_shared if rank.shared else _lockstep_copied
    steps = []
    for step in range(plan.steps):
        batches = _batches(plan, step)
        record: dict[str, Any] = {"loss": {}, "time": {}, "held": 0}
        _, replays = rank.tapes()
        rank.start_step()
        step_function(rank, batches, record)
        rank.end_step(record)
        del batches
        record["routing"] = {key: tape.result() for key, tape in replays.items()}
        rank.detach_tapes()
        record["memory"] = {key: meter.finish_step() for key, meter in rank.meters.items()}
        if rank.layout.rank != 0:  # the same scalars are on every rank: keep one copy
            for key in ("grads", "grads_truth", "params"):
                record.pop(key, None)
        steps.append(record)
        if plan.progress and rank.layout.rank == 0:
            losses = "  ".join(f"{k} {v:.6f}" for k, v in record["loss"].items())
            print(f"  step {step + 1}/{plan.steps}  {losses}", file=sys.stderr)
    evaluation = _evaluate(rank, _batches(plan, plan.steps))
    for counter in rank.counters.values():
        counter.close()
    layout = rank.layout
    stacks: dict[str, Any] = {}
    for key in ("baseline", "candidate"):  # by stack name, as the estimate sections read it
        name = getattr(plan, key)
        stacks[name] = {"memory": [s["memory"][key] for s in steps if s["memory"][key]]}
        if rank.counted:
            stacks[name]["communication"] = rank.communication[key]
        if key in rank.routing_counts:
            stacks[name]["routing_counts"] = rank.routing_counts[key]
    return {
        **stacks,
        "coords": (layout.pp_rank, layout.dp_rank, layout.ep_rank),
        "steps": steps,
        "eval": evaluation,
        "param_bytes": rank.param_bytes,
        "param_elements": sum(p.numel() for p in rank.baseline.part.parameters()),
        "shared_state": rank.shared,
        "lockstep": rank.lockstep,
        "rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "sharded": {k: is_sharded(getattr(rank, k)) for k in ("baseline", "candidate")},
    }
