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
"""

from __future__ import annotations

from dataclasses import dataclass, field

from optimized.estimator.activations import (
    F32,
    I64,
    layer_saved,
    routed_rows,
)
from optimized.estimator.activations import head_saved as head_saved_items
from optimized.estimator.config import EstimateConfig
from optimized.estimator.params import (
    BUCKETS,
    ParamCount,
    embedding_params,
    head_params,
    layer_params,
    shard,
    stage_params,
)
from optimized.estimator.schedule import send_completions, walk


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


def _grad_bytes(config: EstimateConfig, count: ParamCount) -> int:
    return sum(shard(count, config).values()) * config.grad_bytes


def _fsdp_divisor(config: EstimateConfig, experts: bool = False) -> int:
    """How many ways FSDP2 splits a module's parameters and gradients: a non-expert
    module's over DP, the routed experts' over their replicas (``expert_dp``; 1 when
    EP = DP, where they stay off FSDP2)."""
    if not config.fsdp:
        return 1
    return config.expert_dp if experts else config.dp


def _embedding_grad_bytes(config: EstimateConfig) -> int:
    """The embedding's gradient: FSDP-sharded unless it is tied to the output layer."""
    whole = _grad_bytes(config, embedding_params(config.model))
    return whole if config.model.tie_word_embeddings else whole // _fsdp_divisor(config)


def _head_weight_numel(config: EstimateConfig, stages) -> int:
    """The output-layer weight FSDP leaves whole on a rank holding the last stage: only a
    weight tied to the embedding (an untied output layer is sharded over DP like the rest;
    the fused loss runs as its registered forward method)."""
    m = config.model
    held = config.num_stages - 1 in stages and m.tie_word_embeddings
    return m.vocab_size * m.hidden_size if held else 0


def layer_profile(config: EstimateConfig, layer: int) -> LayerProfile:
    m, b, tokens = config.model, config.param_bytes, config.tokens
    boundary = tokens * m.hidden_size * b
    saved = layer_saved(config, layer)
    is_moe = config.moe_layers()[layer]
    experts = sum(item.nbytes for item in saved if item.name.startswith("experts."))
    aggregate = sum(item.nbytes for item in saved if item.name.startswith("aggregate."))
    attention = sum(item.nbytes for item in saved) - experts - aggregate
    count = shard(layer_params(config, layer), config)
    inner = m.moe_intermediate_size // config.etp
    local = m.num_experts // (config.ep * config.etp) if is_moe else 0
    weight_numel = local * 3 * inner * m.hidden_size  # gate_up [E, 2I, H] and down [E, H, I]
    expert_grad = weight_numel * config.grad_bytes // _fsdp_divisor(config, experts=True)
    dense_grad = (sum(count.values()) - weight_numel) * config.grad_bytes // _fsdp_divisor(config)
    if not is_moe:
        largest = max(item.nbytes for item in saved)
        return LayerProfile(attention, 0, 0, 0, dense_grad, 0, boundary, largest + boundary)
    sent, grouped = routed_rows(config)
    rows = sent * m.hidden_size * b
    # With expert parallelism an all-to-all's input and output live side by side.
    exchanged = 2 * rows if config.ep > 1 else 0
    if config.stack == "reference":
        # Per-expert outputs and their concatenation; in backward each expert's slice of the
        # weight gradient is a full-size zero-filled buffer, two of them alive at a time.
        forward = 2 * rows + exchanged
        backward = 2 * local * 2 * inner * m.hidden_size * b + boundary
        deferred = 0
    else:
        # Padded grouped buffers: the gate_up output and its activation's input copy.
        forward = 2 * grouped * m.hidden_size * b + exchanged
        backward = 2 * grouped * 2 * inner * b + boundary + exchanged
        deferred = grouped * (m.hidden_size + 2 * inner + inner + m.hidden_size) * b
    return LayerProfile(
        attention, experts, aggregate, deferred, dense_grad, expert_grad, forward, backward
    )


