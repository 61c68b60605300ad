"""DeepSeek-V3's FP8 weights: dequantised per row slice exactly as transformers does, and read
from a checkpoint quantised the way DeepSeek-V3 is published (`models.hf.fp8`)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from models.hf import (
    CheckpointError,
    CheckpointWeights,
    checkpoint,
    fp8_dequantize,
    fp8_grid_shape,
    fp8_quantize,
    from_pretrained,
    save_pretrained,
    validate_checkpoint,
    write_fp8,
)
from models.network import ExpertParallel, build_model, preset


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int16 if tensor.element_size() == 2 else torch.int32)


def _random_fp8(rows: int, cols: int, block: tuple[int, int], seed: int = 0):
    """Every finite e4m3 code (NaN's two left out) and float32 scales of any mantissa."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=generator)
    codes[(codes & 0x7F) == 0x7F] = 0x7E
    codes.view(-1)[:254] = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F])
    grid = fp8_grid_shape((rows, cols), block)
    scales = torch.rand(grid, generator=generator) * 2.0 ** torch.randint(-30, 4, grid)
    return codes.view(torch.float8_e4m3fn), scales


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_equals_transformers_bit_for_bit(dtype):
    """Whole, and every row slice (starting anywhere in a block) with only the scale rows
    that cover it: the bits transformers' CPU dequantisation gives."""
    block = (16, 32)
    weight, scales = _random_fp8(64, 96, block)
    theirs = Fp8Dequantize(None)._dequantize_one(weight, scales, output_dtype=dtype)
    ours = fp8_dequantize(weight, scales, block, dtype)
    assert ours.dtype == theirs.dtype and torch.equal(_bits(ours), _bits(theirs))
    for first, last in [(0, 16), (5, 9), (15, 17), (20, 64), (33, 34)]:
        top, bottom = first // block[0], (last - 1) // block[0]
        rows = fp8_dequantize(
            weight[first:last], scales[top : bottom + 1], block, dtype, first - top * block[0]
        )
        assert torch.equal(_bits(rows), _bits(theirs[first:last])), (first, last)


def test_partial_blocks_take_their_own_scale():
    """Where a side is not a multiple of the block (DeepSeek-V3's 576-row kv_a_proj_with_mqa),
    the grid has a partial last block and each value takes its block's scale, as DeepSeek's
    own dequantisation reads it."""
    block = (16, 32)
    weight, scales = _random_fp8(40, 72, block, seed=1)
    assert scales.shape == (3, 3)
    rows = torch.arange(40)[:, None] // 16
    cols = torch.arange(72)[None, :] // 32
    expected = (weight.float() * scales[rows, cols]).to(torch.bfloat16)
    assert torch.equal(
        _bits(fp8_dequantize(weight, scales, block, torch.bfloat16)), _bits(expected)
    )
    tail = fp8_dequantize(weight[35:], scales[2:], block, torch.bfloat16, 3)
    assert torch.equal(_bits(tail), _bits(expected[35:]))


def test_quantize_rounds_each_value_within_its_block():
    weight = torch.randn(40, 72, generator=torch.Generator().manual_seed(2)) * 0.02
    values, scale_inv = fp8_quantize(weight, (16, 32))
    assert values.dtype == torch.float8_e4m3fn and scale_inv.shape == (3, 3)
    back = fp8_dequantize(values, scale_inv, (16, 32), torch.float32)
    largest = torch.zeros_like(weight)
    for i in range(3):
        for j in range(3):
            tile = (slice(16 * i, 16 * i + 16), slice(32 * j, 32 * j + 32))
            largest[tile] = weight[tile].abs().max()
    assert bool(((back - weight).abs() <= largest / 16).all())  # e4m3: 3 mantissa bits


BLOCK = (8, 8)
"""Every width of tiny-deepseek-v3 is a multiple of 8, so every block is whole and
transformers' dequantisation (which derives the block from the grid) reads it too."""


def _published_style(tmp_path, block=BLOCK, layers=None):
    """A tiny DeepSeek-V3 (random expert bias) written by us in bf16, then quantised as
    DeepSeek-V3 is published, in several shards."""
    config = preset("tiny-deepseek-v3", **({"num_hidden_layers": layers} if layers else {}))
    model = build_model(config, dtype=torch.bfloat16, seed=1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(3))
    save_pretrained(model, tmp_path / "bf16")
    write_fp8(tmp_path / "bf16", tmp_path / "fp8", max_shard_bytes=60_000, block=block)
    return tmp_path / "fp8"


