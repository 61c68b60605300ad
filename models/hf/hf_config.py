"""A Hugging Face ``config.json`` turned into a `models.network.ModelConfig` and back.

transformers names the same quantity differently in each family (``n_routed_experts``,
``num_local_experts``, ``num_experts``), keeps RoPE settings under ``rope_parameters`` or
``rope_scaling``, and leaves fields out that its modeling defaults. `config_from_hf` reads
every such spelling into one config, after `models.hf.config_json` has refused what
twinpipe does not compute; `config_to_hf` writes the transformers 5 names, so that
``transformers.AutoConfig.for_model(**config_to_hf(c))`` builds the same network
(the parity tests build their reference models that way).
"""

from __future__ import annotations

import os
from typing import Any

from models.hf.config_json import ModelConfigError, check_supported, read_config_json
from models.network import FAMILIES, PRESET_NAMES, ModelConfig, preset


def config_from_hf(path_or_dict: str | os.PathLike | dict[str, Any]) -> ModelConfig:
    """Read a Hugging Face ``config.json`` (a path to it, its folder, or its dict)."""
    if isinstance(path_or_dict, dict):
        where, raw = "config", dict(path_or_dict)
    else:
        where, raw = read_config_json(path_or_dict)
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        raise ModelConfigError(
            f"{where}: model_type={model_type!r} is not supported; expected one of {FAMILIES}"
        )
    check_supported(raw, where)
    try:
        return _from_raw(raw, model_type)
    except KeyError as error:
        raise ModelConfigError(
            f"{where}: required field {error.args[0]!r} is missing for a {model_type} model"
        ) from None
    except (TypeError, ValueError, AttributeError) as error:
        raise ModelConfigError(f"{where}: {error}") from None


DEEPSEEK_V3_DEFAULTS: dict[str, Any] = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
    v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
    first_k_dense_replace=3, norm_topk_prob=True, rope_interleave=True,
)  # fmt: skip
"""transformers 5's ``DeepseekV3Config`` defaults: what its modeling computes with for a field
a ``config.json`` leaves out (DeepSeek-V3's own shape)."""


def _from_raw(raw: dict[str, Any], model_type: str) -> ModelConfig:
    if model_type == "deepseek_v3":
        raw = {**DEEPSEEK_V3_DEFAULTS, **raw}
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope = dict(rope)
    rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    rope_scaling = rope if rope.get("rope_type", "default") != "default" else None
    num_experts = raw.get("n_routed_experts")
    if num_experts is None:
        num_experts = raw.get("num_local_experts", raw.get("num_experts"))
    heads = raw["num_attention_heads"]
    common = dict(
        model_type=model_type,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        intermediate_size=raw["intermediate_size"],
        num_experts=num_experts or 0,
        num_experts_per_tok=raw.get("num_experts_per_tok") or 1,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        initializer_range=raw.get("initializer_range", 0.02),
        attention_bias=raw.get("attention_bias", model_type == "gpt_oss"),
        # DeepSeek-V3's MTP depth; absent: none (transformers' default of 1 builds nothing:
        # its modeling skips the MTP module's weights).
        num_mtp_layers=raw.get("num_nextn_predict_layers") or 0,
    )
    if model_type == "deepseek_v2":
        return ModelConfig(
            **common,
            head_dim=raw.get("qk_rope_head_dim", 64),
            moe_intermediate_size=raw["moe_intermediate_size"],
            topk_method=raw.get("topk_method", "greedy"),
            n_group=raw.get("n_group"),
            topk_group=raw.get("topk_group"),
            routed_scaling_factor=raw.get("routed_scaling_factor", 1.0),
            norm_topk_prob=raw.get("norm_topk_prob", False),
            n_shared_experts=raw.get("n_shared_experts") or 0,
            first_k_dense_replace=raw.get("first_k_dense_replace", 0),
            q_lora_rank=raw.get("q_lora_rank"),
            kv_lora_rank=raw["kv_lora_rank"],
            qk_nope_head_dim=raw["qk_nope_head_dim"],
            qk_rope_head_dim=raw["qk_rope_head_dim"],
            v_head_dim=raw["v_head_dim"],
            aux_loss_alpha=float(raw.get("aux_loss_alpha") or 0.0),
            seq_aux=bool(raw.get("seq_aux", True)),
        )
    if model_type == "deepseek_v3":
        return ModelConfig(
            **common,
            head_dim=raw["qk_rope_head_dim"],
            moe_intermediate_size=raw["moe_intermediate_size"],
            topk_method="noaux_tc",
            n_group=raw["n_group"],
            topk_group=raw["topk_group"],
            routed_scaling_factor=raw["routed_scaling_factor"],
            norm_topk_prob=bool(raw["norm_topk_prob"]),
            n_shared_experts=raw["n_shared_experts"] or 0,
            first_k_dense_replace=raw["first_k_dense_replace"],
            q_lora_rank=raw["q_lora_rank"],
            kv_lora_rank=raw["kv_lora_rank"],
            qk_nope_head_dim=raw["qk_nope_head_dim"],
            qk_rope_head_dim=raw["qk_rope_head_dim"],
            v_head_dim=raw["v_head_dim"],
            rope_interleave=bool(raw["rope_interleave"]),
            aux_loss_alpha=float(raw.get("aux_loss_alpha") or 0.0),
            seq_aux=bool(raw.get("seq_aux", True)),
            expert_bias=True,
        )
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    if model_type == "gpt_oss":
        return ModelConfig(
            **common,
            head_dim=head_dim,
            moe_intermediate_size=raw["intermediate_size"],
            sliding_window=raw.get("sliding_window"),
            layer_types=list(raw["layer_types"]) if raw.get("layer_types") else None,
            swiglu_alpha=raw.get("swiglu_alpha", 1.702),
            swiglu_limit=raw.get("swiglu_limit", 7.0),
            **_router_aux(raw),
        )
    return ModelConfig(
        **common,
        head_dim=head_dim,
        moe_intermediate_size=raw["moe_intermediate_size"],
        norm_topk_prob=raw.get("norm_topk_prob", False),
        mlp_only_layers=list(raw.get("mlp_only_layers") or []),
        decoder_sparse_step=raw.get("decoder_sparse_step", 1),
        **_router_aux(raw),
    )


