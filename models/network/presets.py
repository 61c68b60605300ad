"""Named model shapes: the published checkpoints, real-width mid-size and tiny ones.

The published shapes are those of the public ``config.json`` files. ``mid-*`` presets
keep a published model's widths with 4 layers, 8 or 16 experts and a 32000 vocabulary
(0.5 to 1.1 B parameters: real-width tensors one machine can hold). Tiny presets keep
every feature of their family (MLA, a first dense layer, shared experts, group-limited
routing, sigmoid routing with a corrected bias, YaRN, sinks, sliding windows, biases, q/k
norm, normalised top-k) at a size
where a forward and backward of 2 x 64 tokens takes a fraction of a second on one CPU
core."""

from __future__ import annotations

from models.network.config import ModelConfig

_PRESETS: dict[str, dict] = {
    "deepseek-v2-lite": dict(
        model_type="deepseek_v2",
        vocab_size=102400,
        hidden_size=2048,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=64,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_experts=64,
        num_experts_per_tok=6,
        n_shared_experts=2,
        first_k_dense_replace=1,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=dict(
            rope_type="yarn",
            factor=40,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=0.707,
            mscale_all_dim=0.707,
        ),
        max_position_embeddings=163840,
        aux_loss_alpha=0.001,
        seq_aux=True,
    ),
    "gpt-oss-20b": dict(
        model_type="gpt_oss",
        vocab_size=201088,
        hidden_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=2880,
        moe_intermediate_size=2880,
        num_experts=32,
        num_experts_per_tok=4,
        attention_bias=True,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12,
        rms_norm_eps=1e-5,
        rope_theta=150000.0,
        rope_scaling=dict(
            rope_type="yarn",
            factor=32.0,
            original_max_position_embeddings=4096,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
        ),
        max_position_embeddings=131072,
        router_aux_loss_coef=0.9,
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        router_aux_loss_coef=0.001,
    ),
    # DeepSeek-V3 as published: 671 B parameters in the main model, and its one
    # multi-token-prediction layer (config.json's num_nextn_predict_layers = 1; 11.5 B more,
    # sharing the embedding and the head); num_mtp_layers=0 is the main model alone.
    "deepseek-v3": dict(
        model_type="deepseek_v3",
        vocab_size=129280,
        hidden_size=7168,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        head_dim=64,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_experts=256,
        num_experts_per_tok=8,
        n_shared_experts=1,
        first_k_dense_replace=3,
        topk_method="noaux_tc",
        n_group=8,
        topk_group=4,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=dict(
            rope_type="yarn",
            factor=40,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        max_position_embeddings=163840,
        aux_loss_alpha=0.001,
        seq_aux=True,
        expert_bias=True,
        num_mtp_layers=1,
    ),
    # Moonlight-16B-A3B (moonshotai): DeepSeek-V3's architecture at 16 B, one expert group.
    "moonlight-16b-a3b": dict(
        model_type="deepseek_v3",
        vocab_size=163840,
        hidden_size=2048,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=64,
        intermediate_size=11264,
        moe_intermediate_size=1408,
        num_experts=64,
        num_experts_per_tok=6,
        n_shared_experts=2,
        first_k_dense_replace=1,
        topk_method="noaux_tc",
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.446,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        max_position_embeddings=8192,
        aux_loss_alpha=0.001,
        seq_aux=True,
        expert_bias=True,
    ),
    "tiny-deepseek-v2": dict(
        model_type="deepseek_v2",
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        rope_scaling=dict(
            rope_type="yarn",
            factor=4.0,
            original_max_position_embeddings=64,
            beta_fast=32,
            beta_slow=1,
            mscale=0.707,
            mscale_all_dim=0.707,
        ),
        max_position_embeddings=256,
    ),
    # Group-limited (4 groups of 4, 2 kept: a group's top-2 sum is not its sum, and the 3
    # experts a token takes can span both), q_lora, YaRN with DeepSeek-V3's mscale of 1.
    "tiny-deepseek-v3": dict(
        model_type="deepseek_v3",
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=16,
        num_experts_per_tok=3,
        n_shared_experts=1,
        first_k_dense_replace=1,
        topk_method="noaux_tc",
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        rope_scaling=dict(
            rope_type="yarn",
            factor=4.0,
            original_max_position_embeddings=64,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        max_position_embeddings=256,
        expert_bias=True,
    ),
    "tiny-gpt-oss": dict(
        model_type="gpt_oss",
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=32,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        attention_bias=True,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rms_norm_eps=1e-5,
        rope_theta=150000.0,
        rope_scaling=dict(
            rope_type="yarn",
            factor=4.0,
            original_max_position_embeddings=64,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
        ),
        max_position_embeddings=256,
    ),
    "tiny-qwen3-moe": dict(
        model_type="qwen3_moe",
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        rope_theta=1000000.0,
        max_position_embeddings=256,
    ),
}


def _mid(published: str, **changes) -> dict:
    """A published preset at its real widths with 4 layers, few experts, a 32000 vocabulary."""
    fields = dict(_PRESETS[published], num_hidden_layers=4, vocab_size=32000, **changes)
    if fields.get("layer_types"):
        fields["layer_types"] = fields["layer_types"][:4]
    return fields


# Real-width models with few layers and experts (0.5 to 1.1 B parameters): what the
# checkpoint, memory and export paths are measured on, on one machine, at the widths
# the published checkpoints have (hidden, attention, head and expert widths unchanged).
_PRESETS["mid-deepseek-v2"] = _mid("deepseek-v2-lite", num_experts=16)  # 0.72 B
_PRESETS["mid-qwen3-moe"] = _mid("qwen3-30b-a3b", num_experts=16)  # 0.51 B
_PRESETS["mid-gpt-oss"] = _mid("gpt-oss-20b", num_experts=8)  # 1.09 B
# Moonlight's widths with DeepSeek-V3's group-limited routing (16 experts in 4 groups, 2
# kept), which Moonlight's single group leaves out.
_PRESETS["mid-deepseek-v3"] = _mid("moonlight-16b-a3b", num_experts=16, n_group=4, topk_group=2)

PRESET_NAMES = tuple(_PRESETS)


def preset(name: str, **overrides) -> ModelConfig:
    """The named config, with optional field overrides (e.g. ``num_hidden_layers=8``)."""
    if name not in _PRESETS:
        raise ValueError(f"unknown model preset {name!r}; expected one of {PRESET_NAMES}")
    fields = dict(_PRESETS[name])
    fields.update(overrides)
    return ModelConfig(**fields)
