"""Host synchronisations counted: every place a step makes the host wait for the device.

On a GPU the host runs ahead of the device: it queues kernels, and the device works
through the queue. Anything that needs a device value *on the host* stops the host until
the queue has drained up to that value, and while the host waits it queues nothing, so
the device idles after it. The step's rule (DESIGN.md, "A step does not wait on the
host") allows only what the schedule needs: the all-to-all split sizes (the receive
buffers are sized from them) and the scalars logged once a step.

There are three kinds, and all three can be seen from Python on any device, which lets a
CPU test hold a step to its budget:

- ``read``: a device value read on the host (``Tensor.item``, ``tolist``, ``numpy``,
  ``bool()``/``int()``/``float()``/``__index__`` of a tensor, printing one,
  ``aten._local_scalar_dense``, ``aten.equal``, ``aten.is_nonzero``);
- ``copy``: a copy between host and device (``.cpu()``, ``.to`` another device type,
  ``copy_`` across devices, ``torch.tensor``/``as_tensor``/``new_tensor`` of Python data
  onto a device). On a CPU run host and device are one, so only ``.cpu()`` and the
  Python-data constructors with an explicit device are visible there;
- ``shape``: an op whose output size depends on device values, which must therefore be
  read (``nonzero``, ``masked_select``, ``unique``, ``bincount``, boolean-mask indexing,
  ``repeat_interleave`` without ``output_size``).

`HostSyncCounter` sees them through a ``TorchFunctionMode`` (the Python-level calls:
tensor methods and constructors) and a ``TorchDispatchMode`` (aten ops); an aten op run
by a Python-level call already counted is not counted again. What Triton's CPU
interpreter does to emulate a kernel (copying its arguments through numpy) is no host
synchronisation of the program and is skipped. Allocations of pinned host memory
(``pin_memory()``, ``pin_memory=True``) are counted apart, as ``pin``: a steady-state
step should make none.

Host-side values: some reads are of tensors that live on the host by construction (a
gloo host group's metrics, a pinned buffer the device has already been copied into,
torch AdamW's step count). Code reads them inside `host_side()`; the counter then notes
the read apart, *if* the tensor is on the CPU (on a GPU run a device tensor read there
still counts), so a CPU run cannot hide a device read behind the marker without a GPU
run showing it.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from models.network import HostCopy, host_side_depth

SYNC_KINDS = ("read", "copy", "shape", "pin")
"""Every kind of event, in report order (``pin``: pinned memory allocated)."""

_READ_METHODS = frozenset(
    {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__",
     "__complex__", "__format__", "__repr__", "__str__"}
)  # fmt: skip
_CONSTRUCTORS = frozenset({"tensor", "as_tensor", "asarray"})
_READ_OPS = frozenset({"_local_scalar_dense", "equal", "is_nonzero"})
_SHAPE_OPS = frozenset(
    {"nonzero", "nonzero_numpy", "argwhere", "masked_select", "_unique", "_unique2",
     "unique_dim", "unique_consecutive", "unique_dim_consecutive", "bincount", "histc"}
)  # fmt: skip
_INDEX_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
_COPY_OPS = frozenset({"copy_", "_to_copy"})

_ROOT = Path(__file__).resolve().parents[2]
_INTERPRETER = str(Path("triton") / "runtime" / "interpreter.py")
_THIS = str(Path(__file__).resolve())
_HOST_COPY = str(Path(sys.modules[HostCopy.__module__].__file__).resolve())
"""Where `HostCopy` reads: its copies are the caller's, and are named at the caller."""
_TORCH = str(Path(torch.__file__).parent)

_local = threading.local()


class HostSync(NamedTuple):
    """One event: its kind (`SYNC_KINDS`), what did it, and where in the program."""

    kind: str
    what: str
    """``Tensor.item``, ``aten.nonzero``, ``torch.tensor`` ..."""
    site: str
    """``path:line (function)`` of the innermost frame in this project (else the caller)."""


