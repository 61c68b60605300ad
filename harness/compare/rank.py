"""One rank of `twinpipe compare`: its plan, its stacks, and the instruments it measures
them with.

`RankPlan` is what the parent sends every rank. `Rank` builds the rank's stacks (the
baseline, the candidate, and in bfloat16 lockstep the float32 truth), shares or copies
their state (`harness.compare.stacks`), and keeps the list of instruments
(`harness.compare.instruments`) that every step and every stack's region pass through.
The order of a step is `harness.compare.lockstep`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from harness.compare.inplace import Comparer, RankPlace, pieces
from harness.compare.instruments import CommunicationCount, Instrument, RoutingTapes
from harness.compare.meter import MemoryMeters
from harness.compare.ops_audit import OpsAudit, ops_class
from harness.compare.record import StepRecord
from harness.compare.routing_counts import RoutingCounts
from harness.compare.spill import LoadedPieces, SpilledGradients, TruthSpill
from harness.compare.stacks import (
    share_parameters,
    shares_state,
    stack_class,
    storage_bytes,
    takes_device,
)
from models.network import BalancedRouting, ModelConfig, attach_routing_tape
from models.runtime import OptimizerConfig, ParallelConfig, make_layout, warm_up


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
    """A known bug to plant in the optimized stack (`harness.compare.planted`)."""
    count_routing: bool = False
    """Count each step's expert choices per router call (for the observed-routing estimate)."""
    ops_audit: bool = True
    """Audit the candidate's ops on the run's own inputs against plain PyTorch
    (`harness.compare.ops_audit`; bfloat16 pipeline runs only)."""
    deterministic: bool = False
    """Run deterministic (`models.runtime.determinism`; ``--deterministic``)."""


def _oracle_key(plan: RankPlan) -> str:
    return "baseline" if plan.baseline == "oracle" else "candidate"


def build_stack(
    name: str, plan: RankPlan, layout: Any, device: torch.device, dtype: str | None = None
) -> Any:
    """Stack ``name`` (a `harness.compare.stacks.SIDES` entry) of ``plan`` on this rank's
    ``device``, in ``dtype`` (default: the plan's), seeded from the plan."""
    parallel = dataclasses.replace(plan.parallel, dtype=dtype or plan.parallel.dtype)
    torch.manual_seed(parallel.seed)
    if name == "oracle":
        from reference.oracle import Oracle  # noqa: PLC0415

        return Oracle(
            plan.model, plan.weights, plan.optimizer, parallel.torch_dtype, device,
            micro_batch_size=parallel.micro_batch_size,
        )  # fmt: skip
    cls = stack_class(name)
    # A stack that takes no device builds on the CPU (the parent refused other devices).
    where = {"device": device} if takes_device(name) else {}
    return cls(
        plan.model, parallel, layout, plan.weights, plan.optimizer, stages=plan.stages, **where
    )


