"""ModelConfig: impossible configs fail early and by name; HF config.json in and out; presets."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from models.hf import config_from_hf, config_to_hf
from models.network import PRESET_NAMES, CausalLM, preset

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}

# (preset, overrides, text the error must contain: the field and its value)
INVALID = {
    "top-k above experts": ("tiny-qwen3-moe", {"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    "kv heads do not divide heads": (
        "tiny-qwen3-moe",
        {"num_key_value_heads": 3},
        "num_key_value_heads=3",
    ),
    "unknown topk_method": ("tiny-deepseek-v2", {"topk_method": "noaux_tc"}, "'noaux_tc'"),
    "n_group does not divide experts": ("tiny-deepseek-v2", {"n_group": 3}, "n_group=3"),
    "group routing without n_group": ("tiny-deepseek-v2", {"n_group": None}, "n_group=None"),
    "topk_group above n_group": ("tiny-deepseek-v2", {"topk_group": 5}, "topk_group=5"),
    "top-k above the kept groups": (
        "tiny-deepseek-v2",
        {"num_experts_per_tok": 5},  # 2 groups of 2 experts kept
        "num_experts_per_tok=5",
    ),
    "layer_types of the wrong length": (
        "tiny-gpt-oss",
        {"layer_types": ["full_attention"] * 3},
        "layer_types=['full_attention', 'full_attention', 'full_attention']",
    ),
    "unknown layer type": (
        "tiny-gpt-oss",
        {"layer_types": ["full_attention", "local", "full_attention", "full_attention"]},
        "layer_types='local'",
    ),
    "sliding layers without a window": ("tiny-gpt-oss", {"sliding_window": None}, "sliding_window"),
    "negative sliding window": ("tiny-gpt-oss", {"sliding_window": -4}, "sliding_window=-4"),
    "unknown model_type": ("tiny-qwen3-moe", {"model_type": "llama"}, "model_type='llama'"),
    "zero hidden size": ("tiny-qwen3-moe", {"hidden_size": 0}, "hidden_size=0"),
    "bool layer count": ("tiny-qwen3-moe", {"num_hidden_layers": True}, "num_hidden_layers=True"),
    "negative experts": ("tiny-qwen3-moe", {"num_experts": -1}, "num_experts=-1"),
    "unknown rope type": (
        "tiny-qwen3-moe",
        {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
        "rope_scaling.rope_type='dynamic'",
    ),
    "yarn without a factor": (
        "tiny-qwen3-moe",
        {"rope_scaling": {"rope_type": "yarn"}},
        "rope_scaling.factor=None",
    ),
    "zero norm eps": ("tiny-gpt-oss", {"rms_norm_eps": 0.0}, "rms_norm_eps=0.0"),
    "odd rotary width": ("tiny-deepseek-v2", {"qk_rope_head_dim": 7}, "qk_rope_head_dim=7"),
    "odd head_dim": ("tiny-qwen3-moe", {"head_dim": 15}, "head_dim=15"),
    "MLA without a kv rank": ("tiny-deepseek-v2", {"kv_lora_rank": 0}, "kv_lora_rank=0"),
    "zero q_lora_rank": ("tiny-deepseek-v2", {"q_lora_rank": 0}, "q_lora_rank=0"),
    "negative dense prefix": (
        "tiny-deepseek-v2",
        {"first_k_dense_replace": -1},
        "first_k_dense_replace=-1",
    ),
    "zero sparse step": ("tiny-qwen3-moe", {"decoder_sparse_step": 0}, "decoder_sparse_step=0"),
    "dense layer out of range": ("tiny-qwen3-moe", {"mlp_only_layers": [4]}, "mlp_only_layers=4"),
    "zero swiglu limit": ("tiny-gpt-oss", {"swiglu_limit": 0.0}, "swiglu_limit=0.0"),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_impossible_config_raises_naming_field_and_value(case):
    name, overrides, fragment = INVALID[case]
    with pytest.raises(ValueError, match="is invalid") as error:
        preset(name, **overrides)
    assert fragment in str(error.value)
    assert "ModelConfig." in str(error.value)


def test_replace_validates():
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        preset("tiny-qwen3-moe").replace(num_experts_per_tok=9)


def test_valid_edge_cases_pass():
    preset("tiny-qwen3-moe", num_experts=0, num_experts_per_tok=4)  # all layers dense
    preset("tiny-deepseek-v2", topk_method="greedy", n_group=None, topk_group=None)
    preset("tiny-gpt-oss", layer_types=None, sliding_window=None)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="tiny-qwen3-moe"):
        preset("tiny-llama")


# ------------------------------------------------------------ HF config.json

ROUND_TRIP = {
    "deepseek-v2 group/yarn": ("tiny-deepseek-v2", {}),
    "deepseek-v2 q-lora/greedy/tied": (
        "tiny-deepseek-v2",
        {
            "q_lora_rank": 16,
            "topk_method": "greedy",
            "n_group": 1,
            "topk_group": 1,
            "rope_scaling": None,
            "routed_scaling_factor": 2.0,
            "first_k_dense_replace": 2,
            "attention_bias": True,
            "tie_word_embeddings": True,
        },
    ),
    "gpt-oss yarn/sliding": ("tiny-gpt-oss", {}),
    "gpt-oss default rope/tied": (
        "tiny-gpt-oss",
        {"rope_scaling": None, "sliding_window": 4, "tie_word_embeddings": True},
    ),
    "qwen3-moe": ("tiny-qwen3-moe", {}),
    "qwen3-moe sparse/yarn": (
        "tiny-qwen3-moe",
        {
            "norm_topk_prob": False,
            "mlp_only_layers": [0],
            "decoder_sparse_step": 2,
            "rope_scaling": YARN,
            "tie_word_embeddings": True,
        },
    ),
}


@pytest.mark.parametrize("case", list(ROUND_TRIP) + list(PRESET_NAMES))
def test_from_hf_reads_transformers_config_json(case, tmp_path):
    """to_hf -> a transformers config -> its save_pretrained -> from_hf gives the config back."""
    name, overrides = ROUND_TRIP.get(case, (case, {}))
    config = preset(name, **overrides)
    transformers.AutoConfig.for_model(**config_to_hf(config)).save_pretrained(tmp_path)
    assert config_from_hf(tmp_path) == config
    assert config_from_hf(tmp_path / "config.json") == config
    assert config_from_hf(json.loads((tmp_path / "config.json").read_text())) == config


@pytest.mark.parametrize("model_type", ["deepseek_v2", "gpt_oss", "qwen3_moe"])
def test_from_hf_reads_transformers_defaults(model_type, tmp_path):
    """A config written by transformers with its own defaults builds the same model shapes."""
    hf_config = transformers.AutoConfig.for_model(model_type, num_hidden_layers=3)
    hf_config.save_pretrained(tmp_path)
    config = config_from_hf(tmp_path)
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_config)
        ours = CausalLM(config, ops=object())
    hf_shapes = {n: p.shape for n, p in hf_model.state_dict().items() if p.numel()}
    assert {n: p.shape for n, p in ours.state_dict().items()} == hf_shapes


# Keys as in the published config.json files (transformers 4 style: rope_scaling with "type",
# top-level rope_theta, extra keys twinpipe does not read).
PUBLISHED_STYLE = {
    "deepseek-v2-lite": {
        "model_type": "deepseek_v2",
        "architectures": ["DeepseekV2ForCausalLM"],
        "attention_bias": False,
        "aux_loss_alpha": 0.001,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "kv_lora_rank": 512,
        "max_position_embeddings": 163840,
        "moe_intermediate_size": 1408,
        "moe_layer_freq": 1,
        "n_group": 1,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "norm_topk_prob": False,
        "num_attention_heads": 16,
        "num_experts_per_tok": 6,
        "num_hidden_layers": 27,
        "num_key_value_heads": 16,
        "q_lora_rank": None,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 1.0,
        "scoring_func": "softmax",
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "greedy",
        "torch_dtype": "bfloat16",
        "v_head_dim": 128,
        "vocab_size": 102400,
    },
    "gpt-oss-20b": {
        "model_type": "gpt_oss",
        "output_router_logits": False,
        "router_aux_loss_coef": 0.9,
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "experts_per_token": 4,
        "head_dim": 64,
        "hidden_size": 2880,
        "initializer_range": 0.02,
        "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "max_position_embeddings": 131072,
        "num_attention_heads": 64,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 24,
        "num_key_value_heads": 8,
        "num_local_experts": 32,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "vocab_size": 201088,
    },
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "decoder_sparse_step": 1,
        "head_dim": 128,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "mlp_only_layers": [],
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
}


@pytest.mark.parametrize("name", list(PUBLISHED_STYLE))
def test_from_hf_reads_published_style_config(name, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED_STYLE[name]))
    assert config_from_hf(tmp_path) == preset(name)


def test_from_hf_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        config_from_hf(tmp_path)
    with pytest.raises(ValueError, match="model_type='mixtral'"):
        config_from_hf({"model_type": "mixtral"})


# ------------------------------------------------------------- published sizes
PUBLISHED_TOTALS = {
    "deepseek-v2-lite": 15_706_484_224,
    "gpt-oss-20b": 20_914_757_184,
    "qwen3-30b-a3b": 30_532_122_624,
}


@pytest.mark.parametrize("name", list(PUBLISHED_TOTALS))
def test_published_preset_parameter_counts(name):
    """Counted on the meta device by transformers and by us: the published totals."""
    config = preset(name)
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**config_to_hf(config))
        )
        ours = CausalLM(config, ops=object())
    assert sum(p.numel() for p in hf_model.parameters()) == PUBLISHED_TOTALS[name]
    assert sum(p.numel() for p in ours.parameters()) == PUBLISHED_TOTALS[name]


MID_OF = {"mid-deepseek-v2": "deepseek-v2-lite", "mid-qwen3-moe": "qwen3-30b-a3b",
          "mid-gpt-oss": "gpt-oss-20b"}  # fmt: skip
WIDTHS = (
    "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
    "moe_intermediate_size", "num_experts_per_tok", "n_shared_experts", "q_lora_rank",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "sliding_window",
)  # fmt: skip


@pytest.mark.parametrize("name", list(MID_OF))
def test_mid_presets_have_published_widths(name):
    """Real widths (hidden, attention, heads, experts) with 4 layers, 8 to 16 experts, a 32000
    vocabulary, 0.5 to 1.1 B parameters (counted by transformers and by us on meta)."""
    config, published = preset(name), preset(MID_OF[name])
    for width in WIDTHS:
        assert getattr(config, width) == getattr(published, width), width
    assert config.num_hidden_layers == 4 and 8 <= config.num_experts <= 16
    assert config.vocab_size == 32000
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**config_to_hf(config))
        )
        ours = CausalLM(config, ops=object())
    total = sum(p.numel() for p in ours.parameters())
    assert total == sum(p.numel() for p in hf_model.parameters())
    assert 0.5e9 <= total <= 1.1e9, total


def test_the_balancing_fields_round_trip_and_resolve():
    """transformers' and DeepSeek's load-balancing fields are read from a config.json, written
    back, and resolve to the loss each family's own code trains with."""
    qwen = preset("tiny-qwen3-moe", output_router_logits=True, router_aux_loss_coef=0.001)
    deepseek = preset("tiny-deepseek-v2", aux_loss_alpha=0.001, seq_aux=False)
    for config in (qwen, deepseek, preset("gpt-oss-20b"), preset("deepseek-v2-lite")):
        assert config_from_hf(config_to_hf(config)) == config
    assert qwen.balancing().aux_form == "pooled" and qwen.balancing().aux_coef == 0.001
    assert deepseek.balancing().aux_form == "layer"
    assert preset("deepseek-v2-lite").balancing().aux_form == "sequence"
    assert preset("gpt-oss-20b").balancing().aux_form == "none"  # output_router_logits false
    assert preset("gpt-oss-20b", output_router_logits=True).balancing().aux_coef == 0.9
    overridden = qwen.replace(aux_loss="sequence", aux_loss_coef=0.01, router_z_loss_coef=1e-3)
    assert overridden.balancing().aux_form == "sequence" and overridden.balancing().z_coef == 1e-3
    with pytest.raises(ValueError, match="aux_loss='pooled'.*positive coefficient"):
        preset("tiny-deepseek-v2", aux_loss="pooled")
    with pytest.raises(ValueError, match="aux_loss='seq'.*expected 'auto' or one of"):
        preset("tiny-qwen3-moe", aux_loss="seq")
