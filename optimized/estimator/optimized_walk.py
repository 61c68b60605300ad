"""The optimized schedule's walk, step by step over the overlapped stage functions
(`optimized.estimator.steps`): early frees, deferred weight gradients, F&B pairs
interleaved layer by layer. Shared pieces live in `optimized.estimator.memory`.
"""

from __future__ import annotations

from optimized.estimator.activations import F32, mtp_final_norm_saved
from optimized.estimator.balancing import pooled_stats_bytes, pooled_totals_bytes
from optimized.estimator.config import EstimateConfig
from optimized.estimator.memory import (
    RankEstimate,
    WalkState,
    action_label,
    batch_bytes,
    buffer_bytes,
    embedding_backward_bytes,
    embedding_grad_bytes,
    fused_loss_transient,
    grad_divisor,
    head_weight_numel,
    layer_profile,
    rank_params,
    static_bytes,
    timeline_moment,
    with_optimizer_step,
)
from optimized.estimator.mtp_memory import mtp_grad_bytes, optimized_mtp_depths
from optimized.estimator.schedule import send_completions, walk
from optimized.estimator.sharded_step import FsdpWalk, FsdpWalkState, with_sharded_optimizer_step
from optimized.estimator.steps import step_profile
from optimized.estimator.sync_marks import sync_marks

TRACE: list | None = None
"""Set to a list to record each step of the optimized walk: (layer, step, start, peak)."""


