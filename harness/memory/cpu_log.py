"""The CPU accounting's books: what it knows of each storage, and one step's log of every
allocation, free and resize as ``(uid, delta)``.

`CpuAccounting` (`harness.memory.cpu`) decides what to record; this module keeps the
running total, and with it the peak exactly, then answers from the log alone when the
step ends: where a free made by another thread belongs (`EventLog.move_late_frees`), and
which storages were live at the peak (`EventLog.breakdown`).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from harness.memory.shared import CATEGORIES, StepState

TOP_TENSORS = 5
"""How many of the largest live storages at the peak the tracker names."""


@dataclass
class StorageRecord:
    """What the accounting knows about one live storage."""

    uid: int
    nbytes: int
    ref: weakref.ref
    what: str = ""
    """Where it came from: a registered tensor's name, or the aten op that made it."""
    shape: tuple[int, ...] = ()
    """The shape of the tensor it was first seen through."""
    dtype: str = ""
    named: bool = False
    """Whether ``what`` is a registered name (an op's name gives way to it)."""
    touched: int = 0
    """The step's event count when the step's own thread last used it (see
    `EventLog.move_late_frees`)."""
    late: bool = False
    """Freed by another thread (a gloo worker letting a collective's buffer go)."""


class EventLog:
    """One step's ``(uid, delta)`` events in order, the running total, the event that
    reached the peak, and the event count at each timeline entry; it writes the step's
    peak, its moment and the timeline's interval peaks into the `StepState`."""

    def __init__(self, state: StepState) -> None:
        self.state = state
        self.events: list[tuple[int, int]] = []
        self.current = 0
        """Bytes in use now: the sum of the deltas (with what earlier steps left)."""
        self.peak_event = 0
        """How many events the log held when the peak was reached."""
        self.marks: list[int] = []
        """The event count at each timeline entry of the step (the start, then each mark)."""
        self.late: list[tuple[int, int]] = []
        """This step's frees made by another thread: (index of the free's event, event count
        when the step's thread last used the storage)."""

    def __len__(self) -> int:
        """The event count: the step's clock for `StorageRecord.touched`."""
        return len(self.events)

    def start(self, live: Iterable[StorageRecord]) -> None:
        """A new step: the storages alive from earlier steps are in use now and start the
        log; the peak starts at their total."""
        self.events, self.late = [], []
        self.current = 0
        for info in live:
            if info.nbytes:
                self.events.append((info.uid, info.nbytes))
                self.current += info.nbytes
            info.touched = len(self.events)
        self.state.new_peak(self.current)
        self.peak_event = len(self.events)

    def mark(self) -> None:
        self.marks.append(len(self.events))

    def record(self, uid: int, delta: int) -> None:
        """An allocation or resize by ``delta`` bytes: the total, the current interval's
        peak and the step's peak follow it."""
        self.events.append((uid, delta))
        self.current += delta
        timeline = self.state.timeline
        if timeline and self.current > timeline[-1]["peak_bytes"]:
            timeline[-1]["peak_bytes"] = self.current
        if self.current > self.state.peak_bytes:
            self.state.new_peak(self.current)
            self.peak_event = len(self.events)

    def free(self, info: StorageRecord) -> None:
        """``info``'s storage was freed (a free only lowers the total: no peak to check). A
        free by another thread after the step's thread last used the storage is noted for
        `move_late_frees`."""
        if info.late and info.touched < len(self.events):
            self.late.append((len(self.events), info.touched))
        self.events.append((info.uid, -info.nbytes))
        self.current -= info.nbytes

    def move_late_frees(self) -> None:
        """Frees made by another thread, moved back to the step's last use of the storage;
        the peak, its moment and the timeline are then replayed from the log.

        gloo's worker thread holds a collective's buffers until it lets the finished work
        go, and when the program has already dropped a buffer the worker's release frees
        it, as soon as that thread next gets the GIL: a moment the OS scheduler decides.
        Counted then, the same step's peak could move by one buffer from run to run. The
        program drops such a buffer after its last use, so the free is recorded there, and
        the figure no longer depends on the scheduler.
        """
        moved = [(touched, index) for index, touched in self.late if touched < index]
        if not moved:
            return
        inserts: dict[int, list[tuple[int, int]]] = {}
        for touched, index in moved:
            inserts.setdefault(touched, []).append(self.events[index])
        skipped = {index for _, index in moved}
        marks = set(self.marks)
        events: list[tuple[int, int]] = []
        position: dict[int, int] = {}  # a mark's event count in the new log
        for i in range(len(self.events) + 1):
            events.extend(inserts.get(i, ()))
            if i in marks:
                position[i] = len(events)
            if i < len(self.events) and i not in skipped:
                events.append(self.events[i])
        self.events = events
        self.marks = [position[m] for m in self.marks]
        prefix = list(itertools.accumulate((delta for _, delta in events), initial=0))
        state, timeline = self.state, self.state.timeline
        start = self.marks[0]
        state.peak_bytes, self.peak_event = max(prefix[: start + 1]), start
        for count in range(start + 1, len(prefix)):
            if prefix[count] > state.peak_bytes:
                state.peak_bytes, self.peak_event = prefix[count], count
        ends = self.marks[1:] + [len(events)]
        for entry, begin, end in zip(timeline, self.marks, ends):
            entry["start_bytes"] = prefix[begin]
            entry["peak_bytes"] = max(prefix[begin : end + 1])
        # The moment of the peak: the last mark before the event that reached it.
        owner = max([0] + [k for k, m in enumerate(self.marks) if m < self.peak_event])
        state.peak_moment = {k: timeline[owner][k] for k in ("phase", "micro_batch")}

    def breakdown(
        self, categories: Mapping[int, str], described: Mapping[int, StorageRecord]
    ) -> tuple[dict[str, int], list[dict[str, Any]]]:
        """Bytes by category of the storages live at the peak (the log replayed up to it),
        with ``total``; and the `TOP_TENSORS` largest of them, largest first."""
        live: dict[int, int] = {}
        for uid, delta in self.events[: self.peak_event]:
            live[uid] = live.get(uid, 0) + delta
        breakdown = dict.fromkeys(CATEGORIES, 0)
        for uid, nbytes in live.items():
            breakdown[categories.get(uid, "activations")] += nbytes
        largest = sorted(
            ((nbytes, uid) for uid, nbytes in live.items() if nbytes > 0), reverse=True
        )[:TOP_TENSORS]
        top = []
        for nbytes, uid in largest:
            info = described.get(uid)
            top.append(
                {
                    "what": info.what if info is not None else "?",
                    "shape": list(info.shape) if info is not None else [],
                    "dtype": info.dtype if info is not None else "",
                    "bytes": nbytes,
                    "category": categories.get(uid, "activations"),
                }
            )
        breakdown["total"] = sum(breakdown[category] for category in CATEGORIES)
        peak = self.state.peak_bytes
        if breakdown["total"] != peak:  # pragma: no cover - an accounting bug
            raise AssertionError(f"memory replay gave {breakdown['total']} bytes, peak was {peak}")
        return breakdown, top
