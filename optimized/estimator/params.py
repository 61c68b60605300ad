"""Parameter counts of twinpipe's models, by the bucket that decides how they shard.

| bucket | what | divided by |
|---|---|---|
| ``tensor_sharded`` | attention, dense MLP, shared experts, embedding, output layer | TP |
| ``replicated`` | norms, router, shared-expert gate | 1 |
| ``routed_experts`` | the routed experts' weights and biases | EP (experts) x ETP (width) |

Counts follow `models.network.layers` module by module (the tests hold them against
``sum(p.numel())`` of the built modules), so the per-rank weight, gradient and
optimizer bytes are exact. Each count also carries how many parameter *tensors*
it is made of: `torch.optim.AdamW` keeps a 4-byte ``step`` per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from models.network import ModelConfig
from optimized.estimator.config import EstimateConfig

BUCKETS = ("tensor_sharded", "replicated", "routed_experts")


@dataclass(slots=True)
class ParamCount:
    """Parameters and parameter tensors, per bucket."""

    numel: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BUCKETS, 0))
    """Parameters per bucket."""
    tensors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BUCKETS, 0))
    """Parameter tensors per bucket."""
    largest: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BUCKETS, 0))
    """The largest single tensor per bucket (unsharded), for the optimizer's temporaries."""

    def add(self, bucket: str, *sizes: int) -> ParamCount:
        for size in sizes:
            self.numel[bucket] += size
            self.tensors[bucket] += 1
            self.largest[bucket] = max(self.largest[bucket], size)
        return self

    def __iadd__(self, other: ParamCount) -> ParamCount:  # noqa: PYI034
        for bucket in BUCKETS:
            self.numel[bucket] += other.numel[bucket]
            self.tensors[bucket] += other.tensors[bucket]
            self.largest[bucket] = max(self.largest[bucket], other.largest[bucket])
        return self

    def scaled(self, factor: int) -> ParamCount:
        out = ParamCount()
        for bucket in BUCKETS:
            out.numel[bucket] = self.numel[bucket] * factor
            out.tensors[bucket] = self.tensors[bucket] * factor
            out.largest[bucket] = self.largest[bucket] if factor else 0
        return out

    @property
    def total(self) -> int:
        return sum(self.numel.values())

    @property
    def num_tensors(self) -> int:
        return sum(self.tensors.values())


def attention_params(model: ModelConfig) -> ParamCount:
    """One layer's attention: projections (sharded), sinks (sharded by head), q/k norms."""
    c, count = model, ParamCount()
    hidden, heads, bias = c.hidden_size, c.num_attention_heads, c.attention_bias
    if c.is_deepseek:
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        if c.q_lora_rank is None:
            count.add("tensor_sharded", hidden * heads * qk)
        else:
            count.add("tensor_sharded", hidden * c.q_lora_rank, c.q_lora_rank * heads * qk)
            if bias:
                count.add("tensor_sharded", c.q_lora_rank)
            count.add("replicated", c.q_lora_rank)  # q_a_layernorm
        kv_a = c.kv_lora_rank + c.qk_rope_head_dim
        count.add("tensor_sharded", hidden * kv_a)
        if bias:
            count.add("tensor_sharded", kv_a)
        count.add("replicated", c.kv_lora_rank)  # kv_a_layernorm
        count.add("tensor_sharded", c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim))
        count.add("tensor_sharded", heads * c.v_head_dim * hidden)
        if bias:
            count.add("tensor_sharded", hidden)
        return count
    q, kv = heads * c.head_dim, c.num_key_value_heads * c.head_dim
    count.add("tensor_sharded", hidden * q, hidden * kv, hidden * kv, q * hidden)
    if bias:
        count.add("tensor_sharded", q, kv, kv, hidden)
    if c.model_type == "qwen3_moe":
        count.add("replicated", c.head_dim, c.head_dim)
    if c.model_type == "gpt_oss":
        count.add("tensor_sharded", heads)  # sinks
    return count


def dense_mlp_params(hidden: int, inner: int) -> ParamCount:
    return ParamCount().add("tensor_sharded", hidden * inner, hidden * inner, inner * hidden)


