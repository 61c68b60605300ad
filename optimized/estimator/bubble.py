"""DualPipeV's pipeline bubble, timed from the same walk the memory estimate replays.

Every rank runs its actions (`optimized.estimator.schedule.rank_actions`) in order. An
action starts when the rank is free and its inputs have arrived: a forward of chunk 0
needs the previous rank's forward of the same micro-batch (chunk 1: the next rank's; on
the last rank, its own chunk 0's), a backward needs the gradient from the rank after it
in that chunk's direction (on rank 0 the loss is local: chunk 1's own forward; on the last
rank chunk 0's gradient is chunk 1's backward, local). Messages take no time.

Durations are symbolic, in units of

- ``F``: one chunk's forward of one micro-batch,
- ``B``: its backward for the input gradient,
- ``W``: its backward for the weight gradients,

so a backward that computes weight gradients at once costs ``B + W``, a deferred one ``B``
and its later W step ``W``, and an overlapped F&B pair ``F + B + W`` (overlap hides the
all-to-all, not compute). Each time is carried as its coefficients ``(f, b, w)`` beside
its value under concrete costs (default ``F = B = W = 1``), so the step's makespan and each
rank's idle time come out as, e.g., ``3F + 2B - 1W``: exact for those costs, and for any
costs under which the same waits are the binding ones.

A rank is busy ``2M (F + B + W)`` (each chunk forwards and backwards M micro-batches, and
every weight gradient is computed once); the rest of the makespan is its bubble.
"""

from __future__ import annotations

from dataclasses import dataclass

from optimized.estimator.schedule import walk


@dataclass(frozen=True, slots=True)
class Time:
    """A duration or instant as ``f F + b B + w W``, with its value under concrete costs."""

    f: int = 0
    b: int = 0
    w: int = 0
    value: float = 0.0

    def __add__(self, other: Time) -> Time:
        return Time(self.f + other.f, self.b + other.b, self.w + other.w, self.value + other.value)

    def __sub__(self, other: Time) -> Time:
        return Time(self.f - other.f, self.b - other.b, self.w - other.w, self.value - other.value)

    def scaled(self, factor: int) -> Time:
        return Time(self.f * factor, self.b * factor, self.w * factor, self.value * factor)

    def __str__(self) -> str:
        terms = [(self.f, "F"), (self.b, "B"), (self.w, "W")]
        text = " ".join(f"{'-' if c < 0 else '+'} {abs(c)}{unit}" for c, unit in terms if c).lstrip(
            "+ "
        )
        return text or "0"


def _later(a: Time, b: Time) -> Time:
    return b if b.value > a.value else a


@dataclass(frozen=True, slots=True)
class Bubble:
    """The step's timing under DualPipeV: makespan, and each rank's busy and idle time."""

    pp: int
    num_microbatches: int
    makespan: Time
    busy: list[Time]
    idle: list[Time]
    costs: tuple[float, float, float]

    @property
    def idle_fraction(self) -> float:
        """The largest idle share of the step over the ranks."""
        return max(idle.value for idle in self.idle) / self.makespan.value

    def as_dict(self) -> dict:
        worst = max(range(self.pp), key=lambda r: self.idle[r].value)
        return {
            "costs": dict(zip(("F", "B", "W"), self.costs, strict=True)),
            "makespan": str(self.makespan),
            "makespan_value": self.makespan.value,
            "busy_per_rank": str(self.busy[0]),
            "idle_per_rank": [str(idle) for idle in self.idle],
            "idle_fraction": self.idle_fraction,
            "bubble": str(self.idle[worst]),
        }


def simulate(
    pp: int, num_microbatches: int, costs: tuple[float, float, float] = (1.0, 1.0, 1.0)
) -> Bubble:
    """Time one DualPipeV step of ``pp`` ranks and ``num_microbatches`` micro-batches."""
    f_cost, b_cost, w_cost = costs
    unit_f, unit_b, unit_w = Time(1, 0, 0, f_cost), Time(0, 1, 0, b_cost), Time(0, 0, 1, w_cost)
    actions = [list(walk(rank, pp, num_microbatches)) for rank in range(pp)]
    done: dict[tuple[str, int, int, int], Time] = {}  # (F/B, chunk, micro-batch, rank) -> end
    clock = [Time() for _ in range(pp)]
    busy = [Time() for _ in range(pp)]
    cursor = [0] * pp
    last = pp - 1

    def ready(kind: str, chunk: int, mb: int, rank: int) -> Time | None:
        """When the input of ``kind`` (F or B) of ``chunk``/``mb`` on ``rank`` is there."""
        if kind == "F":
            if chunk == 0:
                source = None if rank == 0 else ("F", 0, mb, rank - 1)
            else:
                source = ("F", 0, mb, rank) if rank == last else ("F", 1, mb, rank + 1)
        elif chunk == 1:
            source = ("F", 1, mb, rank) if rank == 0 else ("B", 1, mb, rank - 1)
        else:
            source = ("B", 1, mb, rank) if rank == last else ("B", 0, mb, rank + 1)
        if source is None:
            return Time()
        return done.get(source)

    progress = True
    while progress:
        progress = False
        for rank in range(pp):
            while cursor[rank] < len(actions[rank]):
                step = actions[rank][cursor[rank]]
                action = step.action
                needs, work = [], Time()
                if action.kind in ("F", "FB"):
                    needs.append(("F", action.chunk, step.forward_micro_batch))
                    work += unit_f
                if action.kind in ("B", "FB"):
                    chunk = action.backward_chunk if action.kind == "FB" else action.chunk
                    needs.append(("B", chunk, step.backward_micro_batch))
                    work += unit_b if action.deferred else unit_b + unit_w
                if action.kind == "W":
                    work = unit_w
                start = clock[rank]
                for kind, chunk, mb in needs:
                    at = ready(kind, chunk, mb, rank)
                    if at is None:
                        break
                    start = _later(start, at)
                else:
                    end = start + work
                    for kind, chunk, mb in needs:
                        done[(kind, chunk, mb, rank)] = end
                    clock[rank], busy[rank] = end, busy[rank] + work
                    cursor[rank] += 1
                    progress = True
                    continue
                break
    if any(cursor[rank] < len(actions[rank]) for rank in range(pp)):
        raise AssertionError("DualPipeV simulation deadlocked: the schedule waits on itself")
    makespan = clock[0]
    for rank in range(1, pp):
        makespan = _later(makespan, clock[rank])
    idle = [makespan - busy[rank] for rank in range(pp)]
    return Bubble(pp, num_microbatches, makespan, busy, idle, costs)


__all__ = ["Bubble", "Time", "simulate"]
