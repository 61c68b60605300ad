"""Exact resume with multi-token prediction, at PP 2 DP 2 with FSDP2 sharding the MTP layers
and `ShardedAdamW` their state: a run resumed from its step-1 checkpoint gives the
uninterrupted run's losses, each depth's MTP loss and accuracy, and final checkpoint, bit
for bit (the MTP layers, their router's bias and the weight's step schedule are training
state like the rest). The stop itself (SIGTERM's checkpoint at a step's end, at DP 2 with
FSDP2) is `tests/test_train.py::test_exact_resume_after_sigterm`'s; this file held a DP 1
SIGTERM case of its own before (docs/testing.md)."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

from optimized.train import chunks
from tests.test_train import config, train

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _mtp(path) -> list[tuple]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [(r["step"], r["loss"], r["mtp_loss"], r["mtp_accuracy"]) for r in rows]


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


def test_resume_is_exact_with_mtp_under_fsdp(tmp_path):
    """Resumed from the uninterrupted run's own step-1 checkpoint (the sharded parameters,
    the sharded AdamW state and the MTP router's bias read back at this layout, then a whole
    optimizer step taken on them) == its step 2, bit for bit: the loss, each depth's MTP
    loss and accuracy, and every tensor of the step-2 checkpoint (the MTP layers' included:
    the last step's update shows in no loss, only there). Two launches. The trainer's own
    runner, the optimized stack (its loss stage gathers the output layer through
    ``fused_loss``)."""
    whole_dir, whole_metrics = tmp_path / "whole", tmp_path / "whole.jsonl"
    whole = train(config(*FSDP, f"checkpoint.dir={whole_dir}", "checkpoint.save_every=1",
                         "checkpoint.keep_last=0",
                         f"logging.metrics_file={whole_metrics}"))[0]  # fmt: skip
    folder, metrics = tmp_path / "run", tmp_path / "run.jsonl"
    shutil.copytree(whole_dir, folder)
    shutil.rmtree(folder / "step-00000002")
    resumed = train(config(*FSDP, f"checkpoint.dir={folder}",
                           f"logging.metrics_file={metrics}"))[0]  # fmt: skip
    assert resumed["start"] == 1
    assert resumed["losses"] == whole["losses"][1:]
    assert _mtp(metrics) == _mtp(whole_metrics)[1:]
    assert all(len(row[2]) == 2 for row in _mtp(whole_metrics))
    got, want = (_tensors(f / "step-00000002") for f in (folder, whole_dir))
    assert got.keys() == want.keys()
    for depth in (4, 5):  # the MTP layers (tiny-deepseek-v3 has 4): weights, state, bias
        layer = f"model.layers.{depth}"
        for key in ("eh_proj.weight", "mlp.experts.down_proj", "shared_head.norm.weight"):
            assert f"model.{layer}.{key}" in want and f"optim.{layer}.{key}.exp_avg_sq" in want
        assert want[f"model.{layer}.mlp.gate.e_score_correction_bias"].abs().max() > 0
    for key in want:
        assert torch.equal(got[key], want[key]), key
