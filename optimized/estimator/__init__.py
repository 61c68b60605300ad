"""The MoE-aware memory estimator: per-rank memory of a DualPipeV step from the configs alone.

Parameters (total, active, per sharding bucket), weight / gradient / optimizer
bytes for the run's precision (optimizer state optionally sharded over DP, the
routed experts over their expert-DP group), and activations: the bytes each
stack keeps per layer and micro-batch, times the micro-batches each chunk
holds at each action of the DualPipeV walk, with the phase where each rank
peaks. Beside it, what Megatron's published formulas would say.

Modules:

- memory: `config` (`EstimateConfig`), `params` (parameter counts), `activations` (what a
  layer saves), `reference_layer` (what the reference's layer holds beyond that), `steps`
  (the optimized stage functions' transients), `recompute` (the optimized attention's
  recomputed backward, GPT-OSS's sinks and windows included), `schedule` (the DualPipeV
  walk), `memory` (what both walks share), `reference_walk` and `optimized_walk`,
  `mtp_memory` (what DeepSeek-V3's MTP module keeps and holds at the loss stage),
  `balancing` (what the routing controls add: saved tensors, a micro-batch's pooled counts,
  the step's load, the bias buffers, their messages),
  `sharded_step` (the FSDP2 runner's units and `ShardedAdamW`'s step as it runs), `ranks`
  (per-rank estimates), `routing` (the routing a run saw, in place of balanced routing),
  `megatron` (the published formulas);
- beside memory: `communication` (every collective and point-to-point call of a step),
  `sync_marks` (where each chunk's gradients are complete in the walk), `bubble` (the
  pipeline bubble, timed from the walk), `plan` (which layouts fit which GPUs), `flops`
  (a step's FLOPs per token and the GPUs' peak rates: MFU);
- commands: `cli` (``twinpipe estimate``) and `plan_cli` (``twinpipe plan``).

May import `models` only, and inside functions (never at module level) two modules
against the order, cycles at call time that `optimized` states: `optimized.pipeline.partition`
to ask which partition the stack would run, and `optimized.train.sizing` where the
commands and the planner size a `twinpipe train` run (the trainer's defaults, read from its
config); never `reference` or `harness`.

The API keeps the names and the meaning of Megatron's ``theoretical_memory_utils``, with
twinpipe's exact counts behind them (``config`` is an `EstimateConfig`):
`compute_weight_and_optimizer_memory` is the weights, every gradient and the optimizer state
of the most loaded rank (it falls as DP, EP and ETP grow), `compute_activation_memory` the
largest activation peak over the ranks' DualPipeV walks, and `report_theoretical_memory`
prints both and their sum as Megatron does. Megatron's own formulas, term for term, are
`optimized.estimator.megatron` (same names, Megatron's ``args``); our per-rank peak
breakdown keeps our own names (`RankEstimate`: ``weights_bytes``, ``gradients_bytes`` at the
peak, ``optimizer_bytes``, ``activation_bytes``, ``peak_bytes``).
"""

from __future__ import annotations

from typing import Any

from models.network import ModelConfig
from optimized.estimator.communication import predict_ranks, predict_traffic, runner_partition
from optimized.estimator.config import EstimateConfig
from optimized.estimator.flops import (
    GPU_PEAKS,
    ForwardFlops,
    TrainingFlops,
    attended_keys,
    forward_flops,
    peak_tflops,
    training_flops,
)
from optimized.estimator.megatron import megatron_figures
from optimized.estimator.memory import RankEstimate, layer_profile, rank_params, static_bytes
from optimized.estimator.params import BUCKETS, active_params, model_params
from optimized.estimator.ranks import estimate_rank, estimate_ranks, largest_peak
from optimized.estimator.routing import ObservedRouting, received_loads
from optimized.estimator.schedule import send_completions, walk

NUM_BYTES_IN_MEGABYTE = 1024 * 1024

__all__ = [
    "GPU_PEAKS",
    "EstimateConfig",
    "ForwardFlops",
    "TrainingFlops",
    "attended_keys",
    "forward_flops",
    "peak_tflops",
    "training_flops",
    "ObservedRouting",
    "RankEstimate",
    "estimate_rank",
    "estimate_ranks",
    "largest_peak",
    "layer_profile",
    "predict_ranks",
    "predict_traffic",
    "rank_params",
    "received_loads",
    "runner_partition",
    "send_completions",
    "static_bytes",
    "walk",
    "compute_activation_memory",
    "compute_weight_and_optimizer_memory",
    "estimate",
    "estimate_for_compare",
    "report_theoretical_memory",
]


def _partition(config: EstimateConfig):
    from optimized.pipeline.partition import stage_layers

    return stage_layers(config)


def _print_params(config: EstimateConfig) -> None:
    total = model_params(config)
    print(f"Total parameters: {total.total:,}  active: {active_params(config, total):,}")
    for bucket in BUCKETS:
        print(f"  {bucket}: {total.numel[bucket]:,}")


def compute_weight_and_optimizer_memory(config: EstimateConfig, verbose: bool = False) -> float:
    """Bytes of weights, all gradients and optimizer state on the most loaded rank (Megatron's
    meaning: every gradient, not only those alive at the activation peak)."""
    if verbose:
        _print_params(config)
    ranks = estimate_ranks(config, _partition(config))
    return float(max(r.weights_bytes + r.all_gradients_bytes + r.optimizer_bytes for r in ranks))