def chunk_profile(config: EstimateConfig, stage: int, layers: list[int]) -> ChunkProfile:
    m, b, tokens = config.model, config.param_bytes, config.tokens
    profiles = [layer_profile(config, layer) for layer in layers]
    head_saved = head_fwd = head_bwd = head_grad = embedding_grad = 0
    if stage == 0:
        embedding_grad = _embedding_grad_bytes(config)
    if stage == config.num_stages - 1:
        # The labels are the batch's: not an activation of their own.
        head_saved = sum(
            item.nbytes for item in head_saved_items(config) if item.name != "loss.target"
        )
        logits = tokens * (m.vocab_size // config.tp)
        if config.stack == "reference":
            head_fwd = logits * b + (logits * F32 if b != F32 else 0)
            head_bwd = 2 * logits * F32
        else:  # the fused loss writes its gradient over the logits it keeps
            head_bwd = 2 * logits * b
        head_grad = _grad_bytes(config, head_params(m))
        if not m.tie_word_embeddings:  # FSDP2 shards the final norm and the output layer
            head_grad //= _fsdp_divisor(config)
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
            "timeline": [dict(moment) for moment in self.timeline],
        }


def rank_params(config: EstimateConfig, stages: tuple[int, int], partition) -> ParamCount:
    count = ParamCount()
    for stage in dict.fromkeys(stages):
        count += stage_params(config, stage, partition[stage])
    return count


