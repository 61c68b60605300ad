"""Progress of loading, saving and exporting a real-size model, on a terminal.

Reading a 30 B-parameter checkpoint takes minutes; a silent process looks hung. A
`ProgressLine` redraws one line on stderr (tensors and GB done, rate, time) while the
work goes tensor by tensor, and prints nothing when stderr is not a terminal (logs,
tests, ranks other than the first), so it never clutters captured output.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressLine:
    """``label: 12/340 tensors, 1.23/4.56 GB, 0.81 GB/s, 3 s`` redrawn on a terminal."""

    def __init__(
        self,
        label: str,
        total_tensors: int | None = None,
        total_bytes: int | None = None,
        stream: TextIO | None = None,
        enabled: bool | None = None,
    ) -> None:
        self.label = label
        self.total_tensors, self.total_bytes = total_tensors, total_bytes
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.tensors = self.bytes = 0
        self.started = time.perf_counter()
        self._drawn = 0.0

    def __call__(self, name: str, nbytes: int) -> None:
        """One more tensor (of ``nbytes``) done."""
        self.tensors += 1
        self.bytes += nbytes
        now = time.perf_counter()
        if self.enabled and now - self._drawn >= 0.2:
            self._drawn = now
            self.stream.write("\r\033[K" + self.text())
            self.stream.flush()

    def text(self) -> str:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        tensors = f"{self.tensors}" + (f"/{self.total_tensors}" if self.total_tensors else "")
        gigabytes = f"{self.bytes / 1e9:.2f}" + (
            f"/{self.total_bytes / 1e9:.2f}" if self.total_bytes else ""
        )
        return (
            f"{self.label}: {tensors} tensors, {gigabytes} GB, "
            f"{self.bytes / 1e9 / elapsed:.2f} GB/s, {elapsed:.0f} s"
        )

    def close(self) -> None:
        """The final figures on their own line (on a terminal)."""
        if self.enabled:
            self.stream.write("\r\033[K" + self.text() + "\n")
            self.stream.flush()
