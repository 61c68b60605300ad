"""The one place that imports Triton for `optimized.ops`.

On a machine without CUDA, Triton kernels run through its interpreter, which
must be switched on (``TRITON_INTERPRET=1``) before `triton` is first imported.
Every kernel module imports ``triton`` and ``tl`` from here, so the variable is
set once, early, and a user's explicit setting is left alone.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""True when kernels run through the Triton interpreter (CPU tensors)."""

__all__ = ["INTERPRETED", "tl", "triton"]