def estimate_rank_optimized(
    config: EstimateConfig, rank: int, partition: list[range], routing=None
) -> RankEstimate:
    """The optimized schedule, step by step (`optimized.estimator.steps`); ``routing``: an
    `ObservedRouting` to use instead of balanced routing."""
    m, b, tokens = config.model, config.param_bytes, config.tokens
    stages = (rank, config.num_stages - 1 - rank)
    count = rank_params(config, stages, partition)
    params, weights, all_gradients, state_bytes = static_bytes(
        config, count, head_weight_numel(config, stages)
    )
    # The first step's forward and backward run before AdamW has created its state.
    optimizer = 0 if config.first_step else state_bytes
    chunk_layers = [list(partition[s]) for s in stages]
    rank_layers = [x for c in chunk_layers for x in c]
    weights += buffer_bytes(config, rank_layers, mtp=rank == 0)
    held = batch_bytes(config, rank_layers)  # the batch and the step's balancing state
    # The pooled loss's counts of a micro-batch on a chunk, and its totals.
    stats, totals = pooled_stats_bytes(config), pooled_totals_bytes(config)
    th = tokens * m.hidden_size * b
    first, last = rank == 0, rank == config.pp - 1
    by_micro_batch: dict = {}

    def profiles_of(chunk, mb):
        """The chunk's layers' (step profiles, layer profiles) for micro-batch ``mb``: the
        same for every micro-batch under balanced routing."""
        key = (chunk, mb if routing is not None else None)
        if key not in by_micro_batch:
            configs = [
                routing.config_for(config, layer, mb) if routing is not None else config
                for layer in chunk_layers[chunk]
            ]
            by_micro_batch[key] = (
                [step_profile(c, layer) for c, layer in zip(configs, chunk_layers[chunk])],
                [layer_profile(c, layer) for c, layer in zip(configs, chunk_layers[chunk])],
            )
        return by_micro_batch[key]

    head_weight = m.vocab_size * m.hidden_size * b
    # Under FSDP2 the fused loss's whole-weight gradient buffer waits for the backward,
    # which reduce-scatters it into a 1/DP shard; without, micro-batch 0's becomes the grad.
    sharded_head = config.fsdp and not m.tie_word_embeddings
    head_divisor = grad_divisor(config) if sharded_head else 1
    # Kept from the loss forward to its backward: the final norm's saved tensors (float input
    # = the chunk output in float32, rsqrt, normalised), the linear cross-entropy's finished
    # grad_hidden and grad_weight (below), scalars. The norm's output and the per-token
    # losses die when the loss stage returns (`fused_loss_transient`).
    head = (th if b == F32 else tokens * m.hidden_size * F32) + tokens * F32 + th
    head += th + 8
    fused_loss = fused_loss_transient(config)
    # Each MTP depth (`models.network.mtp`, after the main loss in the loss stage): what it
    # keeps to the backward and its forward's and backward's high points
    # (`optimized.estimator.mtp_memory`), after the final norm's rerun for its h^0.
    mtp_h0 = sum(item.nbytes for item in mtp_final_norm_saved(config)) if config.mtp_layers else 0
    mtp_of: dict = {}

    def mtp_depths(mb):
        key = mb if routing is not None else None
        if key not in mtp_of:
            mtp_of[key] = optimized_mtp_depths(config, routing, mb)
        return mtp_of[key]

    mtp_grad = mtp_grad_bytes(config)
    state = FsdpWalkState() if config.fsdp else WalkState()
    fsdp = FsdpWalk(
        config, rank, chunk_layers, sync_marks(rank, config.pp, config.num_microbatches)
    )
    fsdp.begin(state, first)
    weight_steps = [0]
    # Sends held until this rank has received the peer's reply that proves them taken
    # (`send_completions`; None: to the end of the step): [bytes, receives needed].
    completions = iter(send_completions(rank, config.pp, config.num_microbatches))
    sends: list[tuple[int, int | None]] = []
    received = [0]
    # Per deferred backward: [weight-gradient inputs it left, the layers whose W it owes].
    deferred: list[list] = []
    local_out: list[int] = []
    peak, peak_step, timeline = -1, None, []

    late_held = [0]

    def hold_late(chunk, index, mb, name):
        """The last layer of a chunk whose output root is kept (not the loss chunk)."""
        if index == len(chunk_layers[chunk]) - 1 and not is_loss(chunk):
            extra = profiles_of(chunk, mb)[0][index].held_to_action_end.get(name, 0)
            state.activations += extra
            late_held[0] += extra

    def release_late():
        state.activations -= late_held[0]
        late_held[0] = 0

    def run_step(chunk, index, mb, step, defer=False):
        transient = step.transient
        if defer and step.name == "experts_backward":
            transient = profiles_of(chunk, mb)[0][index].deferred_experts_rise
        layer = profiles_of(chunk, mb)[1][index]
        if step.grad == "dense" and (chunk, index, "dense") not in state.created:
            transient += step.grad_before_peak  # this backward makes the layer's gradients
        group = fsdp.step_group(chunk, index, step.name)
        if group is not None:  # reshard_after_forward on: the module's parameters gathered
            transient += fsdp.running(group)
        if TRACE is not None:
            level = state.activations + state.gradients
            TRACE.append((chunk_layers[chunk][index], step.name, level, level + transient))
        state.moment(transient)
        state.activations += step.delta
        if step.grad == "dense":
            state.grad((chunk, index, "dense"), layer.dense_grad)
        elif step.grad == "experts":
            if defer:
                state.activations += layer.deferred_inputs
                deferred[-1][0] += layer.deferred_inputs
                deferred[-1][1].append((chunk, index, mb))
            else:
                state.grad((chunk, index, "experts"), layer.expert_grad)
        state.moment()
        if step.name == "attention_backward":
            fsdp.done(state, chunk, f"dense.{chunk_layers[chunk][index]}")
        elif step.name == "experts_backward":
            complete = fsdp.marks.last_weight[chunk] is None
            fsdp.done(state, chunk, f"experts.{chunk_layers[chunk][index]}", complete)

    def weight_step(owed):
        """One W: each deferred grouped GEMM's weight gradient in the order the backward put
        them (`WeightGradStore`); the inputs stay until the whole group has run."""
        for chunk, index, mb in owed:
            key = (chunk, index, "experts")
            first = key not in state.created
            state.created.add(key)
            steps, layers = profiles_of(chunk, mb)
            for transient, share in zip(
                steps[index].weight_transients, steps[index].weight_grad_shares, strict=True
            ):
                state.moment(transient)
                if first:  # the first W of this layer leaves its gradients behind
                    state.gradients += layers[index].expert_grad * share // 3

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
        fsdp.forward(state, chunk, first)
        state.activations += stats  # held by the micro-batch's balance to its backward's end
        if chunk == 0 and first:
            state.moment(th + fsdp.running("embedding"))
            state.activations += th  # the embedding's output
        elif not (chunk == 1 and last):
            receive()

    def f_end(chunk, mb):
        if is_loss(chunk):
            state.moment(th)
            state.activations += head + totals
            if mb == 0 and not sharded_head:  # grad_weight becomes lm_head.grad
                state.grad((chunk, "head"), head_weight)
            else:
                state.activations += head_weight
            # The chunked pass's logits buffer and z-losses, on the gathered weight (FSDP2).
            state.moment(fused_loss + fsdp.running("head"))
            state.activations += mtp_h0
            for k, depth in enumerate(mtp_depths(mb)):  # each on its gathered units (FSDP2)
                group = f"experts.{m.num_hidden_layers + k}"
                state.moment(depth.layer_rise + fsdp.running(group))
                state.moment(depth.loss_rise + fsdp.running("head"))
                state.activations += sum(item.nbytes for item in depth.saved)
        elif chunk == 0 and last:
            local_out.append(th)
        else:
            send(th)

    def b_start(chunk, mb):
        fsdp.backward(chunk)
        if is_loss(chunk):
            state.moment(th + fsdp.running("head"))
            for k, depth in reversed(list(enumerate(mtp_depths(mb)))):  # the MTP's runs first
                group = f"experts.{m.num_hidden_layers + k}"
                state.moment(depth.backward_rise + fsdp.running(group))
                state.activations -= sum(item.nbytes for item in depth.saved)
            state.activations -= head + mtp_h0 + (head_weight if mb or sharded_head else 0)
            if config.mtp_layers:
                state.grad((chunk, "mtp"), mtp_grad)
                if (0, "embedding") in state.created:  # the table's gradient, added in
                    state.moment(embedding_backward_bytes(config) + fsdp.running("embedding"))
                state.grad((0, "embedding"), embedding_grad_bytes(config))
                for group in fsdp.mtp_groups:
                    fsdp.done(state, chunk, group)
            state.activations += th  # head_input.grad
            if sharded_head:  # FSDP2 shards dim 0, rows rounded up
                rows = -(-m.vocab_size // head_divisor)
                state.grad((chunk, "head"), rows * m.hidden_size * config.grad_bytes)
            norm = -(-m.hidden_size // head_divisor)
            state.grad((chunk, "norm"), norm * config.grad_bytes)
            fsdp.done(state, chunk, "head")
        elif not (chunk == 0 and last):
            receive()  # the gradient
            state.activations += totals  # beside it (chunk 0 on the last rank: handed over)

    def b_end(chunk):
        state.activations -= stats
        if not (chunk == 1 and last):  # there the input is chunk 0's output, kept until B0
            state.activations -= th  # the chunk's input (received or embedded), its root
        if chunk == 0 and first:
            state.moment(fsdp.running("embedding"))
            if (chunk, "embedding") in state.created:  # the table's gradient, added in
                state.moment(embedding_backward_bytes(config) + fsdp.running("embedding"))
            state.grad((chunk, "embedding"), embedding_grad_bytes(config))
            fsdp.done(state, chunk, "embedding")
            state.activations -= th + totals
        elif chunk == 1 and last:
            # The input gradient is handed to B0 locally: held until B0 has used it (B0 then
            # frees it as any chunk frees its received gradient).
            state.activations += th
        else:
            send(th + totals)  # the sent gradient and the pooled totals after it
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
        for i, p in enumerate(profiles_of(chunk, mb)[0]):
            for name in fsteps:
                run_step(chunk, i, mb, p.forward[name])
        f_end(chunk, mb)

    def backward(chunk, mb, defer):
        if defer:
            deferred.append([0, []])
        b_start(chunk, mb)
        steps = profiles_of(chunk, mb)[0]
        for i in reversed(range(len(steps))):
            for name in bsteps:
                run_step(chunk, i, mb, steps[i].backward[name], defer)
                hold_late(chunk, i, mb, name)
        b_end(chunk)  # the late-held tensors are alive through it (embedding backward, send)
        release_late()

    def overlapped(fc, fmb, bc, bmb):
        f_start(fc)
        b_start(bc, bmb)
        fl, bsteps_of = profiles_of(fc, fmb)[0], profiles_of(bc, bmb)[0]
        bl = list(reversed(range(len(bsteps_of))))
        for k in range(max(len(fl), len(bl))):
            for side, n in order:
                if side == "F" and k < len(fl):
                    run_step(fc, k, fmb, fl[k].forward[fsteps[n]])
                elif side == "B" and k < len(bl):
                    run_step(bc, bl[k], bmb, bsteps_of[bl[k]].backward[bsteps[n]])
                    hold_late(bc, bl[k], bmb, bsteps[n])
        f_end(fc, fmb)
        b_end(bc)
        release_late()

    for step in walk(rank, config.pp, config.num_microbatches):
        action = step.action
        before = state.peak
        start = state.activations + state.gradients + getattr(state, "weights", 0)
        state.peak = (-1, 0, 0)
        state.moment()
        if action.kind == "F":
            forward(action.chunk, step.forward_micro_batch)
        elif action.kind == "B":
            backward(action.chunk, step.backward_micro_batch, action.deferred)
        elif action.kind == "W":
            if deferred:
                inputs, owed = deferred.pop(0)
                state.moment()
                weight_step(owed)
                state.activations -= inputs
            fsdp.weight_done(state, weight_steps[0])
            weight_steps[0] += 1
        else:
            overlapped(action.chunk, step.forward_micro_batch, action.backward_chunk,
                       step.backward_micro_batch)  # fmt: skip
        during = state.peak
        timeline.append(timeline_moment(step, during, weights + optimizer + held, start))
        if during[0] > peak:
            peak, peak_step, peak_split = during[0], step, during
        state.peak = max(before, during)
    activations_at_peak, gradients_at_peak = peak_split[1], peak_split[2]
    weights += peak_split[3] if len(peak_split) > 3 else 0  # FSDP2's gathered, at the peak
    estimate = RankEstimate(
        rank=rank, stages=stages, layers=(chunk_layers[0], chunk_layers[1]), params=params,
        weights_bytes=weights, gradients_bytes=gradients_at_peak, optimizer_bytes=optimizer,
        activation_bytes=activations_at_peak + held,
        peak_phase=peak_step.action.phase, peak_action=action_label(peak_step.action),
        in_flight_at_peak=peak_step.in_flight, max_in_flight=(0, 0),
        all_gradients_bytes=all_gradients, timeline=timeline,
    )  # fmt: skip
    if config.fsdp:
        return with_sharded_optimizer_step(config, estimate, count, state_bytes)
    return with_optimizer_step(config, estimate, count, state_bytes)
