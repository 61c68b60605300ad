"""Hugging Face checkpoints: round trips, shards, expert-parallel slices, errors that name names."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from models.hf import (
    INDEX_NAME,
    WEIGHTS_NAME,
    CheckpointError,
    config_from_hf,
    config_to_hf,
    from_pretrained,
    load_state_dict_hf,
    save_pretrained,
    to_hf_state_dict,
    validate_checkpoint,
)
from models.network import ExpertParallel, ModelConfig, build_model, preset

FAMILIES = ["tiny-deepseek-v2", "tiny-gpt-oss", "tiny-qwen3-moe"]


def small(name: str, **overrides) -> ModelConfig:
    """A two-layer tiny model (DeepSeek-V2: one dense, one MoE layer)."""
    if name == "tiny-gpt-oss":
        overrides.setdefault("layer_types", ["sliding_attention", "full_attention"])
    return preset(name, num_hidden_layers=2, **overrides)


def saved(config: ModelConfig, path, seed: int = 1, **save_kwargs):
    model = build_model(config, seed=seed)
    save_pretrained(model, path, **save_kwargs)
    return model


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        assert tensor.dtype == b[name].dtype, name
        assert torch.equal(tensor, b[name]), name


def disk_names(path) -> set[str]:
    with safe_open(os.path.join(path, WEIGHTS_NAME), framework="pt") as f:
        return set(f.keys())


# ------------------------------------------------------------------ round trips
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("name", FAMILIES)
def test_round_trip_is_bitwise(name, tied, tmp_path):
    config = small(name, tie_word_embeddings=tied)
    model = saved(config, tmp_path)
    loaded = from_pretrained(tmp_path)
    assert loaded.config == config
    assert_same_state(model.state_dict(), loaded.state_dict())
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    assert ("lm_head.weight" in disk_names(tmp_path)) != tied


def test_bfloat16_round_trip_keeps_dtype(tmp_path):
    model = build_model(small("tiny-qwen3-moe"), seed=2, dtype=torch.bfloat16)
    save_pretrained(model, tmp_path)
    assert load_file(tmp_path / WEIGHTS_NAME)["model.norm.weight"].dtype == torch.bfloat16
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    assert_same_state(model.state_dict(), from_pretrained(tmp_path, torch.bfloat16).state_dict())


@pytest.mark.parametrize("name", ["tiny-deepseek-v2", "tiny-qwen3-moe"])
def test_experts_are_written_one_per_expert_gate_first(name, tmp_path):
    config = small(name)
    model = saved(config, tmp_path)
    disk = load_file(tmp_path / WEIGHTS_NAME)
    inner = config.moe_intermediate_size
    fused = model.state_dict()
    for expert in (0, config.num_experts - 1):
        prefix = f"model.layers.1.mlp.experts.{expert}"
        gate_up = fused["model.layers.1.mlp.experts.gate_up_proj"][expert]
        assert torch.equal(disk[f"{prefix}.gate_proj.weight"], gate_up[:inner])
        assert torch.equal(disk[f"{prefix}.up_proj.weight"], gate_up[inner:])
        down = fused["model.layers.1.mlp.experts.down_proj"][expert]
        assert torch.equal(disk[f"{prefix}.down_proj.weight"], down)
    assert "model.layers.1.mlp.experts.gate_up_proj" not in disk


def test_gpt_oss_experts_stay_fused_on_disk(tmp_path):
    config = small("tiny-gpt-oss")
    model = saved(config, tmp_path)
    names = disk_names(tmp_path)
    for suffix in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        assert f"model.layers.0.mlp.experts.{suffix}" in names
    assert_same_state(
        {n: t for n, t in model.state_dict().items() if n in names},
        load_file(tmp_path / WEIGHTS_NAME),
    )


def test_low_level_pair_round_trips(tmp_path):
    config = small("tiny-deepseek-v2")
    model = saved(config, tmp_path)
    state = load_state_dict_hf(tmp_path)
    assert_same_state(model.state_dict(), state)
    on_disk = to_hf_state_dict(state, config)
    assert_same_state(on_disk, load_file(tmp_path / WEIGHTS_NAME))


# ---------------------------------------------------------------------- shards
@pytest.mark.parametrize("name", FAMILIES)
def test_sharded_save_and_load(name, tmp_path):
    config = small(name)
    limit = 40_000
    model = saved(config, tmp_path, max_shard_bytes=limit)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and not (tmp_path / WEIGHTS_NAME).exists()
    for shard in shards:
        tensors = load_file(tmp_path / shard)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        assert nbytes <= limit or len(tensors) == 1, shard
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in to_hf_state_dict(model.state_dict(), config).values()
    )
    assert_same_state(model.state_dict(), from_pretrained(tmp_path).state_dict())

    save_pretrained(model, tmp_path)  # unsharded again: the old shards go
    assert sorted(os.listdir(tmp_path)) == ["config.json", WEIGHTS_NAME]


@pytest.mark.parametrize("name", FAMILIES)
def test_loads_sharded_checkpoint_written_by_transformers(name, tmp_path):
    import transformers

    config = small(name, tie_word_embeddings=name == "tiny-qwen3-moe")
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config_to_hf(config))
    )
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / INDEX_NAME).exists()
    ours = from_pretrained(tmp_path).state_dict()
    hf_state = hf.state_dict()
    assert ours.keys() == {n for n, t in hf_state.items() if t.numel()}
    for param_name, tensor in ours.items():
        assert torch.equal(tensor, hf_state[param_name]), param_name


def test_written_config_loads_in_transformers(tmp_path):
    import transformers

    for name in FAMILIES:
        config = small(name, tie_word_embeddings=True)
        saved(config, tmp_path / name)
        hf_config = transformers.AutoConfig.from_pretrained(tmp_path / name)
        assert hf_config.model_type == config.model_type
        assert hf_config.tie_word_embeddings
        assert config_from_hf(tmp_path / name) == config


# ------------------------------------------------------------- expert parallel
@pytest.mark.parametrize("ep_size", [2, 4])
@pytest.mark.parametrize("name", FAMILIES)
def test_expert_parallel_rank_loads_its_experts(name, ep_size, tmp_path):
    config = small(name)
    full = saved(config, tmp_path).state_dict()
    per_rank = config.num_experts // ep_size
    for rank in range(ep_size):
        ep = ExpertParallel(None, rank, ep_size)
        shard = from_pretrained(tmp_path, ep=ep).state_dict()
        assert shard.keys() == full.keys()
        for param_name, tensor in shard.items():
            expected = full[param_name]
            if ".mlp.experts." in param_name:
                expected = expected[rank * per_rank : (rank + 1) * per_rank]
                assert tensor.shape[0] == per_rank, param_name
            assert torch.equal(tensor, expected), param_name
        assert_same_state(shard, load_state_dict_hf(tmp_path, ep=ep))


def test_expert_parallel_must_divide_experts(tmp_path):
    saved(small("tiny-qwen3-moe"), tmp_path)
    with pytest.raises(ValueError, match="num_experts=8"):
        load_state_dict_hf(tmp_path, ep=ExpertParallel(None, 0, 3))


def test_save_refuses_an_expert_shard(tmp_path):
    model = build_model(small("tiny-qwen3-moe"), ep=ExpertParallel(None, 1, 2))
    with pytest.raises(ValueError, match="expert shard 1 of 2"):
        save_pretrained(model, tmp_path)


# ---------------------------------------------------------------------- errors
def rewrite(path, change) -> None:
    file = os.path.join(path, WEIGHTS_NAME)
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_config(tmp_path):
    saved(small("tiny-gpt-oss"), tmp_path)
    os.remove(tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="config.json"):
        from_pretrained(tmp_path)


def test_missing_weights(tmp_path):
    saved(small("tiny-gpt-oss"), tmp_path)
    os.remove(tmp_path / WEIGHTS_NAME)
    with pytest.raises(FileNotFoundError, match=f"{WEIGHTS_NAME} or {INDEX_NAME}"):
        from_pretrained(tmp_path)


def test_missing_shard(tmp_path):
    saved(small("tiny-gpt-oss"), tmp_path, max_shard_bytes=40_000)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    os.remove(tmp_path / shard)
    with pytest.raises(FileNotFoundError, match=shard):
        from_pretrained(tmp_path)


def test_unknown_model_type(tmp_path):
    saved(small("tiny-qwen3-moe"), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="model_type='llama'"):
        from_pretrained(tmp_path)


def test_missing_tensor_is_named(tmp_path):
    saved(small("tiny-deepseek-v2"), tmp_path)
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    rewrite(tmp_path, lambda t: t.pop(name))
    with pytest.raises(
        ValueError, match=r"1 missing:\n +" + name.replace(".", r"\.") + r" \[32, 64\]"
    ):
        from_pretrained(tmp_path)


def test_unexpected_tensor_is_named(tmp_path):
    saved(small("tiny-qwen3-moe"), tmp_path)
    name = "model.layers.0.mlp.experts.8.up_proj.weight"  # a ninth expert of eight
    rewrite(tmp_path, lambda t: t.update({name: torch.ones(32, 64)}))
    with pytest.raises(ValueError, match=r"1 unexpected:\n +" + name.replace(".", r"\.")):
        from_pretrained(tmp_path)


def test_wrong_shape_is_named_with_both_shapes(tmp_path):
    saved(small("tiny-gpt-oss"), tmp_path)
    name = "model.layers.1.self_attn.sinks"
    rewrite(tmp_path, lambda t: t.update({name: torch.ones(5)}))
    with pytest.raises(
        ValueError, match=name.replace(".", r"\.") + r": expected \[4\], found \[5\]"
    ):
        from_pretrained(tmp_path)


def test_every_problem_is_listed_at_once(tmp_path):
    saved(small("tiny-qwen3-moe"), tmp_path)

    def break_three(tensors):
        tensors.pop("model.norm.weight")
        tensors["model.extra"] = torch.ones(1)
        tensors["model.embed_tokens.weight"] = torch.ones(3, 64)

    rewrite(tmp_path, break_three)
    with pytest.raises(ValueError) as error:
        from_pretrained(tmp_path)
    message = str(error.value)
    for fragment in ("model.norm.weight", "model.extra", "expected [512, 64], found [3, 64]"):
        assert fragment in message


def test_to_hf_state_dict_names_what_a_partial_state_lacks():
    config = small("tiny-qwen3-moe")
    state = build_model(config).state_dict()
    state.pop("model.layers.1.self_attn.q_norm.weight")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.q_norm\.weight \[16\]"):
        to_hf_state_dict(state, config)


def test_int32_weights_are_refused_naming_file_tensor_and_dtypes(tmp_path):
    saved(small("tiny-qwen3-moe"), tmp_path)
    name = "model.layers.0.self_attn.q_proj.weight"
    rewrite(tmp_path, lambda t: t.update({name: t[name].to(torch.int32)}))
    with pytest.raises(
        CheckpointError,
        match=name.replace(".", r"\.")
        + r": expected F32 or BF16 or F16 or F64, found I32 \(in .*"
        + WEIGHTS_NAME.replace(".", r"\."),
    ):
        from_pretrained(tmp_path)


def test_truncated_files_are_refused_naming_file_and_tensor(tmp_path):
    saved(small("tiny-gpt-oss"), tmp_path, max_shard_bytes=40_000)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    shard = tmp_path / sorted(set(index["weight_map"].values()))[-1]
    raw = shard.read_bytes()
    shard.write_bytes(raw[:-100])
    with pytest.raises(
        CheckpointError,
        match=rf"{shard.name} is truncated: it has {len(raw) - 100} bytes, but tensor "
        rf"\S+ \(F32 \[[\d, ]+\]\) ends at byte {len(raw)}",
    ):
        validate_checkpoint(tmp_path)
    shard.write_bytes(raw[:5])
    with pytest.raises(CheckpointError, match=rf"{shard.name} is truncated or not a safetensors"):
        from_pretrained(tmp_path)


def test_another_models_checkpoint_is_refused(tmp_path):
    saved(small("tiny-qwen3-moe"), tmp_path)
    with pytest.raises(CheckpointError, match="holds a qwen3_moe model, not the deepseek_v2 model"):
        validate_checkpoint(tmp_path, small("tiny-deepseek-v2"))
    wider = small("tiny-qwen3-moe", moe_intermediate_size=48)
    with pytest.raises(
        CheckpointError,
        match=r"model\.layers\.0\.mlp\.experts\.0\.up_proj\.weight: expected \[48, 64\], "
        r"found \[32, 64\] \(in ",
    ):
        validate_checkpoint(tmp_path, wider)
