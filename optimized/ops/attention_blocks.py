"""How `optimized.ops.attention` launches its kernels: block sizes, packing, autotuning.

Three regimes, one kernel family (`optimized.ops.attention_kernels`):

- the interpreter (CPU): each program costs milliseconds of Python whatever its size, so
  one block covers a sequence up to `INTERPRETER_ROWS` and several (batch x head) pairs
  share a program (``pack``): at the tiny presets' 64 tokens one program runs the whole
  forward of a micro-batch;
- bfloat16 on GPUs: the block sizes, warps and pipeline stages are autotuned per shape
  (sequence length, window, head widths, dtype) among a few configurations that suit an
  H100 (`FORWARD_CONFIGS`, ...); a configuration that does not fit the device is skipped
  by the autotuner;
- float32 on GPUs (the stacks' float32 checks, not training): IEEE float32 products, one
  small fixed configuration (`FLOAT32_BLOCKS`): large float32 tiles need more shared
  memory than an A100 has and take minutes to compile.

Tests fix the blocks (`Blocks`) to run several blocks per sequence on the interpreter.

Autotuning happens before the first scheduled step, never inside one
(`optimized.ops.tuning.pretune`; `models.runtime.device_sync`): timing a configuration
synchronises the device, and on NCCL that hangs a pipeline mid-step. The autotuners time
through `benchmark`, which refuses inside a step and counts what it timed
(`BENCHMARKS`). They exist on the interpreter too, with two small configurations
(`INTERPRETER_CONFIGS`), so the pre-tuning path runs and is tested on a CPU: ``blocks=
AUTOTUNED`` asks for them there (by default the interpreter runs its one fixed block).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import NamedTuple

from models.runtime import refuse_in_step
from optimized.ops._triton import INTERPRETED, triton
from optimized.ops.attention_kernels import (
    attention_backward_kv_kernel,
    attention_backward_q_kernel,
    attention_forward_kernel,
)

INTERPRETER_ROWS = 512
"""Rows of a program's tiles on the interpreter: the sequence's block times the pairs it
packs (tiny presets: 8 pairs of 64 rows; score tiles of 512 x 512 cost numpy about as much
as one more program costs Python)."""
PREPROCESS_ROWS = 128
"""Rows per program of the backward's preprocess on GPUs."""
MAX_PROGRAMS = 2**31 - 1
"""The most programs a CUDA grid's first axis holds (its other two: 65 535 each)."""
SMALLEST_BLOCK = 16
"""The fewest rows a block of any kernel here has (`Blocks.check`)."""
KERNELS = {
    "forward": attention_forward_kernel,
    "backward_kv": attention_backward_kv_kernel,
    "backward_q": attention_backward_q_kernel,
}


class Blocks(NamedTuple):
    """Fixed launch parameters: (query rows, key rows) per block of each kernel; ``pack``,
    the most (batch x head) pairs one program may take (its tiles are then ``pack`` times
    as tall; each kernel packs the largest power of two up to it that divides its pairs);
    and on GPUs the warps and pipeline stages. Sizes are powers of two, at least 16; the
    forward's and dQ's query block a multiple of their key block, dK/dV's key block a
    multiple of its query block."""

    forward: tuple[int, int]
    backward_kv: tuple[int, int]
    backward_q: tuple[int, int]
    pack: int = 1
    warps: int = 4
    stages: int = 2

    def check(self) -> None:
        if self.pack < 1 or self.pack & (self.pack - 1):
            raise ValueError(f"Blocks.pack={self.pack!r} is invalid: a power of two >= 1")
        for name in KERNELS:
            rows, cols = getattr(self, name)
            for size in (rows, cols):
                if size < SMALLEST_BLOCK or size & (size - 1):
                    raise ValueError(
                        f"Blocks.{name}={(rows, cols)} is invalid: block sizes must be powers "
                        f"of two >= 16"
                    )
            outer, inner, which = (cols, rows, "key") if name == "backward_kv" else (
                rows, cols, "query")  # fmt: skip
            if outer % inner:
                raise ValueError(
                    f"Blocks.{name}={(rows, cols)} is invalid: its {which} block must be a "
                    f"multiple of the other"
                )


FLOAT32_BLOCKS = Blocks((32, 16), (16, 32), (32, 16), warps=4, stages=2)
"""float32 on GPUs: each kernel compiles in seconds at head width 64 and fits an A100."""


def interpreter_blocks(seq_len: int) -> Blocks:
    """One square block covering the sequence (up to `INTERPRETER_ROWS`), and as many pairs
    per program as fill `INTERPRETER_ROWS` rows."""
    size = min(max(16, triton.next_power_of_2(seq_len)), INTERPRETER_ROWS)
    return Blocks((size, size), (size, size), (size, size), INTERPRETER_ROWS // size)


def _configs(choices: list[tuple[int, int, int, int]]) -> list:
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=warps, num_stages=stages)
        for m, n, warps, stages in choices
    ]


