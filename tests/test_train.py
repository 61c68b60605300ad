"""`twinpipe train`: loss falls, exact resume, layout-changing resume, faults, bad configs.

The ranks run the reference stack's runner through the trainer's one seam
(``TWINPIPE_RUNNER``): on CPU the optimized stack runs its Triton kernels through the
interpreter, about 50x slower, and the trainer around the runner is the same code.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.runtime import RankFailed, launch
from optimized.train import TrainConfig, apply_overrides, validate_config
from optimized.train.cli import _rank_main
from tests._cli import twinpipe_here

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_RUNNER = "reference.pipeline:ReferencePipeline"


@pytest.fixture(autouse=True)
def _reference_runner(monkeypatch):
    monkeypatch.setenv("TWINPIPE_RUNNER", REFERENCE_RUNNER)
    monkeypatch.delenv("TWINPIPE_FAULT", raising=False)


def config(*overrides: str) -> TrainConfig:
    base = [
        "model.name=tiny-deepseek-v2", "data.seq_len=16", "data.micro_batch_size=1",
        "data.micro_batches=2", "steps=6", "optim.warmup_steps=2", "optim.lr=3e-3",
        "optim.min_lr=3e-4",
    ]  # fmt: skip
    return validate_config(apply_overrides(TrainConfig(), base + list(overrides)))


def train(cfg: TrainConfig) -> list[dict]:
    return launch(_rank_main, cfg.parallel.world_size, (cfg,))


@pytest.mark.slow
def test_loss_falls_over_50_steps(tmp_path):
    cfg = config("steps=50", "optim.warmup_steps=5", f"logging.metrics_file={tmp_path / 'm.jsonl'}")
    losses = train(cfg)[0]["losses"]
    assert len(losses) == 50 and all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.0, (first, last)
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 51))
    assert records[-1]["loss"] == losses[-1]
    assert records[0]["peak_memory_source"] == "max-rss"


BIAS_ON = ("moe.expert_bias=true", "moe.expert_bias_rate=0.01", "moe.aux_loss=sequence",
           "moe.aux_loss_coef=0.01")  # fmt: skip
"""Balancing on: the expert bias (training state a resume must restore) and a loss."""


@pytest.mark.slow
@pytest.mark.parametrize(("ep", "moe"), [(1, ()), (2, BIAS_ON)], ids=["ep1", "ep2-expert-bias"])
def test_exact_resume_after_sigterm(tmp_path, monkeypatch, ep, moe):
    """2 steps, SIGTERM (checkpoint), resume to 4 == 4 uninterrupted steps, bit for bit,
    with parameters, gradients and optimizer state sharded by FSDP2 over DP (experts over
    EP; at EP=1 over their 2 replicas by FSDP2 too); and the same losses and gradient
    norms as unsharded, up to float32 rounding. With the expert bias on (EP=2: the case
    that was plain ``ep2`` before holds here, the bias on), every router's bias after the
    resumed run equals the uninterrupted run's, bit for bit (both saved at step 4)."""
    common = ("steps=4", "parallel.dp=2", f"parallel.ep={ep}", "parallel.fsdp=true", *moe)
    kept = [f"checkpoint.dir={tmp_path / 'whole'}"] if moe else []
    whole = train(config(*common, f"logging.metrics_file={tmp_path / 'm.jsonl'}", *kept))
    whole = whole[0]["losses"]
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    norms = [json.loads(x)["gradient_norm"] for x in lines]
    (tmp_path / "m.jsonl").unlink()
    folder = tmp_path / "run"
    cfg = config(*common, f"checkpoint.dir={folder}")
    monkeypatch.setenv("TWINPIPE_FAULT", "sigterm@1:1")
    first = train(cfg)[0]
    assert first["signal"] and first["stopped_at"] == 2
    assert sorted(p.name for p in folder.iterdir()) == ["run.json", "step-00000002"]
    monkeypatch.delenv("TWINPIPE_FAULT")
    second = train(cfg)[0]
    assert second["start"] == 2
    assert first["losses"] + second["losses"] == whole
    if moe:
        _assert_same_biases(tmp_path / "whole" / "step-00000004", folder / "step-00000004")
    # Sharding changes no loss and no gradient norm beyond float32 rounding. FSDP2 sums each
    # micro-batch's reduced gradient, unsharded runs reduce the summed ones: the first step
    # differs by that rounding only (rel <= 1e-6). AdamW then amplifies it where a gradient
    # is near its eps (an update of lr * g / (|g| + eps)): weights drift ~2e-6 apart after
    # one step, and at EP=2 step 3's gradient norm is 2.1e-6 apart (measured; the same
    # expert choices, replayed: no routing swap), so later steps are held to DESIGN.md's
    # float32 loss bound, 1e-5.
    metrics = tmp_path / "plain.jsonl"
    plain = train(config(*common[:3], "parallel.fsdp=false", *moe,
                         f"logging.metrics_file={metrics}"))  # fmt: skip
    plain_norms = [json.loads(x)["gradient_norm"] for x in metrics.read_text().splitlines()]
    pairs = zip(whole + norms, plain[0]["losses"] + plain_norms, strict=True)
    for index, (a, b) in enumerate(pairs):
        bound = 1e-6 if index % len(whole) == 0 else 1e-5
        assert abs(a - b) <= bound * abs(b), (whole, plain[0]["losses"], norms, plain_norms)


