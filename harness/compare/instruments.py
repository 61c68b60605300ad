"""What a rank measures a step with, behind one interface.

A compare rank (`harness.compare.rank.Rank`) runs its stacks step by step and keeps a list
of instruments; each one is told when the run starts, when a step starts, around each
stack's own work (a *region*: a stack's forward and backward, its update), and when the
step ends, when it writes its figures into the step's `StepRecord`. The instruments are:

- the memory meters (`harness.compare.meter.MemoryMeters`): each stack's peak per region;
- the communication count (`CommunicationCount`): each stack's collectives and p2p calls;
- the routing tapes (`RoutingTapes`): the expert choices one stack records and the others
  replay (pinned routing), and what each replay saw;
- the routing counts (`harness.compare.routing_counts.RoutingCounts`): each router call's
  expert histogram, for the observed-routing estimate;
- the ops audit (`harness.compare.ops_audit.OpsAudit`): the candidate's ops against plain
  PyTorch while the candidate runs;
- the spill (`harness.compare.spill.TruthSpill`): the files the float32 truth's step leaves
  (its gradients, AdamW's parked moments), closed when the step ends.

Regions nest in list order: the memory meters' region is outermost, so what the other
instruments do inside it is measured as it always was (nothing: they hold no tensors).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from harness.compare.record import StepRecord
from models.network import RoutingTape, attach_routing_tape, router_keys
from models.runtime import counted_step

SIDES = ("baseline", "candidate")
"""The two stacks compared; the float32 truth is a third key where it runs (``truth``)."""


class Instrument(Protocol):
    """One thing a rank measures; every method has a default that does nothing, so an
    instrument implements only the moments it needs (subclass it to inherit them)."""

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Around the whole run (every step and the evaluation)."""
        yield

    def start_step(self) -> None:
        """Before the step's first stack runs."""

    @contextmanager
    def region(self, key: str, phase: str, held: int) -> Iterator[None]:
        """Around one stack's own work: ``key`` is ``baseline``, ``candidate`` or
        ``truth``, ``phase`` names the work, ``held`` is what the harness keeps outside
        that stack meanwhile (bytes)."""
        yield

    def end_step(self, record: StepRecord) -> None:
        """After the step: write this instrument's figures into ``record``."""

    def finish(self, stacks: dict[str, dict[str, Any]]) -> None:
        """After the run: add per-run figures to each side's entry of the rank's result
        (``stacks`` by side key: ``baseline``, ``candidate``) and let go of hooks."""


class CommunicationCount(Instrument):
    """Each stack's collectives and point-to-point calls, counted per step in its regions
    (`models.runtime.counted_step`); the truth's are not counted."""

    def __init__(self, layout: Any) -> None:
        self.layout = layout
        self.steps: dict[str, list[dict]] = {key: [] for key in SIDES}
        """Per side, per step: ``(kind, group) -> Traffic``, summed over the step's regions."""

    def start_step(self) -> None:
        for steps in self.steps.values():
            steps.append({})

    @contextmanager
    def region(self, key: str, phase: str, held: int) -> Iterator[None]:
        if key not in self.steps:
            yield
            return
        counts: list = []
        with counted_step(self.layout, counts):
            yield
        mine = self.steps[key][-1]
        for what, traffic in counts[0].items():
            if what in mine:
                mine[what].add(traffic)
            else:
                mine[what] = traffic

    def finish(self, stacks: dict[str, dict[str, Any]]) -> None:
        for key in SIDES:
            stacks[key]["communication"] = self.steps[key]


class RoutingTapes(Instrument):
    """Pinned routing: each step one stack records its expert choices (the float32 truth
    where it runs, else the baseline) and the others replay them; the step's record gets
    what each replay saw (`models.network.routing.ReplayResult`)."""

    def __init__(
        self,
        recorder: Any,
        replayers: dict[str, Any],
        every: list[Any],
        rows: list[tuple[int, int]] | None = None,
    ) -> None:
        self.rows = rows
        """The oracle records: each replayer's micro-batches as token ranges of its one
        call per router (`models.network.RoutingTape.replay`)."""
        self.recorder = recorder
        """The stack whose choices are recorded."""
        self.replayers = replayers
        """The stacks that replay them, by key."""
        self.every = every
        """Every stack of the rank (each is detached after a step)."""
        self.replays: dict[str, Any] = {}

    def attach(self) -> None:
        """A fresh recording on the recorder, a replay of it on each replayer."""
        record = RoutingTape()
        attach_routing_tape(self.recorder.part, record)
        self.replays = {
            key: record.replay(self.rows, router_keys(side.part) if self.rows else None)
            for key, side in self.replayers.items()
        }
        for key, tape in self.replays.items():
            attach_routing_tape(self.replayers[key].part, tape)

    def results(self) -> dict[str, Any]:
        """What each replay saw since `attach`; every stack detached."""
        results = {key: tape.result() for key, tape in self.replays.items()}
        for side in self.every:
            attach_routing_tape(side.part, None)
        return results

    def start_step(self) -> None:
        self.attach()

    def end_step(self, record: StepRecord) -> None:
        record.routing = self.results()
