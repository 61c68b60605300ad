"""Exact resume with multi-token prediction: a run stopped by SIGTERM after step 1 and
resumed to step 3 gives the uninterrupted run's losses and each depth's MTP loss and
accuracy, bit for bit (the MTP layers, their router's bias and the weight's step schedule
are training state like the rest)."""

from __future__ import annotations

import json

import pytest

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
