"""Binary files where a text file is read, outside the harness: exit 2 naming the file and
what it should hold, before any rank starts; never a decoding traceback (exit 3).

Each reader gets real binary bytes (a PNG header, random bytes, bytes that are not
UTF-8) and is run by the command's own code: ``python -m harness.cli ...`` in a subprocess
for the TOML config (the whole process's path: no traceback from the interpreter either),
`harness.cli.main` in this process for the rest (`tests._cli.twinpipe_here`, which fails a
command that reaches a rank):
train configs (``--config`` TOML; a model config JSON by ``--model``, ``--set`` and
``estimate --model``), a Hugging Face checkpoint's index, a prepared data folder's
sidecar, a tokenizer.json, an existing metrics file (read back on resume: it was a
traceback from inside rank 0), and a training checkpoint's ``run.json``, ``manifest.json``
and ``config.json``. (prepare-data's own inputs, skipped as binary, are
tests/test_reliability_reports.py's.)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from models.hf import save_pretrained
from models.network import build_model, preset
from models.runtime import launch
from optimized.train import TrainConfig, apply_overrides, validate_config
from optimized.train.cli import _rank_main
from tests._cli import REFERENCE_RUNNER, small_data, twinpipe, twinpipe_here

PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x10"
TRAIN = ("train", "--seq-len", "16", "--micro-batch-size", "1", "--micro-batches", "2",
         "--steps", "2", "--warmup-steps", "1")  # fmt: skip


def binary(path, header: bytes = b"") -> str:
    """``path`` filled with ``header`` and random bytes that are not UTF-8 (0xff never is)."""
    path.write_bytes(header + b"\xff\xfe" + os.urandom(200))
    return str(path)


def refused(done, *needles: str) -> None:
    """Exit 2, one error line naming ``needles``, no traceback, no step run."""
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr, done.stderr
    assert "step 00000001" not in done.stdout
    for needle in needles:
        assert needle in done.stderr, (needle, done.stderr)
    assert "is not a text file" in done.stderr, done.stderr


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A one-step training checkpoint dir (reference runner, one rank)."""
    root = tmp_path_factory.mktemp("binary")
    cfg = apply_overrides(TrainConfig(), [
        "data.seq_len=16", "data.micro_batch_size=1", "data.micro_batches=2", "steps=1",
        "optim.warmup_steps=1", f"checkpoint.dir={root / 'ck'}",
    ])  # fmt: skip
    previous = os.environ.get("TWINPIPE_RUNNER")
    os.environ["TWINPIPE_RUNNER"] = REFERENCE_RUNNER
    try:
        launch(_rank_main, 1, (validate_config(cfg),))
    finally:
        if previous is None:
            del os.environ["TWINPIPE_RUNNER"]
        else:
            os.environ["TWINPIPE_RUNNER"] = previous
    return root / "ck"


def copy_checkpoint(checkpoint, target):
    shutil.copytree(checkpoint, target)
    return target, target / "step-00000001"


@pytest.mark.slow
def test_a_binary_train_config(tmp_path):
    refused(twinpipe(*TRAIN, "--config", binary(tmp_path / "run.toml")),
            "--config", "run.toml", "expected a TOML file")  # fmt: skip


@pytest.mark.parametrize("flag", ["--model", "--set"])
def test_a_binary_model_config_given_to_train(tmp_path, flag):
    path = binary(tmp_path / "config.json", PNG)
    args = ("--model", path) if flag == "--model" else ("--set", f"model.name={path}")
    refused(twinpipe_here(*TRAIN, *args), "model.name", path, "byte 0x89 at offset 0",
            "expected a JSON object (a Hugging Face config.json)")  # fmt: skip


def test_a_binary_model_config_given_to_estimate(tmp_path):
    path = binary(tmp_path / "width.json", PNG)
    refused(twinpipe_here("estimate", "--model", path), path, "Hugging Face config.json")