def _never_mapped(*args, **kwargs):
    raise AssertionError(f"safe_open{args}: a checkpoint file mapped while loading")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_checkpoint_loads_as_transformers_loads_it(tmp_path, monkeypatch, dtype):
    """Ours and transformers' from_pretrained hold the same bits for every tensor (transformers
    keeps the router's weight in float32: the same values); an expert-parallel rank and a
    row slice of a weight dequantise only theirs, to the same bits."""
    path = _published_style(tmp_path)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv" in index
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv" in index
    assert "model.layers.1.mlp.gate.weight_scale_inv" not in index  # the router stays bf16
    layout = validate_checkpoint(path)
    assert layout.quantization == "fp8" and layout.block == BLOCK
    assert layout.tensors["model.layers.2.mlp.shared_experts.down_proj.weight"].dtype == "F8_E4M3"
    assert layout.tensors["model.layers.2.mlp.gate.e_score_correction_bias"].dtype == "F32"
    monkeypatch.setattr(checkpoint, "safe_open", _never_mapped)
    ours = from_pretrained(path, dtype=dtype).state_dict()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).state_dict()
    assert ours.keys() == hf.keys()
    for name, tensor in ours.items():
        if name.endswith("mlp.gate.weight") and dtype != torch.float32:
            assert hf[name].dtype == torch.float32 and torch.equal(tensor.float(), hf[name])
        else:
            assert tensor.dtype == hf[name].dtype and torch.equal(_bits(tensor), _bits(hf[name]))
    assert ours["model.layers.3.mlp.gate.e_score_correction_bias"].abs().sum() > 0
    half = from_pretrained(path, dtype=dtype, ep=ExpertParallel(None, 1, 2)).state_dict()
    for name, tensor in half.items():
        expected = ours[name][8:] if ".mlp.experts." in name else ours[name]
        assert torch.equal(_bits(tensor), _bits(expected)), name
    source = CheckpointWeights(path)
    for name, first, count in [("model.layers.0.mlp.gate_proj.weight", 13, 50),
                               ("model.layers.2.self_attn.kv_b_proj.weight", 7, 1)]:  # fmt: skip
        rows = torch.empty((count, ours[name].shape[1]), dtype=dtype)
        source.fill(name, rows, first)
        assert torch.equal(_bits(rows), _bits(ours[name][first : first + count])), name


def test_partial_blocks_load(tmp_path):
    """16 x 16 blocks leave partial ones (kv_a_proj_with_mqa has 40 rows): transformers 5
    refuses those; ours gives each value its block's scale, as DeepSeek's kernel does."""
    path = _published_style(tmp_path, block=(16, 16))
    ours = from_pretrained(path, dtype=torch.bfloat16).state_dict()
    from safetensors.torch import load_file  # noqa: PLC0415

    stored = {}
    for file in sorted(path.glob("*.safetensors")):
        stored.update(load_file(file))
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    weight, scales = stored[name], stored[name + "_scale_inv"]
    assert weight.shape == (40, 64) and scales.shape == (3, 4)
    rows, cols = torch.arange(40)[:, None] // 16, torch.arange(64)[None, :] // 16
    expected = (weight.float() * scales[rows, cols]).to(torch.bfloat16)
    assert torch.equal(_bits(ours[name]), _bits(expected))


def _rewrite(path, name, tensor):
    """Replace one tensor of a sharded checkpoint folder (its shard re-written)."""
    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    file = path / index[name]
    tensors = load_file(file)
    tensors[name] = tensor
    save_file(tensors, file, metadata={"format": "pt"})


def test_scales_that_do_not_match_are_refused_by_name(tmp_path):
    path = _published_style(tmp_path)
    name = "model.layers.1.mlp.experts.2.down_proj.weight_scale_inv"
    _rewrite(path, name, torch.ones(9, 4))
    with pytest.raises(
        CheckpointError, match=rf"{name}: expected F32 \[8, 4\].*found F32 \[9, 4\]"
    ):
        validate_checkpoint(path)
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"]["fmt"] = "e5m2"
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"quantization_config.fmt='e5m2'"):
        validate_checkpoint(path)


def test_multi_token_prediction_layers_on_disk_are_skipped(tmp_path):
    """DeepSeek-V3's published folder holds its MTP module as one more layer: a config with
    num_nextn_predict_layers = 0 loads the main model and leaves those tensors unread."""
    path = _published_style(tmp_path, layers=5)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(raw, num_hidden_layers=4)))
    layout = validate_checkpoint(path)
    assert not any(name.startswith("model.layers.4.") for name in layout.tensors)
    model = from_pretrained(path, dtype=torch.bfloat16)
    assert len(model.decoder_layers) == 4
