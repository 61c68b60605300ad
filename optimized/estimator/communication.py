"""Every collective and point-to-point call of one training step, per rank, from the config.

The same figures `models.runtime.CommunicationCounter` measures (kind, group, calls,
bytes sent and received by the direct model: never a rank's own slice), predicted from the
model, the layout and the runner alone, exactly when routing is balanced
(`models.network.BalancedRouting`: token ``t`` takes experts ``(t k + i) mod E``):

- **p2p** (``send``/``recv`` on their stream's group, ``forward0`` ... ``backward1`` of
  `models.runtime.p2p`): the DualPipeV messages of `optimized.estimator.schedule.comm_events`, one
  ``[mbs, seq, hidden]`` activation or gradient each, in the run dtype;
- **all_to_all** (``ep``, EP > 1): per MoE layer of the rank's two chunks and micro-batch,
  the count exchange (``num_experts`` int64, ``E / EP`` to each peer), then dispatch and
  combine forward and their two backward exchanges; a rank sends the routed copies bound
  for other EP ranks' experts and receives the copies of its own experts from each peer;
- **the loss** (`models.runtime.shared_loss`): one float32 all-reduce over ``dp`` and one
  broadcast over ``pp`` from pp-rank 0;
- **the routing controls** (`optimized.estimator.balancing`): with the pooled
  load-balancing loss each p2p message is followed, on its stream, by the micro-batch's
  ``[2, E]`` float32 sums (forward) or ``[E]`` float32 totals (backward); with the expert
  bias one all-reduce over ``dp`` of the step's ``[local MoE layers, E]`` int64 load, at the
  optimizer step (`models.runtime.PipelineRunner.update_expert_biases`; a rank without MoE
  layers has no load to reduce);
- **the trainer's own** (``trainer``, `twinpipe train`'s step): the expert load of every MoE
  layer and the step's balancing values for the log, one float64 ``[L (E + 2) + 2]``
  all-reduce over the world (`optimized.train.expert_load`), on a model with MoE layers.

What a step is: what the runner's ``forward_backward`` and ``optimizer_step`` do, as its
loss's collectives are counted because ``forward_backward`` makes them. A value a caller
asks for after the step for its report is the caller's: `PipelineRunner.balancing_values`
(a ``[2]`` float32 all-reduce over ``dp`` and one over ``pp``, which `twinpipe compare` reads
after each step outside the step it counts, and `twinpipe train` folds into its expert-load
all-reduce) and a ``step_load`` asked without the expert bias are not counted.
- **plain runners** (`models.runtime.reduce_gradients`): one all-reduce per parameter,
  over ``dp``, routed experts over ``expert_replica`` (where those groups have > 1 rank);
- **FSDP2** (``fsdp``, `optimized.pipeline.sharding`): the units are each layer's two norms
  and attention, its dense MLP or router and shared experts, the embedding, the final norm
  and the output layer over ``dp``, the routed experts over ``expert_replica`` (only where
  that group has > 1 rank); each MTP layer's like a layer's, with its ``enorm``, ``hnorm``,
  ``eh_proj`` and ``shared_head.norm``, in pp-rank 0's loss stage (chunk 1); a unit's
  all-gather moves its parameters' padded dim-0 shards (``ceil(rows / n)`` rows each), its
  reduce-scatter ``n`` such shards of gradient. With
  ``reshard_after_forward`` a unit is gathered for each forward and each backward (2 M a
  step), without it once a step. With ``grad_sync="step"`` each unit is reduced once a step
  (`optimized.estimator.sync_marks`); with ``micro-batch`` after every backward that leaves
  it a gradient, the routed experts' deferred weight gradients with the next backward or,
  after the chunk's last, at the step's end (`gradient_sync.reduce_pending_gradients`),
  replayed here action by action;
- **ShardedAdamW** (with ``fsdp``): the global gradient norm's float64
  all-reduce over the world, and the float32 slices of each parameter kept off FSDP2 with a
  replica group > 1 all-gathered after the step.

With real routing the all-to-all rows differ from these by the routing's skew; every other
figure does not depend on routing. Not counted: the trainer's own calls (the global batch's
all-gather, the per-step metrics all-reduce) and anything outside the step.

The parameter inventory (names and shapes) comes from building the rank's part on the meta
device: FSDP2's padding and grouping depend on each tensor's shape. Which units exist, when
each collective happens and how many bytes it moves is this module's own model, held against
the counter by tests/test_communication_estimate.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from models.runtime import BACKWARD, FORWARD, Counts, Traffic, stream_name
from optimized.estimator.activations import I64
from optimized.estimator.balancing import balancing, pooled_stats_bytes, pooled_totals_bytes
from optimized.estimator.config import EstimateConfig
from optimized.estimator.schedule import comm_events, rank_actions

F32, F64 = 4, 8


def _add(counts: Counts, kind: str, group: str, sent: int, received: int, calls: int = 1) -> None:
    traffic = counts.setdefault((kind, group), Traffic())
    traffic.calls += calls
    traffic.sent += sent * calls
    traffic.received += received * calls


def runner_partition(config: EstimateConfig) -> list[range]:
    """The stage ranges the runner uses: ``layers_per_stage``, else what the stack's runner
    picks from its `ParallelConfig` (the optimized one asks the memory estimator with its
    plain settings, `optimized.pipeline.runner.default_partition`; the reference splits
    evenly)."""
    from optimized.pipeline.partition import stage_layers  # noqa: PLC0415 (allowed lazily)

    if config.layers_per_stage is not None:
        return stage_layers(config)
    plain = EstimateConfig(
        model=config.model, pp=config.pp, dp=config.dp, ep=config.ep,
        micro_batch_size=config.micro_batch_size, seq_len=config.seq_len,
        num_microbatches=config.num_microbatches, dtype=config.dtype, stack=config.stack,
    )  # fmt: skip
    return stage_layers(plain)


# ------------------------------------------------------------------ the rank's part
def _rank_part(config: EstimateConfig, pp_rank: int, ep_rank: int, chunks):
    """This rank's part on the meta device (shapes only)."""
    from models.network import CausalLM, ExpertParallel  # noqa: PLC0415

    first = pp_rank == 0
    with torch.device("meta"):
        return CausalLM(
            config.model, None, ExpertParallel(None, ep_rank, config.ep),
            list(chunks[0]) + list(chunks[1]), embedding=first, head=first,
        )  # fmt: skip


