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
    chunk_boundary_bytes,
    embedding_saved,
    head_saved,
    layer_saved,
)
from optimized.estimator.config import EstimateConfig
from optimized.estimator.params import BUCKETS, ParamCount, shard, stage_params
from optimized.estimator.schedule import walk


@dataclass(slots=True)
class StageActivations:
    """Bytes one micro-batch keeps in one stage, and what its F and B hold while running."""

    saved: int
    weight_inputs: int
    largest_layer: int
    forward_transient: int
    backward_transient: int


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
        }


def stage_activations(config: EstimateConfig, stage: int, layers: list[int]) -> StageActivations:
    m, b, tokens = config.model, config.param_bytes, config.tokens
    items = []
    largest_layer = 0
    for layer in layers:
        saved = layer_saved(config, layer)
        largest_layer = max(largest_layer, sum(item.nbytes for item in saved))
        items += saved
    boundary = tokens * m.hidden_size * b
    forward_transient = 0
    backward_transient = 2 * max((item.nbytes for item in items), default=0) + 2 * boundary
    if stage == 0:
        items += embedding_saved(config)
    boundary_held = chunk_boundary_bytes(config) if stage != 0 else 0
    if stage == config.num_stages - 1:
        items += head_saved(config)
        logits = tokens * (m.vocab_size // config.tp) * b
        if config.stack == "reference":
            forward_transient = logits + (tokens * m.vocab_size * F32 if b != F32 else 0)
            backward_transient = max(backward_transient, 2 * tokens * m.vocab_size * F32)
        else:
            forward_transient = 0  # the loss writes its gradient over the logits it keeps
    return StageActivations(
        saved=sum(item.nbytes for item in items) + boundary_held,
        weight_inputs=sum(item.nbytes for item in items if item.weight_input),
        largest_layer=largest_layer,
        forward_transient=forward_transient,
        backward_transient=backward_transient,
    )


def rank_params(config: EstimateConfig, stages: tuple[int, int], partition) -> ParamCount:
    count = ParamCount()
    for stage in dict.fromkeys(stages):
        count += stage_params(config, stage, partition[stage])
    return count


def static_bytes(config: EstimateConfig, count: ParamCount) -> tuple[dict[str, int], int, int, int]:
    """(per-rank params by bucket, weight, gradient, optimizer bytes) of one rank."""
    params = shard(count, config)
    numel = sum(params.values())
    weights = numel * config.param_bytes
    gradients = numel * config.grad_bytes
    dense = params["tensor_sharded"] + params["replicated"]
    experts = params["routed_experts"]
    if config.shard_optimizer:
        dense, experts = -(-dense // config.dp), -(-experts // config.expert_dp)
    # AdamW: two moments (and a master copy if asked) per parameter, a float32 step per tensor.
    optimizer = (dense + experts) * config.optimizer_bytes_per_param + F32 * count.num_tensors
    return params, weights, gradients, optimizer


def estimate_rank(config: EstimateConfig, rank: int, partition: list[range]) -> RankEstimate:
    stages = (rank, config.num_stages - 1 - rank)
    count = rank_params(config, stages, partition)
    params, weights, gradients, optimizer = static_bytes(config, count)
    chunks = [stage_activations(config, s, list(partition[s])) for s in stages]
    overlapped = config.stack == "optimized"
    peak, peak_step, timeline = 0, None, []
    most = [0, 0]
    previous = 0
    for step in walk(rank, config.pp, config.num_microbatches):
        action = step.action
        held = sum(step.in_flight[c] * chunks[c].saved for c in (0, 1))
        held += sum(step.awaiting_w[c] * chunks[c].weight_inputs for c in (0, 1))
        if action.kind == "F":
            during = held + chunks[action.chunk].forward_transient
        elif action.kind == "B":
            during = previous + chunks[action.chunk].backward_transient
        elif action.kind == "W":
            during = previous
        else:  # F&B
            fwd, bwd = chunks[action.chunk], chunks[action.backward_chunk]
            if overlapped:
                during = max(previous, held) + fwd.largest_layer + bwd.backward_transient
            else:  # the reference runs the F, then the B
                during = previous + fwd.saved + fwd.forward_transient + bwd.backward_transient
        most = [max(most[c], step.in_flight[c]) for c in (0, 1)]
        timeline.append(
            {
                "phase": action.phase,
                "action": _label(action),
                "in_flight": list(step.in_flight),
                "bytes": during,
            }
        )
        if during > peak:
            peak, peak_step = during, step
        previous = held
    return RankEstimate(
        rank=rank,
        stages=stages,
        layers=(list(partition[stages[0]]), list(partition[stages[1]])),
        params=params,
        weights_bytes=weights,
        gradients_bytes=gradients,
        optimizer_bytes=optimizer,
        activation_bytes=peak,
        peak_phase=peak_step.action.phase if peak_step else "",
        peak_action=_label(peak_step.action) if peak_step else "",
        in_flight_at_peak=peak_step.in_flight if peak_step else (0, 0),
        max_in_flight=tuple(most),
        timeline=timeline,
    )


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
