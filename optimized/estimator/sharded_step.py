"""The optimizer step of the FSDP2 runner (``optimized-fsdp``): `ShardedAdamW` as it runs.

`ShardedAdamW` copies nothing whole. Its step, read off `optimized.train.optimizer` (the
estimator imports nothing from the trainer), holds:

- every parameter's reduced gradient (``.grad``: this rank's FSDP2 rows, or the whole
  all-reduced gradient of a parameter off FSDP2), until the step ends; the slices it
  takes of them are views;
- ``prepare_gradients``, slice by slice, block by block (``UPDATE_BLOCK`` elements): a
  block's ``.double()`` and its ``.pow(2)`` while its squares are summed for the global
  norm, 16 bytes per element of the block;
- the update (`memory.optimizer_temporaries`), slice by slice, block by block: float32
  copies of the 16-bit master, moments and gradient blocks, and the square root and the
  denominator;
- off FSDP2 with a replica group of more than one rank (a tied output layer), the
  all-gather of the updated slices: the received slices and their concatenation.

With ``reshard_after_forward`` off FSDP2's gathered parameters are freed at each unit's
last backward (`optimized.pipeline.gradient_sync`), so the step sees only the shards.

The slices follow the part's parameter order, which a meta-device build of the part gives
exactly (`models.network.CausalLM`, no storage); the step's peak is its largest block's.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from optimized.estimator.activations import F32
from optimized.estimator.config import EstimateConfig
from optimized.estimator.memory import (
    UPDATE_BLOCK,
    WalkState,
    batch_bytes,
    head_weight_numel,
    record_optimizer_step,
    update_blocks,
)

F64 = 8


class SliceBytes(NamedTuple):
    """One parameter's slice in `ShardedAdamW` on this rank."""

    elements: int
    """Elements of the slice (and of the master AdamW steps)."""
    gathered: int
    """Bytes of the write-back all-gather (received slices and their concatenation)."""


def part_parameters(config: EstimateConfig, layers: list[int], first: bool) -> list:
    """``(name, shape)`` of this pp-rank's part in `named_parameters` order, as the runner
    builds it (`models.network.CausalLM`: the embedding, the layers of chunk 0 then chunk 1,
    the MTP layers, the final norm and the output layer, all but the layers on pp-rank 0
    only; an output layer tied to the embedding is the same parameter); each layer's from a
    meta-device `DecoderLayer` or `MTPLayer` (no storage), built once per process."""
    key = ("part_parameters", tuple(layers), first)
    if key not in config.cache:
        m = config.model
        out: list = []
        if first:
            out.append(("model.embed_tokens.weight", (m.vocab_size, m.hidden_size)))
        model_key = repr(m)
        _MODELS.setdefault(model_key, m)
        for layer in layers:
            out += _layer_parameters(model_key, layer, config.ep)
        if first:
            for depth in range(1, config.mtp_layers + 1):  # the MTP layers, with the head
                out += _layer_parameters(model_key, m.num_hidden_layers + depth - 1, config.ep)
            out.append(("model.norm.weight", (m.hidden_size,)))
            if not m.tie_word_embeddings:
                out.append(("lm_head.weight", (m.vocab_size, m.hidden_size)))
        config.cache[key] = out
    return config.cache[key]


_MODELS: dict = {}


@functools.lru_cache(maxsize=4096)
def _layer_parameters(model_key: str, layer: int, ep: int) -> tuple:
    import torch  # noqa: PLC0415

    from models.network import DecoderLayer, ExpertParallel, MTPLayer  # noqa: PLC0415

    model, ep_of = _MODELS[model_key], ExpertParallel(None, 0, ep)
    with torch.device("meta"):
        if layer >= model.num_hidden_layers:  # an MTP depth (`models.network.mtp`)
            built = MTPLayer(model, layer - model.num_hidden_layers + 1, ep_of)
        else:
            built = DecoderLayer(model, layer, ep_of)
    prefix = f"model.layers.{layer}."
    return tuple((prefix + name, tuple(p.shape)) for name, p in built.named_parameters())


