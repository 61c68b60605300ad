"""Autotuning happens before the first scheduled step and never inside one
(`optimized.ops.tuning`, `models.runtime.device_sync`): on the interpreter, with the
autotuner asked for (``OptimizedOps.attention_blocks = AUTOTUNED``), the real optimized
DualPipeV step at PP 2 (ranks as threads, `tests.test_p2p_order`'s NCCL model)."""

from __future__ import annotations

import json

import pytest
import torch

from models.runtime import SyncInStep, scheduled_step
from optimized.ops import OptimizedOps, flash_attention
from optimized.ops.attention_blocks import AUTOTUNED, BENCHMARKS, TUNED
from optimized.ops.tuning import TuningCache, attention_keys, cache_path, pretune
from tests._ranks import on_cpu_rank
from tests.test_p2p_order import (
    _batches,
    _config,
    _one_thread,
    build_schedules,
    run_pipeline,
    whole_model,
)


def _clear_tuners() -> dict:
    saved = {name: dict(tuner.cache) for name, tuner in TUNED.items()}
    for tuner in TUNED.values():
        tuner.cache.clear()
    return saved


def _restore(saved: dict) -> None:
    for name, tuner in TUNED.items():
        tuner.cache.clear()
        tuner.cache.update(saved[name])


def test_an_untuned_key_refuses_to_tune_inside_a_step():
    """The autotuner's timing is a device sync: inside a step it raises, naming it."""
    saved = _clear_tuners()
    try:
        q = torch.randn(1, 2, 16, 16)
        with scheduled_step(), pytest.raises(SyncInStep, match="autotuner timing"):
            flash_attention(q, q[:, :1], q[:, :1], 0.25, blocks=AUTOTUNED)
    finally:
        _restore(saved)


@pytest.mark.slow
def test_pretuned_step_runs_what_was_tuned(tmp_path):
    """Pre-tuned on each rank's part: the choices are written to the cache file; a fresh
    process state loads them (nothing timed) and the step runs with nothing timed in it (a
    configuration timed inside would be a device sync, which the NCCL model fails)."""
    on_cpu_rank(_pretuned_step, str(tmp_path))


@_one_thread()
def _pretuned_step(folder: str) -> None:
    pp = 2
    config = _config(pp)
    schedules = build_schedules("optimized", config, pp, whole_model(config).state_dict())
    batches = _batches(config, 2 * pp)
    micro_batch_size, seq_len = batches[0][0].shape
    saved = _clear_tuners()
    OptimizedOps.attention_blocks = AUTOTUNED
    try:
        for rank, schedule in enumerate(schedules):
            cache = TuningCache(cache_path(folder, rank))
            report = pretune(schedule.part, micro_batch_size, seq_len, cache)
            assert report["keys"] == len(attention_keys(schedule.part, 1, seq_len)) == 1
            assert report["benchmarks"] == (6 if rank == 0 else 0), report  # 2 configs x 3
            entries = json.loads(cache.path.read_text())["kernels"]
            assert sorted(entries) == ["backward_kv", "backward_q", "forward"]
            assert all(len(entries[name]) == 1 for name in entries), entries
        _clear_tuners()
        for rank, schedule in enumerate(schedules):
            report = pretune(schedule.part, micro_batch_size, seq_len,
                             TuningCache(cache_path(folder, rank)))  # fmt: skip
            assert report["loaded"] == 3 and report["benchmarks"] == 0, report
        timed = sum(BENCHMARKS.values())
        run_pipeline(schedules, batches, "dualpipev")
        assert sum(BENCHMARKS.values()) == timed
    finally:
        OptimizedOps.attention_blocks = None
        _restore(saved)
