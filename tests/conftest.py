"""Shared test setup: import from the checkout, run Triton through its interpreter on CPU."""

import os
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
