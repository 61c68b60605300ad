"""`twinpipe train --z-loss --label-smoothing`: the optimized stack's objective, logged.

The trainer's first step with both options on is held against the same objective
computed in float64 on a single-process model from the same weights and batch; the log
line and the metrics record carry the z-loss, through the CLI at two ranks too; the
reference stack, which computes plain cross-entropy only, refuses the options by name.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F

from models.hf import resolve_model
from models.network import IGNORE_INDEX, build_model
from models.runtime import BadInput, launch
from optimized.data.loader import TokenDataset, TokenLoader
from optimized.data.preparation import default_dataset
from optimized.train import TrainConfig, apply_overrides, validate_config
from optimized.train.cli import _rank_main
from optimized.train.metrics import StepMetrics
from optimized.train.objective import objective_options
from optimized.train.preflight import plan_run
from optimized.train.trainer import runner_class
from reference.ops import ReferenceOps
from tests._cli import twinpipe

Z_LOSS, LABEL_SMOOTHING = 1e-2, 0.1


def config(*overrides: str) -> TrainConfig:
    base = [
        "model.name=tiny-deepseek-v2", "data.seq_len=16", "data.micro_batch_size=1",
        "data.micro_batches=2", "steps=1", "optim.warmup_steps=1",
        f"loss.z_loss={Z_LOSS}", f"loss.label_smoothing={LABEL_SMOOTHING}",
    ]  # fmt: skip
    return validate_config(apply_overrides(TrainConfig(), base + list(overrides)))


def float64_objective(cfg: TrainConfig) -> tuple[float, float]:
    """``(loss, z_loss)`` of the first step's batch on the initial weights, in float64."""
    data = cfg.data
    loader = TokenLoader(
        TokenDataset(cfg.data.path or default_dataset(), data.seq_len), data.micro_batches,
        data.micro_batch_size, 0, 1, cfg.seed, data.shuffle,
    )  # fmt: skip
    batch = next(loader)
    ids = batch.inputs.reshape(-1, data.seq_len)
    labels = batch.labels.reshape(-1)
    model = build_model(resolve_model(cfg.model.name), ReferenceOps(), seed=cfg.seed).double()
    with torch.no_grad():
        logits = model(ids).reshape(labels.numel(), -1)
    valid = labels != IGNORE_INDEX
    rows = F.cross_entropy(
        logits, labels, ignore_index=IGNORE_INDEX, reduction="none",
        label_smoothing=cfg.loss.label_smoothing,
    )  # fmt: skip
    z_loss = cfg.loss.z_loss * torch.logsumexp(logits, dim=-1).square() * valid
    count = valid.sum().clamp(min=1)
    return float((rows + z_loss).sum() / count), float(z_loss.sum() / count)


@pytest.mark.slow
def test_first_step_objective_matches_float64(tmp_path, monkeypatch):
    monkeypatch.delenv("TWINPIPE_RUNNER", raising=False)  # the optimized stack
    cfg = config(f"logging.metrics_file={tmp_path / 'metrics.jsonl'}")
    losses = launch(_rank_main, 1, (cfg,))[0]["losses"]
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    expected_loss, expected_z_loss = float64_objective(cfg)
    assert abs(losses[0] - expected_loss) <= 1e-5 * expected_loss
    assert record["loss"] == losses[0]
    assert abs(record["z_loss"] - expected_z_loss) <= 1e-5 * expected_z_loss
    plain = float64_objective(config("loss.z_loss=0", "loss.label_smoothing=0"))[0]
    assert abs(losses[0] - plain) > 1e-3 * plain  # the options changed the objective


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_options_through_the_cli_at_two_ranks(tmp_path):
    """`twinpipe train --z-loss --label-smoothing` at PP=2 logs and records the objective of
    the same batch on one process in float64: every layout prints the same figures."""
    metrics = tmp_path / "metrics.jsonl"
    done = twinpipe(
        "train", "--pp", "2", "--seq-len", "16", "--micro-batch-size", "1",
        "--micro-batches", "4", "--steps", "1", "--warmup-steps", "1",
        "--z-loss", str(Z_LOSS), "--label-smoothing", str(LABEL_SMOOTHING),
        "--metrics-file", str(metrics), TWINPIPE_RUNNER=None,  # the optimized stack
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    expected_loss, expected_z_loss = float64_objective(config("data.micro_batches=4"))
    (record,) = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert abs(record["loss"] - expected_loss) <= 1e-5 * expected_loss
    assert abs(record["z_loss"] - expected_z_loss) <= 1e-5 * expected_z_loss
    # The log line: the cross-entropy part (4 decimals) and the z-loss (5 digits), as printed.
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("step 00000001/")]
    printed = re.search(r"cross-entropy-loss (\S+) \| z-loss (\S+) \|", line)
    assert printed, line
    cross_entropy, z_loss = float(printed[1]), float(printed[2])
    assert abs(cross_entropy - (expected_loss - expected_z_loss)) <= 5e-5 + 1e-5 * expected_loss
    assert abs(z_loss - expected_z_loss) <= 6e-5 * expected_z_loss


def test_log_line_shows_the_z_loss_only_when_on():
    base = dict(step=1, steps=2, step_time_s=0.5, loss=5.25, learning_rate=1e-3,
                gradient_norm=1.0, tokens_per_second=100.0, peak_memory_bytes=10,
                peak_memory_source="max-rss")  # fmt: skip
    assert "z-loss" not in StepMetrics(**base).line()
    line = StepMetrics(**base, z_loss=0.25).line()
    assert "cross-entropy-loss 5.0000 | z-loss 2.5000e-01 |" in line


def test_reference_runner_refuses_the_options_before_any_rank_starts(monkeypatch):
    monkeypatch.setenv("TWINPIPE_RUNNER", "reference.pipeline:ReferencePipeline")
    plain = config("loss.z_loss=0", "loss.label_smoothing=0")
    assert objective_options(plain, runner_class()) == {}
    with pytest.raises(BadInput, match="loss.z_loss = 0.01 and loss.label_smoothing = 0.1"):
        plan_run(config())  # the parent's checks: exit 2, nothing spawned


@pytest.mark.parametrize(
    ("override", "named"),
    [("loss.z_loss=-1", "loss.z_loss = -1.0 is invalid"),
     ("loss.label_smoothing=1", "loss.label_smoothing = 1.0 is invalid")],
)  # fmt: skip
def test_bad_values_name_the_field(override, named):
    with pytest.raises(ValueError, match=named):
        config(override)
