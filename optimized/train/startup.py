"""What a training run does between loading and its first step, and why (docs/gpus.md).

1. Connect: one exchange on every point-to-point stream and one all-reduce on every group
   (`models.runtime.warm_up`), so no NCCL communicator is created inside a step.
2. Tune: every attention key of this rank's layers tuned, and so compiled, on dummy tensors
   of its own shapes (`optimized.ops.tuning.pretune`), the choices kept in
   ``<checkpoint.dir>/tuning/rank<r>.json`` (or ``$TWINPIPE_TUNING_DIR``) for the next run.
   Then every other Triton kernel of the step launched once on such tensors
   (`optimized.ops.precompile`).
3. Tighten: every group's collective timeout set to the steps' ``--timeout``.

Each of 1 and 2 runs under ``--setup-timeout`` (`models.runtime.phase_limit`), as does the
load before them. Together they are a phase of their own for the memory figures
(``warm-up``), which the run's peak leaves out: a step's peak is the steps' own.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from models.runtime import Layout, phase_limit, tighten, warm_up
from optimized.ops.tuning import TuningCache, cache_path
from optimized.train.config import TrainConfig

TUNING_ENV = "TWINPIPE_TUNING_DIR"
"""Where the tuning choices go when the run has no ``checkpoint.dir``."""


def tuning_folder(cfg: TrainConfig) -> str | None:
    """The folder of the tuning cache: the checkpoint folder, else ``$TWINPIPE_TUNING_DIR``;
    None keeps the choices in memory only (the run still steps on what it tuned)."""
    return cfg.checkpoint.dir or os.environ.get(TUNING_ENV) or None


def before_first_step(
    cfg: TrainConfig, runner, layout: Layout, device: torch.device
) -> dict[str, Any]:
    """Connect, tune, tighten; what each did (printed by rank 0)."""
    with phase_limit("connect", cfg.setup_timeout):
        connected = warm_up(layout, device)
    folder = tuning_folder(cfg)
    cache = TuningCache(cache_path(folder, layout.rank)) if folder else None
    tuned = {"keys": 0, "loaded": 0, "benchmarks": 0, "seconds": 0.0, "skipped": True}
    if hasattr(runner, "prepare"):  # a stack with kernels to tune (the optimized one)
        with phase_limit("tune", cfg.setup_timeout):
            tuned = runner.prepare(cache)
    tighten(layout, cfg.timeout)
    return {"connect": connected, "tune": tuned}


def describe(done: dict[str, Any]) -> str:
    """One line: what ran before step 1."""
    connected, tuned = done["connect"], done["tune"]
    line = (
        f"before step 1: {len(connected['collectives'])} groups and "
        f"{len(connected['streams'])} p2p streams connected in {connected['seconds']:g} s"
    )
    if tuned["skipped"]:
        line += "; attention runs fixed blocks here (nothing to tune)"
    else:
        line += (
            f"; {tuned['keys']} attention keys tuned ({tuned['loaded']} choices loaded, "
            f"{tuned['benchmarks']} configurations timed) in {tuned['seconds']:g} s"
        )
    if "compiled_keys" in tuned:
        line += (
            f"; {tuned['compiled_keys']} other kernel keys launched (compiled on a GPU) in "
            f"{tuned['compile_seconds']:g} s"
        )
    if "outside_allocator_bytes" in connected:
        line += (
            f"; {connected['outside_allocator_bytes'] / 2**30:.2f} GiB of the GPU held outside "
            f"the allocator (CUDA context, NCCL)"
        )
    return line
