"""What the network is, at three seams, in three subpackages:

- `models.network`: the math, written once -- configs and presets, the layers as the five
  stages DualPipeV overlaps, the decoder and the model, routing, the ops protocol both
  stacks implement, weight sources. It imports neither of the others;
- `models.hf`: Hugging Face checkpoints and ``config.json`` in and out (sharded
  safetensors read as per-rank slices, written as streams; MXFP4). May use the network
  and the runtime;
- `models.runtime`: what every stack and the harness share to run the network -- devices,
  launching ranks, the parallel layout and its p2p stream groups, communication and
  host-sync counting, the bf16 GEMM policy, progress lines, input checks, the step rules
  both stacks share. May use the network.

Callers import a subpackage (``from models.network import ModelConfig``), not its files;
``tests/test_structure.py`` holds every import to these edges.

This file itself holds one thing every process needs before anything else: the Triton
mode. A process that computes on the CPU runs Triton kernels through Triton's interpreter,
which must be chosen before anything imports ``triton`` -- and torch imports it lazily on
its own (the first AdamW step does). Every twinpipe process imports `models` first, so the
mode is chosen here (a rank's launcher has chosen already: `models.runtime.DevicePlan`).
It lives here rather than in `models.runtime` so that importing the math loads nothing of
the runtime.
"""

import os
import warnings

import torch

DEVICE_ENV = "TWINPIPE_DEVICE"
"""The environment variable a rank reads its device kind from (``cuda`` or ``cpu``)."""


def cuda_available() -> bool:
    """``torch.cuda.is_available()`` without its warnings (no CUDA context is made). The only
    place that asks; `models.runtime.resolve_device` decides from it."""
    if torch.version.cuda is None:
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.cuda.is_available()


def choose_triton_mode() -> None:
    """Before anything imports ``triton``: the interpreter in a process that computes on the
    CPU. A rank's launcher already set ``TRITON_INTERPRET``; a user's setting is kept; any
    other process without a usable GPU interprets."""
    if "TRITON_INTERPRET" in os.environ:
        return
    kind = os.environ.get(DEVICE_ENV)
    if kind is None:
        kind = "cuda" if cuda_available() else "cpu"
    os.environ["TRITON_INTERPRET"] = "1" if kind == "cpu" else "0"


choose_triton_mode()
