"""What DeepSeek-V3's multi-token-prediction module (`models.network.mtp`) adds to the loss
stage's walk, in both stacks: its gradients (`mtp_grad_bytes`), made by its backward, which
runs before the main head's and the loss stage's layers' (autograd takes the MTP's nodes,
made last, first).
"""

from __future__ import annotations

from optimized.estimator.config import EstimateConfig
from optimized.estimator.memory import grad_divisor
from optimized.estimator.params import mtp_params


def mtp_grad_bytes(config: EstimateConfig) -> int:
    """The MTP layers' gradients on pp-rank 0: FSDP2 units like a layer's
    (`optimized.pipeline.sharding`), whole until the loss stage's last backward reduces them
    (``grad_sync="step"``), this rank's rows with ``micro-batch``; routed experts this EP
    rank's. (Its backward also adds into the embedding's gradient: the walks count that.)"""
    numel = mtp_params(config).scaled(config.mtp_layers).numel
    dense = numel["tensor_sharded"] + numel["replicated"]
    grad = -(-dense // grad_divisor(config))
    grad += -(-(numel["routed_experts"] // config.ep) // grad_divisor(config, True))
    return grad * config.grad_bytes
