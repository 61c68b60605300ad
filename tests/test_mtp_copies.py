"""The MTP layer of a Hugging Face folder on read: its copies of the embedding and the head
(``model.layers.{N}.embed_tokens.weight``, ``model.layers.{N}.shared_head.head.weight``)
read once and held equal to the main model's, a folder where they differ refused by name
before any rank starts (exit 2); and its FP8 weights, as DeepSeek-V3 publishes them, read
through the same path as the main layers', to the dequantised values."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.hf import (
    CheckpointError,
    CheckpointWeights,
    checkpoint,
    fp8_dequantize,
    from_pretrained,
    mtp_copies,
    save_pretrained,
    to_hf_state_dict,
    write_fp8,
)
from models.network import build_model, preset

CONFIG = preset("tiny-deepseek-v3", num_mtp_layers=1)
EMBED_COPY = "model.layers.4.embed_tokens.weight"
HEAD_COPY = "model.layers.4.shared_head.head.weight"


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor


def test_copies_that_differ_are_refused_by_name_before_any_rank(tmp_path, capsys, monkeypatch):
    """Copies equal to the main model's load; one row of the head's copy changed: --init-from
    exits 2 naming both tensors and the row, with `launch` made to fail if it is reached;
    read a few rows at a time (a block smaller than the tensor), never mapped whole."""
    from harness.cli import main

    model = build_model(CONFIG, dtype=torch.bfloat16, seed=2)
    save_pretrained(model, tmp_path)
    source = CheckpointWeights(tmp_path)
    monkeypatch.setattr(mtp_copies, "BLOCK_BYTES", 7 * 4 * CONFIG.hidden_size)  # 7 rows a block
    reads = []
    read_rows = checkpoint.read_rows
    monkeypatch.setattr(
        checkpoint, "read_rows", lambda t, out, s=0: (reads.append((t, s)), read_rows(t, out, s))
    )
    monkeypatch.setattr(checkpoint, "safe_open", None)  # never mapped whole
    source.check_mtp_copies()
    tensors = source.layout.tensors | source.layout.copies
    names = {n for n, t in tensors.items() for r, _ in reads if r == t}
    assert names == {EMBED_COPY, HEAD_COPY, "model.embed_tokens.weight", "lm_head.weight"}
    assert len(reads) == len(set(reads)) == 4 * -(-CONFIG.vocab_size // 7)  # each block once
    monkeypatch.undo()
    weights = tmp_path / "model.safetensors"
    tensors = load_file(weights)
    tensors[HEAD_COPY][37, 5] += 1
    save_file(tensors, weights, {"format": "pt"})

    def no_rank(*args, **kwargs):
        raise AssertionError("a rank was launched")

    monkeypatch.setattr("models.runtime.launch", no_rank)
    capsys.readouterr()
    code = main(["train", "--init-from", str(tmp_path), "--steps", "1", "--warmup-steps", "0"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{HEAD_COPY} differs from lm_head.weight (first at row 37)" in err
    assert EMBED_COPY not in err
    with pytest.raises(CheckpointError, match=f"{HEAD_COPY} differs"):
        from_pretrained(tmp_path, dtype=torch.float32)


def test_fp8_mtp_layer_loads_to_the_dequantised_weights(tmp_path):
    """A tiny DeepSeek-V3 with D = 1 quantised as published (the MTP layer's attention and
    experts in FP8 with their scales; eh_proj, the norms and the copies as stored): every
    tensor of the loaded model is the stored one, dequantised, bit for bit."""
    model = build_model(CONFIG, dtype=torch.bfloat16, seed=1)
    save_pretrained(model, tmp_path / "bf16")
    write_fp8(tmp_path / "bf16", tmp_path / "fp8", max_shard_bytes=60_000, block=(8, 8))
    stored = {}
    for file in sorted((tmp_path / "fp8").glob("*.safetensors")):
        stored.update(load_file(file))
    assert stored["model.layers.4.self_attn.q_a_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.4.mlp.experts.3.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.4.eh_proj.weight"].dtype == torch.bfloat16
    for dtype in (torch.bfloat16, torch.float32):
        ours = from_pretrained(tmp_path / "fp8", dtype=dtype)
        on_disk = to_hf_state_dict(ours.state_dict(), CONFIG)
        names = [n for n in stored if not n.endswith("_scale_inv")]
        assert sorted(on_disk) == sorted(names)
        for name in names:
            scales = stored.get(name + "_scale_inv")
            if scales is None:
                expected = stored[name].to(dtype)
            else:
                expected = fp8_dequantize(stored[name], scales, (8, 8), dtype)
            assert torch.equal(_bits(on_disk[name]), _bits(expected)), name
        layer = [n for n in names if n.startswith("model.layers.4.")]
        assert sum(n + "_scale_inv" in stored for n in layer) > 20  # the MTP layer's FP8 ones
