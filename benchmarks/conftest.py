"""pytest-benchmark suites for the optimized ops: one ``bench_<op>.py`` per op.

Run ``pytest benchmarks/ --benchmark-json=out.json``. Files are named
``bench_*.py``; the hook below collects them, so no pytest configuration is
needed. On a machine without CUDA, Triton kernels run through the interpreter
and shapes are small; with CUDA they are realistic.
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collect_file(parent: pytest.Collector, file_path: pathlib.Path):
    if file_path.suffix == ".py" and file_path.name.startswith("bench_"):
        return pytest.Module.from_parent(parent, path=file_path)
    return None
