"""Deterministic mode: one commit, one input, the same bits on every run.

On a CPU a rank's step is already the same from run to run. On a GPU two things are not:

- **sums over repeated indices.** ``index_add_`` / ``scatter_add_`` on CUDA add with float
  atomics, in whatever order the threads arrive: MoE's combine (`scatter_add_rows`, a
  token's k expert outputs summed into its row, and the gather's backward), the GPT-OSS
  expert-bias gradient (a column sum per expert group), the reference's index ops. Here
  they all go through `index_add`, which in deterministic mode sorts the rows by index
  (stable) and sums each index's rows as one segment, in row order: the same bits every
  run, and on a CPU the same bits as ``index_add_`` in float32 (both add in row order;
  bfloat16 rows are added in float32 and rounded once).
  torch's own deterministic algorithms are turned on too
  (``torch.use_deterministic_algorithms(True, warn_only=True)``: an op without a
  deterministic kernel warns, naming itself, instead of failing the run), with cuBLAS's
  fixed workspace (``CUBLAS_WORKSPACE_CONFIG``, read when a cuBLAS handle is created,
  so set before a rank's first product);
- **autotuned kernels** pick their configuration by timing, and a near-tie in time can
  pick another configuration (another reduction order) on the next run. `deterministic`
  is the flag a tuning cache reads: while it is on, a kernel must run a choice that was
  pinned (persisted, or the first run's), never a fresh timing.

`twinpipe compare` turns it on by default on CUDA (``--deterministic auto``), so that
`twinpipe diff` of two compare reports of one commit shows zero; `twinpipe train` and
`bench` leave it off: their figures are the production path's. Its cost on a GPU is not
yet measured (docs/gpus.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

CUBLAS_WORKSPACE = ":4096:8"
"""cuBLAS's workspace setting for reproducible products (CUDA's documentation)."""

_state = {"on": False}


def deterministic() -> bool:
    """Whether this process runs deterministic: the flag sums, tuners and reports read."""
    return _state["on"]


def set_deterministic(on: bool) -> None:
    """Turn deterministic mode on or off for this process (see the module docstring)."""
    _state["on"] = bool(on)
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        # Filling every fresh tensor with NaN is a debugging aid, not determinism: no step
        # of the project reads memory it did not write.
        torch.utils.deterministic.fill_uninitialized_memory = False
    _torch_algorithms(bool(on), True)


def _torch_algorithms(on: bool, warn_only: bool) -> None:
    """torch's deterministic-algorithms setting, changed only when it differs (changing
    it imports torch's compiler configuration: seconds on a loaded CPU)."""
    now = (torch.are_deterministic_algorithms_enabled(),
           torch.is_deterministic_algorithms_warn_only_enabled())  # fmt: skip
    if now != (on, warn_only and on):
        torch.use_deterministic_algorithms(on, warn_only=warn_only)


@contextmanager
def deterministic_mode(on: bool = True) -> Iterator[None]:
    """Deterministic mode ``on`` (or off) inside, the previous setting restored after."""
    before = (_state["on"], torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.utils.deterministic.fill_uninitialized_memory)  # fmt: skip
    set_deterministic(on)
    try:
        yield
    finally:
        _state["on"] = before[0]
        _torch_algorithms(before[1], before[2])
        torch.utils.deterministic.fill_uninitialized_memory = before[3]


def index_add(out: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``out.index_add(0, index, src)`` (out of place: autograd flows to ``src``); in
    deterministic mode by sort and segment sum, each index's rows added in row order.

    Nothing is read on the host: the segment lengths are counted on the device (integer
    adds, exact in any order) and the segment count is ``out``'s row count."""
    if not deterministic() or src.shape[0] == 0:
        return out.index_add(0, index, src)
    order = torch.argsort(index, stable=True)
    lengths = torch.zeros(out.shape[0], dtype=torch.long, device=index.device)
    lengths.index_add_(0, index.long(), torch.ones_like(index, dtype=torch.long))
    # Low-precision rows are added in float32 and rounded once, as index_add_ does.
    rows = src.index_select(0, order).to(torch.promote_types(src.dtype, torch.float32))
    sums = torch.segment_reduce(rows, "sum", lengths=lengths, axis=0, unsafe=True)
    return (out + sums).to(out.dtype)


def index_add_(out: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """`index_add` into ``out`` in place (no autograd through ``out``)."""
    if not deterministic():
        return out.index_add_(0, index, src)
    return out.copy_(index_add(out, index, src))


__all__ = [
    "CUBLAS_WORKSPACE",
    "deterministic",
    "deterministic_mode",
    "index_add",
    "index_add_",
    "set_deterministic",
]
