"""`twinpipe estimate`: per-rank memory of a DualPipeV layout from the configs alone.

Its defaults are `twinpipe train`'s, read from the trainer's config
(`optimized.train.sizing`, imported when the command runs): ``twinpipe estimate --model X``
with the same layout and batch flags as ``twinpipe train --model X`` sizes that run --
its dtype, batch, FSDP2 and optimizer sharding at each DP, AdamW's float32 moments and
masters, gradient sync and recomputation. The estimator's own choices (``--stack
reference``, ``--optimizer-state-dtype param``: torch's AdamW as `twinpipe compare` runs it,
``--shard-optimizer`` without FSDP, ``--tp``/``--etp``) are there for planning.

The routing controls are the trainer's ``[moe]`` keys (`add_routing_controls`): a flag sets
the field on the model's config as the section does (unset: what the model's config asks,
`models.network.ModelConfig.balancing`, which the section's defaults keep), so the estimate
of a balancing run counts what that run holds and sends (`optimized.estimator.balancing`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from models.network import AUX_FORMS, ModelConfig
from optimized.estimator import EstimateConfig, estimate

GIB = 1024**3


TRAINER = "as `twinpipe train`"
"""How a default that is the trainer's is named in the help (the value is read at run time)."""


def add_dtype_and_stack(parser: argparse.ArgumentParser) -> None:
    """``--dtype`` and ``--stack``, as `twinpipe estimate` and `twinpipe plan` take them."""
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help=f"parameter and activation dtype (default: {TRAINER}, its dtype)",
    )
    parser.add_argument(
        "--stack",
        choices=("reference", "optimized"),
        default="optimized",
        help="whose activations to count: the plain reference stack or the optimized one "
        "(early frees, fused cross-entropy)",
    )


ROUTING_CONTROLS = {
    "aux_loss": "aux_loss",
    "aux_loss_coef": "aux_loss_coef",
    "z_loss_coef": "router_z_loss_coef",
    "expert_bias": "expert_bias",
    "expert_bias_rate": "expert_bias_rate",
}
"""The trainer's ``[moe]`` keys, each a flag here (``--z-loss-coef``), and the `ModelConfig`
field each sets."""


def add_routing_controls(parser: argparse.ArgumentParser) -> None:
    """The routing controls, as `twinpipe estimate` and `twinpipe plan` take them."""
    group = parser.add_argument_group(
        "routing controls", "the trainer's [moe] keys (unset: what the model's config asks, "
        "as the trainer's defaults keep it)",
    )  # fmt: skip
    group.add_argument(
        "--aux-loss", choices=("auto", *AUX_FORMS), default=None,
        help="load-balancing loss: auto (what the HF config asks), none, pooled "
        "(transformers'), layer or sequence (DeepSeek's)",
    )  # fmt: skip
    group.add_argument(
        "--aux-loss-coef", type=float, default=None,
        help="its coefficient (default: the family's HF field)",
    )  # fmt: skip
    group.add_argument(
        "--z-loss-coef", type=float, default=None, help="router z-loss coefficient (0: off)"
    )
    group.add_argument(
        "--expert-bias", action=argparse.BooleanOptionalAction, default=None,
        help="aux-loss-free balancing: a float32 bias per MoE router",
    )  # fmt: skip
    group.add_argument(
        "--expert-bias-rate", type=float, default=None, help="how far a step moves the bias"
    )


