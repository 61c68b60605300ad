"""What the reference stack's decoder layer holds above its saved tensors, read off its code.

A layer keeps its saved tensors (`optimized.estimator.activations.layer_saved`) from its
forward to its backward; while either runs it holds more. Each term below is a moment of
`models.network.DecoderLayer` run with `reference.ops.ReferenceOps`, the tensors alive
there that are not saved, and the saved ones not yet made (forward) or already freed
(backward). ``tests/test_estimator_layers.py`` holds every moment against a storage
tracker on real layers.

Forward (relative to the layer's saved tensors all made; a dense layer peaks at its
residual add, `dense_transients`):

- ``aggregate``: ``scatter_add_rows``'s zero-filled ``[T, H]`` and its ``index_add``
  result, beside what `DecoderLayer.forward` still references: the stage records ``a``
  (the sorted rows, the residual when it is not the saved float input, the send
  counts, float32 router weights), ``d`` (the received rows and counts, with EP) and
  ``e`` (the experts' output in token order, with EP);
- ``experts``: the down projection's per-expert outputs and their concatenation, before
  the aggregation's tensors exist; ``gate_up``: the same for the gate/up projection,
  before the activation's.

Backward (relative to the saved tensors less the aggregation's, with the incoming
gradient counted by the walk):

- ``aggregate``: the gradient of the weighted rows, of the expert output and the product
  the router weights' gradient sums, beside the aggregation's saved tensors;
- ``down`` and ``gate_up``: ``x[start:end] @ weight[e]`` per expert, so each expert's
  weight gradient is a full ``[E, in, out]`` zero-filled buffer (``select_backward``)
  that the engine adds to the running sum: three of them at once; beside them the
  gradient of the projection's output, the running sum of its input's gradient, one
  expert's slice of it, and the router weights' gradient (float32 ``[N, 1]``);
- ``attention`` (every layer): the softmax's backward, once the MLP or MoE part, the
  post-attention norm, the output projection's input and the values are freed: the
  gradient of the probabilities (float32), of the scores, and of the values;
- ``mlp`` (dense layers): the SwiGLU's backward: the gradients of its two inputs.

An expert's slice uses the balanced share of the rows (observed routing: the largest).
"""

from __future__ import annotations

from optimized.estimator.activations import F32, I64, Saved, routed
from optimized.estimator.config import EstimateConfig


def _sum(items: list[Saved], *prefixes: str, exclude: tuple[str, ...] = ()) -> int:
    return sum(
        item.nbytes
        for item in items
        if item.name.startswith(prefixes) and not item.name.startswith(exclude or ("\0",))
    )


def attention_backward_peak(config: EstimateConfig, items: list[Saved]) -> int:
    """The eager softmax's backward above the layer's level when its backward starts, once
    the tensors saved after the attention's probabilities are freed."""
    m, b = config.model, config.param_bytes
    heads = m.num_attention_heads // config.tp
    batch, seq = config.micro_batch_size, config.seq_len
    columns = seq + 1 if m.model_type == "gpt_oss" else seq
    scores = batch * heads * seq * columns
    v_dim = m.v_head_dim if m.is_deepseek else m.head_dim
    grad_v = config.tokens * heads * v_dim * b
    # Float32 gradient of the probabilities (cast back from the run dtype's in 16-bit) and
    # the scores' gradient in the run dtype (GPT-OSS: its float max-subtracted scores).
    grads = scores * F32 + scores * (F32 if m.model_type == "gpt_oss" else b) + grad_v
    freed = _sum(
        items, "mlp.", "router.", "dispatch.", "shared_experts.", "experts.", "aggregate.",
        "post_attention_layernorm.", "o_proj.", "attention.v", "attention.probs",
    )  # fmt: skip
    return grads - freed


def dense_transients(config: EstimateConfig, items: list[Saved]) -> tuple[int, int]:
    """(forward, backward) transients of a dense layer."""
    m, b = config.model, config.param_bytes
    th = config.tokens * m.hidden_size * b
    ffn = m.intermediate_size // config.tp
    # Forward: the residual add ``h + mlp(x)`` beside everything saved: its output, the MLP's
    # output and the attention block's (`DecoderLayer.attention` still references it), and
    # in 16-bit ``h`` (the norm saved a float32 copy of it). Backward: the SwiGLU's two
    # input gradients once the down projection's input is freed (its gradient went in).
    forward = (3 if b == F32 else 4) * th
    mlp = 3 * config.tokens * ffn * b - _sum(items, "mlp.down_input")
    return forward, max(mlp, attention_backward_peak(config, items))


def _activation_items(items: list[Saved]) -> int:
    """The expert activation's saved tensors (made after the gate/up projection's output)."""
    keep = ("experts.grouped_input", "experts.gate_up", "experts.order", "experts.gather_index",
            "experts.positions", "experts.down_input")  # fmt: skip
    return _sum(items, "experts.", exclude=keep)


def moe_transients(config: EstimateConfig, items: list[Saved]) -> tuple[int, int]:
    """(forward, backward) transients of a MoE layer (see the module docstring)."""
    m, b = config.model, config.param_bytes
    hidden, tokens = m.hidden_size, config.tokens
    th = tokens * hidden * b
    rows = routed(config)
    sent, received = rows.sent, rows.received
    local = max(m.num_experts // config.ep, 1)
    inner = m.moe_intermediate_size // config.etp
    ep = config.ep > 1
    rows_sent, rows_received = sent * hidden * b, received * hidden * b
    group = rows.largest
    aggregate = _sum(items, "aggregate.")
    shared = bool(config.shared_expert_width)
    # What DecoderLayer.forward's records keep that nothing saves.
    residual = 0 if (b == F32 and not shared) else th
    counts = m.num_experts * I64 * (2 if ep else 1)
    float_weights = sent * F32 if b != F32 else 0
    records = residual + rows_sent + counts + float_weights + (rows_received if ep else 0)
    bias_rows = group * hidden * b if m.model_type == "gpt_oss" else 0
    forward = max(
        records + (rows_received if ep else 0) + 2 * th,
        records - aggregate + 2 * rows_received + bias_rows,
        records - aggregate - _activation_items(items) - _sum(items, "experts.down_input")
        + received * 2 * inner * b,
    )  # fmt: skip
    weight_down = local * inner * hidden * b
    weight_gate_up = local * 2 * inner * hidden * b
    positions = _sum(items, "experts.positions")
    router_grad = sent * F32
    backward = max(
        _sum(items, "aggregate.expert_output", "aggregate.weights") + 3 * rows_sent,
        3 * weight_down + rows_received + received * inner * b + group * inner * b
        + router_grad - positions,
        3 * weight_gate_up + received * 2 * inner * b + rows_received + group * hidden * b
        + router_grad - positions - _sum(items, "experts.gate_up", "experts.down_input")
        - _activation_items(items),
        attention_backward_peak(config, items) + aggregate,
    )  # fmt: skip
    return forward, backward


__all__ = ["attention_backward_peak", "dense_transients", "moe_transients"]