def _shapes(module: torch.nn.Module) -> list[torch.Size]:
    return [p.shape for p in module.parameters()]


class Unit:
    """One FSDP2 unit: its parameters' shapes, its group, its chunk, whether it is the
    routed experts (weights deferrable to W; biases not)."""

    def __init__(self, shapes, group: str, size: int, chunk: int, experts: bool) -> None:
        self.shapes, self.group, self.size, self.chunk = shapes, group, size, chunk
        self.experts = experts
        self.calls = 2
        """Forward and backward calls of the module per micro-batch (each gathers it with
        ``reshard_after_forward``): 2, more where the MTP module runs it again."""
        self.also: int | None = None
        """The other chunk whose backwards also give it a gradient (the embedding, which the
        MTP module runs in the loss stage, chunk 1), reduced after each with
        ``micro-batch``."""

    def shard_numel(self, which=None) -> int:
        """Elements of this rank's padded shards (``which``: indices of the parameters)."""
        indices = range(len(self.shapes)) if which is None else which
        total = 0
        for i in indices:
            shape = self.shapes[i]
            rows = math.ceil(shape[0] / self.size) if len(shape) else 1
            total += rows * math.prod(shape[1:])
        return total

    def weight_indices(self) -> list[int]:
        """The parameters whose gradients a zero-bubble backward defers (3-d expert weights)."""
        return [i for i, s in enumerate(self.shapes) if len(s) == 3]


