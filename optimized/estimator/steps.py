"""The optimized stack, one decoder layer as the fourteen steps of `optimized.pipeline.overlap`.

The optimized schedule runs each layer as seven forward and seven backward
steps (`FORWARD_STEPS`, `BACKWARD_STEPS`) and DualPipeV's F&B interleaves a
forward layer with a backward layer step by step (`OVERLAPPED_LAYER_STEPS`).
Each step here is what it leaves held (``delta``), how far above the level it
started from it climbs while it runs (``transient``, measured from the step's
start, not its end: a forward step's peak is its kept bytes plus its
temporaries), and the gradient bytes it creates. Read off the code (stage records, early frees in
`optimized.pipeline.execution`, saved tensors of the optimized ops) and checked against
the tracker by ``tests/test_estimator_activations.py``:

- stage 1 runs the attention block under non-reentrant checkpoint: only the
  block's input is kept (it is the previous layer's output, counted there);
  then the post-attention norm, router, dispatch layout, shared experts as the
  reference keeps them, plus the padded sorted-token buffer (rows rounded up to
  ``GATHER_ALIGNMENT``), the sorted weights (float32), the send counts and the
  residual;
- with expert parallelism the exchanges allocate their outputs at start and
  free the sent buffer at wait; without it they are the identity and the
  received rows are the sorted buffer (freed by the experts stage);
- the experts keep the grouped input, gate/up output, activation, the padded
  gathered output and the positions.

Transients marked *fitted* were measured on tiny-deepseek-v2 (float32, 2 x 64
tokens) and are scaled with the layer's token rows; everything else is derived.
Everything is as measured with the Triton interpreter's launch cycles collected
(on CPU each interpreted launch keeps its arguments alive until Python's GC
runs; see tests/test_estimator_vs_measured.py): that garbage is no memory of the
stack and is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from optimized.estimator.activations import (
    F32,
    GATHER_ALIGNMENT,
    I64,
    dense_mlp_saved,
    layer_saved,
    routed,
)
from optimized.estimator.config import EstimateConfig


@dataclass(slots=True)
class Step:
    name: str
    delta: int = 0
    transient: int = 0
    grad: str | None = None
    """``dense`` or ``experts``: the layer's gradient bytes of that kind appear here."""


@dataclass(slots=True)
class StepProfile:
    forward: dict[str, Step] = field(default_factory=dict)
    backward: dict[str, Step] = field(default_factory=dict)
    weight_transients: list[int] = field(default_factory=list)
    """Per grouped GEMM a W step runs for this layer (down, then gate_up: the order the
    backward put them), the bytes it holds while it runs (see `weight_step_transients`)."""
    weight_grad_shares: tuple[int, int] = (1, 2)
    """Thirds of the layer's expert weight gradient each of those GEMMs makes (down: one,
    gate/up: two)."""
    held_to_action_end: dict[str, int] = field(default_factory=dict)
    """Bytes a backward step would free, or a leaf's gradient it makes, that stay alive
    until the end of the action when this layer is the last of a chunk whose output is
    kept as the root of the chunk's backward (see `step_profile`)."""

    @property
    def held(self) -> int:
        """Bytes one micro-batch keeps in this layer after its forward (its output included)."""
        return sum(step.delta for step in self.forward.values())


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _names(items, prefixes):
    return sum(item.nbytes for item in items if item.name.startswith(prefixes))


