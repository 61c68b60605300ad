"""Before the first step: every communicator up, and limits that fit each phase.

Communicators. NCCL creates a group's communicator at the group's first use, and each pair's
point-to-point one at the pair's first send: left alone, that happens inside step 1, in the
middle of the schedule, where a rank blocks creating one while its peer waits elsewhere
(`tests/test_nccl_model.py`: with communicators made lazily even PP 2 hangs on a device sync)
and where their buffers, outside the caching allocator, appear in no step's figures.
`warm_up` runs one exchange on every point-to-point stream of the rank's pipeline (each
neighbour pair, in the stream's direction) and one all-reduce on every group (the world,
PP, DP, EP, the expert replicas, the host-scalar gloo group), in one order on every rank.
On CUDA it then reports ``torch.cuda.mem_get_info`` beside the allocator's own figures, so
the memory NCCL and the CUDA context hold outside the allocator shows
(``outside_allocator_bytes``). It runs before any step's communication is counted.

Limits. The collective timeout guards the steps: tight (``--timeout``, 120 s by default),
since a step that waits that long on a peer has lost it. What runs before step 1 is slower
and has no peer to lose: loading the weights, compiling and tuning the kernels
(`optimized.ops.tuning`), connecting. Each runs under its own limit (`phase_limit`:
``--setup-timeout``), the collective timeout is the largest limit until the warm-up is
done, and `tighten` then sets every group's to the steps' own. A phase that runs out
raises `PhaseTimeout` naming the phase and the flag that sets its limit (a crash: exit 3).
"""

from __future__ import annotations

import datetime
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from models.runtime.distributed import Layout
from models.runtime.p2p import StreamGroups

STEP_TIMEOUT_S = 120.0
"""The collective timeout of a training step, after the warm-up (``--timeout``)."""
SETUP_TIMEOUT_S = 900.0
"""The limit of each phase before the first step (``--setup-timeout``): loading, compiling
and tuning, connecting."""


class PhaseTimeout(RuntimeError):
    """A phase before the first step ran past its limit."""


@contextmanager
def phase_limit(phase: str, seconds: float | None, flag: str = "--setup-timeout") -> Iterator[None]:
    """Raise `PhaseTimeout` in this (main) thread if the code inside runs past ``seconds``;
    no limit when ``seconds`` is None or off the main thread (signals go to it only). Host
    work is interrupted between Python operations; a collective past its limit ends by the
    collective timeout, which is at least this limit until `tighten`."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum, frame) -> None:
        raise PhaseTimeout(
            f"phase '{phase}' ran past its limit of {seconds:g} s ({flag} sets it): the run "
            f"stopped before its first step"
        )

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def layout_groups(layout: Layout) -> dict[str, Any]:
    """Every collective group of ``layout``, by name, in the order every rank uses them."""
    groups = {"world": dist.group.WORLD, "pp": layout.pp_group, "dp": layout.dp_group,
              "ep": layout.ep_group, "expert_replica": layout.expert_replica_group,
              "host": layout.host_group}  # fmt: skip
    return {name: group for name, group in groups.items() if group is not None}


def _streams(layout: Layout) -> list[tuple[str, Any, int]]:
    """(name, group, step) of each stream: its messages go from pp-rank r to r + step."""
    if layout.streams is None:
        return []
    steps = {"forward0": 1, "forward1": -1, "backward0": -1, "backward1": 1}
    return [(name, getattr(layout.streams, name), steps[name]) for name in StreamGroups._fields]


def warm_up(layout: Layout, device: torch.device) -> dict[str, Any]:
    """One exchange on every stream of this rank's pipeline, one all-reduce on every group;
    what it did, and on CUDA the device's memory beside the allocator's."""
    began = time.perf_counter()
    done: dict[str, Any] = {"collectives": [], "streams": []}
    for name, group in layout_groups(layout).items():
        on = torch.device("cpu") if name == "host" else device
        dist.all_reduce(torch.ones(1, device=on), group=group)
        done["collectives"].append(name)
    works = []
    for name, group, step in _streams(layout):
        to, source = layout.pp_rank + step, layout.pp_rank - step
        if 0 <= to < layout.pp:
            works.append(dist.isend(torch.ones(1, device=device), layout.global_rank(to), group))
        if 0 <= source < layout.pp:
            buffer = torch.empty(1, device=device)
            works.append(dist.irecv(buffer, layout.global_rank(source), group))
        done["streams"].append(name)
    for work in works:
        work.wait()
    done["seconds"] = round(time.perf_counter() - began, 3)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserved = torch.cuda.memory_reserved(device)
        done.update(device_free_bytes=int(free), device_total_bytes=int(total),
                    allocator_reserved_bytes=int(reserved),
                    outside_allocator_bytes=int(total - free - reserved))  # fmt: skip
    return done


def tighten(layout: Layout, seconds: float) -> None:
    """Set every group's collective timeout to ``seconds`` (the steps' own, after warm-up)."""
    timeout = datetime.timedelta(seconds=seconds)
    groups = list(layout_groups(layout).values())
    groups += [group for _, group, _ in _streams(layout)]
    for group in groups:
        c10d._set_pg_timeout(timeout, group)