def fsdp_units(config: EstimateConfig, part, chunks, pp_rank: int) -> list[Unit]:
    """The FSDP2 units of a rank (see the module docstring); groups of one rank are left
    out (FSDP2 does not communicate there)."""
    dp, replicas = config.dp, config.dp // config.ep
    tied = config.model.tie_word_embeddings
    units: list[Unit] = []

    def add(module, chunk, group="dp", size=dp, experts=False) -> Unit | None:
        if module is None or size == 1:
            return None
        units.append(Unit(_shapes(module), group, size, chunk, experts))
        return units[-1]

    depths = len(part.mtp_layers)  # pp-rank 0: each depth runs the embedding and the head

    def again(unit: Unit | None, calls: int, also: int | None = None) -> None:
        if unit is not None and depths:
            unit.calls += calls
            unit.also = also

    def add_layer(layer, chunk: int, deferred: bool) -> None:
        for module in layer.fsdp_modules():  # `models.network.DecoderLayer.fsdp_modules`
            add(module, chunk)
        if layer.is_moe:
            add(layer.mlp.experts, chunk, "expert_replica", replicas, experts=deferred)

    if pp_rank == 0 and not tied:
        again(add(part.model.embed_tokens, 0), 2 * depths, 1)
    # The main layers' units; their routed experts' weight gradients may be deferred to W.
    for chunk, layers in enumerate(chunks):
        for index in layers:
            add_layer(part.layer(index), chunk, deferred=True)
    if pp_rank == 0:
        again(add(part.model.norm, 1), 2)  # h^0, forward and backward
        if not tied:  # each depth's loss (forward, backward) and top-1 (forward)
            again(add(part.lm_head, 1), 3 * depths)
    for layer in part.mtp_layers:  # pp-rank 0's loss stage: complete at its backward
        add_layer(layer, 1, deferred=False)
    return units


# ------------------------------------------------------------------ the parts of a step
def _p2p(config: EstimateConfig, pp_rank: int, counts: Counts) -> None:
    message = config.tokens * config.model.hidden_size * config.param_bytes
    # The pooled loss's sums after each activation, its totals after each gradient.
    follows = {FORWARD: pooled_stats_bytes(config), BACKWARD: pooled_totals_bytes(config)}
    for event in comm_events(pp_rank, config.pp, config.num_microbatches):
        direction = FORWARD if event.message.kind == "activation" else BACKWARD
        stream = stream_name(direction, event.message.chunk)
        for nbytes in (message, follows[direction]):
            if not nbytes:
                continue
            if event.op == "send":
                _add(counts, "send", stream, nbytes, 0)
            else:
                _add(counts, "recv", stream, 0, nbytes)


