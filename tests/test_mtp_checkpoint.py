"""The MTP layer in Hugging Face checkpoints: written under the published names (with its
copies of the embedding and the head), read back bit for bit, ignored by transformers (the
same main-model logits), and a folder whose MTP tensors are missing or of another depth
refused by name before any weight is read."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors import safe_open

from models.hf import CheckpointError, from_pretrained, save_pretrained
from models.network import build_model, preset
from reference.ops import ReferenceOps

CONFIG = preset("tiny-deepseek-v3", num_mtp_layers=1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("mtp")
    model = build_model(CONFIG, ops=ReferenceOps(), seed=3)
    save_pretrained(model, path)
    return path, model


def _on_disk(path) -> dict[str, torch.Tensor]:
    out = {}
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return out


def test_written_under_the_published_names_and_read_back_bit_for_bit(folder):
    path, model = folder
    assert json.loads((path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    disk = _on_disk(path)
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "self_attn.q_a_proj.weight", "mlp.gate.e_score_correction_bias",
                 "mlp.experts.0.gate_proj.weight"):  # fmt: skip
        assert f"model.layers.4.{name}" in disk, name
    assert disk["model.layers.4.eh_proj.weight"].shape == (64, 128)
    embed = disk["model.embed_tokens.weight"]
    assert torch.equal(disk["model.layers.4.embed_tokens.weight"], embed)
    assert torch.equal(disk["model.layers.4.shared_head.head.weight"], disk["lm_head.weight"])
    back = from_pretrained(path, dtype=torch.float32)
    ours, theirs = model.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert any(k.startswith("model.layers.4.eh_proj") for k in theirs)


def test_transformers_ignores_the_layer_and_gives_the_main_models_logits(folder):
    path, model = folder
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, model(ids), atol=1e-5, rtol=1e-5)


def test_missing_or_other_depth_mtp_tensors_are_named(folder, tmp_path):
    path, _ = folder
    config = json.loads((path / "config.json").read_text())
    deeper = tmp_path / "deeper"
    deeper.mkdir()
    for file in path.iterdir():
        (deeper / file.name).write_bytes(file.read_bytes())
    (deeper / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=2)))
    missing = r"66 missing:\s+model\.layers\.5\.input_layernorm\.weight"
    with pytest.raises(CheckpointError, match=missing):
        from_pretrained(deeper, dtype=torch.float32)
