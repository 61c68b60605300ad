"""What the tracker and its backends share: the categories, the walkers that read a
registered source's tensors and names, and `StepState`, the step's figures a backend writes.

The tracker owns one `StepState` and hands it to its backend; the backend never sees the
tracker. So the backends import this module and the tracker imports the backends, and
nothing imports back.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations")
REGISTERED = CATEGORIES[:3]
"""The categories a source is registered as; ``activations`` is everything else."""
START_PHASE = "start"
"""The moment of a step before its first mark."""


def iter_source(source: Any, category: str) -> Iterator[torch.Tensor]:
    """Tensors a registered source stands for, read now.

    A module stands for its parameters and buffers, or, registered as gradients,
    for its parameters' ``.grad``; an optimizer for the tensors in its ``state``.
    """
    if source is None:
        return
    if isinstance(source, torch.Tensor):
        yield source
    elif isinstance(source, torch.nn.Module):
        if category == "gradients":
            yield from grads_of(source.parameters())
        else:
            yield from source.parameters()
            yield from source.buffers()
    elif isinstance(source, torch.optim.Optimizer):
        for state in source.state.values():
            yield from iter_source(state, category)
    elif isinstance(source, Mapping):
        for value in source.values():
            yield from iter_source(value, category)
    elif callable(source):
        yield from iter_source(source(), category)
    elif isinstance(source, Iterable) and not isinstance(source, (str, bytes)):
        for item in source:
            yield from iter_source(item, category)


def grads_of(tensors: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The ``.grad`` of each leaf tensor that has one."""
    for tensor in tensors:
        if tensor.is_leaf and tensor.grad is not None:
            yield tensor.grad


def iter_parameters(source: Any) -> Iterator[torch.Tensor]:
    """Leaf tensors requiring grad among registered parameters (for grad hooks)."""
    for tensor in iter_source(source, "parameters"):
        if tensor.requires_grad and tensor.is_leaf:
            yield tensor


def registered_names(sources: Mapping[str, list[Any]]) -> dict[int, str]:
    """Names of the registered tensors by ``id``: parameters and buffers by their module
    names, their gradients as ``grad of NAME``, optimizer state as ``KEY of NAME``."""
    names: dict[int, str] = {}
    by_parameter: dict[int, str] = {}
    for source in sources["parameters"]:
        if isinstance(source, torch.nn.Module):
            for name, param in source.named_parameters():
                names[id(param)] = by_parameter[id(param)] = name
                if param.grad is not None:
                    names[id(param.grad)] = f"grad of {name}"
            for name, buffer in source.named_buffers():
                names[id(buffer)] = name
    for source in sources["optimizer_state"]:
        if isinstance(source, torch.optim.Optimizer):
            for param, state in source.state.items():
                owner = by_parameter.get(id(param), "a parameter")
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        names[id(value)] = f"{key} of {owner}"
    return names


def _start() -> dict[str, Any]:
    return {"phase": START_PHASE, "micro_batch": None}


@dataclass(slots=True)
class StepState:
    """The tracker's step as its backend sees it: the registered sources and the current
    moment (the tracker writes them), and the peak, its moment, its breakdown and the
    timeline's interval peaks (the backend writes them)."""

    sources: dict[str, list[Any]] = field(default_factory=lambda: {c: [] for c in REGISTERED})
    """Registered sources by category (`REGISTERED`), in registration order."""
    in_step: bool = False
    """Whether a step is running."""
    moment: dict[str, Any] = field(default_factory=_start)
    """The current ``{"phase", "micro_batch"}``: the last mark's, or `START_PHASE`."""
    timeline: list[dict[str, Any]] = field(default_factory=list)
    """Per mark of the step: its moment, ``start_bytes`` and ``peak_bytes`` until the next."""
    peak_bytes: int = 0
    """The step's highest bytes in use so far."""
    peak_moment: dict[str, Any] = field(default_factory=_start)
    """The moment in which `peak_bytes` was reached."""
    breakdown: dict[str, int] = field(default_factory=dict)
    """Bytes by category at the peak, and ``total``."""

    def new_peak(self, nbytes: int) -> None:
        """``nbytes`` is the step's highest so far, reached in the current moment."""
        self.peak_bytes = nbytes
        self.peak_moment = dict(self.moment)


class Backend(Protocol):
    """What the tracker asks of a device's accounting; each call reads or writes the
    `StepState` the backend was built with."""

    def enter(self) -> None:
        """A step starts: the peak restarts from the bytes in use now."""

    def exit(self) -> None:
        """The step ended: the peak, its moment and its breakdown are final."""

    def mark(self) -> None:
        """A mark is about to change the moment: the interval before it is done."""

    def registered(self, parameters: Any) -> None:
        """Sources were registered during a step (``parameters``: the new parameters)."""

    def current_bytes(self) -> int:
        """Bytes in use now."""

    def top_tensors(self) -> list[dict[str, Any]]:
        """The largest storages live at the last step's peak (empty where unknown)."""