def balanced_rows(config: EstimateConfig) -> list[int]:
    """Routed copies a micro-batch sends to each EP rank under `BalancedRouting`."""
    m = config.model
    slots, experts = config.tokens * m.num_experts_per_tok, m.num_experts
    per_expert = [slots // experts + (e < slots % experts) for e in range(experts)]
    local = experts // config.ep
    return [sum(per_expert[r * local : (r + 1) * local]) for r in range(config.ep)]


def _all_to_all(
    config: EstimateConfig, part, ep_rank: int, counts: Counts, routed: tuple[int, int] | None
) -> None:
    if config.ep == 1:
        return
    m, ep = config.model, config.ep
    # The MTP layers (pp-rank 0's loss stage) exchange like any MoE layer.
    moe_layers = len(part.moe_layers_with_mtp)
    if not moe_layers:  # a rank of dense layers only exchanges nothing
        return
    calls = moe_layers * config.num_microbatches
    count_bytes = (ep - 1) * (m.num_experts // ep) * I64
    _add(counts, "all_to_all", "ep", count_bytes, count_bytes, calls)
    if routed is None:
        rows = balanced_rows(config)
        # My copies bound for other ranks' experts; every peer's copies for my experts.
        routed = (calls * (sum(rows) - rows[ep_rank]), calls * (ep - 1) * rows[ep_rank])
    row = m.hidden_size * config.param_bytes
    out, back = routed[0] * row, routed[1] * row
    # Dispatch and the combine's backward send `out` (2 calls per layer and micro-batch);
    # combine and the dispatch's backward send the expert rows back.
    for sent, received in ((out, back), (back, out)):
        traffic = counts.setdefault(("all_to_all", "ep"), Traffic())
        traffic.calls += 2 * calls
        traffic.sent += 2 * sent
        traffic.received += 2 * received


def _loss(config: EstimateConfig, pp_rank: int, counts: Counts) -> None:
    if config.dp > 1:
        moved = (config.dp - 1) * F32
        _add(counts, "all_reduce", "dp", moved, moved)
    if config.pp > 1:
        if pp_rank == 0:
            _add(counts, "broadcast", "pp", (config.pp - 1) * F32, 0)
        else:
            _add(counts, "broadcast", "pp", 0, F32)


def _balancing(config: EstimateConfig, part, counts: Counts) -> None:
    """The expert bias's load all-reduce (see the module docstring)."""
    moe = len(part.moe_layers_with_mtp)
    if balancing(config).expert_bias and config.dp > 1 and moe:
        moved = (config.dp - 1) * moe * config.model.num_experts * I64
        _add(counts, "all_reduce", "dp", moved, moved)


def _trainer(config: EstimateConfig, counts: Counts) -> None:
    """`twinpipe train`'s expert-load all-reduce (`optimized.train.expert_load`)."""
    world, layers = config.pp * config.dp, sum(config.moe_layers())
    if world > 1 and layers:
        moved = (world - 1) * F64 * (layers * (config.model.num_experts + 2) + 2)
        _add(counts, "all_reduce", "world", moved, moved)


def _plain_reduction(config: EstimateConfig, part, counts: Counts) -> None:
    replicas = config.dp // config.ep
    for name, param in part.named_parameters():
        expert = ".mlp.experts." in name
        group, size = ("expert_replica", replicas) if expert else ("dp", config.dp)
        if size > 1:
            moved = (size - 1) * param.numel() * config.grad_bytes
            _add(counts, "all_reduce", group, moved, moved)


def _reduce_scatter(config: EstimateConfig, unit: Unit, counts: Counts, which=None) -> None:
    moved = (unit.size - 1) * unit.shard_numel(which) * config.grad_bytes
    _add(counts, "reduce_scatter", unit.group, moved, moved)


def _micro_batch_reductions(config: EstimateConfig, units, pp_rank: int, counts: Counts) -> None:
    """``grad_sync="micro-batch"``: replay the actions; a unit is reduced by each backward of
    its chunk that leaves it a gradient (deferred expert weights: the W'd ones so far)."""
    pending = [False, False]  # W'd expert weight gradients of each chunk not yet reduced
    deferred: list[int] = []
    for action in rank_actions(pp_rank, config.pp, config.num_microbatches):
        if action.kind == "W":
            if deferred:
                pending[deferred.pop(0)] = True
            continue
        if action.kind not in ("B", "FB"):
            continue
        chunk = action.backward_chunk if action.kind == "FB" else action.chunk
        defer = action.deferred and config.stack == "optimized"
        for unit in units:
            if unit.chunk != chunk:
                if unit.also == chunk:
                    _reduce_scatter(config, unit, counts)
                continue
            if not unit.experts or not defer or pending[chunk]:
                _reduce_scatter(config, unit, counts)
                continue
            rest = [i for i in range(len(unit.shapes)) if i not in unit.weight_indices()]
            if rest:  # the biases' gradients are not deferred
                _reduce_scatter(config, unit, counts, rest)
        if defer:
            deferred.append(chunk)
        pending[chunk] = False
    for chunk in (0, 1):  # `reduce_pending_gradients` at the step's end
        if pending[chunk]:
            for unit in units:
                if unit.chunk == chunk and unit.experts:
                    _reduce_scatter(config, unit, counts, unit.weight_indices())


def _fsdp(config: EstimateConfig, units: list[Unit], pp_rank: int, counts: Counts) -> None:
    for unit in units:
        gathers = unit.calls * config.num_microbatches if config.reshard_after_forward else 1
        moved = (unit.size - 1) * unit.shard_numel() * config.param_bytes
        _add(counts, "all_gather", unit.group, moved, moved, gathers)
    if config.grad_sync == "step":
        for unit in units:
            _reduce_scatter(config, unit, counts)
    else:
        _micro_batch_reductions(config, units, pp_rank, counts)


def _off_fsdp(config: EstimateConfig, part, counts: Counts) -> None:
    """What `ShardedAdamW` and `reduce_unsharded_gradients` move: gradients of parameters
    off FSDP2 all-reduced, the norm all-reduced, their updated float32 slices gathered."""
    replicas = config.dp // config.ep
    for name, param in part.named_parameters():
        expert = ".mlp.experts." in name
        group, size = ("expert_replica", replicas) if expert else ("dp", config.dp)
        if size == 1 or not _tied(config, name):
            continue  # an FSDP2 unit's (see `fsdp_units`), or nothing to share
        moved = (size - 1) * param.numel() * config.grad_bytes  # `reduce_unsharded_gradients`
        _add(counts, "all_reduce", group, moved, moved)
        slice_bytes = math.ceil(param.numel() / size) * F32
        _add(counts, "all_gather", group, (size - 1) * slice_bytes, (size - 1) * slice_bytes)
    world = config.pp * config.dp
    if world > 1:
        _add(counts, "all_reduce", "world", (world - 1) * F64, (world - 1) * F64)


def _tied(config: EstimateConfig, name: str) -> bool:
    """A parameter kept off FSDP2 although its group has > 1 rank: the tied embedding (and
    output layer)."""
    tied = config.model.tie_word_embeddings
    return tied and (name.startswith("model.embed_tokens.") or name.startswith("lm_head."))


# ------------------------------------------------------------------ the API
def predict_traffic(
    config: EstimateConfig,
    rank: int,
    partition: list[range] | None = None,
    routed: tuple[int, int] | None = None,
    trainer: bool = False,
) -> Counts:
    """``(kind, group) -> Traffic`` of global rank ``rank`` for one training step of the
    runner ``config`` describes: the reference or optimized stack with plain AdamW, or
    (``fsdp``) the optimized stack sharded as `twinpipe train` runs it (`ShardedAdamW`).

    ``routed``: the routed copies this rank sent to other EP ranks and received from them
    over the step's dispatches, when the routing was observed; None: `BalancedRouting`.
    ``trainer``: the step as `twinpipe train` takes it, its own per-step collective too."""
    pp_rank, dp_rank = divmod(rank, config.dp)
    ep_rank = dp_rank % config.ep
    partition = partition or runner_partition(config)
    chunks = (partition[pp_rank], partition[config.num_stages - 1 - pp_rank])
    part = _rank_part(config, pp_rank, ep_rank, chunks)
    counts: Counts = {}
    _p2p(config, pp_rank, counts)
    _all_to_all(config, part, ep_rank, counts, routed)
    if config.fsdp:
        units = fsdp_units(config, part, chunks, pp_rank)
        _fsdp(config, units, pp_rank, counts)
        _off_fsdp(config, part, counts)
    else:
        _plain_reduction(config, part, counts)
    _loss(config, pp_rank, counts)
    _balancing(config, part, counts)
    if trainer:
        _trainer(config, counts)
    return counts


def predict_ranks(config: EstimateConfig) -> Iterator[Counts]:
    """`predict_traffic` of every global rank, in rank order."""
    partition = runner_partition(config)
    for rank in range(config.pp * config.dp):
        yield predict_traffic(config, rank, partition)


PLAN_KINDS = {
    "all_to_all": ("all_to_all",),
    "p2p": ("send",),
    "data_parallel": ("all_gather", "reduce_scatter", "all_reduce", "broadcast"),
}
"""How `twinpipe plan`'s three traffic kinds group the counter's kinds."""


def bytes_sent_by_plan_kind(counts: Counts) -> dict[str, int]:
    """Bytes a rank sends per step, grouped as `twinpipe plan` reports them (`PLAN_KINDS`):
    what `optimized.estimator.plan` ranks layouts by, from `predict_traffic`."""
    return {
        name: sum(t.sent for (kind, _), t in counts.items() if kind in kinds)
        for name, kinds in PLAN_KINDS.items()
    }
