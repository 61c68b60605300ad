"""No device-wide synchronisation inside a scheduled step: the guard, and the one way to sync.

Why. On NCCL a large point-to-point send completes only when the peer's receive runs,
and ``torch.cuda.synchronize()`` (or anything that calls it: Triton's autotuner timing
its candidates, ``empty_cache``, the caching allocator's out-of-memory retry, a profiler
or a user hook) waits for every stream of the device, NCCL's included. The DualPipeV
schedules post a send as soon as its tensor exists and the matching receive when the
peer needs the data, so in the middle of a step a rank has sends in flight whose
receives its peer will post only after this rank's *next* send: a device-wide sync
there waits for a receive that waits for it. At PP >= 3 the first backward is such a
moment on every rank (tests/test_nccl_model.py runs the project's own schedules under
NCCL's rules and shows the hang). gloo completes a send without the receive, so no CPU
run can show it.

The rule, by construction: everything that may synchronise the device (compiling and
autotuning every kernel, the communicators' set-up, the memory tracker's resets) runs
before the first scheduled step or after it, never inside. The schedules run their
``step`` inside `scheduled_step`; project code that must synchronise calls
`device_sync`, which refuses inside a step (`SyncInStep`, naming what asked); code that
would synchronise as a side effect (the autotuner's benchmark) calls `refuse_in_step`
first. `guard_torch_syncs` makes ``torch.cuda.synchronize`` and
``torch.cuda.empty_cache`` refuse inside a step too, for code outside the project.

A test can replace refusing with a model of what the sync would do on NCCL
(`modelled_syncs`): the CPU model of NCCL's rules waits there for every send and receive
the rank has posted, and reports the deadlock, naming rank and action.

The state is per thread: the CPU model runs a pipeline's ranks as threads of one process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

_local = threading.local()


class SyncInStep(RuntimeError):
    """A device-wide synchronisation was asked for inside a scheduled step."""


def _depth() -> int:
    return getattr(_local, "depth", 0)


def in_scheduled_step() -> bool:
    """True while this thread runs a schedule's step."""
    return _depth() > 0


@contextmanager
def scheduled_step() -> Iterator[None]:
    """Mark this thread as inside a scheduled step (nests)."""
    _local.depth = _depth() + 1
    try:
        yield
    finally:
        _local.depth -= 1


@contextmanager
def modelled_syncs(model: Callable[[str], None]) -> Iterator[None]:
    """Inside a step, hand every device-wide sync of this thread to ``model(reason)``
    instead of refusing it (the CPU model of NCCL's rules)."""
    previous = getattr(_local, "model", None)
    _local.model = model
    try:
        yield
    finally:
        _local.model = previous


def refuse_in_step(reason: str) -> None:
    """Raise `SyncInStep` naming ``reason`` if this thread is inside a scheduled step (or
    hand it to the thread's model, `modelled_syncs`); nothing outside a step."""
    if not in_scheduled_step():
        return
    model = getattr(_local, "model", None)
    if model is not None:
        model(reason)
        return
    raise SyncInStep(
        f"{reason} would synchronise the device inside a scheduled step: on NCCL it waits "
        f"for sends whose receives the peers post later (a hang at PP >= 3); do it before "
        f"the first step (docs/gpus.md, 'Before the first step')"
    )


def device_sync(device: torch.device | str, reason: str) -> None:
    """Wait for every stream of ``device`` (nothing on a CPU), refused inside a step."""
    refuse_in_step(reason)
    device = torch.device(device)
    if device.type == "cuda":
        _ORIGINAL["synchronize"](device)


_ORIGINAL: dict[str, Callable] = {
    "synchronize": torch.cuda.synchronize,
    "empty_cache": torch.cuda.empty_cache,
}


def _guarded(name: str) -> Callable:
    original = _ORIGINAL[name]

    def guarded(*args, **kwargs):
        refuse_in_step(f"torch.cuda.{name}()")
        return original(*args, **kwargs)

    guarded.__name__ = guarded.__qualname__ = name
    guarded.__doc__ = original.__doc__
    guarded.twinpipe_guarded = True
    return guarded


def guard_torch_syncs() -> None:
    """Make ``torch.cuda.synchronize`` and ``torch.cuda.empty_cache`` refuse inside a
    scheduled step (idempotent; outside a step they do what they did)."""
    for name in _ORIGINAL:
        if not getattr(getattr(torch.cuda, name), "twinpipe_guarded", False):
            setattr(torch.cuda, name, _guarded(name))
