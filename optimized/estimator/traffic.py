"""Bytes one rank sends per training step, by kind of communication, from the configs alone.

Used by `twinpipe plan` to rank layouts that fit. The terms follow what the code calls
(bytes that leave the rank; under balanced routing each rank receives as much as it sends):

- ``all_to_all``: each MoE layer of the rank's two chunks, per micro-batch, exchanges its
  expert counts (``num_experts`` int64) and then runs four row exchanges of ``tokens x
  top_k`` rows of ``hidden_size`` (dispatch and combine, and their backward); a share
  ``(EP - 1) / EP`` of the rows goes to other ranks (`models.decoder.DecoderLayer.dispatch`);
- ``p2p``: the DualPipeV messages of `optimized.estimator.schedule.comm_events`, one
  ``tokens x hidden`` activation or gradient each;
- ``data_parallel``: without FSDP one all-reduce per step of every gradient (non-expert
  over DP, routed experts over their ``DP / EP`` replicas; `models.training.reduce_gradients`),
  a ring sending ``2 (n - 1) / n`` of the bytes; with FSDP2 (`optimized.pipeline.sharding`)
  each module's parameters are all-gathered for every forward and every backward and its
  gradients reduce-scattered after every backward (``(n - 1) / n`` each), and what stays
  off FSDP2 (routed experts at EP = DP, a tied embedding) is all-reduced once and its
  updated shards all-gathered.

An exact communication model (measured call by call) is being written beside this one in
`optimized.estimator`; `step_traffic` is the single function `twinpipe plan` calls, so it
can be swapped for that model without touching the plan.
"""

from __future__ import annotations

from optimized.estimator.activations import I64
from optimized.estimator.config import EstimateConfig
from optimized.estimator.params import embedding_params, head_params, layer_params, shard
from optimized.estimator.schedule import comm_events

KINDS = ("all_to_all", "p2p", "data_parallel")


def _ring(group: int) -> float:
    """Share of a tensor one rank sends in a ring reduce-scatter or all-gather."""
    return (group - 1) / group if group > 1 else 0.0


def step_traffic(config: EstimateConfig, rank: int, partition: list[range]) -> dict[str, int]:
    """Bytes pp-rank ``rank`` sends in one step, per kind (see the module docstring)."""
    m, b = config.model, config.param_bytes
    stages = (rank, config.num_stages - 1 - rank)
    layers = [layer for stage in dict.fromkeys(stages) for layer in partition[stage]]
    moe = config.moe_layers()
    micro_batches = config.num_microbatches
    rows = config.tokens * m.num_experts_per_tok
    per_exchange = rows * m.hidden_size * b * _ring(config.ep)
    counts = m.num_experts * I64 * _ring(config.ep)
    moe_layers = sum(1 for layer in layers if moe[layer])
    all_to_all = round(moe_layers * micro_batches * (4 * per_exchange + counts))

    message = config.tokens * m.hidden_size * b
    sends = sum(1 for e in comm_events(rank, config.pp, micro_batches) if e.op == "send")
    p2p = sends * message

    dense = experts = 0
    for layer in layers:
        sharded = shard(layer_params(config, layer), config)
        experts += sharded["routed_experts"]
        dense += sharded["tensor_sharded"] + sharded["replicated"]
    tied = m.tie_word_embeddings
    off_fsdp_dense = 0
    if 0 in stages:
        embedding = shard(embedding_params(m), config)["tensor_sharded"]
        dense += embedding
        off_fsdp_dense += embedding if tied else 0
    if config.num_stages - 1 in stages:
        dense += sum(shard(head_params(m), config).values())
    replicas = config.expert_dp
    if not config.fsdp:
        data_parallel = dense * config.grad_bytes * 2 * _ring(config.dp)
        data_parallel += experts * config.grad_bytes * 2 * _ring(replicas)
    else:
        # Per micro-batch and chunk: gather for F, gather for B, reduce-scatter after B.
        per_use = b * 2 + config.grad_bytes
        sharded_dense = dense - off_fsdp_dense
        data_parallel = micro_batches * sharded_dense * per_use * _ring(config.dp)
        data_parallel += off_fsdp_dense * (config.grad_bytes * 2 + b) * _ring(config.dp)
        if replicas > 1:
            data_parallel += micro_batches * experts * per_use * _ring(replicas)
    return {"all_to_all": all_to_all, "p2p": p2p, "data_parallel": round(data_parallel)}


__all__ = ["KINDS", "step_traffic"]