def slice_bytes(config: EstimateConfig, name: str, shape: tuple[int, ...]) -> SliceBytes:
    """What `ShardedAdamW.prepare_gradients` and its write-back hold for one parameter on
    dp-rank 0 (FSDP2 rows rounded up, as `static_bytes` counts them)."""
    numel = 1
    for size in shape:
        numel *= size
    expert = ".mlp.experts." in name
    replicas = config.dp // config.ep if expert else config.dp
    tied = config.model.tie_word_embeddings and ("embed_tokens" in name or "lm_head" in name)
    fsdp = (replicas > 1) if expert else not tied
    if fsdp:
        rows = shape[0] if shape else 1
        return SliceBytes(-(-rows // replicas) * (numel // max(rows, 1)), 0)
    chunk = -(-numel // replicas)
    gathered = 2 * replicas * chunk * F32 if replicas > 1 else 0
    return SliceBytes(chunk, gathered)


def sharded_step_extra(config: EstimateConfig, layers: list[int], first: bool) -> int:
    """Bytes `ShardedAdamW`'s step holds at its highest beyond the weights, the reduced
    gradients and the optimizer state (see the module docstring): its largest block's
    squares, update or the write-back all-gather."""
    slices = [slice_bytes(config, n, s) for n, s in part_parameters(config, layers, first)]
    block = min(max((piece.elements for piece in slices), default=0), UPDATE_BLOCK)
    squares = 2 * F64 * block
    update = update_blocks(config) * F32 * block
    return max(squares, update, max((piece.gathered for piece in slices), default=0))


def gathered_weight_bytes(config: EstimateConfig, params: dict[str, int], head_numel: int) -> int:
    """FSDP2's gathered parameters that `static_bytes` adds with ``reshard_after_forward``
    off (the rank's part unsharded); freed by the last backward, so not held in the step."""
    if not config.fsdp or config.reshard_after_forward:
        return 0
    dense = params["tensor_sharded"] + params["replicated"]
    experts = params["routed_experts"] if config.expert_dp > 1 else 0
    return (dense - head_numel + experts) * config.param_bytes


def with_sharded_optimizer_step(config: EstimateConfig, estimate, count, optimizer: int):
    """`memory.with_optimizer_step` for the FSDP2 runner: the weights without FSDP2's
    gathered copies, every reduced gradient, ``optimizer`` bytes of state and what
    `ShardedAdamW`'s step holds beyond them (`sharded_step_extra`)."""
    layers = [*estimate.layers[0], *estimate.layers[1]]
    extra = sharded_step_extra(config, layers, estimate.rank == 0)
    gathered = gathered_weight_bytes(
        config, estimate.params, head_weight_numel(config, estimate.stages)
    )
    weights = estimate.weights_bytes - gathered
    activations = batch_bytes(config, layers) + extra
    return record_optimizer_step(estimate, weights, optimizer, activations, start_below=extra)


# ------------------------------------------------------------------ the walk
class UnitGroup(NamedTuple):
    """FSDP2 units that gather, reshard and reduce together in the walk (a layer's
    non-expert modules, its routed experts, the embedding, the head)."""

    gathered: int
    """Bytes of their unsharded parameters (what ``reshard_after_forward`` off holds)."""
    unsharded_grads: int
    """Bytes of their unsharded gradients (``grad_sync="step"`` holds them until reduced)."""
    sharded_grads: int
    """Bytes of their reduced gradients (this rank's rows, rounded up)."""
    largest_unit_grads: int
    """Bytes of the largest unit's unsharded gradients: FSDP2's reduce-scatter copies a
    unit's gradients into one flat input before it frees them."""
    largest_unit_params: int
    """Bytes of the largest unit's unsharded parameters: with ``reshard_after_forward`` on,
    what is gathered while that module runs (twice that while the all-gather's flat output
    is copied out into the parameters)."""


def _unit_of(name: str) -> tuple[str, str] | None:
    """``(group, unit)`` of an FSDP2 parameter, after `optimized.pipeline.sharding`'s
    `fsdp_modules` and `expert_modules` (None: off FSDP2, for `unit_groups` to skip)."""
    parts = name.split(".")
    if name.startswith("model.embed_tokens."):
        return "embedding", "embedding"
    if name.startswith(("lm_head.", "model.norm.")):
        return "head", parts[0] if parts[0] == "lm_head" else "norm"
    if name.startswith("model.layers."):
        layer, module = parts[2], parts[3]
        if module == "mlp" and parts[4] == "experts":
            return f"experts.{layer}", "experts"
        if module == "mlp" and parts[4] == "shared_experts":
            return f"dense.{layer}", "shared_experts"
        return f"dense.{layer}", module
    return None


def unit_groups(config: EstimateConfig, layers: list[int], first: bool) -> dict[str, UnitGroup]:
    """This pp-rank's FSDP2 unit groups: ``dense.<layer>``, ``experts.<layer>`` (routed
    experts with more than one replica), ``embedding`` and ``head`` (when not tied)."""
    key = ("unit_groups", tuple(layers), first)
    if key in config.cache:
        return config.cache[key]
    tied = config.model.tie_word_embeddings
    units: dict[str, dict[str, list[int]]] = {}
    for name, shape in part_parameters(config, layers, first):
        found = _unit_of(name)
        if found is None or (tied and found[0] in ("embedding", "head") and found[1] != "norm"):
            continue
        group, unit = found
        experts = group.startswith("experts.")
        divisor = config.expert_dp if experts else config.dp
        if experts and divisor == 1:
            continue  # EP = DP: the experts stay whole (ZeRO-1)
        numel = 1
        for size in shape:
            numel *= size
        rows = shape[0] if shape else 1
        sharded = -(-rows // divisor) * (numel // max(rows, 1))
        totals = units.setdefault(group, {}).setdefault(unit, [0, 0])
        totals[0] += numel
        totals[1] += sharded
    out = {}
    for group, members in units.items():
        whole = sum(t[0] for t in members.values())
        rows = sum(t[1] for t in members.values())
        out[group] = UnitGroup(
            whole * config.param_bytes,
            whole * config.grad_bytes,
            rows * config.grad_bytes,
            max(t[0] for t in members.values()) * config.grad_bytes,
            max(t[0] for t in members.values()) * config.param_bytes,
        )
    config.cache[key] = out
    return out


class FsdpWalkState(WalkState):
    """`WalkState` with the weights' change from the static figure (FSDP2's gathered
    parameters come and go): peaks are ``(total, activations, gradients, weights)``."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = 0

    def moment(self, extra: int = 0) -> None:
        act = self.activations + extra
        total = act + self.gradients + self.weights
        if total > self.peak[0]:
            self.peak = (total, act, self.gradients, self.weights)


class FsdpWalk:
    """What FSDP2 changes in the optimized walk at its defaults (``grad_sync="step"``,
    ``reshard_after_forward`` off), by unit group (`unit_groups`):

    - parameters are gathered at the chunk's first forward (`static_bytes` counts the whole
      part gathered; before a chunk's first forward the walk takes its share off) and
      resharded at the chunk's last backward, group by group as the backward passes them;
    - gradients accumulate unsharded (the walk's layer profiles count them so) and are
      reduce-scattered once, at the chunk's last backward (routed experts with replicas:
      at the W step that completes them, `sync_marks`), leaving this rank's rows; the
      reduction holds a flat copy of one unit's gradients beside them while it copies in.

    With ``reshard_after_forward`` on, a unit is gathered only while its module runs, and
    then twice over (`running`). With ``grad_sync="micro-batch"`` the walk counts sharded
    gradients and no per-backward reduce-scatter (see `EstimateConfig.fsdp`)."""

    def __init__(self, config: EstimateConfig, rank: int, chunk_layers, marks) -> None:
        self.active = config.fsdp and config.grad_sync == "step"
        self.reshard_off = not config.reshard_after_forward
        self.gathers = config.fsdp and config.reshard_after_forward
        first = rank == 0
        layers = [*chunk_layers[0], *chunk_layers[1]]
        self.groups = unit_groups(config, layers, first) if config.fsdp else {}
        mtp = range(
            config.model.num_hidden_layers, config.model.num_hidden_layers + config.mtp_layers
        )
        self.mtp_groups = [f"{kind}.{layer}" for layer in (mtp if first else ())
                           for kind in ("dense", "experts")]  # fmt: skip
        """The MTP layers' groups (pp-rank 0's loss stage, chunk 1): their gradients,
        experts' included, are complete at the loss stage's backward (nothing deferred)."""
        self.chunk_layers = chunk_layers
        self.marks = marks
        self.forwards = [0, 0]
        self.backwards = [0, 0]
        self.weights = 0
        self.last = [False, False]
        self.pending_experts: dict[int, list[str]] = {}

    def chunk_groups(self, chunk: int, first: bool) -> list[str]:
        names = [f"{kind}.{layer}" for layer in self.chunk_layers[chunk]
                 for kind in ("dense", "experts")]  # fmt: skip
        if first:
            names.append("embedding" if chunk == 0 else "head")
        if first and chunk == 1:
            names += self.mtp_groups
        return [n for n in names if n in self.groups]

    def begin(self, state, first: bool) -> None:
        if self.active and self.reshard_off:
            for chunk in (0, 1):
                for name in self.chunk_groups(chunk, first):
                    state.weights -= self.groups[name].gathered

    def forward(self, state, chunk: int, first: bool) -> None:
        if self.active and self.reshard_off and self.forwards[chunk] == 0:
            for name in self.chunk_groups(chunk, first):
                state.weights += self.groups[name].gathered
        self.forwards[chunk] += 1

    def backward(self, chunk: int) -> None:
        self.last[chunk] = self.backwards[chunk] == self.marks.last_backward[chunk]
        self.backwards[chunk] += 1

    def done(self, state, chunk: int, name: str, reduce: bool = True) -> None:
        """Group ``name`` has run its part of the chunk's backward."""
        group = self.groups.get(name)
        if not (self.active and self.last[chunk] and group):
            return
        if self.reshard_off:
            state.weights -= group.gathered
        if not reduce:
            self.pending_experts.setdefault(self.marks.last_weight[chunk], []).append(name)
            return
        self.reduce(state, group)

    def reduce(self, state, group: UnitGroup) -> None:
        state.moment(group.largest_unit_grads)
        state.gradients -= group.unsharded_grads - group.sharded_grads
        state.moment()

    def running(self, group: str) -> int:
        """With ``reshard_after_forward`` on: bytes FSDP2 holds while a module of ``group``
        runs, forward or backward (its largest unit): the all-gather's flat output and the
        parameters copied out of it, both alive until the module is done (0 otherwise)."""
        found = self.groups.get(group) if self.gathers else None
        return 2 * found.largest_unit_params if found else 0

    def step_group(self, chunk: int, index: int, name: str) -> str | None:
        """The unit group a stage step of layer ``index`` of ``chunk`` runs modules of."""
        layer = self.chunk_layers[chunk][index]
        if name in ("attention_forward", "attention_backward"):
            return f"dense.{layer}"
        if name in ("experts_forward", "experts_backward"):
            return f"experts.{layer}"
        return None

    def weight_done(self, state, ordinal: int) -> None:
        """The rank's W step number ``ordinal`` has run."""
        for name in self.pending_experts.pop(ordinal, []) if self.active else []:
            self.reduce(state, self.groups[name])