def with_routing_controls(model: ModelConfig, args: argparse.Namespace) -> ModelConfig:
    """``model`` with the routing-control flags given set on it (validated there: a bad value
    raises `ValueError` naming the field)."""
    changes = {
        field: getattr(args, key) for key, field in ROUTING_CONTROLS.items()
        if getattr(args, key, None) is not None
    }  # fmt: skip
    return dataclasses.replace(model, **changes) if changes else model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="preset name or a HF config.json / folder")
    parser.add_argument("--pp", type=int, default=None, help=f"pipeline ranks, 2 * pp "
                        f"stages (default: {TRAINER})")  # fmt: skip
    parser.add_argument("--dp", type=int, default=None, help=f"data-parallel ranks (default: "
                        f"{TRAINER})")  # fmt: skip
    parser.add_argument("--ep", type=int, default=None, help=f"expert-parallel ranks, divides "
                        f"dp (default: {TRAINER})")  # fmt: skip
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (planning only)")
    parser.add_argument("--etp", type=int, default=1, help="expert tensor parallel (planning only)")
    parser.add_argument(
        "--micro-batch-size", type=int, default=None,
        help=f"sequences per micro-batch (default: {TRAINER})",
    )  # fmt: skip
    parser.add_argument(
        "--seq-len", type=int, default=None,
        help=f"tokens per sequence, at most the model's max_position_embeddings (default: "
        f"{TRAINER})",
    )  # fmt: skip
    parser.add_argument(
        "--micro-batches", type=int, default=None,
        help=f"micro-batches per step (default: {TRAINER}, or 2 * pp where that is more: "
        "the least DualPipeV runs)",
    )  # fmt: skip
    add_dtype_and_stack(parser)
    parser.add_argument(
        "--shard-optimizer",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="shard optimizer state over DP (default: with FSDP2, as the trainer; on without "
        "FSDP2 sizes a ZeRO-1 optimizer the trainer does not have)",
    )
    parser.add_argument(
        "--fsdp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"FSDP2 sharding of parameters, gradients and optimizer state over DP (default: "
        f"{TRAINER}, on when dp > 1)",
    )
    parser.add_argument(
        "--optimizer-state-dtype",
        choices=("param", "float32", "bfloat16"),
        default=None,
        help=f"AdamW moments' dtype (default: {TRAINER}'s ShardedAdamW; param: the "
        "parameters' dtype, as torch's AdamW in `twinpipe compare`)",
    )
    parser.add_argument(
        "--master-weights",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"a float32 master copy of 16-bit parameters (default: {TRAINER})",
    )
    parser.add_argument(
        "--grad-sync",
        choices=("step", "micro-batch"),
        default=None,
        help="with FSDP2: gradients reduced once per step (held unsharded across the "
        "micro-batches until the chunk's last backward) or after every backward (default: "
        f"{TRAINER})",
    )
    parser.add_argument(
        "--reshard-after-forward",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with FSDP2: free gathered parameters after each forward (2 M all-gathers a "
        "step), or hold the part's parameters gathered from the first forward to the last "
        f"backward (default: {TRAINER})",
    )
    parser.add_argument(
        "--recompute",
        choices=("on", "off"),
        default=None,
        help="optimized stack: recompute each attention block in backward, or keep its "
        f"activations (default: {TRAINER})",
    )
    parser.add_argument(
        "--layers-per-stage",
        type=lambda text: [int(part) for part in text.split(",")],
        default=None,
        help="comma-separated layers of each of the 2 * pp stages (overrides the partition)",
    )
    parser.add_argument(
        "--moe-shared-expert-intermediate-size",
        type=int,
        default=None,
        help="shared experts' total width (Megatron's field; default: the model's)",
    )
    # Megatron fields twinpipe does not model: accepted so that they are refused by name.
    parser.add_argument("--context-parallel-size", type=int, default=1, help="refused unless 1")
    parser.add_argument(
        "--virtual-pipeline-model-parallel-size", type=int, default=None, help="refused if set"
    )
    parser.add_argument("--moe-latent-size", type=int, default=None, help="refused if set")
    add_routing_controls(parser)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def config_from_args(args: argparse.Namespace) -> EstimateConfig:
    """The trainer's run of these flags (`optimized.train.sizing`), then the estimator's
    own choices on top."""
    from models.hf import resolve_model
    from optimized.train.sizing import estimate_config, trainer_default, training_run

    model = resolve_model(args.model)
    micro_batches = args.micro_batches
    if micro_batches is None:  # the trainer's, raised to the least DualPipeV runs
        pp = args.pp if args.pp is not None else trainer_default("parallel.pp")
        micro_batches = max(trainer_default("data.micro_batches"), 2 * pp)
    state_dtype = args.optimizer_state_dtype
    run = training_run({
        "parallel.pp": args.pp, "parallel.dp": args.dp, "parallel.ep": args.ep,
        "parallel.fsdp": args.fsdp, "parallel.grad_sync": args.grad_sync,
        "parallel.reshard_after_forward": args.reshard_after_forward,
        "parallel.recompute": None if args.recompute is None else args.recompute == "on",
        "data.micro_batch_size": args.micro_batch_size, "data.seq_len": args.seq_len,
        "data.micro_batches": micro_batches, "dtype": args.dtype,
        "optim.state_dtype": None if state_dtype == "param" else state_dtype,
        "optim.master_weights": args.master_weights,
    })  # fmt: skip
    if run.data.seq_len > model.max_position_embeddings:
        raise ValueError(
            f"--seq-len={run.data.seq_len} is invalid: {args.model} has "
            f"max_position_embeddings={model.max_position_embeddings}; expected 1.."
            f"{model.max_position_embeddings}"
        )
    config = estimate_config(
        run, model, args.stack, tp=args.tp, etp=args.etp, layers_per_stage=args.layers_per_stage,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        context_parallel_size=args.context_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        moe_latent_size=args.moe_latent_size,
    )  # fmt: skip
    changes = {"model": with_routing_controls(config.model, args)}
    if state_dtype == "param":
        changes["optimizer_state_dtype"] = "param"
    if args.shard_optimizer is not None:
        changes["shard_optimizer"] = args.shard_optimizer
    return config.replace(**changes)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        report = estimate(config, with_partitions=True)
    except (ValueError, OSError, TypeError) as error:
        print(f"twinpipe estimate: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(format_report(report))
    return 0


def _gib(value: float) -> str:
    return f"{value / GIB:9.3f} GiB"


def format_report(report: dict) -> str:
    params, layout = report["params"], report["layout"]
    header = (
        f"model {report['model']}  stack {report['stack']}  PP={layout['pp']} DP={layout['dp']} "
        f"EP={layout['ep']} TP={layout['tp']} ETP={layout['etp']} expert-DP={layout['expert_dp']}"
        f"  mbs={layout['micro_batch_size']} seq={layout['seq_len']} "
        f"M={layout['num_microbatches']}  {report['precision']['dtype']}"
    )
    lines = [
        header,
        f"parameters: total {params['total']:,}  active {params['active']:,}",
    ]
    for bucket, value in params["buckets"].items():
        lines.append(f"  {bucket:<15} {value:,}")
    lines.append(f"partition (layers per stage): {report['partition']}")
    lines.append(
        "rank  stages  weights        gradients      optimizer      activations    peak"
        "           peak at"
    )
    for rank in report["ranks"]:
        lines.append(
            f"{rank['rank']:>4}  {rank['stages'][0]},{rank['stages'][1]:<5} "
            f"{_gib(rank['weights_bytes'])} {_gib(rank['gradients_bytes'])} "
            f"{_gib(rank['optimizer_bytes'])} {_gib(rank['activation_bytes'])} "
            f"{_gib(rank['peak_bytes'])}  {rank['peak_phase']} {rank['peak_action']} "
            f"in flight {rank['in_flight_at_peak']}"
        )
    meg = report["megatron"]
    lines.append(
        f"Megatron-LM's theoretical_memory_usage (activations {meg['activation_formula']}): "
        f"weights+optimizer {_gib(meg['weight_and_optimizer_bytes'])}, activations "
        f"{_gib(meg['activation_bytes'])}, total {_gib(meg['total_bytes'])}"
    )
    if meg.get("not_counted"):
        lines.append("  Megatron's formulas do not count: " + "; ".join(meg["not_counted"]))
    for row in report.get("partitions", []):
        lines.append(
            f"partition {row['name']:<9} {row['layers_per_stage']}  largest per-rank peak "
            f"{_gib(row['largest_peak_bytes'])}"
        )
    return "\n".join(lines)