def _assert_same_biases(a: Path, b: Path) -> None:
    """Both checkpoints hold every MoE layer's expert bias, moved, and bit for bit equal."""
    from optimized.train.checkpoint_weights import TrainingCheckpointWeights

    sources = TrainingCheckpointWeights(a), TrainingCheckpointWeights(b)
    for layer in (1, 2, 3):  # tiny-deepseek-v2's MoE layers
        name = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
        biases = [torch.empty(8), torch.empty(8)]
        for source, bias in zip(sources, biases):
            source.fill(name, bias)
        assert torch.equal(biases[0], biases[1]) and biases[0].abs().max() > 0, (name, biases)


_ONE_RANK: dict = {}


def _one_rank_losses() -> list[float]:
    """Three steps of the global batch on one rank (both layout-changing resumes' truth)."""
    if not _ONE_RANK:
        _ONE_RANK["losses"] = train(config("data.micro_batches=8", "steps=3"))[0]["losses"]
    return _ONE_RANK["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("ep", [(2, 4), (1, 2)], ids=["ep2-ep4", "ep1-ep2"])
def test_resume_at_another_layout(tmp_path, monkeypatch, ep):
    """Saved at PP=2 DP=2 EP=2, resumed at PP=1 DP=4 EP=4 (and EP=1 then EP=2, where
    FSDP2 shards the experts over 2 replicas both times): the same global batches and
    the same losses, up to rounding, as one rank running all three steps."""
    before = ("parallel.pp=2", "parallel.dp=2", f"parallel.ep={ep[0]}", "data.micro_batches=4")
    after = ("parallel.pp=1", "parallel.dp=4", f"parallel.ep={ep[1]}", "data.micro_batches=2")
    whole = _one_rank_losses()
    monkeypatch.setenv("TWINPIPE_FAULT", "sigterm@0:0")
    saved = train(config(*before, "steps=3", f"checkpoint.dir={tmp_path}"))[0]
    assert saved["stopped_at"] == 1
    monkeypatch.delenv("TWINPIPE_FAULT")
    resumed = train(config(*after, "steps=3", f"checkpoint.dir={tmp_path}"))[0]
    assert resumed["start"] == 1
    got = saved["losses"] + resumed["losses"]
    for a, b in zip(got, whole, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (got, whole)


@pytest.mark.slow
def test_nonfinite_gradient_stops_naming_step_and_rank(monkeypatch):
    monkeypatch.setenv("TWINPIPE_FAULT", "nan-grad@1:1")
    with pytest.raises(RankFailed, match=r"non-finite gradient norm at step 2.*rank\(s\) \[1\]"):
        train(config("parallel.dp=2", "steps=3"))


@pytest.mark.slow
def test_skip_nonfinite_skips_the_step(monkeypatch):
    monkeypatch.setenv("TWINPIPE_FAULT", "nan-grad@1:1")
    losses = train(config("parallel.dp=2", "steps=3", "optim.skip_nonfinite=true"))[0]["losses"]
    assert losses[1] is None and all(math.isfinite(x) for x in (losses[0], losses[2]))


HANG_GUARD_S = 600
"""Subprocess timeouts catch a hang only; no test asserts how fast anything runs."""
CPU_RANKS = {"TWINPIPE_DEVICE": "cpu", "TRITON_INTERPRET": "1"}
"""The environment of ranks torchrun starts on the CPU (with ``--set device=cpu``): each
resolves its device itself (``auto`` takes a GPU per rank where there are enough) and
imports Triton in the mode it finds before reading its config (this process's own on a
GPU machine: compiled), so both are set for it."""


@pytest.mark.slow
def test_crashed_rank_ends_every_rank_with_its_error(capsys, monkeypatch):
    """The command's `main` in this process, launching its two ranks (the real command's
    exit 3 on a crashed rank is held by tests/test_reliability_runs.py and
    tests/test_train_nonfinite.py, and torchrun's by the next test)."""
    from harness.cli import main

    # A rank that never learned of the crash would block in gloo until the hang guard.
    monkeypatch.setenv("TWINPIPE_FAULT", "crash@1:1")
    code = main(["train", "--model", "tiny-deepseek-v2", "--seq-len", "16",
                 "--micro-batch-size", "1", "--micro-batches", "2", "--dp", "2", "--steps",
                 "50", "--nproc", "2"])  # fmt: skip
    assert code == 3  # a crash (#19): never 1, which means "outside tolerance"
    assert "rank 1 crashed at step 2" in capsys.readouterr().err


@pytest.mark.slow
def test_crashed_rank_under_torchrun_ends_every_rank_with_its_error():
    """Under torchrun the same fault ends the job: the peer blocked in a gloo collective
    sees the closed connection and raises, and torchrun names the crashed rank as the root
    cause. Measured 17.6 s for the whole run on 2 cores; the timeout only catches a hang."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0",
         "-m", "harness.cli", "train", "--model", "tiny-deepseek-v2", "--seq-len", "16",
         "--micro-batch-size", "1", "--micro-batches", "2", "--dp", "2", "--steps", "50",
         "--set", "device=cpu"],
        cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S,
        env={**os.environ, "TWINPIPE_RUNNER": REFERENCE_RUNNER, "TWINPIPE_FAULT": "crash@1:1",
             **CPU_RANKS},
    )  # fmt: skip
    assert done.returncode != 0
    assert "rank 1 crashed at step 2" in done.stderr
    assert "Root Cause" in done.stderr and "rank      : 1" in done.stderr


@pytest.mark.parametrize(
    "args, named",
    [
        (["--set", "optim.bogus=1"], "optim.bogus"),
        (["--set", "nonsense=3"], "nonsense"),
        (["--ep", "3", "--dp", "2"], "parallel.ep"),
        (["--micro-batches", "1", "--pp", "1"], "data.micro_batches"),
    ],
)
def test_bad_config_is_an_error_naming_the_key(args, named):
    """In this process (the command's own code, no interpreter to start: the subprocess
    path is held by the crash tests below and tests/test_binary_inputs.py)."""
    done = twinpipe_here("train", *args, "--print-config")
    assert done.returncode == 2 and named in done.stderr


def test_print_config_shows_the_resolved_config(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("steps = 17\n[optim]\nlr = 0.002\n")
    done = twinpipe_here("train", "--config", str(toml), "--set", "parallel.dp=2",
                         "--seq-len", "24", "--print-config")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "steps = 17" in done.stdout and "lr = 0.002" in done.stdout
    assert "dp = 2" in done.stdout and "seq_len = 24" in done.stdout


@pytest.mark.slow
def test_the_trainer_drives_the_optimized_pipeline(monkeypatch):
    """The production seam (`RUNNER`) runs the optimized stack: same losses as the
    reference runner within the optimized-vs-reference tolerance."""
    cfg = config("steps=2", "optim.warmup_steps=1")
    reference = train(cfg)[0]["losses"]
    monkeypatch.delenv("TWINPIPE_RUNNER")
    from optimized.train.trainer import runner_class

    assert runner_class().__name__ == "OptimizedPipeline"
    results = train(cfg)
    optimized = results[0]["losses"]
    # Every Triton kernel key of step 1 was launched before it (optimized.ops.precompile).
    assert [result["kernels_first_in_step"] for result in results] == [[]] * len(results)
    for a, b in zip(optimized, reference, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (optimized, reference)