def moe_params(config: EstimateConfig) -> ParamCount:
    """Router, all routed experts (unsharded) and shared experts of one MoE layer."""
    c, count = config.model, ParamCount()
    hidden, inner, experts = c.hidden_size, c.moe_intermediate_size, c.num_experts
    count.add("replicated", experts * hidden)
    if c.model_type == "gpt_oss":
        count.add("replicated", experts)  # router bias
        count.add(
            "routed_experts",
            experts * hidden * 2 * inner,
            experts * 2 * inner,
            experts * inner * hidden,
            experts * hidden,
        )
    else:
        count.add("routed_experts", experts * 2 * inner * hidden, experts * hidden * inner)
    if config.shared_expert_width:
        count += dense_mlp_params(hidden, config.shared_expert_width)
        if config.shared_expert_gate:
            count.add("replicated", hidden)
    return count


def layer_params(config: EstimateConfig, layer: int, is_moe: bool | None = None) -> ParamCount:
    """One decoder layer, unsharded: two norms, attention, dense MLP or MoE."""
    model = config.model
    if is_moe is None:
        is_moe = config.moe_layers()[layer]
    count = ParamCount().add("replicated", model.hidden_size, model.hidden_size)
    count += attention_params(model)
    if is_moe:
        count += moe_params(config)
    else:
        count += dense_mlp_params(model.hidden_size, model.intermediate_size)
    return count


def embedding_params(model: ModelConfig) -> ParamCount:
    return ParamCount().add("tensor_sharded", model.vocab_size * model.hidden_size)


def head_params(model: ModelConfig) -> ParamCount:
    """Final norm and output layer (the output layer shares the embedding when tied)."""
    count = ParamCount().add("replicated", model.hidden_size)
    if not model.tie_word_embeddings:
        count.add("tensor_sharded", model.vocab_size * model.hidden_size)
    return count


def mtp_params(config: EstimateConfig) -> ParamCount:
    """One multi-token-prediction block (DeepSeek-V3 / Megatron layout): two input norms,
    the ``[2H -> H]`` projection, a decoder layer of the last layer's kind (Megatron builds
    it from the last layer's spec) and the shared head's norm. The embedding and output
    layer are the main model's."""
    hidden = config.model.hidden_size
    count = ParamCount().add("replicated", hidden, hidden, hidden)
    count.add("tensor_sharded", 2 * hidden * hidden)
    count += layer_params(config, 0, is_moe=config.moe_layers()[-1])
    return count


def model_params(config: EstimateConfig) -> ParamCount:
    """The whole model, unsharded, MTP blocks included."""
    count = embedding_params(config.model)
    for layer in range(config.model.num_hidden_layers):
        count += layer_params(config, layer)
    count += head_params(config.model)
    count += mtp_params(config).scaled(config.mtp_layers)
    return count


def active_params(config: EstimateConfig, total: ParamCount | None = None) -> int:
    """Parameters one token touches: the total minus the routed experts it skips."""
    total = total or model_params(config)
    model = config.model
    if not model.num_experts:
        return total.total
    skipped = total.numel["routed_experts"] * (1 - model.num_experts_per_tok / model.num_experts)
    return total.total - round(skipped)


def stage_params(config: EstimateConfig, stage: int, layers: range) -> ParamCount:
    """Unsharded parameters of one pipeline stage: its layers, plus the embedding on
    stage 0 and the head (and MTP blocks) on the last stage."""
    count = ParamCount()
    if stage == 0:
        count += embedding_params(config.model)
    for layer in layers:
        count += layer_params(config, layer)
    if stage == config.num_stages - 1:
        count += head_params(config.model)
        count += mtp_params(config).scaled(config.mtp_layers)
    return count


def shard(count: ParamCount, config: EstimateConfig) -> dict[str, int]:
    """Per-rank parameters of each bucket: sharded by TP, replicated, or by ETP x EP."""
    return {
        "tensor_sharded": -(-count.numel["tensor_sharded"] // config.tp),
        "replicated": count.numel["replicated"],
        "routed_experts": count.numel["routed_experts"] // (config.etp * config.ep),
    }
