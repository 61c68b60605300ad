"""Where ranks compute: the one place that asks the machine about CUDA.

twinpipe chooses a device once, in the process that starts the ranks (`resolve_device`,
from ``--device auto|cuda|cpu``), and hands it to every rank at spawn together with the
Triton mode (`DevicePlan.rank_environment`): the interpreter exactly when the rank computes
on the CPU, whatever the machine has. After that, code asks its tensors and parts for their
device. Nothing outside this module calls ``torch.cuda.is_available()``.

Why one GPU per local rank and nothing in between:

- NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), and gloo carries no CUDA
  tensors for send, receive or all-to-all: a layout with more local ranks than GPUs can
  only run on the CPU.
- Triton's interpreter is chosen when ``triton`` is first imported, and its kernels then
  take CPU tensors only; compiled kernels take CUDA tensors only. A rank's mode must match
  the device it computes on, so it is set in the rank's environment before it starts.

``auto`` runs on the GPUs when there is one per local rank, else on the CPU, and says so
in one line. ``cuda`` without enough usable GPUs is bad input (exit 2), reported before
any rank starts, naming what was asked, what the machine has and what would work.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

from models import DEVICE_ENV, choose_triton_mode

DEVICE_CHOICES = ("auto", "cuda", "cpu")
"""The values ``--device`` (and the trainer's ``device`` field) accept."""


class DeviceError(ValueError):
    """The device asked for cannot be had on this machine (bad input: exit 2)."""


@dataclass(frozen=True, slots=True)
class CudaSupport:
    """What this machine offers: usable CUDA devices, and why there are none when so."""

    gpus: int
    """CUDA devices torch can use (0 when none, or when CUDA is unusable)."""
    names: tuple[str, ...] = ()
    """Their names, when torch reports them without starting a CUDA context."""
    why_none: str = ""
    """Why ``gpus`` is 0: no CUDA build of torch, no driver, an error torch gave."""


def cuda_support() -> CudaSupport:
    """Ask torch, once, what CUDA devices this process can use (no CUDA context is made)."""
    if torch.version.cuda is None:
        signs = _gpu_signs()
        why = f"torch {torch.__version__} is a build without CUDA"
        return CudaSupport(0, (), why + (f" ({signs})" if signs else ""))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    if not available:  # torch says why in a warning (an old driver, a failed init)
        said = "; ".join(str(w.message).strip().splitlines()[0] for w in caught)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        why = said or "torch sees no CUDA device (no driver, or no GPU)"
        if visible is not None:
            why += f"; CUDA_VISIBLE_DEVICES={visible!r}"
        return CudaSupport(0, (), why)
    count = torch.cuda.device_count()
    try:
        names = tuple(torch.cuda.get_device_name(i) for i in range(count))
    except Exception as error:  # noqa: BLE001  (a driver error is the reason to report)
        return CudaSupport(0, (), f"CUDA is visible but unusable: {error}")
    return CudaSupport(count, names)


def _gpu_signs() -> str:
    """A hint that GPUs exist though this torch cannot use them."""
    if os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl"):
        return "an NVIDIA device node exists: install a CUDA build of torch to use it"
    return ""


@dataclass(frozen=True, slots=True)
class DevicePlan:
    """The device every local rank of one job computes on, and how it was chosen."""

    kind: str
    """``cuda`` or ``cpu``."""
    requested: str
    """What was asked for: ``auto``, ``cuda`` or ``cpu``."""
    local_ranks: int
    """Processes this machine runs for the job."""
    gpu_names: tuple[str, ...] = ()
    """The GPUs the ranks take (rank ``i`` takes GPU ``i``), when on CUDA."""
    note: str = ""
    """One line for the user when ``auto`` chose the CPU on a machine with GPUs."""

    @property
    def interpreted(self) -> bool:
        """Triton runs through its interpreter (the ranks compute on the CPU)."""
        return self.kind == "cpu"

    def rank_environment(self) -> dict[str, str]:
        """What each rank's environment holds before it starts (and imports Triton)."""
        return {DEVICE_ENV: self.kind, "TRITON_INTERPRET": "1" if self.interpreted else "0"}

    def describe(self) -> str:
        """``cuda (1 x NVIDIA H100 80GB HBM3)`` or ``cpu``."""
        if self.kind == "cpu":
            return "cpu"
        names = sorted(set(self.gpu_names))
        return f"cuda ({len(self.gpu_names)} x {', '.join(names)})" if names else "cuda"


def resolve_device(
    requested: str,
    local_ranks: int,
    layout: str = "",
    support: CudaSupport | None = None,
) -> DevicePlan:
    """The device for ``local_ranks`` processes on this machine, from ``requested``.

    ``layout`` names the layout in messages (``PP 2 x DP 2``); ``support`` is what the
    machine has (default: asked now; tests pass their own). Raises `DeviceError` naming
    what was asked, what the machine has and what would work."""
    if requested not in DEVICE_CHOICES:
        raise DeviceError(
            f"--device: {requested!r} is not a device; expected one of {', '.join(DEVICE_CHOICES)}"
        )
    if requested == "cpu":
        return DevicePlan("cpu", requested, local_ranks)
    support = cuda_support() if support is None else support
    ranks = f"{local_ranks} local rank{'s' * (local_ranks != 1)}"
    what = f"the layout {layout} runs {ranks}" if layout else f"this job runs {ranks}"
    if support.gpus >= local_ranks:
        return DevicePlan("cuda", requested, local_ranks, support.names[:local_ranks])
    if support.gpus == 0:
        has = f"this machine has no usable CUDA device: {support.why_none}"
        if requested == "cuda":
            raise DeviceError(f"--device cuda: {has}; use --device cpu (or auto)")
        return DevicePlan("cpu", requested, local_ranks)
    has = f"this machine has {support.gpus} GPU{'s' * (support.gpus != 1)}"
    if requested == "cuda":
        raise DeviceError(
            f"--device cuda: {what}, one GPU each (NCCL puts no two ranks on one GPU), and "
            f"{has}. Ways out: a layout with at most {support.gpus} rank"
            f"{'s' * (support.gpus != 1)} per machine (fewer --pp / --dp), or --device cpu"
        )
    note = (
        f"device: running on the CPU: {what} and {has} (one GPU per rank); "
        f"--device cuda with at most {support.gpus} rank{'s' * (support.gpus != 1)} uses them"
    )
    return DevicePlan("cpu", requested, local_ranks, note=note)


def rank_device() -> torch.device:
    """This rank's device: what its launcher handed it (`DEVICE_ENV`, ``LOCAL_RANK``).

    A process no launcher of ours started (``torchrun``, a plain script) resolves ``auto``
    for its machine's local ranks (``LOCAL_WORLD_SIZE``)."""
    kind = os.environ.get(DEVICE_ENV)
    if kind is None:
        kind = resolve_device("auto", int(os.environ.get("LOCAL_WORLD_SIZE", 1))).kind
        os.environ[DEVICE_ENV] = kind
    if kind not in ("cuda", "cpu"):
        raise DeviceError(f"{DEVICE_ENV}={kind!r}: expected cuda or cpu")
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def triton_device() -> torch.device:
    """Where this process's Triton kernels take their tensors: chooses the mode first
    (`choose_triton_mode`), then ``cuda`` when kernels compile, the CPU when interpreted."""
    choose_triton_mode()
    return torch.device("cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda")


__all__ = [
    "DEVICE_CHOICES",
    "DEVICE_ENV",
    "CudaSupport",
    "DeviceError",
    "DevicePlan",
    "choose_triton_mode",
    "cuda_support",
    "rank_device",
    "resolve_device",
    "triton_device",
]
