"""What Megatron's published estimator would say for the same layout, for comparison.

Weights and optimizer: the MoE-aware formula of Megatron-LM PR #4687 (three
parameter buckets; 18 bytes per parameter, or ``6 + 12 / DP`` with the
distributed optimizer, where routed experts use the expert-DP group) on the
most loaded shard of a plain pipeline (``layers / PP`` plus the embedding).
Activations: Korthikanti et al.'s selective-recompute formula as Megatron codes
it (``s * b * h * (18 + 4 * ffn / h)`` per layer, 16-bit, sequence parallel,
first stage holding ``PP`` micro-batches), divided by TP.
"""

from __future__ import annotations

from optimized.estimator.config import EstimateConfig
from optimized.estimator.params import (
    embedding_params,
    layer_params,
    mtp_params,
    shard,
)


def megatron_weight_and_optimizer_bytes(config: EstimateConfig) -> float:
    layers = _layer_params_per_rank(config)
    per_rank = {bucket: layers[bucket] / config.pp for bucket in layers}
    embedding = shard(embedding_params(config.model), config)["tensor_sharded"]
    dense = per_rank["tensor_sharded"] + per_rank["replicated"] + embedding
    experts = per_rank["routed_experts"]
    if config.shard_optimizer:
        dense_bytes = 6 + 12 / config.dp
        expert_bytes = 6 + 12 / config.expert_dp
    else:
        dense_bytes = expert_bytes = 18
    return dense * dense_bytes + experts * expert_bytes


def _layer_params_per_rank(config: EstimateConfig) -> dict[str, float]:
    """Per-rank (sharded) parameters of all decoder layers and MTP blocks, by bucket."""
    total = {"tensor_sharded": 0, "replicated": 0, "routed_experts": 0}
    for layer in range(config.model.num_hidden_layers):
        for bucket, value in shard(layer_params(config, layer), config).items():
            total[bucket] += value
    for bucket, value in shard(mtp_params(config).scaled(config.mtp_layers), config).items():
        total[bucket] += value
    return total


def megatron_activation_bytes(config: EstimateConfig, num_microbatches: int | None) -> float:
    m = config.model
    s, b, h = config.seq_len, config.micro_batch_size, m.hidden_size
    ffn = m.intermediate_size
    memory = s * b * h * (18 + 4 * ffn / h) * m.num_hidden_layers
    memory += 8 * s * b * config.pp  # embedding inputs
    memory += s * b * h * config.pp  # embedding dropout
    if config.pp > 1 and num_microbatches is not None:
        memory *= min(1, num_microbatches / config.pp)
    if config.pp == 1:
        memory += s * b * h * 4 * (1 + m.vocab_size / h)  # output layer and loss
    return memory / config.tp