def buffer_bytes(config: EstimateConfig, layers) -> int:
    """Non-parameter buffers the registered modules hold: each attention's rotary
    ``inv_freq`` (half the rotary width), in the run dtype."""
    m = config.model
    rotary = m.qk_rope_head_dim if m.model_type == "deepseek_v2" else m.head_dim
    return len(list(layers)) * (rotary // 2) * config.param_bytes


def batch_bytes(config: EstimateConfig) -> int:
    """Every rank draws the whole global batch's int64 ids and labels, and the step's loss."""
    global_batch = config.dp * config.num_microbatches * config.micro_batch_size
    return 2 * I64 * global_batch * config.seq_len + F32


def static_bytes(
    config: EstimateConfig, count: ParamCount, head_numel: int = 0
) -> tuple[dict[str, int], int, int, int]:
    """(per-rank params by bucket, weight, gradient, optimizer bytes) of one rank.

    Under ``fsdp`` parameters and gradients are split like `_fsdp_divisor` (rows rounded
    up); ``head_numel``: the output-layer weight this rank holds whole (`_head_weight_numel`)."""
    params = shard(count, config)
    dense = params["tensor_sharded"] + params["replicated"]
    experts = params["routed_experts"]
    held = dense + experts
    if config.fsdp:
        held = -(-(dense - head_numel) // config.dp) + head_numel
        held += -(-experts // _fsdp_divisor(config, experts=True))
    weights = held * config.param_bytes
    gradients = held * config.grad_bytes
    if config.shard_optimizer or config.fsdp:
        dense, experts = -(-dense // config.dp), -(-experts // config.expert_dp)
    # AdamW: two moments (and a master copy if asked) per parameter, a float32 step per tensor.
    optimizer = (dense + experts) * config.optimizer_bytes_per_param + F32 * count.num_tensors
    return params, weights, gradients, optimizer


TRACE: list | None = None
"""Set to a list to record each step of the optimized walk: (layer, step, start, peak)."""


class _State:
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


def estimate_rank(config: EstimateConfig, rank: int, partition: list[range]) -> RankEstimate:
    if config.stack == "optimized":
        return _estimate_rank_optimized(config, rank, partition)
    stages = (rank, config.num_stages - 1 - rank)
    count = rank_params(config, stages, partition)
    params, weights, all_gradients, optimizer = static_bytes(
        config, count, _head_weight_numel(config, stages)
    )
    layers = [layer for s in dict.fromkeys(stages) for layer in partition[s]]
    weights += buffer_bytes(config, layers)
    chunks = [chunk_profile(config, s, list(partition[s])) for s in stages]
    boundary = config.tokens * config.model.hidden_size * config.param_bytes
    optimized = config.stack == "optimized"
    first, last = rank == 0, rank == config.pp - 1
    state = _State()
    deferred: list[tuple[int, int]] = []  # (chunk, micro-batch) awaiting W
    peak, peak_step, timeline, most = -1, None, [], [0, 0]

    def forward_start(chunk: int) -> None:
        if chunk == 1 and last:
            state.activations -= boundary  # the input is chunk 0's output, already held

    def forward_end(chunk: int) -> None:
        # The output stays: as the backward's root, and in the pending send (to the step's
        # end) or the local hand-over to chunk 1 (until B0 frees it).
        if not (chunk == 1 and first):
            state.activations += boundary

    def forward_layer(chunk: int, layer: LayerProfile, part: str = "all") -> None:
        if part in ("all", "attention"):
            state.activations += layer.attention
        if part in ("all", "experts"):
            state.activations += layer.experts
            state.moment(layer.forward_transient)
        if part in ("all", "aggregate"):
            state.activations += layer.aggregate

    def forward(chunk: int) -> None:
        c = chunks[chunk]
        forward_start(chunk)
        for layer in c.layers:
            state.activations += layer.saved
            state.moment(layer.forward_transient)
        if c.head_saved:
            # log_softmax writes what the loss keeps while the logits are still alive
            state.moment(c.head_forward_transient + c.head_saved)
            state.activations += c.head_saved
        forward_end(chunk)
        state.moment()

    def backward_start(chunk: int) -> int:
        c = chunks[chunk]
        received = 0
        if c.head_saved:
            state.moment(c.head_backward_transient)
            state.activations -= c.head_saved
            state.grad((chunk, "head"), c.head_grad)
        elif not (chunk == 0 and last):
            received = boundary  # the incoming gradient, freed with the backward
            state.activations += received
        return received

    def backward_layer(chunk: int, index: int, layer: LayerProfile, defer: bool, part="all"):
        if part in ("all", "experts"):
            state.activations -= layer.aggregate
            state.moment(layer.backward_transient)
            state.activations -= layer.experts
            if defer and layer.deferred_inputs:
                state.activations += layer.deferred_inputs
            else:
                state.grad((chunk, index, "experts"), layer.expert_grad)
        if part in ("all", "attention"):
            state.activations -= layer.attention
            state.grad((chunk, index, "dense"), layer.dense_grad)

    def backward_end(chunk: int, received: int) -> None:
        c = chunks[chunk]
        state.activations -= received
        if chunk == 0 and last:  # the gradient B1 handed over, and chunk 0's output
            state.activations -= 2 * boundary
        if chunk == 1 and last:  # chunk 1's input lives on as chunk 0's output until B0
            state.activations += boundary
        if c.embedding_grad:
            state.grad((chunk, "embedding"), c.embedding_grad)
        else:
            state.activations += boundary  # the gradient sent (or handed to B0) stays
        state.moment()

    def backward(chunk: int, defer: bool) -> None:
        c = chunks[chunk]
        received = backward_start(chunk)
        for index in reversed(range(len(c.layers))):
            backward_layer(chunk, index, c.layers[index], defer)
            state.moment()
        backward_end(chunk, received)

    def overlapped(f_chunk: int, b_chunk: int) -> None:
        fc, bc = chunks[f_chunk], chunks[b_chunk]
        forward_start(f_chunk)
        received = backward_start(b_chunk)
        b_layers = list(reversed(range(len(bc.layers))))
        for step in range(max(len(fc.layers), len(b_layers))):
            f = fc.layers[step] if step < len(fc.layers) else None
            b = bc.layers[b_layers[step]] if step < len(b_layers) else None
            if f is not None:
                forward_layer(f_chunk, f, "attention")
            if b is not None:
                backward_layer(b_chunk, b_layers[step], b, False, "experts")
            if f is not None:
                forward_layer(f_chunk, f, "experts")
            if b is not None:
                backward_layer(b_chunk, b_layers[step], b, False, "attention")
            if f is not None:
                forward_layer(f_chunk, f, "aggregate")
            state.moment()
        if fc.head_saved:
            state.moment(fc.head_forward_transient)
            state.activations += fc.head_saved
        forward_end(f_chunk)
        backward_end(b_chunk, received)

    def weight_step() -> None:
        if not deferred:
            return
        chunk, index = deferred.pop(0)
        for i, layer in enumerate(chunks[chunk].layers):
            if layer.deferred_inputs:
                state.moment(layer.expert_grad)
                state.activations -= layer.deferred_inputs
                state.grad((chunk, i, "experts"), layer.expert_grad)
        state.moment()

    for step in walk(rank, config.pp, config.num_microbatches):
        action = step.action
        before = state.peak
        state.peak = (-1, 0, 0)
        if action.kind == "F":
            forward(action.chunk)
        elif action.kind == "B":
            defer = optimized and action.deferred
            backward(action.chunk, defer)
            if defer:
                deferred.append((action.chunk, step.backward_micro_batch))
        elif action.kind == "W":
            if optimized:
                weight_step()
            state.moment()
        elif optimized:
            overlapped(action.chunk, action.backward_chunk)
        else:  # the reference runs the F, then the B
            forward(action.chunk)
            backward(action.backward_chunk, False)
        during = state.peak
        most = [max(most[c], step.in_flight[c]) for c in (0, 1)]
        timeline.append(_moment(step, during, weights + optimizer + batch_bytes(config)))
        if during[0] > peak:
            peak, peak_step, peak_split = during[0], step, during
        state.peak = max(before, during)
    # The optimizer step: every gradient, the state AdamW creates, a parameter-sized pair of
    # temporaries for the largest tensor.
    _, activations_at_peak, gradients_at_peak = peak_split
    return RankEstimate(
        rank=rank,
        stages=stages,
        layers=(list(partition[stages[0]]), list(partition[stages[1]])),
        params=params,
        weights_bytes=weights,
        gradients_bytes=gradients_at_peak,
        optimizer_bytes=optimizer,
        activation_bytes=activations_at_peak + batch_bytes(config),
        peak_phase=peak_step.action.phase if peak_step else "",
        peak_action=_label(peak_step.action) if peak_step else "",
        in_flight_at_peak=peak_step.in_flight if peak_step else (0, 0),
        max_in_flight=tuple(most),
        all_gradients_bytes=all_gradients,
        timeline=timeline,
    )


def _estimate_rank_optimized(
    config: EstimateConfig, rank: int, partition: list[range]
) -> RankEstimate:
    """The optimized schedule, step by step (`optimized.estimator.steps`)."""
    from optimized.estimator.steps import step_profile

    m, b, tokens = config.model, config.param_bytes, config.tokens
    stages = (rank, config.num_stages - 1 - rank)
    count = rank_params(config, stages, partition)
    params, weights, all_gradients, optimizer = static_bytes(
        config, count, _head_weight_numel(config, stages)
    )
    chunk_layers = [list(partition[s]) for s in stages]
    weights += buffer_bytes(config, [x for c in chunk_layers for x in c])
    th = tokens * m.hidden_size * b
    first, last = rank == 0, rank == config.pp - 1
    profiles = [[step_profile(config, layer) for layer in c] for c in chunk_layers]
    grads = [[layer_profile(config, layer) for layer in c] for c in chunk_layers]
    head_weight = m.vocab_size * m.hidden_size * b
    # Under FSDP2 the fused loss's whole-weight gradient buffer waits for the backward,
    # which reduce-scatters it into a 1/DP shard; without, micro-batch 0's becomes the grad.
    sharded_head = config.fsdp and not m.tie_word_embeddings
    head_divisor = _fsdp_divisor(config) if sharded_head else 1
    # Final norm (float input = the chunk output in float32, rsqrt, normalised, output),
    # the linear cross-entropy's finished grad_hidden, its losses and grad_weight.
    head = (th if b == F32 else tokens * m.hidden_size * F32) + tokens * F32 + 2 * th
    head += th + tokens * F32 + 8
    state = _State()
    # Sends held until this rank has received the peer's reply that proves them taken
    # (`send_completions`; None: to the end of the step): [bytes, receives needed].
    completions = iter(send_completions(rank, config.pp, config.num_microbatches))
    sends: list[tuple[int, int | None]] = []
    received = [0]
    deferred: list[int] = []
    local_out: list[int] = []
    peak, peak_step, timeline = -1, None, []

    late_held = [0]

    def hold_late(chunk, index, name):
        """The last layer of a chunk whose output root is kept (not the loss chunk)."""
        if index == len(profiles[chunk]) - 1 and not is_loss(chunk):
            extra = profiles[chunk][index].held_to_action_end.get(name, 0)
            state.activations += extra
            late_held[0] += extra

    def release_late():
        state.activations -= late_held[0]
        late_held[0] = 0

    def run_step(chunk, index, mb, step, defer=False):
        if TRACE is not None:
            level = state.activations + state.gradients
            TRACE.append((chunk_layers[chunk][index], step.name, level, level + step.transient))
        state.moment(step.transient)
        state.activations += step.delta
        if step.grad == "dense":
            state.grad((chunk, index, "dense"), grads[chunk][index].dense_grad)
        elif step.grad == "experts":
            if defer:
                inputs = grads[chunk][index].deferred_inputs
                state.activations += inputs
                deferred[-1] += inputs
            else:
                state.grad((chunk, index, "experts"), grads[chunk][index].expert_grad)
        state.moment()

    def is_loss(chunk):
        return chunk == 1 and first

    def send(nbytes):
        sends.append((nbytes, next(completions)))

    def receive():
        """One received tensor; the sends it proves complete are waited and freed."""
        state.activations += th
        state.moment()
        received[0] += 1
        for item in [x for x in sends if x[1] is not None and x[1] <= received[0]]:
            sends.remove(item)
            state.activations -= item[0]

    def f_start(chunk):
        if chunk == 0 and first:
            state.activations += th  # the embedding's output
        elif not (chunk == 1 and last):
            receive()

    def f_end(chunk, mb):
        if is_loss(chunk):
            state.moment(th)
            state.activations += head
            if mb == 0 and not sharded_head:  # grad_weight becomes lm_head.grad
                state.grad((chunk, "head"), head_weight)
            else:
                state.activations += head_weight
            state.moment()
        elif chunk == 0 and last:
            local_out.append(th)
        else:
            send(th)

    def b_start(chunk, mb):
        if is_loss(chunk):
            state.moment(th)
            state.activations -= head + (head_weight if mb or sharded_head else 0)
            state.activations += th  # head_input.grad
            if sharded_head:  # FSDP2 shards dim 0, rows rounded up
                rows = -(-m.vocab_size // head_divisor)
                state.grad((chunk, "head"), rows * m.hidden_size * config.grad_bytes)
            norm = -(-m.hidden_size // head_divisor)
            state.grad((chunk, "norm"), norm * config.grad_bytes)
        elif not (chunk == 0 and last):
            receive()  # the gradient

    def b_end(chunk):
        if not (chunk == 1 and last):  # there the input is chunk 0's output, kept until B0
            state.activations -= th  # the chunk's input (received or embedded), its root
        if chunk == 0 and first:
            state.grad((chunk, "embedding"), _embedding_grad_bytes(config))
            state.activations -= th
        elif chunk == 1 and last:
            # The input gradient is handed to B0 locally: held until B0 has used it (B0 then
            # frees it as any chunk frees its received gradient).
            state.activations += th
        else:
            send(th)  # the sent gradient
        state.moment()

    fsteps = ("attention_forward", "dispatch_start", "dispatch_wait", "experts_forward",
              "combine_start", "combine_wait", "aggregate_forward")  # fmt: skip
    bsteps = ("aggregate_backward", "combine_backward_start", "combine_backward_wait",
              "experts_backward", "dispatch_backward_start", "dispatch_backward_wait",
              "attention_backward")  # fmt: skip
    order = (("B", 0), ("B", 1), ("F", 0), ("F", 1), ("B", 2), ("B", 3), ("B", 4), ("F", 2),
             ("F", 3), ("F", 4), ("B", 5), ("B", 6), ("F", 5), ("F", 6))  # fmt: skip

    def forward(chunk, mb):
        f_start(chunk)
        for i, p in enumerate(profiles[chunk]):
            for name in fsteps:
                run_step(chunk, i, mb, p.forward[name])
        f_end(chunk, mb)

    def backward(chunk, mb, defer):
        if defer:
            deferred.append(0)
        b_start(chunk, mb)
        for i in reversed(range(len(profiles[chunk]))):
            for name in bsteps:
                run_step(chunk, i, mb, profiles[chunk][i].backward[name], defer)
                hold_late(chunk, i, name)
        release_late()
        b_end(chunk)

    def overlapped(fc, fmb, bc, bmb):
        f_start(fc)
        b_start(bc, bmb)
        fl, bl = profiles[fc], list(reversed(range(len(profiles[bc]))))
        for k in range(max(len(fl), len(bl))):
            for side, n in order:
                if side == "F" and k < len(fl):
                    run_step(fc, k, fmb, fl[k].forward[fsteps[n]])
                elif side == "B" and k < len(bl):
                    run_step(bc, bl[k], bmb, profiles[bc][bl[k]].backward[bsteps[n]])
                    hold_late(bc, bl[k], bsteps[n])
        f_end(fc, fmb)
        release_late()
        b_end(bc)

    for step in walk(rank, config.pp, config.num_microbatches):
        action = step.action
        before = state.peak
        state.peak = (-1, 0, 0)
        state.moment()
        if action.kind == "F":
            forward(action.chunk, step.forward_micro_batch)
        elif action.kind == "B":
            backward(action.chunk, step.backward_micro_batch, action.deferred)
        elif action.kind == "W":
            if deferred:
                inputs = deferred.pop(0)
                state.moment()
                state.activations -= inputs
        else:
            overlapped(action.chunk, step.forward_micro_batch, action.backward_chunk,
                       step.backward_micro_batch)  # fmt: skip
        during = state.peak
        timeline.append(_moment(step, during, weights + optimizer + batch_bytes(config)))
        if during[0] > peak:
            peak, peak_step, peak_split = during[0], step, during
        state.peak = max(before, during)
    _, activations_at_peak, gradients_at_peak = peak_split
    return RankEstimate(
        rank=rank, stages=stages, layers=(chunk_layers[0], chunk_layers[1]), params=params,
        weights_bytes=weights, gradients_bytes=gradients_at_peak, optimizer_bytes=optimizer,
        activation_bytes=activations_at_peak + batch_bytes(config),
        peak_phase=peak_step.action.phase, peak_action=_label(peak_step.action),
        in_flight_at_peak=peak_step.in_flight, max_in_flight=(0, 0),
        all_gradients_bytes=all_gradients, timeline=timeline,
    )  # fmt: skip


def _moment(step, during: tuple[int, int, int], static: int) -> dict:
    """One action of the walk as the timeline reports it.

    ``mark`` and ``micro_batch`` are what the stack's observer (the harness's memory
    tracker) records at the start of the same action, so a measured peak moment can be
    looked up here; ``peak_bytes`` is the rank's total during the action and
    ``gradients_bytes`` the gradients existing at that moment.
    """
    action = step.action
    if action.kind == "W":
        mark, micro_batch = "W", None
    elif action.kind == "B":
        mark, micro_batch = f"B{action.chunk}", step.backward_micro_batch
    elif action.kind == "F":
        mark, micro_batch = f"F{action.chunk}", step.forward_micro_batch
    else:  # the optimized stack marks the pair; the reference its F first
        mark, micro_batch = _label(action), step.forward_micro_batch
    return {
        "phase": action.phase,
        "action": _label(action),
        "mark": f"{action.phase}:{mark}",
        "micro_batch": micro_batch,
        "in_flight": list(step.in_flight),
        "bytes": during[0],
        "peak_bytes": during[0] + static,
        "gradients_bytes": during[2],
    }


def _label(action) -> str:
    if action.kind == "FB":
        return f"F{action.chunk}&B{action.backward_chunk}"
    suffix = " (W deferred)" if action.deferred else ""
    return f"{action.kind}{action.chunk}{suffix}"


def estimate_ranks(config: EstimateConfig, partition: list[range]) -> list[RankEstimate]:
    return [estimate_rank(config, rank, partition) for rank in range(config.pp)]


def largest_peak(config: EstimateConfig, partition: list[range]) -> int:
    return max(rank.peak_bytes for rank in estimate_ranks(config, partition))


__all__ = ["BUCKETS", "RankEstimate", "estimate_rank", "estimate_ranks", "largest_peak"]
