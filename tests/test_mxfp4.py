"""GPT-OSS's MXFP4 experts: dequantised per slice exactly as transformers does, and read
from a checkpoint quantised the way GPT-OSS is published."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from models.hf import (
    CheckpointError,
    checkpoint,
    dequantize,
    from_pretrained,
    quantize,
    save_pretrained,
    validate_checkpoint,
    write_mxfp4,
)
from models.network import ExpertParallel, build_model, preset


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int16 if tensor.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_equals_transformers_bit_for_bit(dtype):
    """Every code (all 256 byte values) at scales from 2^-40 to 2^20, whole and per expert."""
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (4, 48, 3, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(127 - 40, 127 + 20, (4, 48, 3), dtype=torch.uint8, generator=generator)
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # every code in both nibbles
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, K, N]
    ours = dequantize(blocks, scales, dtype)  # [E, N, K]
    assert torch.equal(_bits(ours.transpose(1, 2)), _bits(theirs))
    for expert in range(4):  # a rank's slice: one expert at a time
        one = dequantize(blocks[expert : expert + 1], scales[expert : expert + 1], dtype)
        assert torch.equal(_bits(one[0].transpose(0, 1)), _bits(theirs[expert]))


def test_quantize_rounds_each_value_to_a_nearby_code():
    weight = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1)) * 0.02
    blocks, scales = quantize(weight)
    assert blocks.shape == (2, 16, 2, 16) and scales.shape == (2, 16, 2)
    back = dequantize(blocks, scales, torch.float32)
    largest = weight.reshape(2, 16, 2, 32).abs().amax(-1, keepdim=True)
    error = (back - weight).reshape(2, 16, 2, 32).abs()
    assert bool((error <= largest / 3).all())  # a block's max is at least 3 * its scale
    exact = torch.tensor([[0.5, -1.5, 6.0, 0.0] * 8])
    assert torch.equal(dequantize(*quantize(exact), torch.float32), exact)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_quantize_refuses_a_value_the_format_cannot_hold(value):
    """e2m1 codes and e8m0 scales have no NaN or infinity: a NaN would otherwise be written as
    some finite code (its block's scale a cast of NaN), silently."""
    weight = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(2))
    weight[1, 2, 40] = value
    with pytest.raises(ValueError, match=r"MXFP4 cannot hold .*\[2, 4, 64\].*\[1, 2, 1, 8\]"):
        quantize(weight)


def _published_style(tmp_path, seed=1):
    """A tiny GPT-OSS written by us in bf16, then quantised as GPT-OSS is published."""
    model = build_model(preset("tiny-gpt-oss"), dtype=torch.bfloat16, seed=seed)
    save_pretrained(model, tmp_path / "bf16")
    write_mxfp4(tmp_path / "bf16", tmp_path / "mxfp4", max_shard_bytes=60_000)
    return tmp_path / "mxfp4"


def _never_mapped(*args, **kwargs):
    raise AssertionError(f"safe_open{args}: a checkpoint file mapped while loading")


def test_mxfp4_checkpoint_loads_as_transformers_loads_it(tmp_path, monkeypatch):
    """Ours and transformers' from_pretrained hold the same bits for every parameter; an
    expert-parallel rank dequantises only its experts, to the same bits."""
    path = _published_style(tmp_path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in index["weight_map"]
    assert "model.layers.0.mlp.experts.gate_up_proj" not in index["weight_map"]
    assert validate_checkpoint(path).quantization == "mxfp4"
    # Blocks and scales are read by byte range (`read_rows`), never through safetensors'
    # memory map: its pages would count in the load's resident peak.
    monkeypatch.setattr(checkpoint, "safe_open", _never_mapped)
    ours = from_pretrained(path, dtype=torch.bfloat16).state_dict()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    theirs = hf.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(_bits(tensor), _bits(theirs[name])), name
    half = from_pretrained(path, dtype=torch.bfloat16, ep=ExpertParallel(None, 1, 2))
    for name, tensor in half.state_dict().items():
        expected = ours[name][4:] if ".mlp.experts." in name else ours[name]
        assert torch.equal(_bits(tensor), _bits(expected)), name


def test_unknown_quantisation_is_refused_naming_it(tmp_path):
    path = _published_style(tmp_path)
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8"}
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"config\.json: quantization_config.*'fp8'"):
        from_pretrained(path)
