"""`twinpipe train`'s TFLOP/s and MFU (log line, metrics file) and ``--profile DIR``: a
Chrome trace and a table of the top ops per rank, of the chosen steps.

The ranks run the reference stack's runner through the trainer's one seam, as in
tests/test_train.py: the trainer around it is the same code."""

from __future__ import annotations

import json

import pytest
import torch

from models.network import preset
from models.runtime import launch
from optimized.estimator.flops import training_flops
from optimized.train import TrainConfig, apply_overrides, validate_config
from optimized.train.cli import _rank_main
from optimized.train.metrics import StepMetrics, Throughput
from optimized.train.profiling import parse_steps
from tests.test_train import _reference_runner  # noqa: F401  (the trainer on the reference)


def config(*overrides: str) -> TrainConfig:
    base = [
        "model.name=tiny-qwen3-moe", "data.seq_len=16", "data.micro_batch_size=1",
        "data.micro_batches=2", "steps=3", "optim.warmup_steps=1",
    ]  # fmt: skip
    return validate_config(apply_overrides(TrainConfig(), base + list(overrides)))


@pytest.mark.slow
def test_profile_and_throughput_of_a_real_run(tmp_path):
    profile, metrics = tmp_path / "profile", tmp_path / "m.jsonl"
    cfg = config("parallel.dp=2", f"logging.profile_dir={profile}",
                 f"logging.metrics_file={metrics}")  # fmt: skip
    launch(_rank_main, 2, (cfg,))
    # Each rank: a Chrome trace of steps 2 and 3 (the default: the run's first step warms
    # up), and the table of its top host ops (no device section on CPU ranks).
    assert sorted(p.name for p in profile.iterdir()) == [
        "rank0.top_ops.md", "rank0.trace.json", "rank1.top_ops.md", "rank1.trace.json",
    ]  # fmt: skip
    for rank in (0, 1):
        trace = json.loads((profile / f"rank{rank}.trace.json").read_text())
        names = {event.get("name") for event in trace["traceEvents"]}
        assert {"step 2", "step 3", "aten::mm"} <= names and "step 1" not in names
        table = (profile / f"rank{rank}.top_ops.md").read_text()
        assert table.startswith(f"# Top ops: rank {rank}, steps 2-3\n")
        assert "## Host ops by self CPU time" in table and "Device kernels" not in table
        rows = [line for line in table.splitlines() if line.startswith("| `")]
        assert 5 <= len(rows) <= 25 and any("| `aten::mm` |" in row for row in rows)
    # TFLOP/s per device from the config's FLOPs per token (the reference runner does not
    # recompute attention), no MFU without a peak.
    per_token = training_flops(preset("tiny-qwen3-moe"), 16, recompute=False).model
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert record["model_flops_per_token"] == per_token
        expected = record["tokens_per_second"] * per_token / 2 / 1e12
        assert record["tflops"] == pytest.approx(expected, rel=1e-12)
        assert record["hardware_tflops"] == record["tflops"]
        assert record["mfu"] is None and record["hfu"] is None and record["peak_tflops"] is None


def test_log_line_shows_tflops_and_mfu():
    base = dict(step=1, steps=2, step_time_s=0.5, loss=5.25, learning_rate=1e-3,
                gradient_norm=1.0, tokens_per_second=100.0, peak_memory_bytes=10,
                peak_memory_source="max-rss")  # fmt: skip
    assert "tflops" not in StepMetrics(**base).line()
    cpu = StepMetrics(**base, tflops=0.000421).line()
    assert "| tflops-per-device 0.000421 | peak-memory" in cpu and "mfu" not in cpu
    gpu = StepMetrics(**base, tflops=157.24, mfu=0.159).line()
    assert "| tflops-per-device 157.2 | mfu 15.9% | peak-memory" in gpu


def test_mfu_against_a_given_peak_and_none_on_the_cpu():
    model = preset("mid-deepseek-v2")
    cfg = config("data.seq_len=4096", "data.micro_batches=4")
    cpu = Throughput.of(cfg, model, torch.device("cpu"), recompute=True)
    assert cpu.peak is None and "no MFU" in cpu.describe()
    figures = cpu.figures(60_000.0)
    assert figures["mfu"] is None and figures["hfu"] is None
    # GPU.md's step: about 2.62 GFLOP per token at 60 K tokens/s is about 157 TFLOP/s.
    assert figures["tflops"] == pytest.approx(157.5, abs=0.1)
    assert figures["hardware_tflops"] > figures["tflops"]
    given = Throughput.of(config("data.seq_len=4096", "logging.peak_tflops=989.4"), model,
                          torch.device("cpu"), recompute=True)  # fmt: skip
    figures = given.figures(60_000.0)
    assert figures["mfu"] == pytest.approx(figures["tflops"] / 989.4)
    assert figures["hfu"] == pytest.approx(figures["hardware_tflops"] / 989.4)


def test_profile_steps():
    assert parse_steps(None, 0, 100) == range(2, 4)
    assert parse_steps(None, 10, 100) == range(12, 14)  # a resumed run skips its own first
    assert parse_steps(None, 0, 2) == range(1, 3) and parse_steps(None, 0, 1) == range(1, 2)
    assert parse_steps("5", 0, 9) == range(5, 6) and parse_steps("3-7", 0, 9) == range(3, 8)
    for bad in ("0", "4-2", "8-12", "x", "1,2"):
        with pytest.raises(ValueError, match=f"logging.profile_steps = '{bad}' is invalid"):
            parse_steps(bad, 0, 9)
    with pytest.raises(ValueError, match="logging.profile_steps = '5-9' is invalid"):
        config("logging.profile_steps=5-9")
    with pytest.raises(ValueError, match="logging.peak_tflops = -1.0 is invalid"):
        config("logging.peak_tflops=-1")
