"""Where a report's figures come from: the commit of the checkout, the machine, and the
device the ranks computed on (its name and the torch, Triton and CUDA versions)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from typing import Any


def git_commit(cwd: str | os.PathLike[str] | None = None) -> str:
    """Short commit of the checkout, with ``-dirty`` when tracked files changed; or 'unknown'."""

    def git(*args: str) -> str:
        completed = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30, check=True
        )
        return completed.stdout.strip()

    try:
        commit = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{commit}-dirty" if dirty else commit


def machine_description() -> str:
    """One line: CPU architecture and cores, the GPUs torch can use, torch version (a history
    entry's ``machine``). The GPUs come from the device resolver (`models.runtime.device`), the one
    place that asks the machine about CUDA."""
    parts = [f"{platform.machine() or 'cpu'}, {os.cpu_count()} CPU cores"]
    import torch  # noqa: PLC0415 (reading and writing reports needs no torch)

    from models.runtime import cuda_support  # noqa: PLC0415

    support = cuda_support()
    if support.gpus:
        names = sorted(set(support.names))
        parts.append(f"{support.gpus} x {', '.join(names) or 'GPU'}")
    else:
        parts.append("no GPU")
    parts.append(f"torch {torch.__version__}")
    parts.append(f"Python {platform.python_version()}")
    return ", ".join(parts)


def machine_line() -> str:
    """Host name, architecture and torch version: a compare report's ``machine``."""
    import torch  # noqa: PLC0415 (reading and writing reports needs no torch)

    return f"{platform.node()} {platform.machine()} torch {torch.__version__}"


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; else what `platform` says)."""
    try:
        with open("/proc/cpuinfo", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip().lower() in ("model name", "hardware", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def package_version(name: str) -> str | None:
    """An installed distribution's version, without importing it (None: not installed)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def device_description(device: Any) -> dict[str, Any]:
    """A report's ``device``: ``type`` (``cpu`` or ``cuda``), ``name`` (the GPU's, or the
    CPU model), and the ``torch``, ``triton`` and ``cuda`` versions (``cuda`` null on a
    torch without CUDA). Called where the device is used (a rank), for its own device."""
    import torch  # noqa: PLC0415

    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = cpu_name()
    return {
        "type": device.type,
        "name": name,
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "cuda": torch.version.cuda,
    }


def device_line(device: Any) -> str:
    """``cuda (NVIDIA H100 80GB HBM3), torch 2.11.0, Triton 3.6.0, CUDA 13.0`` from a
    report's ``device`` section (``""`` when there is none)."""
    if not isinstance(device, dict) or not device.get("type"):
        return ""
    text = str(device["type"])
    if device.get("name"):
        text += f" ({device['name']})"
    versions = [("torch", device.get("torch")), ("Triton", device.get("triton")),
                ("CUDA", device.get("cuda"))]  # fmt: skip
    return ", ".join([text] + [f"{what} {value}" for what, value in versions if value])