def test_a_binary_checkpoint_index(tmp_path):
    """A Hugging Face folder whose ``model.safetensors.index.json`` is binary."""
    folder = tmp_path / "hf"
    save_pretrained(build_model(preset("tiny-deepseek-v2"), seed=0), folder)
    os.rename(folder / "model.safetensors", folder / "model-00001-of-00001.safetensors")
    index = binary(folder / "model.safetensors.index.json")
    refused(twinpipe_here(*TRAIN, "--init-from", str(folder)), "model.init_from", index,
            "weight_map")  # fmt: skip


def test_a_binary_data_index(tmp_path):
    data = small_data(tmp_path)
    index = binary(tmp_path / "data" / "twinpipe-data.json")
    refused(twinpipe_here(*TRAIN, "--data", data), "data.path", index, "twinpipe prepare-data")


def test_a_binary_tokenizer(tmp_path):
    (tmp_path / "text.txt").write_text("some words\n")
    tokenizer = binary(tmp_path / "tokenizer.json")
    done = twinpipe_here("prepare-data", "--input", str(tmp_path / "text.txt"), "--tokenizer",
                    tokenizer, "--out", str(tmp_path / "out"))  # fmt: skip
    refused(done, "--tokenizer", tokenizer, "expected a Hugging Face tokenizer.json")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_binary_metrics_file_is_refused_before_resuming(tmp_path, checkpoint):
    """Resuming reads the metrics file back (to drop the steps it redoes): a binary one
    ended in a traceback from rank 0 (exit 3)."""
    root, _ = copy_checkpoint(checkpoint, tmp_path / "ck")
    metrics = binary(tmp_path / "metrics.jsonl", PNG)
    done = twinpipe_here(*TRAIN, "--checkpoint-dir", str(root), "--metrics-file", metrics,
                    TWINPIPE_RUNNER=REFERENCE_RUNNER)  # fmt: skip
    refused(done, "logging.metrics_file", metrics, "JSON lines")


@pytest.mark.slow
def test_a_binary_run_record(tmp_path, checkpoint):
    root, _ = copy_checkpoint(checkpoint, tmp_path / "ck")
    run = binary(root / "run.json")
    done = twinpipe_here(*TRAIN, "--checkpoint-dir", str(root), TWINPIPE_RUNNER=REFERENCE_RUNNER)
    refused(done, "checkpoint.dir", run, "naming the run that owns the folder")


@pytest.mark.slow
@pytest.mark.parametrize("command", ["export", "init-from"])
def test_a_binary_manifest(tmp_path, checkpoint, command):
    root, step = copy_checkpoint(checkpoint, tmp_path / "ck")
    manifest = binary(step / "manifest.json")
    if command == "export":
        done = twinpipe_here("export", "--checkpoint", str(step), "--out", str(tmp_path / "hf"))
        assert f"skipping checkpoint {step}: '{manifest}' is not a text file" in done.stderr
        refused(done, "--checkpoint", "listing the checkpoint's files")
    else:
        done = twinpipe_here(*TRAIN, "--init-from", str(step), TWINPIPE_RUNNER=REFERENCE_RUNNER)
        refused(done, "model.init_from", "incomplete or corrupt", manifest)


@pytest.mark.slow
def test_a_binary_config_in_a_checkpoint_its_manifest_vouches_for(tmp_path, checkpoint):
    """A checkpoint written with a binary ``config.json`` (its manifest agrees, so it
    verifies): export and ``--init-from`` name the file."""
    root, step = copy_checkpoint(checkpoint, tmp_path / "ck")
    config = binary(step / "config.json", PNG)
    manifest = json.loads((step / "manifest.json").read_text())
    data = (step / "config.json").read_bytes()
    manifest["files"]["config.json"] = {"size": len(data),
                                        "sha256": hashlib.sha256(data).hexdigest()}  # fmt: skip
    (step / "manifest.json").write_text(json.dumps(manifest))
    refused(twinpipe_here("export", "--checkpoint", str(step), "--out", str(tmp_path / "hf")),
            config, "Hugging Face config.json")  # fmt: skip
    refused(twinpipe_here(*TRAIN, "--init-from", str(step), TWINPIPE_RUNNER=REFERENCE_RUNNER),
            "model.init_from", config)  # fmt: skip
