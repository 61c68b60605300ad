"""Training checkpoints: corrupt or partial ones skipped, HF export and --init-from."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from models.config import ModelConfig
from models.model import CausalLM
from optimized.train import TokenDataset, TokenLoader, default_dataset
from optimized.train.checkpointing import load_model_state, newest_valid
from optimized.train.export import export
from reference.ops import ReferenceOps
from tests.test_train import _reference_runner, config, train  # noqa: F401 - fixture


def test_corrupt_and_partial_checkpoints_are_skipped(tmp_path):
    cfg = config("steps=4", "checkpoint.save_every=2", "checkpoint.keep_last=0",
                 f"checkpoint.dir={tmp_path}")  # fmt: skip
    train(cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "run.json", "step-00000002", "step-00000004"]  # fmt: skip
    data = next((tmp_path / "step-00000004").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    (tmp_path / "step-00000006").mkdir()  # a partial one: no manifest
    with pytest.warns(UserWarning) as caught:
        assert newest_valid(tmp_path).name == "step-00000002"
    messages = [str(w.message) for w in caught]
    assert "step-00000006" in messages[0] and "incomplete" in messages[0]
    assert "step-00000004" in messages[1] and "sha256" in messages[1]
    resumed = train(cfg)[0]
    assert resumed["start"] == 2 and len(resumed["losses"]) == 2


def _first_batch(cfg):
    loader = TokenLoader(
        TokenDataset(default_dataset(), cfg.data.seq_len), cfg.data.micro_batches,
        cfg.data.micro_batch_size, seed=cfg.seed,
    )  # fmt: skip
    batch = next(loader)
    return batch.inputs.reshape(-1, cfg.data.seq_len), batch.labels.reshape(-1, cfg.data.seq_len)


def test_export_loads_in_transformers_and_init_from_resumes_it(tmp_path):
    import transformers

    cfg = config("steps=2", f"checkpoint.dir={tmp_path / 'ck'}")
    train(cfg)
    folder = export(tmp_path / "ck", tmp_path / "hf")
    ids, labels = _first_batch(cfg)

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    hf.set_attn_implementation("eager")
    hf.set_experts_implementation("eager")
    with torch.no_grad():
        logits = hf(input_ids=ids).logits.float()
    hf_loss = float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)))

    model_config = ModelConfig.from_hf(str(folder / "config.json"))
    ours = CausalLM(model_config, ReferenceOps())
    ours.load_state_dict(load_model_state(folder, model_config))
    with torch.no_grad():
        our_loss = float(ours.loss(ids, labels))
    assert math.isfinite(hf_loss) and abs(our_loss - hf_loss) <= 1e-5 * hf_loss

    # Step 1 of a run started from the export sees the same weights and the same batch.
    started = train(config("steps=1", "optim.warmup_steps=0", f"model.init_from={tmp_path / 'hf'}"))
    assert abs(started[0]["losses"][0] - hf_loss) <= 1e-5 * hf_loss
