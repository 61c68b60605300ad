"""What every op benchmark shares: the device, the shapes' scale, timing and peak memory.

Each benchmark times one implementation (``optimized`` or ``plain``) of one op,
forward and backward, on inputs made fresh by a setup function that is not
timed, and records in ``extra_info`` the op, the implementation, the shape,
the dtype, the device and the peak memory of one extra run measured by
`harness.memory.MemoryTracker` (exact storage accounting on CPU, the caching
allocator's statistics on CUDA; inputs included in both).

Shapes: each benchmark names a GPU shape (the seed's: 4096 tokens x 102400 vocabulary in
bfloat16 for the losses, GPT-OSS-20B's attention at 4096 tokens, ...) and a small CPU
shape, and `pick` chooses. The GPU shapes are used on CUDA, or anywhere with
``--gpu-shapes`` (``pytest benchmarks/ --gpu-shapes``, ``twinpipe bench --gpu-shapes``):
on the CPU interpreter they take minutes per op, but the memory figures are the real ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from harness.memory import MemoryTracker

ON_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
ROUNDS = 20 if ON_CUDA else 3
WARMUP_ROUNDS = 2 if ON_CUDA else 0
GPU_SHAPES_FLAG = "--gpu-shapes"

_gpu_shapes = ON_CUDA


def use_gpu_shapes(on: bool) -> None:
    """Set by `benchmarks/conftest.py` from ``--gpu-shapes`` before the modules are imported."""
    global _gpu_shapes
    _gpu_shapes = on or ON_CUDA


def pick(gpu: Any, cpu: Any) -> Any:
    """The GPU shape on CUDA or with ``--gpu-shapes``, else the CPU shape."""
    return gpu if _gpu_shapes else cpu


Setup = Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]


def synchronize() -> None:
    if ON_CUDA:
        torch.cuda.synchronize()


def peak_memory_bytes(run: Callable[..., Any], setup: Setup) -> int:
    args, kwargs = setup()
    synchronize()
    tracker = MemoryTracker(DEVICE)
    with tracker.step():
        run(*args, **kwargs)
        synchronize()
    return tracker.peak_bytes


def bench(
    benchmark: Any,
    run: Callable[..., Any],
    setup: Setup,
    op: str,
    implementation: str,
    flops: int | None = None,
    **info: Any,
) -> None:
    """Time ``run(*setup())`` and record its peak memory and description in extra_info;
    with ``flops`` (the work of one run) also ``tflop_per_s`` at the mean time."""

    def timed(*args: Any, **kwargs: Any) -> None:
        run(*args, **kwargs)
        synchronize()

    benchmark.group = op
    benchmark.extra_info.update(
        op=op,
        implementation=implementation,
        device=str(DEVICE),
        shapes="gpu" if _gpu_shapes else "cpu",
        peak_memory_bytes=peak_memory_bytes(run, setup),
        **{
            key: str(value) if isinstance(value, torch.dtype) else value
            for key, value in info.items()
        },
    )
    benchmark.pedantic(timed, setup=setup, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS, iterations=1)
    stats = getattr(benchmark, "stats", None)
    if flops is not None:
        benchmark.extra_info["flops"] = flops
        if stats is not None and stats.stats.mean > 0:  # None under --benchmark-disable
            benchmark.extra_info["tflop_per_s"] = flops / stats.stats.mean / 1e12
