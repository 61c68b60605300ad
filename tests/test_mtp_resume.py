"""Exact resume with multi-token prediction: a run stopped by SIGTERM after step 1 and
resumed to step 3 gives the uninterrupted run's losses and each depth's MTP loss and
accuracy, bit for bit (the MTP layers, their router's bias and the weight's step schedule
are training state like the rest): at one process, and at PP 2 DP 2 with FSDP2 sharding the
MTP layers and `ShardedAdamW` their state, where the final checkpoints are equal too."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from optimized.train import chunks
from tests.test_train import config, train

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

MTP = ("model.name=tiny-deepseek-v3", "mtp.layers=2", "mtp.loss_coef=0.3",
       "mtp.loss_coef_steps=3:0.1", "steps=3")  # fmt: skip


def _mtp(path) -> list[tuple]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [(r["step"], r["loss"], r["mtp_loss"], r["mtp_accuracy"]) for r in rows]


def test_resume_is_exact_with_mtp(tmp_path, monkeypatch):
    whole = train(config(*MTP, f"logging.metrics_file={tmp_path / 'whole.jsonl'}"))[0]
    folder, metrics = tmp_path / "run", tmp_path / "run.jsonl"
    cfg = config(*MTP, f"checkpoint.dir={folder}", f"logging.metrics_file={metrics}")
    monkeypatch.setenv("TWINPIPE_FAULT", "sigterm@0:0")
    first = train(cfg)[0]
    assert first["stopped_at"] == 1
    monkeypatch.delenv("TWINPIPE_FAULT")
    second = train(cfg)[0]
    assert second["start"] == 1
    assert first["losses"] + second["losses"] == whole["losses"]
    assert _mtp(metrics) == _mtp(tmp_path / "whole.jsonl")
    assert all(len(row[2]) == 2 for row in _mtp(metrics))


FSDP = ("model.name=tiny-deepseek-v3", "mtp.layers=2", "mtp.loss_coef=0.3",
        "mtp.loss_coef_steps=2:0.1", "steps=2", "parallel.pp=2", "parallel.dp=2",
        "parallel.ep=1", "parallel.fsdp=true", "data.micro_batches=4")  # fmt: skip
"""PP 2 DP 2 EP 1, FSDP2 on: every MTP unit sharded over DP, its routed experts over their
2 replicas; the weight's change at step 2 falls in the resumed part."""


def _tensors(folder) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint holds (parameters, expert biases, AdamW state), whole."""
    reader = chunks.CachedReader(folder)
    out = {}
    for key, meta in chunks.tensor_metadata(reader.read_metadata()).items():
        out[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            chunks.load({key: chunks.rows(out[key], 0, tuple(meta.size))}, reader=reader,
                        collective=False)  # fmt: skip
    return out


def test_resume_is_exact_with_mtp_under_fsdp(tmp_path, monkeypatch):
    """Stopped by SIGTERM after step 1 and resumed (the sharded parameters, the sharded AdamW
    state and the MTP router's bias read back at this layout, then a whole optimizer step
    taken on them) == 2 uninterrupted steps, bit for bit: the losses, each depth's MTP loss
    and accuracy, and every tensor of the final checkpoint (the MTP layers' included: the
    last step's update shows in no loss, only there). The trainer's own runner, the
    optimized stack (its loss stage gathers the output layer through ``fused_loss``)."""
    whole_dir = tmp_path / "whole"
    whole = train(config(*FSDP, f"checkpoint.dir={whole_dir}",
                         f"logging.metrics_file={tmp_path / 'whole.jsonl'}"))[0]  # fmt: skip
    folder, metrics = tmp_path / "run", tmp_path / "run.jsonl"
    cfg = config(*FSDP, f"checkpoint.dir={folder}", f"logging.metrics_file={metrics}")
    monkeypatch.setenv("TWINPIPE_FAULT", "sigterm@0:0")
    first = train(cfg)[0]
    assert first["stopped_at"] == 1
    monkeypatch.delenv("TWINPIPE_FAULT")
    second = train(cfg)[0]
    assert second["start"] == 1
    assert first["losses"] + second["losses"] == whole["losses"]
    assert _mtp(metrics) == _mtp(tmp_path / "whole.jsonl")
    assert all(len(row[2]) == 2 for row in _mtp(metrics))
    got, want = (_tensors(f / "step-00000002") for f in (folder, whole_dir))
    assert got.keys() == want.keys()
    for depth in (4, 5):  # the MTP layers (tiny-deepseek-v3 has 4): weights, state, bias
        layer = f"model.layers.{depth}"
        for key in ("eh_proj.weight", "mlp.experts.down_proj", "shared_head.norm.weight"):
            assert f"model.{layer}.{key}" in want and f"optim.{layer}.{key}.exp_avg_sq" in want
        assert want[f"model.{layer}.mlp.gate.e_score_correction_bias"].abs().max() > 0
    for key in want:
        assert torch.equal(got[key], want[key]), key
