"""What every op benchmark shares: the device, the shapes' scale, timing and peak memory.

Each benchmark times one implementation (``optimized`` or ``plain``) of one op,
forward and backward, on inputs made fresh by a setup function that is not
timed, and records in ``extra_info`` the op, the implementation, the shape,
the dtype, the device and the peak memory of one extra run measured by
`harness.memory.MemoryTracker` (exact storage accounting on CPU, the caching
allocator's statistics on CUDA; inputs included in both). That run also counts the Triton
kernels the op launches (``triton_launches``) beside the process's Triton mode (``triton``:
``interpreter`` or ``compiled``): an interpreted kernel's time is no speed measurement, and
the dashboard says so for exactly the ops that launched one.

Shapes: each benchmark names a GPU shape (the seed's: 4096 tokens x 102400 vocabulary in
bfloat16 for the losses, GPT-OSS-20B's attention at 4096 tokens, ...) and a small CPU
shape, and `pick` chooses. The GPU shapes are used on CUDA, or anywhere with
``--gpu-shapes`` (``pytest benchmarks/ --gpu-shapes``, ``twinpipe bench --gpu-shapes``):
on the CPU interpreter they take minutes per op, but the memory figures are the real ones.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from harness.memory import MemoryTracker
from harness.report import cpu_name
from models.runtime import triton_device

DEVICE = triton_device()
"""Where the benchmarks compute: what `twinpipe bench --device` chose (it hands the device and
the Triton mode to this process), else a GPU when there is one (`models.runtime.device`)."""
ON_CUDA = DEVICE.type == "cuda"
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


def triton_mode() -> str:
    """``interpreter`` where this process runs Triton kernels through Triton's interpreter
    (the CPU), else ``compiled``."""
    return "interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "compiled"


@contextlib.contextmanager
def counting_triton_launches() -> Iterator[list[int]]:
    """Counts the Triton kernel launches made inside the block (``counter[0]``), compiled or
    interpreted: both kinds of kernel launch through their class's ``run``."""
    from triton.runtime.interpreter import InterpretedFunction  # noqa: PLC0415
    from triton.runtime.jit import JITFunction  # noqa: PLC0415

    counter = [0]
    originals = {kind: kind.run for kind in (JITFunction, InterpretedFunction)}

    def counting(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            counter[0] += 1
            return original(self, *args, **kwargs)

        return run

    for kind, original in originals.items():
        kind.run = counting(original)
    try:
        yield counter
    finally:
        for kind, original in originals.items():
            kind.run = original


def _tracked(run: Callable[..., Any], setup: Setup) -> tuple[int, list[torch.Tensor], int]:
    """The peak bytes of one run of ``run(*setup())`` (inputs included), its inputs, and the
    Triton kernels it launched."""
    args, kwargs = setup()
    synchronize()
    tracker = MemoryTracker(DEVICE)
    with counting_triton_launches() as launches, tracker.step():
        run(*args, **kwargs)
        synchronize()
    inputs = [value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)]
    return tracker.peak_bytes, inputs, launches[0]


def peak_memory_bytes(run: Callable[..., Any], setup: Setup) -> int:
    return _tracked(run, setup)[0]


def peak_above_inputs_bytes(run: Callable[..., Any], setup: Setup) -> int:
    """Peak memory of one run beyond its tensor inputs and the gradients they received
    (how the issue's loss figures count: 1.00x the logits for an in-place cross-entropy)."""
    peak, inputs, _ = _tracked(run, setup)
    held = sum(t.nbytes + (t.grad.nbytes if t.grad is not None else 0) for t in inputs)
    return peak - held


def liger_installed() -> bool:
    """Whether Liger-Kernel can be compared against: installed, and a GPU to run it on."""
    return ON_CUDA and importlib.util.find_spec("liger_kernel") is not None


def bench(
    benchmark: Any,
    run: Callable[..., Any],
    setup: Setup,
    op: str,
    implementation: str,
    flops: float | None = None,
    **info: Any,
) -> None:
    """Time ``run(*setup())`` and record its peak memory and description in extra_info;
    given the ``flops`` one run does, also ``tflops_per_s`` at the median time."""

    def timed(*args: Any, **kwargs: Any) -> None:
        run(*args, **kwargs)
        synchronize()

    benchmark.group = op
    peak, _, launches = _tracked(run, setup)
    benchmark.extra_info.update(
        op=op,
        implementation=implementation,
        device=str(DEVICE),
        device_name=torch.cuda.get_device_name(DEVICE) if ON_CUDA else cpu_name(),
        shapes="gpu" if _gpu_shapes else "cpu",
        peak_memory_bytes=peak,
        triton=triton_mode(),
        triton_launches=launches,
        **{
            key: str(value) if isinstance(value, torch.dtype) else value
            for key, value in info.items()
        },
    )
    benchmark.pedantic(timed, setup=setup, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS, iterations=1)
    stats = getattr(getattr(benchmark, "stats", None), "stats", None)
    if flops is not None and stats is not None and stats.median > 0:
        benchmark.extra_info.update(flops=flops, tflops_per_s=flops / stats.median / 1e12)
