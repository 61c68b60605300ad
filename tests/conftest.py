"""Shared test setup: import from the checkout, choose the Triton mode, and the device the
in-process kernel tests compute on.

The same ``pytest`` runs on a CPU machine and on a machine with a GPU. This process
compiles Triton kernels when it has a GPU and interprets them otherwise
(`models.runtime.choose_triton_mode`); kernel tests take their tensors on `compute_device`,
so they run compiled on CUDA and through the interpreter elsewhere. Multi-process tests
start their ranks on the CPU unless they ask for CUDA (`models.runtime.launch`), and
each CPU rank interprets whatever this process chose. Tests marked ``gpu`` need CUDA and
are skipped, with the reason, where there is none.
"""

import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from models.runtime import cuda_support, triton_device  # noqa: E402  (after the path is set)

DEVICE = triton_device()
"""Where this process's Triton kernels take their tensors: ``cuda`` when it compiles them,
else the CPU (the interpreter)."""


@pytest.fixture
def compute_device():
    """The device an in-process kernel test puts its tensors on (`DEVICE`). A process that
    compiles Triton kernels with no GPU to run them on (``TRITON_INTERPRET=0`` on a CPU
    machine: how the suite is checked for GPU machines without one) skips such tests."""
    if DEVICE.type == "cuda" and not cuda_support().gpus:
        pytest.skip("this process compiles Triton kernels and has no GPU to run them on")
    return DEVICE


@pytest.fixture
def gpu_device():
    """The GPU a ``gpu``-marked test runs compiled Triton kernels on. Where the marker lets it
    run (there is a GPU) but this process interprets Triton (``TRITON_INTERPRET=1`` set by
    the user), its kernels take CPU tensors only, so the test is skipped, saying why."""
    if DEVICE.type != "cuda":
        pytest.skip("this process interprets Triton kernels (TRITON_INTERPRET=1): CPU tensors only")
    return DEVICE


def pytest_collection_modifyitems(config, items):
    support = cuda_support()
    if support.gpus:
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU: {support.why_none}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    """Under pytest-xdist a worker's environment names it (``PYTEST_XDIST_WORKER`` and the
    rest). What a test starts is not a worker of this run: `twinpipe bench` runs
    pytest-benchmark, which turns itself off when it sees those names."""
    for key in [key for key in os.environ if key.startswith("PYTEST_XDIST_")]:
        del os.environ[key]
