"""What DeepSeek-V3's multi-token-prediction module (`models.network.mtp`) adds to the loss
stage's walk: its gradients (`mtp_grad_bytes`, both stacks), and in the optimized stack
what each depth keeps and the high points of its forward and backward (`MtpDepth`).

The reference stack's depth is `activations.mtp_depth_saved` under its walk's head
moments. The optimized stack (`optimized.pipeline.mtp_stage`) runs each depth as one plain
decoder layer under autograd with the stack's ops, after the main head's fused loss, its
loss with the same fused output layer: read off that code and held against a storage
tracker (tests/test_mtp_estimator.py) and the measured peak
(tests/test_estimator_vs_measured.py):

- kept to the backward: the final norm's rerun for ``h^0`` (`mtp_final_norm_saved`, once);
  per depth the embedding's indices, ``enorm``, ``hnorm``, ``eh_proj``'s ``[T, 2H]``
  input; the decoder layer as a plain forward keeps it: the attention block's input only
  (recomputed in backward; without recompute the block's saved tensors,
  `recompute.kept_block`), the post-attention norm, router, dispatch and shared experts as
  the reference keeps them, the grouped input, gate/up output and fused activation, the
  gather index and group offsets, the router weights in the run dtype and the padded
  gathered expert output (no positions, no weighted copy: `scatter_add_rows` keeps its
  index only); ``shared_head.norm`` without its output (the fused loss keeps no copy of
  its input); the fused loss's finished ``grad_hidden`` and its ``[vocab, H]``
  ``grad_weight`` (added into the output layer's ``.grad`` by the backward);
- the forward's high point: inside the layer, at the experts' gather back into the
  received order (`steps`' ``experts_forward`` moment), with everything the stage-1 record
  holds still referenced by the layer's locals (the padded sorted tokens too, which the
  staged layer frees at the dispatch); after it, the fused loss's buffer
  (`memory.fused_loss_transient`) or the top-1 figure's ``[min(T, top1_rows), vocab]``
  logits beside the normed state; in 16-bit the embedding's output and the previous
  depth's state (their norms keep float copies) beside either, as the stage's locals;
- the backward (the MTP's nodes, made last, run first), once its loss state and the
  shared head norm's are freed: at the aggregate's (`steps`' ``aggregate_backward``
  moment) or, the gathered expert output freed, at the grouped experts'
  (`steps.experts_backward_rise`, weight gradients at once), whichever is higher (the
  experts' unless the routing leaves few grouped rows).
"""

from __future__ import annotations

from dataclasses import dataclass

from models.network import top1_rows
from optimized.estimator.activations import (
    F32,
    GATHER_ALIGNMENT,
    I64,
    Saved,
    layer_saved,
    mtp_depth_saved,
    routed,
)
from optimized.estimator.config import EstimateConfig
from optimized.estimator.memory import fused_loss_transient, grad_divisor
from optimized.estimator.params import mtp_params
from optimized.estimator.recompute import kept_block
from optimized.estimator.steps import experts_backward_rise, round_up, step_profile


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


@dataclass(frozen=True, slots=True)
class MtpDepth:
    """One optimized MTP depth for one micro-batch, relative to the level it starts from."""

    saved: list[Saved]
    """What it keeps to the backward."""
    layer_rise: int
    """Its forward's high point inside its decoder layer (at the routed experts)."""
    loss_rise: int
    """Its forward's high point at its loss (the fused loss's buffer or the top-1 logits)."""
    backward_rise: int
    """Its backward's high point, from the level with everything it keeps."""


