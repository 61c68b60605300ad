"""One model config for the four MoE families twinpipe trains.

`ModelConfig` holds the union of the fields of DeepSeek-V2, DeepSeek-V3, GPT-OSS and
Qwen3-MoE, named as in their Hugging Face `config.json` where the families
agree, so that `from_hf` / `to_hf` are a renaming and nothing is guessed.
Every config is validated when it is built: an impossible one raises
`ValueError` naming the field, its value and what would be valid, long before
any process group starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from math import inf
from typing import Any

from models.network.balancing import AUX_FORMS, Balancing

FAMILIES = ("deepseek_v2", "deepseek_v3", "gpt_oss", "qwen3_moe")
DEEPSEEK = ("deepseek_v2", "deepseek_v3")
"""The families with multi-head latent attention, dense first layers and shared experts."""
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_TYPES = ("default", "yarn")


@dataclass(slots=True)
class ModelConfig:
    """Shapes and semantics of a MoE decoder-only language model."""

    model_type: str
    """Family: one of `FAMILIES` (as in HF ``model_type``)."""
    vocab_size: int
    """Number of token ids; rows of the embedding and of the output layer."""
    hidden_size: int
    """Width of the residual stream."""
    num_hidden_layers: int
    """Number of decoder layers."""
    num_attention_heads: int
    """Query heads per layer."""
    num_key_value_heads: int
    """Key/value heads per layer (GQA); must divide ``num_attention_heads``."""
    head_dim: int
    """Per-head width of q/k/v (GPT-OSS, Qwen3); for DeepSeek-V2, HF stores the rope width here."""
    intermediate_size: int
    """Hidden width of a dense MLP layer."""
    moe_intermediate_size: int
    """Hidden width of one routed (and one shared) expert."""
    num_experts: int
    """Routed experts per MoE layer (HF: ``n_routed_experts`` / ``num_local_experts``)."""
    num_experts_per_tok: int
    """Experts each token is routed to (top-k)."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies."""
    rope_scaling: dict[str, Any] | None = None
    """Rotary scaling (``{"rope_type": "yarn", "factor": ..., ...}``) or None for plain RoPE."""
    max_position_embeddings: int = 4096
    """Longest sequence the rotary tables are built for."""
    tie_word_embeddings: bool = False
    """Output layer shares the embedding matrix."""
    initializer_range: float = 0.02
    """Std of the normal initialisation of linear and embedding weights."""
    attention_bias: bool = False
    """Biases on the attention projections (GPT-OSS: on q/k/v/o; DeepSeek: on the a-projections)."""
    # Router.
    topk_method: str = "greedy"
    """DeepSeek routing: ``greedy`` or ``group_limited_greedy`` (V2); ``noaux_tc`` (V3, the
    only one: sigmoid scores, groups ranked by the sum of their two best biased scores)."""
    n_group: int | None = None
    """DeepSeek group-limited routing: number of expert groups."""
    topk_group: int | None = None
    """DeepSeek group-limited routing: groups a token may use."""
    routed_scaling_factor: float = 1.0
    """DeepSeek: routed expert weights are multiplied by this."""
    norm_topk_prob: bool = False
    """Qwen3-MoE, DeepSeek-V3: renormalise the top-k weights to sum to one."""
    # Which layers are MoE.
    n_shared_experts: int = 0
    """DeepSeek: shared experts, fused as one MLP of width ``moe_intermediate_size * n``."""
    first_k_dense_replace: int = 0
    """DeepSeek: the first k layers are dense MLPs."""
    mlp_only_layers: list[int] = field(default_factory=list)
    """Qwen3-MoE: layers that use a dense MLP."""
    decoder_sparse_step: int = 1
    """Qwen3-MoE: layer i is MoE when ``(i + 1) % decoder_sparse_step == 0``."""
    # DeepSeek multi-head latent attention.
    q_lora_rank: int | None = None
    """MLA: rank of the query compression; None projects queries directly."""
    kv_lora_rank: int = 0
    """MLA: rank of the joint key/value compression."""
    qk_nope_head_dim: int = 0
    """MLA: per-head query/key width without rotary."""
    qk_rope_head_dim: int = 0
    """MLA: per-head query/key width with rotary (one shared rotary key)."""
    v_head_dim: int = 0
    """MLA: per-head value width."""
    rope_interleave: bool = True
    """DeepSeek-V3 (transformers' ``rope_interleave``): the rotary width holds interleaved
    pairs, rotated on the even/odd slices; false: rotate-half. (V2 is always interleaved.)"""
    # GPT-OSS.
    sliding_window: int | None = None
    """GPT-OSS: window of the sliding-attention layers."""
    layer_types: list[str] | None = None
    """GPT-OSS: ``full_attention`` or ``sliding_attention`` per layer."""
    swiglu_alpha: float = 1.702
    """GPT-OSS: slope inside the clamped SwiGLU's sigmoid."""
    swiglu_limit: float = 7.0
    """GPT-OSS: clamp of the gate (above) and up (both sides) projections."""
    num_mtp_layers: int = 0
    """Multi-token prediction (DeepSeek-V3's MTP module, `models.network.mtp`): its depth
    ``D``, one extra decoder layer per depth (HF: ``num_nextn_predict_layers``; the run's
    ``[mtp] layers``); 0: none."""
    mtp_loss_coef: float = 0.1
    """The MTP losses' weight ``lambda`` in ``L_main + lambda / D * sum_k L_k`` (the run's
    ``[mtp] loss_coef``; Megatron's default 0.1)."""
    # Routing controls (`models.network.balancing`): the HF fields, then a run's choices.
    output_router_logits: bool = False
    """Qwen3-MoE, GPT-OSS (HF): train on the language-model loss plus
    ``router_aux_loss_coef`` times transformers' pooled load-balancing loss."""
    router_aux_loss_coef: float = 0.0
    """Qwen3-MoE, GPT-OSS (HF): that loss's coefficient (published: 0.001 and 0.9)."""
    aux_loss_alpha: float = 0.0
    """DeepSeek-V2 (HF): coefficient of DeepSeek's own balancing loss (transformers' modeling
    ignores it; DeepSeek's trains with it): on when positive."""
    seq_aux: bool = True
    """DeepSeek-V2 (HF): that loss per sequence (else per layer over the micro-batch)."""
    aux_loss: str = "auto"
    """The run's load-balancing loss: ``auto`` (what the HF fields above ask), ``none``, or a
    form of `models.network.balancing.AUX_FORMS` (the ``[moe]`` section's ``aux_loss``)."""
    aux_loss_coef: float | None = None
    """The run's coefficient of that loss; None: the family's HF field."""
    router_z_loss_coef: float = 0.0
    """Router z-loss coefficient (ST-MoE; 0: off)."""
    expert_bias: bool = False
    """Aux-loss-free balancing: a float32 bias per MoE layer, added to the router's scores to
    choose experts (``e_score_correction_bias``). Always on for DeepSeek-V3, whose model it
    is part of (loaded, used, checkpointed and exported); ``expert_bias_rate = 0`` keeps it
    fixed."""
    expert_bias_rate: float = 1e-3
    """How far each optimizer step moves the expert bias (DeepSeek-V3's gamma: 0.001 for
    most of its pre-training, then 0)."""

    def __post_init__(self) -> None:
        self.validate()

    # ----------------------------------------------------------------- queries
    @property
    def family(self) -> str:
        return self.model_type

    @property
    def is_deepseek(self) -> bool:
        """DeepSeek-V2 or V3: MLA, dense first layers, shared experts, a float32 router."""
        return self.model_type in DEEPSEEK

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` routes to experts (else it is a dense MLP)."""
        if self.is_deepseek:
            return layer >= self.first_k_dense_replace
        if self.model_type == "qwen3_moe":
            return (
                layer not in self.mlp_only_layers
                and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0
            )
        return True  # GPT-OSS: every layer

    def layer_type(self, layer: int) -> str:
        if self.layer_types is None or layer >= self.num_hidden_layers:
            return "full_attention"  # an MTP layer attends over the whole sequence
        return self.layer_types[layer]

    @property
    def moe_layers(self) -> int:
        """How many decoder layers route to experts."""
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    @property
    def routed_layers(self) -> int:
        """MoE layers of the main model and of the MTP module: the layers the pooled
        load-balancing loss counts (`models.network.balancing`)."""
        n = self.num_hidden_layers
        return self.moe_layers + sum(self.is_moe_layer(n + k) for k in range(self.num_mtp_layers))

    def balancing(self) -> Balancing:
        """The routing controls this config trains with (`models.network.Balancing`)."""
        if self.is_deepseek:
            coef = self.aux_loss_alpha
            family_form = "sequence" if self.seq_aux else "layer"
            family_form = family_form if coef > 0 else "none"
        else:
            coef = self.router_aux_loss_coef
            family_form = "pooled" if self.output_router_logits else "none"
        form = family_form if self.aux_loss == "auto" else self.aux_loss
        if self.aux_loss_coef is not None:
            coef = self.aux_loss_coef
        return Balancing(
            form, float(coef), float(self.router_z_loss_coef), self.expert_bias,
            float(self.expert_bias_rate),
        )  # fmt: skip

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # -------------------------------------------------------------- validation
    def validate(self) -> None:
        def bad(name: str, value: Any, valid: str) -> ValueError:
            return ValueError(f"ModelConfig.{name}={value!r} is invalid: {valid}")

        if self.model_type not in FAMILIES:
            raise bad("model_type", self.model_type, f"expected one of {FAMILIES}")
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "moe_intermediate_size",
            "num_experts_per_tok",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise bad(name, value, "expected a positive integer")
        if not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise bad("num_experts", self.num_experts, "expected an integer >= 0")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad(
                "num_key_value_heads",
                self.num_key_value_heads,
                f"must divide num_attention_heads={self.num_attention_heads}",
            )
        if not isinstance(self.decoder_sparse_step, int) or self.decoder_sparse_step < 1:
            raise bad("decoder_sparse_step", self.decoder_sparse_step, "expected an integer >= 1")
        has_moe = any(self.is_moe_layer(i) for i in range(self.num_hidden_layers))
        if has_moe and self.num_experts_per_tok > self.num_experts:
            raise bad(
                "num_experts_per_tok",
                self.num_experts_per_tok,
                f"top-k cannot exceed num_experts={self.num_experts}",
            )
        if self.topk_method not in TOPK_METHODS:
            raise bad("topk_method", self.topk_method, f"expected one of {TOPK_METHODS}")
        v3 = self.model_type == "deepseek_v3"
        if v3 != (self.topk_method == "noaux_tc"):
            raise bad(
                "topk_method",
                self.topk_method,
                "DeepSeek-V3 routes with 'noaux_tc' only (transformers' DeepseekV3TopkRouter), "
                "the other families with 'greedy' (DeepSeek-V2 also 'group_limited_greedy')",
            )
        if v3 and not self.expert_bias:
            raise bad(
                "expert_bias",
                self.expert_bias,
                "DeepSeek-V3 chooses experts on scores + e_score_correction_bias, part of the "
                "model: it is always on (expert_bias_rate = 0 keeps it fixed)",
            )
        if self.topk_method in ("group_limited_greedy", "noaux_tc"):
            if not self.n_group or self.num_experts % self.n_group:
                raise bad(
                    "n_group",
                    self.n_group,
                    f"must be >= 1 and divide num_experts={self.num_experts}",
                )
            if not self.topk_group or self.topk_group > self.n_group:
                raise bad("topk_group", self.topk_group, f"must be in [1, n_group={self.n_group}]")
            per_group = self.num_experts // self.n_group
            if v3 and per_group < 2:
                raise bad(
                    "n_group",
                    self.n_group,
                    "noaux_tc scores a group by its two best experts: num_experts / n_group "
                    f"= {self.num_experts} / {self.n_group} must be at least 2",
                )
            if self.num_experts_per_tok > self.topk_group * per_group:
                raise bad(
                    "num_experts_per_tok",
                    self.num_experts_per_tok,
                    f"exceeds the {self.topk_group * per_group} experts of topk_group groups",
                )
        if self.rms_norm_eps <= 0:
            raise bad("rms_norm_eps", self.rms_norm_eps, "expected a positive float")
        if self.rope_theta <= 0:
            raise bad("rope_theta", self.rope_theta, "expected a positive float")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rope_type not in ROPE_TYPES:
                raise bad("rope_scaling.rope_type", rope_type, f"expected one of {ROPE_TYPES}")
            if rope_type == "yarn" and not self.rope_scaling.get("factor", 0) > 0:
                raise bad("rope_scaling.factor", self.rope_scaling.get("factor"), "yarn needs > 0")
        if self.is_deepseek:
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                value = getattr(self, name)
                if not isinstance(value, int) or value <= 0:
                    raise bad(name, value, "DeepSeek's MLA needs a positive integer")
            if self.qk_rope_head_dim % 2:
                raise bad("qk_rope_head_dim", self.qk_rope_head_dim, "rotary needs an even width")
            if self.q_lora_rank is not None and self.q_lora_rank <= 0:
                raise bad("q_lora_rank", self.q_lora_rank, "expected None or a positive integer")
            if self.first_k_dense_replace < 0:
                raise bad("first_k_dense_replace", self.first_k_dense_replace, "expected >= 0")
        elif self.head_dim % 2:
            raise bad("head_dim", self.head_dim, "rotary needs an even width")
        if self.model_type == "gpt_oss":
            if self.layer_types is not None:
                if len(self.layer_types) != self.num_hidden_layers:
                    raise bad(
                        "layer_types",
                        self.layer_types,
                        f"needs one entry per layer ({self.num_hidden_layers})",
                    )
                for kind in self.layer_types:
                    if kind not in LAYER_TYPES:
                        raise bad("layer_types", kind, f"entries must be one of {LAYER_TYPES}")
                window = self.sliding_window
                if "sliding_attention" in self.layer_types and not (
                    isinstance(window, int) and window >= 1
                ):
                    raise bad("sliding_window", window, "sliding layers need an integer >= 1")
            if self.swiglu_limit <= 0:
                raise bad("swiglu_limit", self.swiglu_limit, "expected a positive float")
        if self.aux_loss not in ("auto", *AUX_FORMS):
            raise bad("aux_loss", self.aux_loss, f"expected 'auto' or one of {AUX_FORMS}")
        for name in ("router_aux_loss_coef", "aux_loss_alpha", "router_z_loss_coef",
                     "expert_bias_rate"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0:
                raise bad(name, value, "expected a float >= 0")
        mtp = self.num_mtp_layers
        if not isinstance(mtp, int) or isinstance(mtp, bool) or mtp < 0:
            raise bad("num_mtp_layers", mtp, "expected an integer >= 0 (the MTP depth D)")
        coef = self.mtp_loss_coef
        if not isinstance(coef, int | float) or isinstance(coef, bool) or not 0 <= coef < inf:
            raise bad("mtp_loss_coef", coef, "expected a finite float >= 0")
        if self.aux_loss_coef is not None and not (
            isinstance(self.aux_loss_coef, int | float) and self.aux_loss_coef >= 0
        ):
            raise bad("aux_loss_coef", self.aux_loss_coef, "expected None or a float >= 0")
        balancing = self.balancing()
        if self.aux_loss not in ("auto", "none") and not balancing.aux_coef > 0:
            raise bad(
                "aux_loss",
                self.aux_loss,
                "a load-balancing loss needs a positive coefficient: set aux_loss_coef (the "
                "model's config gives none)",
            )
        if self.model_type == "qwen3_moe":
            for layer in self.mlp_only_layers:
                if not 0 <= layer < self.num_hidden_layers:
                    raise bad(
                        "mlp_only_layers", layer, f"layers are 0..{self.num_hidden_layers - 1}"
                    )