def _eager_attention_peaks(config: EstimateConfig) -> tuple[int, int]:
    """(forward, backward) peaks of the attention core above the step's start when it
    runs eagerly: with GPT-OSS's sinks the optimized attention falls back to the plain
    computation (`optimized.ops.attention`), whose ``[B, h, S, S + 1]`` scores, in float
    of the run dtype, dominate. Zero for the fused path.

    Forward (recomputed in backward as well): two score-sized buffers at the softmax
    (its input and output) and the float32 ``[S, S]`` mask; backward: three (the saved
    probabilities, their gradient, the softmax's input gradient). Per token beside them,
    *fitted* on tiny-gpt-oss at S = 64, 96, 128 (within 0.5% there): 7 x the hidden
    state forward (normed input, q, k, v, the GQA-repeated k and v, the rotary
    temporaries) and 4.5 x backward.
    """
    m, b = config.model, config.param_bytes
    if m.model_type != "gpt_oss":
        return 0, 0
    seq, heads = config.seq_len, m.num_attention_heads // config.tp
    scores = config.micro_batch_size * heads * seq * (seq + 1) * b
    th = config.tokens * m.hidden_size * b
    forward = 2 * scores + seq * seq * F32 + 7 * th
    backward = 3 * scores + round(4.5 * th)
    return forward, backward


def step_profile(config: EstimateConfig, layer: int) -> StepProfile:
    """One layer's fourteen steps (computed once per layer kind, dense or MoE, per config)."""
    key = ("step_profile", config.moe_layers()[layer])
    if key not in config.cache:
        config.cache[key] = _step_profile(config, layer)
    return config.cache[key]


