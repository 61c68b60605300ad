"""Per-rank memory of a DualPipeV step: weights, gradients, optimizer state, activations.

Activations at each action of the walk are the sum, over the rank's two
chunks, of (micro-batches in flight) x (bytes one micro-batch keeps in that
chunk), plus the weight-gradient inputs of deferred backwards, plus what the
action itself holds while it runs:

- a forward holds its micro-batch's activations as it builds them (counted as
  in flight from its start) and, on the loss stage, the logits;
- a backward holds the gradients of the largest saved tensor it is working on
  (gradient in and out) and of the stage boundary; on the loss stage the
  reference holds two float32 logits-sized gradients;
- an overlapped ``F&B`` (optimized) interleaves the two layer by layer, so it
  peaks one layer above the larger of "before" and "after"; the reference runs
  the F, then the B.

This module holds what both walks share (per-layer and per-chunk profiles, static
bytes, the walk's running state, the timeline's entries); the walks themselves are
`optimized.estimator.reference_walk` and `optimized.estimator.optimized_walk`, and
`optimized.estimator.ranks` picks one per stack.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from optimized.estimator.activations import (
    F32,
    I64,
    layer_saved,
    mtp_saved,
    routed_rows,
)
from optimized.estimator.activations import head_saved as head_saved_items
from optimized.estimator.balancing import bias_buffer_bytes, step_state_bytes
from optimized.estimator.config import EstimateConfig
from optimized.estimator.params import (
    ParamCount,
    embedding_params,
    head_params,
    layer_params,
    shard,
    stage_params,
)
from optimized.estimator.reference_layer import dense_transients, moe_transients


@dataclass(slots=True)
class LayerProfile:
    """One decoder layer, one micro-batch: what each stage keeps and what runs leave behind."""

    attention: int
    """Saved by stage 1 (norms, attention, router, shared experts, dispatch bookkeeping)."""
    experts: int
    """Saved by stage 3 (grouped expert MLP)."""
    aggregate: int
    """Saved by stage 5 (weighting and scatter back)."""
    deferred_inputs: int
    """What a deferred (zero-bubble) backward leaves for its W step: the grouped GEMMs'
    inputs and output gradients."""
    dense_grad: int
    """Gradient bytes of the layer's parameters other than routed-expert weights."""
    expert_grad: int
    """Gradient bytes of the routed-expert weights (deferrable to W)."""
    forward_transient: int
    """Bytes above what the layer keeps, at the forward's high point."""
    backward_transient: int
    """Bytes above the saved tensors while the layer's backward runs (its peak is at the
    grouped experts: their gradients, or the plain stack's full-size weight-gradient
    buffers, before the attention's gradients exist)."""

    @property
    def saved(self) -> int:
        return self.attention + self.experts + self.aggregate


@dataclass(slots=True)
class ChunkProfile:
    """One stage (one chunk of a rank) for one micro-batch."""

    layers: list[LayerProfile]
    head_saved: int
    head_forward_transient: int
    head_backward_transient: int
    head_grad: int
    embedding_grad: int

    @property
    def saved(self) -> int:
        return sum(layer.saved for layer in self.layers) + self.head_saved

    @property
    def largest_layer(self) -> int:
        return max((layer.saved for layer in self.layers), default=0)


def grad_bytes(config: EstimateConfig, count: ParamCount) -> int:
    return sum(shard(count, config).values()) * config.grad_bytes


def fsdp_divisor(config: EstimateConfig, experts: bool = False) -> int:
    """How many ways FSDP2 splits a module's parameters and gradients: a non-expert
    module's over DP, the routed experts' over their replicas (``expert_dp``; 1 when
    EP = DP, where they stay off FSDP2)."""
    if not config.fsdp:
        return 1
    return config.expert_dp if experts else config.dp


def grad_divisor(config: EstimateConfig, experts: bool = False) -> int:
    """How many ways a gradient is split while the step runs: as `fsdp_divisor`, except that
    with ``grad_sync="step"`` FSDP2 reduces a unit only at its chunk's last backward, so its
    gradient accumulates unsharded (1) from the chunk's first backward until then."""
    if config.fsdp and config.grad_sync == "step":
        return 1
    return fsdp_divisor(config, experts)


def embedding_backward_bytes(config: EstimateConfig) -> int:
    """What the embedding's backward returns: the whole table's gradient
    (`embedding_dense_backward`), which a later micro-batch's autograd then adds into the
    gradient already there (a DeepSeek-V2-Lite-width table is 131 MB in bf16)."""
    return grad_bytes(config, embedding_params(config.model))


