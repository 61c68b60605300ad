"""The reference schedule's walk: a literal DualPipeV whose overlapped pairs run as F, then
B, and whose backwards compute weight gradients at once (nothing deferred, nothing freed
early). Shared pieces live in `optimized.estimator.memory`.
"""

from __future__ import annotations

from optimized.estimator.activations import chunk_boundary_bytes
from optimized.estimator.balancing import pooled_stats_bytes, pooled_totals_bytes
from optimized.estimator.config import EstimateConfig
from optimized.estimator.memory import (
    LayerProfile,
    RankEstimate,
    WalkState,
    action_label,
    batch_bytes,
    buffer_bytes,
    chunk_profile,
    embedding_backward_bytes,
    embedding_grad_bytes,
    head_weight_numel,
    rank_params,
    static_bytes,
    timeline_moment,
    with_optimizer_step,
)
from optimized.estimator.mtp_memory import mtp_grad_bytes
from optimized.estimator.schedule import walk


def estimate_rank_reference(
    config: EstimateConfig, rank: int, partition: list[range], routing=None
) -> RankEstimate:
    """One pp-rank of the reference stack, action by action over the DualPipeV walk;
    ``routing``: an `ObservedRouting` to use instead of balanced routing."""
    stages = (rank, config.num_stages - 1 - rank)
    count = rank_params(config, stages, partition)
    params, weights, all_gradients, state_bytes = static_bytes(
        config, count, head_weight_numel(config, stages)
    )
    # The first step's forward and backward run before AdamW has created its state.
    optimizer = 0 if config.first_step else state_bytes
    layers = [layer for s in dict.fromkeys(stages) for layer in partition[s]]
    weights += buffer_bytes(config, layers, mtp=config.num_stages - 1 in stages)
    held = batch_bytes(config, layers)  # the batch and the step's balancing state
    # The pooled loss's counts of a micro-batch on a chunk, and its totals: held by the
    # micro-batch's balance until its backward ends, and by a pending send to the step's end.
    stats, totals = pooled_stats_bytes(config), pooled_totals_bytes(config)
    by_micro_batch: dict = {}

    def chunk_of(chunk: int, mb: int | None):
        """The chunk's profile for micro-batch ``mb`` (the same for all when balanced)."""
        key = (chunk, mb if routing is not None else None)
        if key not in by_micro_batch:
            config_of = None
            if routing is not None:
                config_of = lambda layer: routing.config_for(config, layer, mb)  # noqa: E731
            layers = list(partition[stages[chunk]])
            by_micro_batch[key] = chunk_profile(config, stages[chunk], layers, config_of)
        return by_micro_batch[key]

    boundary = config.tokens * config.model.hidden_size * config.param_bytes
    # A received input the pipeline keeps as the backward's leaf: in float32 it is the first
    # norm's saved float input (counted with the layer), in 16-bit a tensor of its own.
    leaf = chunk_boundary_bytes(config)
    optimized = config.stack == "optimized"
    first, last = rank == 0, rank == config.pp - 1
    state = WalkState()
    deferred: list[tuple[int, int]] = []  # (chunk, micro-batch) awaiting W
    peak, peak_step, timeline, most = -1, None, [], [0, 0]

    def forward_start(chunk: int) -> None:
        state.activations += stats
        if chunk == 1 and last:
            # The input is chunk 0's output, already held (in float32 also as the float input).
            state.activations -= boundary - leaf
        elif not (chunk == 0 and first):
            state.activations += leaf

    def forward_end(chunk: int) -> None:
        # The output stays: as the backward's root, and in the pending send (to the step's
        # end) or the local hand-over to chunk 1 (until B0 frees it).
        if not (chunk == 1 and first):
            state.activations += boundary
        else:  # the loss stage: the pooled totals, kept to the backward
            state.activations += totals

    def forward_layer(chunk: int, layer: LayerProfile, part: str = "all") -> None:
        if part in ("all", "attention"):
            state.activations += layer.attention
        if part in ("all", "experts"):
            state.activations += layer.experts
            state.moment(layer.forward_transient)
        if part in ("all", "aggregate"):
            state.activations += layer.aggregate

    def forward(chunk: int, mb: int) -> None:
        c = chunk_of(chunk, mb)
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

    def backward_start(chunk: int, mb: int) -> int:
        c = chunk_of(chunk, mb)
        received = 0
        if c.head_saved:
            state.moment(c.head_backward_transient)
            state.activations -= c.head_saved
            state.grad((chunk, "head"), c.head_grad)
            if config.mtp_layers:  # the MTP's backward: its layers' gradients, the table's
                state.grad((chunk, "mtp"), mtp_grad_bytes(config))
                if (0, "embedding") in state.created:  # added into the table's gradient
                    state.moment(embedding_backward_bytes(config))
                state.grad((0, "embedding"), embedding_grad_bytes(config))
        elif not (chunk == 0 and last):
            received = boundary  # the incoming gradient, freed with the backward
            state.activations += received + totals
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
        c = chunk_of(chunk, None)
        state.activations -= received
        if (chunk == 1 and first) or (chunk == 0 and last):  # its counts were not sent
            state.activations -= stats
        if chunk == 0 and first:  # nor its totals
            state.activations -= totals
        if chunk == 0 and last:  # the gradient B1 handed over, and chunk 0's output
            state.activations -= 2 * boundary
        if chunk == 1 and last:  # chunk 1's input lives on as chunk 0's output until B0
            state.activations += boundary - leaf
        elif not (chunk == 0 and first):
            state.activations -= leaf
        if c.embedding_grad:
            if (chunk, "embedding") in state.created:  # the table's gradient, added in
                state.moment(embedding_backward_bytes(config))
            state.grad((chunk, "embedding"), c.embedding_grad)
        else:
            state.activations += boundary  # the gradient sent (or handed to B0) stays
        state.moment()

    def backward(chunk: int, mb: int, defer: bool) -> None:
        c = chunk_of(chunk, mb)
        received = backward_start(chunk, mb)
        for index in reversed(range(len(c.layers))):
            backward_layer(chunk, index, c.layers[index], defer)
            state.moment()
        backward_end(chunk, received)

    def overlapped(f_chunk: int, fmb: int, b_chunk: int, bmb: int) -> None:
        fc, bc = chunk_of(f_chunk, fmb), chunk_of(b_chunk, bmb)
        forward_start(f_chunk)
        received = backward_start(b_chunk, bmb)
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
        for i, layer in enumerate(chunk_of(chunk, index).layers):
            if layer.deferred_inputs:
                state.moment(layer.expert_grad)
                state.activations -= layer.deferred_inputs
                state.grad((chunk, i, "experts"), layer.expert_grad)
        state.moment()

    for step in walk(rank, config.pp, config.num_microbatches):
        action = step.action
        before, start = state.peak, state.activations + state.gradients
        state.peak = (-1, 0, 0)
        fmb, bmb = step.forward_micro_batch, step.backward_micro_batch
        if action.kind == "F":
            forward(action.chunk, fmb)
        elif action.kind == "B":
            defer = optimized and action.deferred
            backward(action.chunk, bmb, defer)
            if defer:
                deferred.append((action.chunk, step.backward_micro_batch))
        elif action.kind == "W":
            if optimized:
                weight_step()
            state.moment()
        elif optimized:
            overlapped(action.chunk, fmb, action.backward_chunk, bmb)
        else:  # the reference runs the F, then the B
            forward(action.chunk, fmb)
            backward(action.backward_chunk, bmb, False)
        during = state.peak
        most = [max(most[c], step.in_flight[c]) for c in (0, 1)]
        timeline.append(timeline_moment(step, during, weights + optimizer + held, start))
        if during[0] > peak:
            peak, peak_step, peak_split = during[0], step, during
        state.peak = max(before, during)
    _, activations_at_peak, gradients_at_peak = peak_split
    estimate = RankEstimate(
        rank=rank,
        stages=stages,
        layers=(list(partition[stages[0]]), list(partition[stages[1]])),
        params=params,
        weights_bytes=weights,
        gradients_bytes=gradients_at_peak,
        optimizer_bytes=optimizer,
        activation_bytes=activations_at_peak + held,
        peak_phase=peak_step.action.phase if peak_step else "",
        peak_action=action_label(peak_step.action) if peak_step else "",
        in_flight_at_peak=peak_step.in_flight if peak_step else (0, 0),
        max_in_flight=tuple(most),
        all_gradients_bytes=all_gradients,
        timeline=timeline,
    )
    return with_optimizer_step(config, estimate, count, state_bytes)
