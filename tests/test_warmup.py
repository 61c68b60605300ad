"""Before the first step (`models.runtime.warmup`, `optimized.train.startup`): every
communicator up on gloo, its calls counted apart from the steps'; phase limits that name the
phase that ran out; the timeouts' flags checked before any rank starts."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
import torch

from models.runtime import (
    CommunicationCounter,
    ParallelConfig,
    PhaseTimeout,
    by_kind,
    group_names,
    launch,
    make_layout,
    phase_limit,
    rank_device,
    tighten,
    warm_up,
)
from optimized.train import apply_overrides, validate_config
from optimized.train.phases import PhasePeaks
from tests._cli import REFERENCE_RUNNER, twinpipe
from tests.test_train import config, train


def _cli(*args: str) -> subprocess.CompletedProcess:
    """``twinpipe train ARGS`` in a subprocess, the reference runner for speed."""
    return twinpipe("train", *args, TWINPIPE_RUNNER=REFERENCE_RUNNER)


def _warm_rank() -> dict:
    layout = make_layout(ParallelConfig(pp=2, dp=2, ep=2, micro_batches=4))
    counter = CommunicationCounter(group_names(layout)).install()
    try:
        counter.start()
        done = warm_up(layout, rank_device())
        warm = by_kind(counter.stop())
        counter.start()
        after = by_kind(counter.stop())
    finally:
        counter.remove()
    tighten(layout, 30.0)
    return {"done": done, "warm": warm, "after": after, "pp_rank": layout.pp_rank}


@pytest.mark.slow
def test_warm_up_calls_every_group_and_stream_once_counted_apart():
    """PP 2 x DP 2, EP 2 on gloo: one all-reduce on each group (the world, PP, DP, EP, the
    expert replicas, the host group: on gloo the world), one message on each stream in its
    direction; nothing counted after it."""
    for result in launch(_warm_rank, 4, ()):
        done, warm = result["done"], result["warm"]
        assert done["collectives"] == ["world", "pp", "dp", "ep", "expert_replica", "host"]
        assert done["streams"] == ["forward0", "forward1", "backward0", "backward1"]
        groups = warm["all_reduce"]["groups"]
        assert {name: figures["calls"] for name, figures in groups.items()} == {
            "world": 2, "pp": 1, "dp": 1, "ep": 1, "expert_replica": 1,
        }  # fmt: skip
        sends = {"forward0", "backward1"} if result["pp_rank"] == 0 else {"forward1", "backward0"}
        receives = {"forward0", "forward1", "backward0", "backward1"} - sends
        assert {g: f["calls"] for g, f in warm["send"]["groups"].items()} == dict.fromkeys(sends, 1)
        assert {g: f["calls"] for g, f in warm["recv"]["groups"].items()} == dict.fromkeys(
            receives, 1
        )
        assert result["after"] == {}


@pytest.mark.slow
def test_the_step_traffic_holds_no_warm_up(tmp_path):
    """A PP 2 training run: step 1's counted traffic is step 2's (the warm-up ran before the
    counter), and the warm-up's peak is kept apart from the steps'."""
    metrics = tmp_path / "m.jsonl"
    cfg = config("parallel.pp=2", "steps=2", "data.micro_batches=4",
                 f"logging.metrics_file={metrics}")  # fmt: skip
    result = train(cfg)[0]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    traffic = [record["communication_bytes"] for record in records]
    assert len(traffic) == 2 and traffic[0] and traffic[0] == traffic[1], traffic
    assert all("warm-up" in peaks for peaks in result["memory_peaks"])


def test_a_phase_past_its_limit_names_the_phase():
    with pytest.raises(PhaseTimeout, match=r"phase 'tune' ran past its limit of 0.05 s"):
        with phase_limit("tune", 0.05):
            time.sleep(5)


@pytest.mark.slow
def test_train_setup_timeout_trips_at_load_with_exit_3():
    """A tiny ``--setup-timeout``: the load runs out, the error names it, exit 3 (a crash)."""
    done = _cli(
        "--model", "tiny-deepseek-v2", "--seq-len", "16", "--micro-batch-size", "1",
        "--micro-batches", "2", "--steps", "1", "--nproc", "1", "--setup-timeout", "0.001",
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert "phase 'load' ran past its limit of 0.001 s (--setup-timeout sets it)" in done.stderr


@pytest.mark.parametrize("key", ["timeout", "setup_timeout"])
def test_bad_timeouts_are_refused(key):
    with pytest.raises(ValueError, match=rf"{key} = 0.0 is invalid: must be a finite number"):
        validate_config(apply_overrides(config(), [f"{key}=0"]))


def _phase_peaks(counted: bool) -> tuple[int, int] | None:
    """The warm-up phase's peak and the run's, or None where the kernel cannot reset the
    high-water mark."""
    peaks = PhasePeaks(torch.device("cpu"))
    peaks.begin(counted=counted)
    held = torch.ones(64 * 2**20 // 4)  # 64 MiB touched in the warm-up
    held.add_(1)
    peaks.end("warm-up")
    del held
    peaks.begin()
    torch.ones(2**16).sum()
    peaks.end("train")
    return (peaks.peaks["warm-up"], peaks.lifetime()) if peaks.resettable else None


def _both_phase_peaks() -> list[tuple[int, int] | None]:
    return [_phase_peaks(False), _phase_peaks(True)]


def test_warm_up_is_no_steps_peak():
    """`PhasePeaks` on the CPU (resident-set high-water mark): a phase begun with
    ``counted=False`` stays out of the run's peak; counted, the same phase is in it.

    In one fresh rank process: a pytest worker's resident set moves with what earlier tests
    left running in it (threads, the allocator's arenas), which is no phase's."""
    from models.runtime import launch  # noqa: PLC0415

    uncounted, counted = launch(_both_phase_peaks, 1, (), device="cpu")[0]
    if uncounted is None or counted is None:
        pytest.skip("this kernel does not let a process reset its high-water mark")
    slack = 2**20  # the kernel folds a thread's resident-set counters into VmHWM lazily
    warm, lifetime = uncounted
    assert lifetime < warm - 32 * 2**20, (lifetime, warm)
    warm, lifetime = counted
    assert lifetime >= warm - slack, (lifetime, warm)


def test_the_trackers_step_peak_excludes_a_warm_up_allocation():
    """What the warm-up allocates and frees before the step (the autotuner's cache-flush
    buffer, 256 MiB on a GPU; 8 MiB here) is no part of the step's peak; the same buffer
    inside a step is (the control)."""
    from harness.memory import MemoryTracker  # noqa: PLC0415

    size = 8 * 2**20

    def warm_up_buffer() -> None:
        torch.empty(size, dtype=torch.uint8).fill_(1)

    tracker = MemoryTracker("cpu")
    warm_up_buffer()
    with tracker.step():
        torch.ones(2**16).sum()
    assert tracker.peak_bytes < size // 4, tracker.peak_bytes
    with tracker.step():
        warm_up_buffer()
    assert tracker.peak_bytes >= size, tracker.peak_bytes