def embedding_grad_bytes(config: EstimateConfig) -> int:
    """The embedding's gradient: FSDP-sharded unless it is tied to the output layer."""
    whole = grad_bytes(config, embedding_params(config.model))
    return whole if config.model.tie_word_embeddings else whole // grad_divisor(config)


LOSS_CHUNKS_PER_VOCABULARY, LOSS_CHUNK_VOCAB_MULTIPLE, LOSS_MIN_CHUNK_VOCAB = 32, 128, 1024
"""`optimized.ops.linear_cross_entropy`'s chunk rule constants (the estimator imports no op)."""
LOSS_STATS_ROWS = 4
"""Float32 values a token the fused loss keeps per row while it runs (softmax statistics)."""


def loss_chunk_vocab(vocab_size: int, hidden_size: int) -> int:
    """Vocabulary columns per chunk of the fused loss: the op's `default_chunk_vocab`,
    ``max(vocab / 32, hidden, 1024)`` rounded up to a multiple of 128, at most the
    vocabulary."""
    widest = max(-(-vocab_size // LOSS_CHUNKS_PER_VOCABULARY), hidden_size, LOSS_MIN_CHUNK_VOCAB)
    multiple = LOSS_CHUNK_VOCAB_MULTIPLE
    return min(vocab_size, -(-widest // multiple) * multiple)


def loss_buffer_elements(tokens: int, vocab: int, hidden_size: int, element_size: int) -> int:
    """The fused loss's one flat buffer, in elements of the hidden's dtype: the op's
    `chunk_plan`. ``[tokens, chunk]`` logits; for 16-bit inputs over several chunks, pass 2
    takes the tokens in the fewest equal blocks whose ``[block, chunk]`` logits plus a
    float32 ``[block, hidden]`` accumulator (from a 16-byte boundary) fit in that buffer."""
    chunk = loss_chunk_vocab(vocab, hidden_size)
    logits = tokens * chunk
    if element_size >= F32 or tokens == 0 or chunk == vocab:
        return logits
    most = max(1, logits * element_size // (chunk * element_size + hidden_size * F32))
    block = -(-tokens // -(-tokens // most))
    align = 16 // element_size
    offset = -(-block * chunk // align) * align
    return max(logits, offset + block * hidden_size * F32 // element_size)


def fused_loss_transient(config: EstimateConfig) -> int:
    """What the optimized loss stage (`OptimizedDualPipeV._loss_sum`) holds while the linear
    cross-entropy's two passes run (`optimized.ops.linear_cross_entropy`), beyond what the
    walk's ``head`` keeps to the backward (the norm's saved tensors, ``grad_hidden``,
    ``grad_weight``): the final norm's output (the op's input, not saved), the per-token
    float32 losses and z-losses, the float32 softmax statistics ``[4, tokens]``, and the
    one flat buffer (`loss_buffer_elements`) in the hidden's dtype, in which each chunk's
    logits are written and turned into their gradient in place. All die when the loss stage
    returns. At mid width (hidden 2048, vocabulary 32000: chunks of 2048 words) a 512-token
    micro-batch's buffer is ``[512, 2048]``: 2.1 MB in bf16."""
    m, tokens, b = config.model, config.tokens, config.param_bytes
    buffer = loss_buffer_elements(tokens, m.vocab_size, m.hidden_size, b)
    return tokens * m.hidden_size * b + (2 + LOSS_STATS_ROWS) * tokens * F32 + buffer * b


def head_weight_numel(config: EstimateConfig, stages) -> int:
    """The output-layer weight FSDP leaves whole on a rank holding the last stage: only a
    weight tied to the embedding (an untied output layer is sharded over DP like the rest;
    the fused loss runs as its registered forward method)."""
    m = config.model
    held = config.num_stages - 1 in stages and m.tie_word_embeddings
    return m.vocab_size * m.hidden_size if held else 0


def layer_profile(config: EstimateConfig, layer: int) -> LayerProfile:
    """One layer's profile (computed once per layer kind, dense or MoE, per config)."""
    key = ("layer_profile", config.moe_layers()[layer])
    if key not in config.cache:
        config.cache[key] = _layer_profile(config, layer)
    return config.cache[key]


def _layer_profile(config: EstimateConfig, layer: int) -> LayerProfile:
    m, b, tokens = config.model, config.param_bytes, config.tokens
    boundary = tokens * m.hidden_size * b
    saved = layer_saved(config, layer)
    is_moe = config.moe_layers()[layer]
    experts = sum(item.nbytes for item in saved if item.name.startswith("experts."))
    aggregate = sum(item.nbytes for item in saved if item.name.startswith("aggregate."))
    attention = sum(item.nbytes for item in saved) - experts - aggregate
    count = shard(layer_params(config, layer), config)
    # EP divides the experts, ETP each expert's FFN width.
    inner = m.moe_intermediate_size // config.etp
    local = m.num_experts // config.ep if is_moe else 0
    weight_numel = local * 3 * inner * m.hidden_size  # gate_up [E, 2I, H] and down [E, H, I]
    expert_grad = weight_numel * config.grad_bytes // grad_divisor(config, experts=True)
    dense_grad = (sum(count.values()) - weight_numel) * config.grad_bytes // grad_divisor(config)
    if not is_moe:
        forward, backward = dense_transients(config, saved)
        return LayerProfile(attention, 0, 0, 0, dense_grad, 0, forward, backward)
    sent, grouped = routed_rows(config)
    rows = sent * m.hidden_size * b
    # With expert parallelism an all-to-all's input and output live side by side.
    exchanged = 2 * rows if config.ep > 1 else 0
    if config.stack == "reference":
        forward, backward = moe_transients(config, saved)
        deferred = 0
    else:
        # Padded grouped buffers: the gate_up output and its activation's input copy.
        forward = 2 * grouped * m.hidden_size * b + exchanged
        backward = 2 * grouped * 2 * inner * b + boundary + exchanged
        deferred = grouped * (m.hidden_size + 2 * inner + inner + m.hidden_size) * b
    return LayerProfile(
        attention, experts, aggregate, deferred, dense_grad, expert_grad, forward, backward
    )


def chunk_profile(
    config: EstimateConfig, stage: int, layers: list[int], config_of=None
) -> ChunkProfile:
    """One stage for one micro-batch; ``config_of(layer)``: each layer's config (observed
    routing), else ``config``."""
    m, b, tokens = config.model, config.param_bytes, config.tokens
    profiles = [layer_profile(config_of(i) if config_of else config, i) for i in layers]
    head_saved = head_fwd = head_bwd = head_grad = embedding_grad = 0
    if stage == 0:
        embedding_grad = embedding_grad_bytes(config)
    if stage == config.num_stages - 1:
        # The labels are the batch's: not an activation of their own.
        head_saved = sum(
            item.nbytes for item in head_saved_items(config) if item.name != "loss.target"
        )
        head_saved += sum(item.nbytes for item in mtp_saved(config))  # each MTP depth's
        logits = tokens * (m.vocab_size // config.tp)
        if config.stack == "reference":
            head_fwd = logits * b + (logits * F32 if b != F32 else 0)
            head_bwd = 2 * logits * F32
        else:  # the fused loss writes its gradient over the logits it keeps
            head_bwd = 2 * logits * b
        head_grad = grad_bytes(config, head_params(m))
        if not m.tie_word_embeddings:  # FSDP2 shards the final norm and the output layer
            head_grad //= grad_divisor(config)
    return ChunkProfile(profiles, head_saved, head_fwd, head_bwd, head_grad, embedding_grad)


@dataclass(slots=True)
class RankEstimate:
    """One pp-rank's memory (every DP rank of it is alike)."""

    rank: int
    stages: tuple[int, int]
    layers: tuple[list[int], list[int]]
    params: dict[str, int]
    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    peak_phase: str
    peak_action: str
    in_flight_at_peak: tuple[int, int]
    max_in_flight: tuple[int, int]
    all_gradients_bytes: int = 0
    """Gradients once every parameter has one (after the backward); ``gradients_bytes`` is
    what exists at the peak (the step starts with none: ``zero_grad(set_to_none=True)``)."""
    optimizer_step_bytes: int = 0
    """The rank's total while the optimizer steps: weights, every gradient, the optimizer
    state and the update's temporaries (the peak when it exceeds the walk's)."""
    timeline: list[dict] = field(default_factory=list, repr=False)

    @property
    def static_bytes(self) -> int:
        return self.weights_bytes + self.gradients_bytes + self.optimizer_bytes

    @property
    def peak_bytes(self) -> int:
        return self.static_bytes + self.activation_bytes

    def as_dict(self) -> dict:
        return {
            "rank": self.rank,
            "stages": list(self.stages),
            "layers": [list(chunk) for chunk in self.layers],
            "params": dict(self.params),
            "weights_bytes": self.weights_bytes,
            "gradients_bytes": self.gradients_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "activation_bytes": self.activation_bytes,
            "peak_bytes": self.peak_bytes,
            "peak_phase": self.peak_phase,
            "peak_action": self.peak_action,
            "in_flight_at_peak": list(self.in_flight_at_peak),
            "max_in_flight": list(self.max_in_flight),
            "all_gradients_bytes": self.all_gradients_bytes,
            "optimizer_step_bytes": self.optimizer_step_bytes,
            "timeline": [dict(moment) for moment in self.timeline],
        }


def rank_params(config: EstimateConfig, stages: tuple[int, int], partition) -> ParamCount:
    count = ParamCount()
    for stage in dict.fromkeys(stages):
        count += stage_params(config, stage, partition[stage])
    return count


def buffer_bytes(config: EstimateConfig, layers, mtp: bool = False) -> int:
    """Non-parameter buffers the registered modules hold: each attention's rotary
    ``inv_freq`` (half the rotary width), in float32 whatever the run dtype, as transformers
    keeps it (`models.network.layers._init_rope_buffer`), and with the expert bias on each
    MoE router's float32 ``e_score_correction_bias``; ``mtp``: the MTP layers' too (the
    rank holding the head), each of the last layer's kind."""
    m, layers = config.model, list(layers)
    rotary = m.qk_rope_head_dim if m.is_deepseek else m.head_dim
    if mtp:
        layers += [m.num_hidden_layers - 1] * config.mtp_layers
    return len(layers) * (rotary // 2) * F32 + bias_buffer_bytes(config, layers)


def batch_bytes(config: EstimateConfig, layers=()) -> int:
    """Every rank draws the whole global batch's int64 ids and labels; the step's loss and
    its token count (`models.runtime.token_count`: a 0-dim int64 on the device, so that
    nothing is read on the host) live through the step, and so does the routing controls'
    state of a rank holding ``layers`` (`optimized.estimator.balancing.step_state_bytes`)."""
    global_batch = config.dp * config.num_microbatches * config.micro_batch_size
    return 2 * I64 * global_batch * config.seq_len + F32 + I64 + step_state_bytes(config, layers)


def static_bytes(
    config: EstimateConfig, count: ParamCount, head_numel: int = 0
) -> tuple[dict[str, int], int, int, int]:
    """(per-rank params by bucket, weight, gradient, optimizer bytes) of one rank.

    Under ``fsdp`` parameters and gradients are split like `fsdp_divisor` (rows rounded
    up); ``head_numel``: the output-layer weight this rank holds whole (`head_weight_numel`).
    Without ``reshard_after_forward`` FSDP2 also holds every unit's gathered parameters from
    its first forward to its last backward: the weights add the whole part's unsharded size."""
    params = shard(count, config)
    dense = params["tensor_sharded"] + params["replicated"]
    experts = params["routed_experts"]
    held = dense + experts
    if config.fsdp:
        held = -(-(dense - head_numel) // config.dp) + head_numel
        held += -(-experts // fsdp_divisor(config, experts=True))
    weights = held * config.param_bytes
    gradients = held * config.grad_bytes
    if config.fsdp and not config.reshard_after_forward:
        gathered = dense - head_numel + (experts if config.expert_dp > 1 else 0)
        weights += gathered * config.param_bytes
    if config.shard_optimizer or config.fsdp:
        dense, experts = -(-dense // config.dp), -(-experts // config.expert_dp)
    # AdamW: two moments (and a master copy if asked) per parameter, a float32 step per tensor.
    optimizer = (dense + experts) * config.optimizer_bytes_per_param + F32 * count.num_tensors
    return params, weights, gradients, optimizer


def largest_state_tensor_bytes(config: EstimateConfig, count: ParamCount) -> int:
    """Bytes of one copy of the rank's largest parameter tensor in the optimizer's state dtype:
    torch's AdamW (single-tensor on CPU) divides ``sqrt(exp_avg_sq)`` by the bias correction,
    so two such temporaries are alive at once."""
    divisors = {
        "tensor_sharded": config.tp * fsdp_divisor(config),
        "replicated": fsdp_divisor(config),
        "routed_experts": config.ep * config.etp * fsdp_divisor(config, experts=True),
    }
    largest = max(-(-count.largest[b] // divisors[b]) for b in divisors)
    return largest * config.moment_bytes


UPDATE_BLOCK = 1 << 22
"""Elements per block of `ShardedAdamW`'s blocked update (its ``UPDATE_BLOCK``; a test holds
them equal: the estimator imports nothing from the trainer)."""


def update_blocks(config: EstimateConfig) -> int:
    """float32 blocks alive at once in `ShardedAdamW`'s blocked update: copies of what is not
    float32 among the master (the parameter's dtype without masters), the two moments and
    the gradient, then the square root and the denominator (an update scaled by clipping
    also copies a float32 gradient block: one more then)."""
    master = 4 if config.master_weights else config.param_bytes
    copies = (master != F32) + 2 * (config.moment_bytes != F32) + (config.grad_bytes != F32)
    return copies + 2


def optimizer_temporaries(config: EstimateConfig, count: ParamCount) -> int:
    """Bytes alive at once inside the optimizer step beyond its state: torch's AdamW, two
    copies of the largest tensor (`largest_state_tensor_bytes`); `ShardedAdamW`'s blocked
    update, `update_blocks` float32 blocks, or fewer elements when the largest tensor is
    smaller."""
    if not config.blocked_update:
        return 2 * largest_state_tensor_bytes(config, count)
    largest = largest_state_tensor_bytes(config, count) // config.moment_bytes
    return update_blocks(config) * min(largest, UPDATE_BLOCK) * F32


def with_optimizer_step(
    config: EstimateConfig, estimate: RankEstimate, count: ParamCount, optimizer: int
) -> RankEstimate:
    """Add the optimizer step to a walked rank: every gradient, ``optimizer`` bytes of state
    (all of it, created now on the first step) and two temporaries of the largest tensor.
    The step's peak is whichever is higher, the walk's or this."""
    temporaries = optimizer_temporaries(config, count)
    activations = batch_bytes(config, [*estimate.layers[0], *estimate.layers[1]]) + temporaries
    return record_optimizer_step(
        estimate, estimate.weights_bytes, optimizer, activations, start_below=temporaries
    )


def record_optimizer_step(
    estimate: RankEstimate, weights: int, optimizer: int, activations: int, start_below: int
) -> RankEstimate:
    """The optimizer step as the walk's last moment: ``weights``, every gradient,
    ``optimizer`` bytes of state and ``activations`` (the batch and the step's own
    temporaries, ``start_below`` of them made by the step); the rank's peak if higher."""
    total = weights + estimate.all_gradients_bytes + optimizer + activations
    estimate.optimizer_step_bytes = total
    estimate.timeline.append(
        {"phase": "optimizer", "action": "step", "mark": "optimizer", "micro_batch": None,
         "in_flight": [0, 0], "bytes": total - weights - optimizer, "peak_bytes": total,
         "start_bytes": total - start_below, "gradients_bytes": estimate.all_gradients_bytes}
    )  # fmt: skip
    if total > estimate.peak_bytes:
        estimate.weights_bytes = weights
        estimate.gradients_bytes = estimate.all_gradients_bytes
        estimate.optimizer_bytes = optimizer
        estimate.activation_bytes = activations
        estimate.peak_phase, estimate.peak_action = "optimizer", "step"
        estimate.in_flight_at_peak = (0, 0)
    return estimate


class WalkState:
    """Bytes held on one rank as the walk goes: activations and gradients created so far."""

    def __init__(self) -> None:
        self.activations = 0
        self.gradients = 0
        self.created: set = set()
        self.peak = (-1, 0, 0)  # (activations + gradients, activations, gradients)

    def grad(self, key, nbytes: int) -> None:
        if key not in self.created:
            self.created.add(key)
            self.gradients += nbytes

    def moment(self, extra: int = 0) -> None:
        act = self.activations + extra
        if act + self.gradients > self.peak[0]:
            self.peak = (act + self.gradients, act, self.gradients)


def timeline_moment(step, during: tuple[int, int, int], static: int, start: int = 0) -> dict:
    """One action of the walk as the timeline reports it.

    ``mark`` and ``micro_batch`` are what the stack's observer (the harness's memory
    tracker) records at the start of the same action, so a measured peak moment can be
    looked up here; ``peak_bytes`` is the rank's total during the action,
    ``start_bytes`` its total when the action starts, and ``gradients_bytes`` the gradients
    existing at the peak.
    """
    action = step.action
    if action.kind == "W":
        mark, micro_batch = "W", None
    elif action.kind == "B":
        mark, micro_batch = f"B{action.chunk}", step.backward_micro_batch
    elif action.kind == "F":
        mark, micro_batch = f"F{action.chunk}", step.forward_micro_batch
    else:  # the optimized stack marks the pair; the reference its F first
        mark, micro_batch = action_label(action), step.forward_micro_batch
    return {
        "phase": action.phase,
        "action": action_label(action),
        "mark": f"{action.phase}:{mark}",
        "micro_batch": micro_batch,
        "in_flight": list(step.in_flight),
        "bytes": during[0],
        "peak_bytes": during[0] + static,
        "start_bytes": start + static,
        "gradients_bytes": during[2],
    }


def action_label(action) -> str:
    if action.kind == "FB":
        return f"F{action.chunk}&B{action.backward_chunk}"
    suffix = " (W deferred)" if action.deferred else ""
    return f"{action.kind}{action.chunk}{suffix}"