class Rank:
    """The stacks of one rank, and the instruments that measure them."""

    def __init__(self, plan: RankPlan, device: torch.device) -> None:
        self.plan = plan
        self.device = device
        """Where this rank computes (`harness.compare.arithmetic.rank_arithmetic`)."""
        self.layout = make_layout(plan.parallel)
        layout = self.layout
        # Host-side sums and names go through the gloo group; device tensors never do.
        self.comparer = Comparer(layout.host_group)
        self.place = RankPlace(layout.dp_rank, layout.ep)
        self.whole = RankPlace(layout.dp_rank, layout.ep, whole=True)
        self.baseline = build_stack(plan.baseline, plan, layout, device)
        self.candidate = build_stack(plan.candidate, plan, layout, device)
        pipelines = "oracle" not in (plan.baseline, plan.candidate)
        self.oracle = None if pipelines else getattr(self, _oracle_key(plan))
        """The oracle, where it is a side: it leads (`harness.compare.lockstep.oracle_step`)."""
        self.lockstep = plan.trajectory == "lockstep"
        self.shared = self.lockstep and pipelines and shares_state(self.baseline, self.candidate)
        if self.shared:
            share_parameters(self.baseline, self.candidate)
        self.truth = None
        if self.lockstep and plan.noise_floor and pipelines:
            self.truth = build_stack("reference", plan, layout, device, dtype="float32")
            # One micro-batch in flight: float32 activations of the DualPipeV order would
            # be twice what the bf16 stacks hold (`ReferenceDualPipeV.sequential`).
            self.truth.schedule.sequential = True
        if plan.routing == "balanced" and pipelines:
            for side in (self.baseline, self.candidate, self.truth):
                if side is not None:
                    attach_routing_tape(side.part, BalancedRouting())
        self.param_bytes = storage_bytes([p for p in self.baseline.part.parameters()])
        self.counted = pipelines
        """Whether the stacks' communication is counted (two pipeline stacks)."""
        self.tapes = self._routing_tapes(plan.routing == "pinned")
        # The float32 truth's step is the harness's too: measured, reported.
        stacks = {"baseline": self.baseline, "candidate": self.candidate, "truth": self.truth}
        self.memory = MemoryMeters(
            {k: s for k, s in stacks.items() if s is not None}, plan.track_memory, device
        )
        self.spill = TruthSpill() if self.truth is not None else None
        self.instruments = self._instruments(pipelines)

    def _instruments(self, pipelines: bool) -> list[Instrument]:
        """Every instrument of the run, in the order their regions nest (see
        `harness.compare.instruments`)."""
        plan = self.plan
        found: list[Instrument | None] = [self.tapes, self.memory]
        if self.counted:
            found.append(CommunicationCount(self.layout))
        if plan.count_routing and pipelines:
            sides = {"baseline": self.baseline, "candidate": self.candidate}
            found.append(RoutingCounts(sides, plan.model.num_experts))
        audited = ops_class(plan.candidate)
        if plan.ops_audit and pipelines and audited and plan.parallel.dtype == "bfloat16":
            found.append(OpsAudit(audited))
        found.append(self.spill)
        return [instrument for instrument in found if instrument is not None]

    def _routing_tapes(self, pinned: bool) -> RoutingTapes | None:
        """Pinned routing: the truth records where it runs (both bfloat16 stacks replay),
        else the oracle where it is a side (the pipeline replays its micro-batches' rows of
        the oracle's whole batch), else the baseline (the candidate replays)."""
        if not pinned:
            return None
        every = [s for s in (self.baseline, self.candidate, self.truth) if s is not None]
        if self.oracle is not None:
            key = "baseline" if self.plan.candidate == "oracle" else "candidate"
            return RoutingTapes(self.oracle, {key: getattr(self, key)}, every, self._rows())
        if self.truth is None:
            return RoutingTapes(self.baseline, {"candidate": self.candidate}, every)
        replayers = {"candidate": self.candidate, "baseline": self.baseline}
        return RoutingTapes(self.truth, replayers, every)

    def prepare(self) -> dict[str, Any]:
        """Before the first step, before any instrument counts: every communicator up
        (`models.runtime.warm_up`) and each stack's kernels tuned (its ``prepare``), so no
        step creates one or tunes, and no step's peak holds the tuner's buffers."""
        done: dict[str, Any] = {"connect": warm_up(self.layout, self.device)}
        for key in ("baseline", "candidate", "truth"):
            prepare = getattr(getattr(self, key), "prepare", None)
            if prepare is not None:
                done[key] = prepare()
        return done

    def _rows(self) -> list[tuple[int, int]]:
        """This rank's micro-batches as token ranges of the global batch, in order
        (`models.runtime.micro_batches_of`, the tokens of a batch flattened by sequence)."""
        parallel = self.plan.parallel
        size, seq = parallel.micro_batch_size * parallel.seq_len, parallel.seq_len
        first = self.layout.dp_rank * parallel.micro_batches * parallel.micro_batch_size * seq
        return [(first + j * size, first + (j + 1) * size) for j in range(parallel.micro_batches)]

    # ------------------------------------------------------------------ instruments
    @contextmanager
    def installed(self) -> Iterator[None]:
        """Every instrument installed for the run."""
        with ExitStack() as stack:
            for instrument in self.instruments:
                stack.enter_context(instrument.installed())
            yield

    @contextmanager
    def region(self, key: str, phase: str, held: int = 0) -> Iterator[None]:
        """A stack's own work (``key``: baseline, candidate or truth), through every
        instrument: its memory region, its communication counted into this step's figure,
        the ops audit while the candidate runs (a step may have several regions)."""
        with ExitStack() as stack:
            for instrument in self.instruments:
                stack.enter_context(instrument.region(key, phase, held))
            yield

    def start_step(self) -> None:
        for instrument in self.instruments:
            instrument.start_step()

    def end_step(self, record: StepRecord) -> None:
        for instrument in self.instruments:
            instrument.end_step(record)

    def finish(self, stacks: dict[str, dict[str, Any]]) -> None:
        for instrument in self.instruments:
            instrument.finish(stacks)

    # ------------------------------------------------------------------ comparisons
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