def optimized_mtp_depth(config: EstimateConfig) -> MtpDepth:
    """One depth as `optimized.pipeline.mtp_stage` runs it (see the module docstring);
    ``config``: with the depth's routing (``expert_load``) when observed."""
    m, b, tokens = config.model, config.param_bytes, config.tokens
    hidden, th = m.hidden_size, config.tokens * m.hidden_size * b
    layer, is_moe = m.num_hidden_layers - 1, config.moe_layers()[-1]
    gpt_oss = m.model_type == "gpt_oss"
    inputs = ("mtp.embedding.", "mtp.enorm.", "mtp.hnorm.", "mtp.eh_proj.")
    saved = [item for item in mtp_depth_saved(config) if item.name.startswith(inputs)]
    # The attention block's input (in float32 also its norm's float input), the block
    # itself only without recompute (in 16-bit the norm's float copy is in it).
    if config.recompute or b == F32:
        saved.append(Saved("mtp.attention.input", th))
    if not config.recompute:
        saved.append(Saved("mtp.attention.block", kept_block(config, layer)))
    items = layer_saved(config.replace(stack="reference"), layer, is_moe)
    stage = ("post_attention_layernorm.", "router.", "dispatch.", "shared_experts.", "mlp.")
    saved += [item for item in items if item.name.startswith(stage)]
    profile = step_profile(config, layer)
    before_layer = sum(item.nbytes for item in saved)
    forward = before_layer
    if is_moe:
        rows = routed(config)
        local = max(m.num_experts // config.ep, 1)
        inner = m.moe_intermediate_size // config.etp
        expert_out = round_up(rows.received, GATHER_ALIGNMENT) * hidden * b
        saved += [
            Saved("mtp.experts.gather_index", rows.received * I64),
            Saved("mtp.experts.offsets", local * 4),
            Saved("mtp.experts.grouped", rows.grouped * (hidden + 3 * inner) * b),
            Saved("mtp.experts.row_groups", 2 * rows.grouped * I64 if gpt_oss else 0),
            Saved("mtp.aggregate.weights", rows.sent * b),
            Saved("mtp.aggregate.expert_output", expert_out),
        ]
        # The stage-1 record stays referenced by the layer's locals through the experts.
        stage1 = profile.forward["attention_forward"].delta - kept_block(config, layer) * (
            not config.recompute
        )
        stage1 -= sum(item.nbytes for item in items if item.name.startswith(stage))
        received = profile.forward["dispatch_start"].delta  # EP: the received rows
        experts = profile.forward["experts_forward"].transient
        forward = before_layer + stage1 + received + experts
        # The aggregate's backward (the combined rows' and the router weights' gradients
        # beside the padded sorted rows; no stage leaf, so no copy of the residual's
        # gradient), then the experts' once the gathered output is freed.
        aggregate = profile.backward["aggregate_backward"].transient - th
        experts = experts_backward_rise(config, rows, local, inner, deferred=False)
        backward = max(aggregate, experts - expert_out)
    else:  # a dense layer: its forward's high point (the residual add) over its input
        forward += profile.forward["attention_forward"].transient
        forward -= sum(item.nbytes for item in items if item.name.startswith(stage[0]))
        forward -= sum(item.nbytes for item in items if item.name.startswith("mlp."))
        backward = profile.backward["attention_backward"].transient
    head_norm = [
        item for item in mtp_depth_saved(config)
        if item.name.startswith("mtp.shared_head.norm.") and not item.name.endswith(".output")
    ]  # fmt: skip
    vocab = m.vocab_size // config.tp
    loss = [
        Saved("mtp.loss.grad_hidden", th),
        Saved("mtp.loss.grad_weight", vocab * hidden * b),
        Saved("mtp.loss.scalars", 8),
    ]
    saved += head_norm + loss
    kept = sum(item.nbytes for item in saved)
    before_loss = kept - sum(item.nbytes for item in loss)
    # The fused loss's buffer beside its normed input; then the top-1 figure's logits
    # beside the normed state and the loss's kept state.
    rows = min(tokens, top1_rows(vocab))
    top1 = rows * vocab * b + rows * I64 + th
    at_loss = max(before_loss + fused_loss_transient(config), kept + top1)
    # In 16-bit the depth's inputs outlive their norms' float copies as the stage's locals:
    # the embedding's output to the depth's end, the previous state to the layer's.
    if b != F32:
        forward, at_loss = forward + 2 * th, at_loss + th
    freed = sum(item.nbytes for item in loss) + sum(item.nbytes for item in head_norm[1:])
    return MtpDepth(saved, forward, at_loss, backward - freed)


def optimized_mtp_depths(config: EstimateConfig, routing=None, micro_batch=0) -> list[MtpDepth]:
    """Each depth of one micro-batch, depth 1 first; ``routing``: an `ObservedRouting` (the
    depth's MoE layer is ``num_hidden_layers + depth - 1``), else balanced."""
    first = config.model.num_hidden_layers
    configs = [
        routing.config_for(config, first + depth, micro_batch) if routing else config
        for depth in range(config.mtp_layers)
    ]
    return [optimized_mtp_depth(each) for each in configs]
