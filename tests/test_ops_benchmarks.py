"""``--gpu-shapes`` gives the benchmarks the seed's shapes, whatever the device (the
benchmarks' device is where this process's Triton kernels run, `compute_device`)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import _common
from benchmarks import conftest as bench_conftest

ROOT = Path(__file__).resolve().parents[1]


class _Config:
    def __init__(self, gpu_shapes: bool) -> None:
        self.gpu_shapes = gpu_shapes

    def getoption(self, name: str) -> bool:
        assert name == "--gpu-shapes"
        return self.gpu_shapes


@pytest.fixture
def reload_with():
    modules = []

    def load(gpu_shapes: bool, name: str):
        bench_conftest.pytest_configure(_Config(gpu_shapes))
        module = importlib.import_module(f"benchmarks.{name}")
        modules.append(importlib.reload(module))
        return modules[-1]

    yield load
    bench_conftest.pytest_configure(_Config(False))
    for module in modules:
        importlib.reload(module)


def test_gpu_shapes_flag_switches_every_loss_benchmark(reload_with, compute_device):
    """Where kernels compile (CUDA) the GPU shapes are used without the flag too."""
    assert _common.DEVICE == compute_device
    without_flag = (4096, 102400) if compute_device.type == "cuda" else (64, 4096)
    for name in ("bench_cross_entropy", "bench_linear_cross_entropy"):
        small = reload_with(False, name)
        assert (small.TOKENS, small.VOCAB) == without_flag
        seed = reload_with(True, name)
        assert (seed.TOKENS, seed.VOCAB, seed.DTYPE) == (4096, 102400, torch.bfloat16)
    attention = reload_with(True, "bench_attention")
    assert (attention.HEADS, attention.KV_HEADS, attention.SEQ, attention.WINDOW) == (
        64, 8, 4096, 128,
    )  # fmt: skip
    assert _common.pick(gpu="gpu", cpu="cpu") == "gpu"


@pytest.mark.slow
def test_flag_is_registered_with_pytest():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "benchmarks/", "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "--gpu-shapes" in result.stdout