def _router_aux(raw: dict[str, Any]) -> dict[str, Any]:
    """transformers' load-balancing fields (Qwen3-MoE, GPT-OSS), with transformers' defaults
    where absent (off; a coefficient of 0.001)."""
    coef = raw.get("router_aux_loss_coef")
    return dict(
        output_router_logits=bool(raw.get("output_router_logits") or False),
        router_aux_loss_coef=0.001 if coef is None else float(coef),
    )


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dict of ``config`` (transformers 5 names)."""
    rope_parameters = {"rope_theta": config.rope_theta, "rope_type": "default"}
    if config.rope_scaling is not None:
        rope_parameters.update(config.rope_scaling)
    out: dict[str, Any] = dict(
        model_type=config.model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        intermediate_size=config.intermediate_size,
        num_experts_per_tok=config.num_experts_per_tok,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters=rope_parameters,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        initializer_range=config.initializer_range,
        attention_bias=config.attention_bias,
        hidden_act="silu",
    )
    if config.num_mtp_layers:  # transformers' modeling ignores the MTP layers it names
        out["num_nextn_predict_layers"] = config.num_mtp_layers
    if config.model_type == "deepseek_v2":
        out.update(
            architectures=["DeepseekV2ForCausalLM"],
            head_dim=config.qk_rope_head_dim,
            moe_intermediate_size=config.moe_intermediate_size,
            n_routed_experts=config.num_experts,
            topk_method=config.topk_method,
            n_group=config.n_group,
            topk_group=config.topk_group,
            routed_scaling_factor=config.routed_scaling_factor,
            norm_topk_prob=config.norm_topk_prob,
            n_shared_experts=config.n_shared_experts,
            first_k_dense_replace=config.first_k_dense_replace,
            q_lora_rank=config.q_lora_rank,
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            aux_loss_alpha=config.aux_loss_alpha,
            seq_aux=config.seq_aux,
        )
    elif config.model_type == "deepseek_v3":
        out.update(
            architectures=["DeepseekV3ForCausalLM"],
            head_dim=config.qk_rope_head_dim,
            moe_intermediate_size=config.moe_intermediate_size,
            n_routed_experts=config.num_experts,
            scoring_func="sigmoid",
            topk_method="noaux_tc",
            n_group=config.n_group,
            topk_group=config.topk_group,
            routed_scaling_factor=config.routed_scaling_factor,
            norm_topk_prob=config.norm_topk_prob,
            n_shared_experts=config.n_shared_experts,
            first_k_dense_replace=config.first_k_dense_replace,
            q_lora_rank=config.q_lora_rank,
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            rope_interleave=config.rope_interleave,
            num_nextn_predict_layers=config.num_mtp_layers,
            aux_loss_alpha=config.aux_loss_alpha,
            seq_aux=config.seq_aux,
        )
    elif config.model_type == "gpt_oss":
        out.update(
            architectures=["GptOssForCausalLM"],
            head_dim=config.head_dim,
            num_local_experts=config.num_experts,
            sliding_window=config.sliding_window,
            layer_types=config.layer_types,
            swiglu_alpha=config.swiglu_alpha,
            swiglu_limit=config.swiglu_limit,
            output_router_logits=config.output_router_logits,
            router_aux_loss_coef=config.router_aux_loss_coef,
        )
    else:
        out.update(
            architectures=["Qwen3MoeForCausalLM"],
            head_dim=config.head_dim,
            moe_intermediate_size=config.moe_intermediate_size,
            num_experts=config.num_experts,
            norm_topk_prob=config.norm_topk_prob,
            mlp_only_layers=list(config.mlp_only_layers),
            decoder_sparse_step=config.decoder_sparse_step,
            output_router_logits=config.output_router_logits,
            router_aux_loss_coef=config.router_aux_loss_coef,
        )
    return out


def resolve_model(name_or_path: str) -> ModelConfig:
    """A preset name, a Hugging Face ``config.json``, or a checkpoint folder holding one."""
    if name_or_path in PRESET_NAMES:
        return preset(name_or_path)
    if os.path.exists(name_or_path):
        return config_from_hf(name_or_path)
    raise ValueError(
        f"model {name_or_path!r} is neither a preset ({', '.join(PRESET_NAMES)}) "
        "nor a path to a Hugging Face config.json"
    )


__all__ = ["config_from_hf", "config_to_hf", "resolve_model"]
