"""Every autotuned kernel tuned before the first scheduled step, its choices kept on disk.

Why. Triton's autotuner times its candidate configurations the first time it meets a key
(sequence length, window, head widths, dtypes), and timing synchronises the device. Inside
a DualPipeV step that is a hang on NCCL (`models.runtime.device_sync`). So a rank tunes,
before its first step, every attention key its own layers will meet, on dummy tensors of
its own shapes (micro-batch size, sequence length, heads, widths, window, sinks, dtype):
`pretune`. The same pass compiles those kernels. The choices go to a JSON file
(`TuningCache`) that the next run of the same device and Triton loads instead of timing,
so the measured steps run exactly what was tuned; a key missing from the file is tuned and
added. Inside a step the autotuners refuse to time anything
(`optimized.ops.attention_blocks.benchmark`).

The kernels that are compiled but not tuned (cross-entropy, the grouped GEMM's zero-tail
kernel, activations) are launched once before the step by `optimized.ops.precompile`.

On the interpreter the attention kernels run one fixed block unless asked for the
autotuner (``OptimizedOps.attention_blocks = AUTOTUNED``): `pretune` then tunes there too
(the tests), and otherwise has nothing to do.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

from models.network import GroupedQueryAttention, MultiHeadLatentAttention
from optimized.ops._triton import INTERPRETED, triton
from optimized.ops.attention import flash_attention
from optimized.ops.attention_blocks import AUTOTUNED, BENCHMARKS, TUNED
from optimized.ops.optimized_ops import OptimizedOps

CACHE_VERSION = 1


class AttentionKey(NamedTuple):
    """What one attention call's tuning depends on (and the dummy tensors' shapes)."""

    batch: int
    heads: int
    kv_heads: int
    seq_len: int
    qk_dim: int
    v_dim: int
    window: int | None
    sinks: bool
    dtype: str
    """``bfloat16`` or ``float32``."""


def attention_keys(part: torch.nn.Module, micro_batch_size: int, seq_len: int) -> list:
    """The distinct `AttentionKey` of every attention layer in ``part`` (this rank's)."""
    dtype = str(next(part.parameters()).dtype).removeprefix("torch.")
    keys = set()
    for module in part.modules():
        if isinstance(module, GroupedQueryAttention):
            keys.add(AttentionKey(
                micro_batch_size, module.num_heads, module.num_kv_heads, seq_len,
                module.head_dim, module.head_dim, module.window, module.has_sinks, dtype,
            ))  # fmt: skip
        elif isinstance(module, MultiHeadLatentAttention):
            keys.add(AttentionKey(
                micro_batch_size, module.num_heads, module.num_heads, seq_len,
                module.nope + module.rope, module.v_dim, None, False, dtype,
            ))  # fmt: skip
    return sorted(keys, key=repr)


def run_attention_key(key: AttentionKey, device: torch.device, blocks) -> None:
    """Forward and backward of one key on dummy tensors (compiles; tunes where asked)."""
    dtype = getattr(torch, key.dtype)
    generator = torch.Generator().manual_seed(0)

    def dummy(*shape: int) -> torch.Tensor:
        values = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
        return values.requires_grad_()

    q = dummy(key.batch, key.heads, key.seq_len, key.qk_dim)
    k = dummy(key.batch, key.kv_heads, key.seq_len, key.qk_dim)
    v = dummy(key.batch, key.kv_heads, key.seq_len, key.v_dim)
    sinks = dummy(key.heads).float().detach().requires_grad_() if key.sinks else None
    out = flash_attention(q, k, v, key.qk_dim**-0.5, key.window, sinks, blocks=blocks)
    out.backward(torch.ones_like(out))


class TuningCache:
    """The autotuners' choices in one JSON file: ``{"version", "device", "triton",
    "kernels": {name: [{"key": [...], "config": {...}}]}}``. A file written for another
    device or Triton is not loaded (its timings say nothing here)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    @staticmethod
    def _where() -> dict[str, str]:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() and not INTERPRETED \
            else "interpreter"  # fmt: skip
        return {"device": device, "triton": triton.__version__}

    def load(self) -> int:
        """Install the file's choices into the autotuners; how many (0: no usable file)."""
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return 0
        if data.get("version") != CACHE_VERSION or {k: data.get(k) for k in self._where()} != (
            self._where()
        ):
            return 0
        loaded = 0
        for name, entries in data.get("kernels", {}).items():
            tuner = TUNED.get(name)
            if tuner is None:
                continue
            for entry in entries:
                config = entry["config"]
                tuner.cache[tuple(entry["key"])] = triton.Config(
                    config["kwargs"], num_warps=config["num_warps"],
                    num_stages=config["num_stages"],
                )  # fmt: skip
                loaded += 1
        return loaded

    def save(self) -> int:
        """Write every autotuner's choices (atomically); how many."""
        kernels: dict[str, list[dict[str, Any]]] = {}
        for name, tuner in TUNED.items():
            kernels[name] = [
                {"key": list(key), "config": {"kwargs": dict(config.kwargs),
                 "num_warps": config.num_warps, "num_stages": config.num_stages}}
                for key, config in sorted(tuner.cache.items(), key=lambda item: repr(item[0]))
            ]  # fmt: skip
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"version": CACHE_VERSION, **self._where(), "kernels": kernels}
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(temporary, self.path)
        return sum(len(entries) for entries in kernels.values())


def cache_path(folder: str | os.PathLike, rank: int) -> Path:
    """Where rank ``rank`` keeps its choices under a run's ``folder``."""
    return Path(folder) / "tuning" / f"rank{rank}.json"


def pretune(
    part: torch.nn.Module,
    micro_batch_size: int,
    seq_len: int,
    cache: TuningCache | None = None,
    blocks=None,
) -> dict[str, Any]:
    """Tune (and compile) every attention key of ``part`` before the first step, loading and
    then saving ``cache`` when given. ``blocks``: the ops' launch choice (default
    ``OptimizedOps.attention_blocks``). Returns what it did: ``keys``, ``loaded`` (choices
    read from the cache), ``benchmarks`` (configurations timed now), ``seconds``,
    ``skipped`` (the interpreter's fixed blocks: nothing to tune or compile)."""
    blocks = OptimizedOps.attention_blocks if blocks is None else blocks
    keys = attention_keys(part, micro_batch_size, seq_len)
    report = {"keys": len(keys), "loaded": 0, "benchmarks": 0, "seconds": 0.0,
              "skipped": INTERPRETED and blocks != AUTOTUNED}  # fmt: skip
    if report["skipped"] or not keys:
        return report
    began, timed = time.perf_counter(), sum(BENCHMARKS.values())
    if cache is not None:
        report["loaded"] = cache.load()
    device = next(part.parameters()).device
    for key in keys:
        run_attention_key(key, device, blocks)
    report["benchmarks"] = sum(BENCHMARKS.values()) - timed
    if cache is not None:
        cache.save()
    report["seconds"] = round(time.perf_counter() - began, 3)
    return report
