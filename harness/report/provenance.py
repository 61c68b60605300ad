"""Where a report's figures come from: the commit of the checkout and the machine."""

from __future__ import annotations

import os
import platform
import subprocess


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
    """One line: CPU architecture and cores, the GPU if any, torch version (a history
    entry's ``machine``)."""
    parts = [f"{platform.machine() or 'cpu'}, {os.cpu_count()} CPU cores"]
    try:
        import torch

        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            parts.append(f"{count} x {torch.cuda.get_device_name(0)}")
        else:
            parts.append("no GPU")
        parts.append(f"torch {torch.__version__}")
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    parts.append(f"Python {platform.python_version()}")
    return ", ".join(parts)


def machine_line() -> str:
    """Host name, architecture and torch version: a compare report's ``machine``."""
    import torch  # noqa: PLC0415 (reading and writing reports needs no torch)

    return f"{platform.node()} {platform.machine()} torch {torch.__version__}"