def _device_of(value: Any) -> torch.device | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value.device
    if isinstance(value, (str, torch.device)):
        return torch.device(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.device("cuda", value)
    return None


def _to_target(args: tuple, kwargs: dict) -> torch.device | None:
    """The device a ``Tensor.to`` call moves to (None: it keeps the device)."""
    if "device" in kwargs:
        return _device_of(kwargs["device"])
    for arg in args[1:]:
        if isinstance(arg, torch.dtype):
            continue
        device = _device_of(arg)
        if device is not None:
            return device
    return None


_PACKAGES = ("models", "reference", "optimized", "harness", "benchmarks")
_relative: dict[str, str | None] = {}


def _project_path(filename: str) -> str | None:
    """``filename`` relative to the checkout when it is a source file of the project."""
    if filename not in _relative:
        path = Path(filename)
        relative = None
        if path.is_absolute() and path.is_file():
            try:
                relative = path.resolve().relative_to(_ROOT)
            except ValueError:
                relative = None
        keep = relative is not None and relative.parts[0] in _PACKAGES
        _relative[filename] = relative.as_posix() if keep else None
    return _relative[filename]


def _site() -> str:
    """The innermost frame in the project's packages (outside this module and `HostCopy`),
    else the first caller outside torch."""
    frame = sys._getframe(2)
    fallback = None
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename not in (_THIS, _HOST_COPY) and not filename.startswith(_TORCH):
            if fallback is None:
                fallback = frame
            relative = _project_path(filename)
            if relative is not None:
                return f"{relative}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    if fallback is None:
        return "?"
    return f"{fallback.f_code.co_filename}:{fallback.f_lineno} ({fallback.f_code.co_name})"


def _in_interpreter() -> bool:
    """Whether Triton's interpreter is on the stack (emulating a kernel on the CPU)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_INTERPRETER):
            return True
        frame = frame.f_back
    return False


class _FunctionLevel(TorchFunctionMode):
    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        event = self.counter.classify_call(func, args, kwargs)
        if event is None:
            return func(*args, **kwargs)
        self.counter.note(*event)
        _local.inside = getattr(_local, "inside", 0) + 1
        try:
            return func(*args, **kwargs)
        finally:
            _local.inside -= 1


class _DispatchLevel(TorchDispatchMode):
    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not getattr(_local, "inside", 0):
            event = self.counter.classify_op(func, args, kwargs)
            if event is not None:
                self.counter.note(*event)
        return func(*args, **kwargs)


class HostSyncCounter:
    """Counts host synchronisations (module docstring) while installed and `active`::

        with HostSyncCounter() as counter:
            with counter.counting():
                step()
            events = counter.take()

    Modes are per thread: install the counter in the thread that runs the step (autograd
    carries them into its own threads).
    """

    def __init__(self) -> None:
        self.events: list[HostSync] = []
        """Counted events since the last `take`."""
        self.host_events: list[HostSync] = []
        """Reads of CPU tensors inside `host_side`, noted apart (not in `events`)."""
        self.active = False
        self._modes: list = []

    # ------------------------------------------------------------ install
    def __enter__(self) -> HostSyncCounter:
        self._modes = [_FunctionLevel(self), _DispatchLevel(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []

    @contextmanager
    def counting(self) -> Iterator[HostSyncCounter]:
        """Count the events made inside (the counter must be entered)."""
        self.active = True
        try:
            yield self
        finally:
            self.active = False

    def take(self) -> list[HostSync]:
        """The counted events so far, and start again from zero (host-side notes too)."""
        events, self.events, self.host_events = self.events, [], []
        return events

    # ------------------------------------------------------------ rules
    def classify_call(self, func, args: tuple, kwargs: dict) -> tuple | None:
        """``(kind, what, device)`` of a Python-level call, or None when it is no event."""
        if not self.active:
            return None
        name = getattr(func, "__name__", "")
        tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if tensor is not None and name in _READ_METHODS:
            return "read", f"Tensor.{name}", tensor.device
        if tensor is not None and name == "cpu":
            return "copy", "Tensor.cpu", tensor.device
        if tensor is not None and name == "to":
            target = _to_target(args, kwargs)
            if target is not None and target.type != tensor.device.type:
                return "copy", f"Tensor.to({target.type})", tensor.device
            return None
        if tensor is not None and name == "pin_memory":
            return "pin", "Tensor.pin_memory", None
        if kwargs.get("pin_memory"):
            return "pin", f"torch.{name}(pin_memory=True)", None
        if name in _CONSTRUCTORS and args and not isinstance(args[0], torch.Tensor):
            device = _device_of(kwargs.get("device"))
            if device is not None:
                return "copy", f"torch.{name}(data, device)", device
        if name == "new_tensor" and tensor is not None:
            return "copy", "Tensor.new_tensor", tensor.device
        return None

    def classify_op(self, func, args: tuple, kwargs: dict) -> tuple | None:
        """``(kind, what, device)`` of an aten op, or None when it is no event."""
        if not self.active:
            return None
        name = func._schema.name.split("::")[-1]
        what = f"aten.{name}"
        tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
        device = None if tensor is None else tensor.device
        if name in _READ_OPS:
            return "read", what, device
        if name in _SHAPE_OPS:
            return "shape", what, device
        if name == "repeat_interleave" and func._overloadname == "Tensor":
            if kwargs.get("output_size") is None:
                return "shape", f"{what} (no output_size)", device
            return None
        if name in _INDEX_OPS and len(args) > 1:
            indices = args[1] or ()
            if any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                for i in indices
            ):
                return "shape", f"{what} (boolean mask)", device
            return None
        if name in _COPY_OPS and tensor is not None:
            if name == "copy_":
                source = args[1] if len(args) > 1 else None
                target = source.device if isinstance(source, torch.Tensor) else None
            else:
                target = _device_of(kwargs.get("device"))
            if target is not None and target.type != tensor.device.type:
                return "copy", f"{what} ({tensor.device.type}<->{target.type})", device
        return None

    def note(self, kind: str, what: str, device: torch.device | None) -> None:
        """Record one event; ``device``: where the tensor it touches lives."""
        if _in_interpreter():
            return
        event = HostSync(kind, what, _site())
        on_host = device is None or device.type == "cpu"
        if kind == "read" and on_host and host_side_depth():
            self.host_events.append(event)
        else:
            self.events.append(event)


def count_by_kind(events: list[HostSync]) -> dict[str, int]:
    """``kind -> count``, every kind of `SYNC_KINDS` present (zeros included)."""
    counts = Counter(e.kind for e in events)
    return {kind: counts.get(kind, 0) for kind in SYNC_KINDS}


def describe_syncs(events: list[HostSync]) -> str:
    """One line per distinct ``(kind, what, site)``, most frequent first."""
    counts = Counter(events)
    return "\n".join(
        f"{n:5d}  {e.kind:5s}  {e.what:40s}  {e.site}" for e, n in counts.most_common()
    )