def weight_step_transients(config: EstimateConfig) -> list[int]:
    """What each deferred expert weight gradient holds while its W step computes it
    (`optimized.ops.grouped_linear`): the ``[E_local, in, out]`` gradient, and where the
    parameter is used through a transposed view (all families but GPT-OSS, whose experts
    are stored ``[E, in, out]``) a zero-filled parameter-sized copy laid out like the
    parameter, which is added into ``.grad`` (or becomes it, the first time). Down
    projection first, then gate/up."""
    m, b = config.model, config.param_bytes
    local = max(m.num_experts // config.ep, 1)
    inner = m.moe_intermediate_size // config.etp
    copies = 1 if m.model_type == "gpt_oss" else 2
    down, gate_up = local * inner * m.hidden_size * b, local * 2 * inner * m.hidden_size * b
    return [copies * down, copies * gate_up]


def _step_profile(config: EstimateConfig, layer: int) -> StepProfile:
    m, b, tokens = config.model, config.param_bytes, config.tokens
    hidden = m.hidden_size
    th = tokens * hidden * b
    is_moe = config.moe_layers()[layer]
    items = layer_saved(config.replace(stack="reference"), layer)
    profile = StepProfile()
    fwd, bwd = profile.forward, profile.backward
    names = ("attention_forward", "dispatch_start", "dispatch_wait", "experts_forward",
             "combine_start", "combine_wait", "aggregate_forward")  # fmt: skip
    bnames = ("aggregate_backward", "combine_backward_start", "combine_backward_wait",
              "experts_backward", "dispatch_backward_start", "dispatch_backward_wait",
              "attention_backward")  # fmt: skip
    for name in names:
        fwd[name] = Step(name)
    for name in bnames:
        bwd[name] = Step(name)
    kept = _names(items, ("post_attention_layernorm.",))
    eager_forward, eager_backward = _eager_attention_peaks(config)
    if not is_moe:
        kept += _names(items, ("mlp.",))
        fwd["attention_forward"] = Step(
            "attention_forward", kept + th, max(kept + th + 2 * th, eager_forward)
        )
        # fitted: the MLP's and the recomputed attention block's backward
        bwd["attention_backward"] = Step(
            "attention_backward", -(kept + th), max(round(9.3359375 * th), eager_backward),
            "dense",
        )  # fmt: skip
        return profile
    profile.weight_transients = weight_step_transients(config)
    rows = routed(config)
    sent, grouped, received = rows.sent, rows.grouped, rows.received
    ep = config.ep > 1
    padded_sent = _round_up(sent, GATHER_ALIGNMENT)
    padded_received = _round_up(received, GATHER_ALIGNMENT)
    inner = m.moe_intermediate_size // config.etp
    local = max(m.num_experts // config.ep, 1)
    kept += _names(items, ("router.", "dispatch.", "shared_experts."))
    sorted_tokens = padded_sent * hidden * b
    # The residual is the attention residual itself (the norm's float input) only in float32
    # without shared experts.
    residual_is_h = b == F32 and not config.shared_expert_width
    attention = kept + sorted_tokens + sent * F32 + m.num_experts * I64
    attention += 0 if residual_is_h else th
    fwd["attention_forward"] = Step(
        "attention_forward", attention, max(attention + 2 * th + sent * F32, eager_forward)
    )
    rows_in = received * hidden * b
    if ep:
        fwd["dispatch_start"] = Step("dispatch_start", rows_in)
        fwd["dispatch_wait"] = Step("dispatch_wait", -sorted_tokens)
    freed_input = rows_in if ep else sorted_tokens
    expert_out = padded_received * hidden * b
    experts = grouped * (hidden + 3 * inner) * b + expert_out + received * I64 + local * 4
    # GPT-OSS's expert biases: each grouped linear keeps every row's expert (int64).
    row_groups = 2 * grouped * I64 if m.model_type == "gpt_oss" else 0
    experts += row_groups
    fwd["experts_forward"] = Step(
        "experts_forward",
        experts - freed_input,
        # the down projection's product beside its output (and, with GPT-OSS's biases, the
        # gathered bias rows beside both)
        experts + (2 if row_groups else 1) * grouped * hidden * b + received * I64 + 64,
    )
    rows_out = sent * hidden * b
    if ep:
        fwd["combine_start"] = Step("combine_start", rows_out)
        fwd["combine_wait"] = Step("combine_wait", -expert_out)
    aggregate = (th if residual_is_h else 0) + (sent * b if b != F32 else 0)
    fwd["aggregate_forward"] = Step("aggregate_forward", aggregate, rows_out + 2 * th)
    # Backward.
    # The gradients of the combined rows and router weights, and of the residual leaf: the
    # output gradient is still referenced, so AccumulateGrad copies it.
    bwd["aggregate_backward"] = Step(
        "aggregate_backward", rows_out + sent * F32 + th,
        padded_sent * hidden * b + 2 * rows_out + sent * F32 + th,
    )  # fmt: skip
    if ep:
        bwd["combine_backward_start"] = Step("combine_backward_start", rows_in - rows_out)
        bwd["combine_backward_wait"] = Step("combine_backward_wait", -rows_out)
    saved_experts = grouped * (hidden + 3 * inner) * b + received * I64 + local * 4 + row_groups
    bwd["experts_backward"] = Step(
        "experts_backward",
        -saved_experts - (0 if ep else expert_out),
        grouped * 3 * inner * b + local * hidden * inner * b,
        "experts",
    )
    if ep:
        bwd["dispatch_backward_start"] = Step("dispatch_backward_start", rows_out)
        bwd["dispatch_backward_wait"] = Step("dispatch_backward_wait", -rows_in)
    # The last layer of a chunk: the chunk's output stays referenced (the root of the chunk's
    # backward, kept by DualPipeV until the action ends) and through its graph the
    # AccumulateGrad nodes of the aggregate stage's leaves, so those leaves and their
    # gradients outlive the steps that drop them: the combined rows (without EP the
    # expert output's storage itself) and their gradient, the router weights and their
    # gradient, the residual's gradient and the layer's output gradient.
    if ep:
        late = {"combine_backward_start": rows_out, "combine_backward_wait": rows_out}
    else:
        late = {"experts_backward": expert_out + rows_out}
    late["attention_backward"] = 2 * th + 2 * sent * F32
    profile.held_to_action_end = late
    # What is left of the layer goes; fitted: the recomputed attention block's backward.
    left = sum(s.delta for s in fwd.values()) + sum(s.delta for s in bwd.values())
    bwd["attention_backward"] = Step(
        "attention_backward", -left, max(round(12.8671875 * th), eager_backward), "dense"
    )
    return profile


__all__ = ["Step", "StepProfile", "dense_mlp_saved", "step_profile"]
