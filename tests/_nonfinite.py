"""Float32 bit patterns a GPU's arithmetic makes and the CPU's does not, for the tests that
feed NaN and infinity through the kernels (`tests/test_ops_nonfinite.py`) and the harness."""

from __future__ import annotations

import torch

GPU_NAN, GPU_NEGATIVE_NAN = 0x7FFFFFFF, 0xFFFFFFFF
"""The NaNs NVIDIA GPUs produce: what the old rounding turned into -0.0 and +0.0."""
PATTERNS = (GPU_NAN, GPU_NEGATIVE_NAN, 0x7FC00000, 0xFFC00000, 0x7F800001, 0x7F800000, 0xFF800000)
"""Float32 bit patterns: both GPU NaNs, numpy's (and negated), a NaN whose payload lies in the
low half only, +inf and -inf."""


def from_bits(bits) -> torch.Tensor:
    """float32 values with the given bit patterns."""
    return torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits]).to(
        torch.int32).view(torch.float32)  # fmt: skip


NONFINITE = from_bits(PATTERNS)


NANS = 5
"""The first `NANS` patterns are NaNs, the last two infinities."""