TUNING_KEY = ["seq_len", "window", "QK_DIM", "V_DIM"]
"""The autotuner's key (it adds the pointers' dtypes)."""
FORWARD_CONFIGS = _configs([(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 4)])
"""(query block, key block, warps, stages): Triton's fused-attention tutorial's and
FlashAttention-2's choices for head widths 64 and 128 on an H100, not yet timed here."""
BACKWARD_KV_CONFIGS = _configs([(32, 128, 4, 3), (64, 128, 8, 3), (32, 64, 4, 4), (16, 128, 4, 4)])
BACKWARD_Q_CONFIGS = _configs([(128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4)])
INTERPRETER_CONFIGS = _configs([(16, 16, 1, 1), (32, 32, 1, 1)])
"""The interpreter's candidates (square blocks suit all three kernels): what a CPU tunes when
``blocks=AUTOTUNED`` asks it to (the pre-tuning path's tests)."""
AUTOTUNED = "autotuned"
"""``blocks`` value: the autotuner's choice, on the interpreter too."""
BENCHMARKS: Counter = Counter()
"""kernel name -> configurations timed by its autotuner in this process (tests)."""


def benchmark(name: str):
    """The autotuner's timing function for kernel ``name``: refused inside a scheduled step
    (`models.runtime.refuse_in_step`: it synchronises the device), counted in `BENCHMARKS`;
    Triton's own benchmarker on GPUs, one timed call on the interpreter."""

    def timed(kernel_call, quantiles):
        refuse_in_step(f"Triton's autotuner timing a configuration of attention's {name}")
        BENCHMARKS[name] += 1
        if not INTERPRETED:
            return triton.runtime.driver.active.get_benchmarker()(kernel_call, quantiles=quantiles)
        start = time.perf_counter()
        kernel_call()
        elapsed = (time.perf_counter() - start) * 1e3
        return [elapsed] * len(quantiles)

    return timed


TUNED = {
    name: triton.autotune(
        INTERPRETER_CONFIGS if INTERPRETED else configs, key=TUNING_KEY, do_bench=benchmark(name)
    )(KERNELS[name])
    for name, configs in (
        ("forward", FORWARD_CONFIGS),
        ("backward_kv", BACKWARD_KV_CONFIGS),
        ("backward_q", BACKWARD_Q_CONFIGS),
    )
}
"""name -> the autotuned kernel (bfloat16 on GPUs; on the interpreter only when asked)."""


def pack_for(limit: int, pairs: int) -> int:
    """The largest power of two up to ``limit`` that divides ``pairs``."""
    pack = 1
    while pack * 2 <= limit and pairs % (pack * 2) == 0:
        pack *= 2
    return pack


def attention_grid(seq_len: int, block: int, pair_programs: int) -> tuple[int]:
    """The one-axis grid of ``pair_programs`` programs of pairs over a sequence of
    ``block``-row blocks (`optimized.ops.attention_kernels._grid_position` unfolds it). A
    ValueError naming the shape and the limit where even that axis cannot hold it."""
    programs = triton.cdiv(seq_len, block) * pair_programs
    if programs > MAX_PROGRAMS:
        raise ValueError(
            f"flash_attention: {seq_len} tokens in blocks of {block} rows for {pair_programs} "
            f"programs of (batch x head) pairs need {programs} programs; a CUDA grid holds at "
            f"most {MAX_PROGRAMS} (2^31 - 1)"
        )
    return (programs,)


def check_shape(batch: int, heads: int, seq_len: int) -> None:
    """Refuse, before anything is allocated, a shape whose grid would not fit at the smallest
    block: ``batch x heads`` pairs of ``seq_len`` tokens (a ValueError naming both)."""
    pairs = batch * heads
    if triton.cdiv(seq_len, SMALLEST_BLOCK) * pairs > MAX_PROGRAMS:
        raise ValueError(
            f"flash_attention: batch {batch} x {heads} heads x {seq_len} tokens is out of reach: "
            f"{pairs} pairs of {triton.cdiv(seq_len, SMALLEST_BLOCK)} blocks of "
            f"{SMALLEST_BLOCK} rows exceed a CUDA grid's {MAX_PROGRAMS} programs (2^31 - 1); "
            f"split the batch"
        )


def kernel_launch(name: str, blocks: Blocks | None, seq_len: int, pairs: int):
    """(kernel, grid, launch keywords) for kernel ``name`` over ``pairs`` (batch x head)
    pairs: the fixed ``blocks`` when given, else (None or `AUTOTUNED`) the autotuner."""
    per_program = "BLOCK_N" if name == "backward_kv" else "BLOCK_M"
    if blocks is None or blocks == AUTOTUNED:

        def grid(meta):
            return attention_grid(seq_len, meta[per_program], pairs)

        return TUNED[name], grid, {"PACK": 1}
    rows, cols = getattr(blocks, name)
    pack = pack_for(blocks.pack, pairs)
    grid = attention_grid(seq_len, cols if name == "backward_kv" else rows, pairs // pack)
    keywords = {"BLOCK_M": rows, "BLOCK_N": cols, "PACK": pack}
    if not INTERPRETED:
        keywords.update(num_warps=blocks.warps, num_stages=blocks.stages)
    return KERNELS[name], grid, keywords


__all__ = [
    "AUTOTUNED", "BENCHMARKS", "INTERPRETER_CONFIGS", "benchmark",
    "BACKWARD_KV_CONFIGS", "BACKWARD_Q_CONFIGS", "FLOAT32_BLOCKS", "FORWARD_CONFIGS",
    "INTERPRETER_ROWS", "MAX_PROGRAMS", "PREPROCESS_ROWS", "SMALLEST_BLOCK", "TUNED",
    "TUNING_KEY", "Blocks", "attention_grid", "check_shape", "interpreter_blocks",
    "kernel_launch", "pack_for",
]  # fmt: skip
