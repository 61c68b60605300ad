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

Every transient is derived from the code; the attention block's recompute in backward
is `optimized.estimator.recompute`, as is the
block kept without recompute (``EstimateConfig.recompute`` off: its saved tensors join
stage 1's kept bytes and its backward reruns nothing), and a W
step's weight gradients `weight_step_transients`. Everything is as measured with the
Triton interpreter's launch cycles collected (on CPU each interpreted launch keeps its
arguments alive until Python's GC runs; see tests/test_estimator_vs_measured.py): that
garbage is no memory of the stack and is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from optimized.estimator.activations import (
    F32,
    GATHER_ALIGNMENT,
    I64,
    Routed,
    dense_mlp_saved,
    layer_saved,
    routed,
)
from optimized.estimator.config import EstimateConfig
from optimized.estimator.recompute import (
    attention_backward_rise,
    kept_attention_backward,
    kept_block,
)


@dataclass(slots=True)
class Step:
    name: str
    delta: int = 0
    transient: int = 0
    grad: str | None = None
    """``dense`` or ``experts``: the layer's gradient bytes of that kind appear here."""
    grad_before_peak: int = 0
    """Of those, the bytes already made at the step's high point when they are made for
    the first time in the step (``zero_grad`` leaves none: a layer's first backward makes
    them): the attention backward has made every dense weight gradient but the recomputed
    block's projections' and input norm's by the fused attention's backward."""


@dataclass(slots=True)
class StepProfile:
    forward: dict[str, Step] = field(default_factory=dict)
    backward: dict[str, Step] = field(default_factory=dict)
    weight_transients: list[int] = field(default_factory=list)
    """Per grouped GEMM a W step runs for this layer (down, then gate_up: the order the
    backward put them), the bytes it holds while it runs (see `weight_step_transients`)."""
    deferred_experts_rise: int = 0
    """The experts backward's rise when its weight gradients are deferred to a W step."""
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


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _names(items, prefixes):
    return sum(item.nbytes for item in items if item.name.startswith(prefixes))


def experts_backward_rise(
    config: EstimateConfig, rows: Routed, local: int, inner: int, deferred: bool
) -> int:
    """The grouped expert MLP's backward (`optimized.ops.grouped_linear.GroupedLinear` and
    the fused activation), above the level it starts from, at the highest of three moments
    (``G`` grouped rows):

    - down projection: its output's gradient ``[G, H]`` and its input's ``[G, I]``, then
      either GPT-OSS's bias gradient (float32 per-expert sums of, in 16-bit, a float32 copy
      of the output gradient) or the ``[E, I, H]`` weight gradient (not when deferred:
      the W step computes it);
    - the activation: its input's gradient ``[G, 2I]`` beside its output's ``[G, I]``
      (and, deferred, the down projection's output gradient, kept for the W step);
    - gate/up projection, once the activation's saved input and (not deferred) the down
      projection's input are freed: its input's gradient ``[G, H]``, the down
      projection's bias gradient, then its own bias temporaries or its weight gradient
      ``[E, H, 2I]``;
    - the scatter back to the received order: the received rows' gradient ``[R, H]``
      beside the grouped input's (deferred: beside the W step's output gradients).

    Weight gradients are added into existing ``.grad`` (a step's first backward of a layer
    creates them: the walk counts them as gradients when the step ends).
    """
    m, b = config.model, config.param_bytes
    hidden, grouped, received = m.hidden_size, rows.grouped, rows.received
    biased = m.model_type == "gpt_oss"

    def bias(width: int) -> tuple[int, int]:
        """(temporaries, the bias gradient left) of one biased GEMM's backward."""
        if not biased:
            return 0, 0
        sums = (local + 1) * width * F32
        if b == F32:
            return sums, sums
        return sums + grouped * width * F32, local * width * b

    weight_down, weight_gate_up = local * inner * hidden * b, local * 2 * inner * hidden * b
    down_tmp, down_kept = bias(hidden)
    gate_up_tmp, gate_up_kept = bias(2 * inner)
    base = grouped * hidden * b + grouped * inner * b
    down = base + max(down_tmp, down_kept + (0 if deferred else weight_down))
    # Back to the received order at the end: the received rows' gradient ``[R, H]`` beside
    # the grouped input's, the gate/up output and row groups freed.
    scatter = received * hidden * b + grouped * hidden * b
    scatter -= grouped * 2 * inner * b + (2 * grouped * I64 if biased else 0)
    # (the down projection's bias gradient has gone into ``.grad``, its row groups are freed)
    activation = grouped * inner * b + grouped * 2 * inner * b - (grouped * I64 if biased else 0)
    gate_up = grouped * hidden * b + down_kept
    if deferred:
        activation += grouped * hidden * b
        gate_up += grouped * hidden * b + gate_up_tmp
        # The W step's inputs: the down projection's and gate/up's output gradients.
        scatter += grouped * hidden * b + grouped * 2 * inner * b
    else:
        scatter -= grouped * inner * b
        gate_up -= grouped * inner * b + (grouped * I64 if biased else 0)
        gate_up += max(gate_up_tmp, gate_up_kept + weight_gate_up)
    return max(down, activation, gate_up, scatter)


def dense_grads_before_attention(
    config: EstimateConfig, layer: int, output_made: bool = True
) -> int:
    """Dense weight-gradient bytes a layer's first backward has made when its recomputed
    attention's fused backward runs: all but those of the input norm and the q / kv
    projections and their norms (the output projection's is made before; not yet, with
    ``output_made`` False: the post-attention norm's backward)."""
    from optimized.estimator.memory import layer_profile  # noqa: PLC0415 (memory imports us)
    from optimized.estimator.params import attention_params, shard  # noqa: PLC0415

    m = config.model
    late = shard(attention_params(m), config)
    v_dim = m.v_head_dim if m.is_deepseek else m.head_dim
    output = m.num_attention_heads * v_dim * m.hidden_size // config.tp
    output += m.hidden_size if m.attention_bias and not m.is_deepseek else 0
    unmade = sum(late.values()) - (output if output_made else 0) + m.hidden_size
    dense = layer_profile(config, layer).dense_grad
    return max(dense - unmade * config.grad_bytes, 0)


def attention_backward_step(config: EstimateConfig, layer: int, is_moe: bool, delta: int) -> Step:
    """The ``attention_backward`` step: the recomputed block's backward (`recompute`), or
    without recompute the highest of the moments of `kept_attention_backward`, with the
    dense gradients a layer's first backward has made before each."""
    if config.recompute:
        return Step(
            "attention_backward", delta, attention_backward_rise(config, layer, is_moe),
            "dense", dense_grads_before_attention(config, layer),
        )  # fmt: skip
    moments = []
    for rise, made in kept_attention_backward(config, layer, is_moe):
        if made == "block":
            before = dense_grads_before_attention(config, layer)
        elif made == "post_norm":
            before = dense_grads_before_attention(config, layer, output_made=False)
        else:
            before = int(made.removeprefix("mlp:"))
        moments.append((rise, before))
    steady = max(rise for rise, _ in moments)
    first = max(rise + before for rise, before in moments)
    return Step("attention_backward", delta, steady, "dense", first - steady)


def step_profile(config: EstimateConfig, layer: int) -> StepProfile:
    """One layer's fourteen steps (computed once per layer kind per config: dense or MoE;
    a sliding window changes no memory of the fused attention)."""
    key = ("step_profile", config.moe_layers()[layer])
    if key not in config.cache:
        config.cache[key] = _step_profile(config, layer)
    return config.cache[key]


def weight_step_transients(config: EstimateConfig) -> list[int]:
    """What each deferred expert weight gradient holds while its W step computes it
    (`optimized.ops.grouped_linear`): the ``[E_local, in, out]`` gradient, computed in the
    parameter's own layout (also where the parameter is used through a transposed view),
    so it becomes ``.grad`` the first time and is added into it in place after that, with
    no staging copy. Down projection first, then gate/up."""
    m, b = config.model, config.param_bytes
    local = max(m.num_experts // config.ep, 1)
    inner = m.moe_intermediate_size // config.etp
    return [local * inner * m.hidden_size * b, local * 2 * inner * m.hidden_size * b]


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
    # Without recompute the attention block's saved tensors stay from here to the backward.
    block = 0 if config.recompute else kept_block(config, layer)
    if not is_moe:
        kept += _names(items, ("mlp.",))
        # The residual add ``h + mlp(x)``: its output beside the MLP's and the block's, and
        # in 16-bit ``h`` (the norm saved a float32 copy of it: `reference_layer`).
        adds = (2 if b == F32 else 3) * th
        fwd["attention_forward"] = Step(
            "attention_forward", kept + th + block, kept + th + adds + block
        )
        # The MLP's and the recomputed attention block's backward (`recompute`).
        bwd["attention_backward"] = attention_backward_step(
            config, layer, False, -(kept + th + block)
        )
        return profile
    profile.weight_transients = weight_step_transients(config)
    rows = routed(config)
    sent, grouped, received = rows.sent, rows.grouped, rows.received
    ep = config.ep > 1
    padded_sent = round_up(sent, GATHER_ALIGNMENT)
    padded_received = round_up(received, GATHER_ALIGNMENT)
    inner = m.moe_intermediate_size // config.etp
    local = max(m.num_experts // config.ep, 1)
    kept += _names(items, ("router.", "dispatch.", "shared_experts."))
    sorted_tokens = padded_sent * hidden * b
    # The residual is the attention residual itself (the norm's float input) only in float32
    # without shared experts.
    residual_is_h = b == F32 and not config.shared_expert_width
    # The routing counts: one [2, num_experts] int64 tensor (sent, and received at EP > 1).
    attention = kept + sorted_tokens + sent * F32 + 2 * m.num_experts * I64
    attention += 0 if residual_is_h else th
    # The stage's high point, gathering the router weights into expert order, beside what it
    # keeps: the attention block's output (``h``'s other addend), the shared experts' output
    # and, when neither kept float input nor residual, ``h`` itself (16-bit with shared
    # experts), and the float32 top-k weights.
    shared = bool(config.shared_expert_width)
    outputs = th + (th if shared else 0) + (th if shared and b != F32 else 0)
    top_k_weights = tokens * m.num_experts_per_tok * F32
    attention += block
    fwd["attention_forward"] = Step(
        "attention_forward", attention, attention + outputs + top_k_weights
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
    # The high point: gathering the output into the received order (the down projection's
    # output beside everything kept); with GPT-OSS's biases, or adding the down
    # projection's bias before that: its product and the gathered bias rows (added into the
    # product in place).
    gather = experts + grouped * hidden * b
    bias_add = 0
    if row_groups:
        bias_add = experts - expert_out + 2 * grouped * hidden * b + (local + 1) * hidden * b
    fwd["experts_forward"] = Step(
        "experts_forward", experts - freed_input, max(gather, bias_add) + received * I64 + 64
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
        experts_backward_rise(config, rows, local, inner, deferred=False),
        "experts",
    )
    profile.deferred_experts_rise = experts_backward_rise(config, rows, local, inner, deferred=True)
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
    # What is left of the layer goes; the recomputed attention block's backward (`recompute`).
    left = sum(s.delta for s in fwd.values()) + sum(s.delta for s in bwd.values())
    bwd["attention_backward"] = attention_backward_step(config, layer, True, -left)
    return profile


__all__ = ["Step", "StepProfile", "dense_mlp_saved", "step_profile"]
