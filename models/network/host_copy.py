"""Device values read on the host on purpose: the split sizes a MoE layer must know, the
scalars logged once a step.

A step may wait on the device only for what the schedule needs (DESIGN.md, "A step does
not wait on the host"). What it does read goes through here, so that the read is one
blocking copy into a buffer kept from step to step (`HostCopy`) and so that a read of a
tensor that already lives on the host can say so (`host_side`).

`models.runtime.host_sync` counts every host synchronisation a step makes; it reads the
marker through `host_side_depth`. The marker lives here, with the reads, because the
network's own layers make them: the math must not import the runtime that counts.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_local = threading.local()


def host_side_depth() -> int:
    """How many `host_side` blocks this thread is inside (0: none)."""
    return getattr(_local, "depth", 0)


@contextmanager
def host_side() -> Iterator[None]:
    """Mark reads of host-resident tensors: a `models.runtime.HostSyncCounter` notes a read
    inside as host-side when its tensor is on the CPU (on a GPU run a device tensor read here
    still counts, so a CPU run cannot hide a device read behind the marker). Costs nothing
    when no counter is installed."""
    depth = host_side_depth()
    _local.depth = depth + 1
    try:
        yield
    finally:
        _local.depth = depth


class HostCopy:
    """Small device tensors read on the host through one buffer, allocated at the first read
    and reused: pinned when the tensor is on a GPU (a read into fresh pageable memory would
    stage through a new allocation each time), none at all when it is already on the CPU.

    `tolist` is one host synchronisation: a blocking copy into the buffer (the device's
    queue drains up to the tensor), then a read of host memory. Owned by whoever reads the
    same kind of tensor again and again (a MoE layer's split sizes, the logged scalars).
    """

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def tolist(self, tensor: torch.Tensor) -> list:
        """``tensor.tolist()``, through the pinned buffer when ``tensor`` is not on the CPU."""
        if tensor.device.type == "cpu":
            return tensor.tolist()
        buffer = self._buffer
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._buffer = buffer
        buffer.copy_(tensor)
        with host_side():
            return buffer.tolist()


__all__ = ["HostCopy", "host_side", "host_side_depth"]