def compute_activation_memory(
    config: EstimateConfig, num_microbatches: int | None, verbose: bool = False
) -> float:
    """Peak activation bytes on the most loaded rank over the DualPipeV walk."""
    if num_microbatches is not None:
        config = config.replace(num_microbatches=num_microbatches)
    ranks = estimate_ranks(config, _partition(config))
    if verbose:
        for rank in ranks:
            print(
                f"rank {rank.rank}: activations {rank.activation_bytes / NUM_BYTES_IN_MEGABYTE:.2f}"
                f" MB at {rank.peak_phase} {rank.peak_action}, in flight {rank.in_flight_at_peak}"
            )
    return float(max(rank.activation_bytes for rank in ranks))


def report_theoretical_memory(
    config: EstimateConfig, num_microbatches: int | None = None, verbose: bool = False
) -> tuple[float, float, float]:
    """Print and return (weight and optimizer, activation, total) in MB, as Megatron's does.

    Weight and optimizer is `compute_weight_and_optimizer_memory`, activation
    `compute_activation_memory`; like Megatron's, their sum is an upper bound (the two
    maxima may fall on different ranks). Per rank, the peak itself follows.
    """
    if num_microbatches is not None:
        config = config.replace(num_microbatches=num_microbatches)
    if verbose:
        _print_params(config)
    ranks = estimate_ranks(config, _partition(config))
    mb = NUM_BYTES_IN_MEGABYTE
    static = max(r.weights_bytes + r.all_gradients_bytes + r.optimizer_bytes for r in ranks) / mb
    activation = max(r.activation_bytes for r in ranks) / mb
    print(
        f"Theoretical memory footprints: weight and optimizer={static:.2f} MB, "
        f"activation={activation:.2f} MB, total={static + activation:.2f} MB"
    )
    for rank in ranks:
        print(f"  rank {rank.rank}: peak {rank.peak_bytes / mb:.2f} MB at {rank.peak_phase} "
              f"{rank.peak_action}")  # fmt: skip
    return static, activation, static + activation


def estimate(config: EstimateConfig, with_partitions: bool = False) -> dict[str, Any]:
    """The full report as a JSON-able dict (``params``, ``ranks``, ``megatron``, ...)."""
    partition = _partition(config)
    total = model_params(config)
    ranks: list[RankEstimate] = estimate_ranks(config, partition)
    report: dict[str, Any] = {
        "model": config.model.model_type,
        "layout": {
            "pp": config.pp,
            "dp": config.dp,
            "ep": config.ep,
            "tp": config.tp,
            "etp": config.etp,
            "expert_dp": config.expert_dp,
            "micro_batch_size": config.micro_batch_size,
            "seq_len": config.seq_len,
            "num_microbatches": config.num_microbatches,
        },
        "precision": {
            "dtype": config.dtype,
            "grad_bytes": config.grad_bytes,
            "optimizer_bytes_per_param": config.optimizer_bytes_per_param,
            "shard_optimizer": config.shard_optimizer,
            "fsdp": config.fsdp,
        },
        "stack": config.stack,
        "params": {
            "total": total.total,
            "active": active_params(config, total),
            "buckets": dict(total.numel),
        },
        "partition": [len(stage) for stage in partition],
        "ranks": [rank.as_dict() for rank in ranks],
        "megatron": megatron_figures(config),
    }
    if with_partitions:
        from optimized.pipeline.partition import partition_report

        report["partitions"] = partition_report(config)
    return report


def estimate_for_compare(
    model_config: ModelConfig,
    parallel_layout: Any,
    stack: str,
    measured_peaks: list[int] | None = None,
    routing: dict[int, dict] | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """The estimate `twinpipe compare` puts beside its measured peaks.

    ``parallel_layout`` is any object (or dict) with ``pp``, ``dp``, ``ep`` and optionally
    ``micro_batch_size``, ``seq_len``, ``num_microbatches``, ``dtype``, ``layers_per_stage``
    attributes; ``overrides`` set any other `EstimateConfig` field. compare runs unsharded
    AdamW, so ``shard_optimizer`` defaults to False. With ``measured_peaks`` (bytes per
    pp-rank) each rank gets ``measured_bytes`` and ``error`` (estimate / measured - 1) for
    our figure and for Megatron's. With ``routing`` (global rank -> ``{(layer, micro_batch):
    rows per local expert}``, `optimized.estimator.routing.received_loads`) the report also
    has ``observed_ranks``: per global rank, the estimate under the routing the run saw.
    """
    fields = {}
    names = (
        "pp", "dp", "ep", "tp", "etp", "micro_batch_size", "seq_len", "num_microbatches",
        "dtype", "layers_per_stage", "recompute",
    )  # fmt: skip
    for name in names:
        if isinstance(parallel_layout, dict):
            value = parallel_layout.get(name)
        else:
            value = getattr(parallel_layout, name, None)
        if value is not None:
            fields[name] = list(value) if name == "layers_per_stage" else value
    fields.setdefault("shard_optimizer", False)
    fields.update(overrides)
    config = EstimateConfig(model_config, stack=stack, **fields)
    report = estimate(config)
    if routing is not None:
        partition = _partition(config)
        report["observed_ranks"] = {
            rank: estimate_rank(
                config, rank // config.dp, partition, ObservedRouting(loads)
            ).as_dict()
            for rank, loads in sorted(routing.items())
        }
    if measured_peaks is not None:
        megatron_total = report["megatron"]["total_bytes"]
        for rank, measured in zip(report["ranks"], measured_peaks):
            rank["measured_bytes"] = measured
            rank["error"] = rank["peak_bytes"] / measured - 1
            rank["megatron_error"] = megatron_total / measured - 1
    return report
