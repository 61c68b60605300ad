"""pytest-benchmark suites for the optimized ops: one ``bench_<op>.py`` per op.

Run ``pytest benchmarks/ --benchmark-json=out.json``. Files are named
``bench_*.py``; the hook below collects them, so no pytest configuration is
needed. On a machine without CUDA, Triton kernels run through the interpreter
and shapes are small; with CUDA, or with ``--gpu-shapes``, they are the seed's
(4096 tokens x 102400 vocabulary, bfloat16, ...: `benchmarks._common.pick`).
``-p benchmarks.profiling --profile-dir DIR`` (what ``twinpipe bench --profile DIR`` runs)
profiles the run (`benchmarks.profiling`).
"""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from models.runtime import choose_triton_mode  # noqa: E402  (after the path is set)

choose_triton_mode()  # a process that computes on the CPU interprets Triton kernels


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--gpu-shapes",
        action="store_true",
        help="benchmark at the GPU shapes (4096 tokens x 102400 vocabulary, bf16, ...) even "
        "without CUDA; default: GPU shapes on CUDA, small shapes on CPU",
    )


def pytest_configure(config: pytest.Config) -> None:
    from benchmarks._common import use_gpu_shapes

    use_gpu_shapes(config.getoption("--gpu-shapes"))


def pytest_collect_file(parent: pytest.Collector, file_path: pathlib.Path):
    """``bench_*.py`` under a folder pytest was given. A file named on the command line is
    collected by pytest itself (collected here too, each benchmark ran twice)."""
    if parent.session.isinitpath(file_path):
        return None
    if file_path.suffix == ".py" and file_path.name.startswith("bench_"):
        return pytest.Module.from_parent(parent, path=file_path)
    return None
