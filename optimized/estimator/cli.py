"""`twinpipe estimate`: per-rank memory of a DualPipeV layout from the configs alone."""

from __future__ import annotations

import argparse
import json
import sys

from optimized.estimator import EstimateConfig, estimate

GIB = 1024**3


def add_dtype_and_stack(parser: argparse.ArgumentParser) -> None:
    """``--dtype`` and ``--stack``, as `twinpipe estimate` and `twinpipe plan` take them."""
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="bfloat16",
        help="parameter and activation dtype",
    )
    parser.add_argument(
        "--stack",
        choices=("reference", "optimized"),
        default="optimized",
        help="whose activations to count: the plain reference stack or the optimized one "
        "(early frees, fused cross-entropy)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="preset name or a HF config.json / folder")
    parser.add_argument("--pp", type=int, default=1, help="pipeline ranks (2 * pp stages)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel ranks")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (divides dp)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (planning only)")
    parser.add_argument("--etp", type=int, default=1, help="expert tensor parallel (planning only)")
    parser.add_argument("--micro-batch-size", type=int, default=1, help="sequences per micro-batch")
    parser.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="tokens per sequence, at most the model's max_position_embeddings (default: "
        "4096, or max_position_embeddings when smaller)",
    )
    parser.add_argument(
        "--micro-batches", type=int, default=None, help="micro-batches per step (default: 2 * pp)"
    )
    add_dtype_and_stack(parser)
    parser.add_argument(
        "--shard-optimizer",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="shard optimizer state over DP (default: on when dp > 1, as the trainer's FSDP2)",
    )
    parser.add_argument(
        "--fsdp",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="count FSDP2 sharding of non-expert parameters, gradients and optimizer state "
        "over DP, as `twinpipe train` does at dp > 1",
    )
    parser.add_argument(
        "--optimizer-state-dtype",
        choices=("param", "float32", "bfloat16"),
        default=None,
        help="AdamW moments' dtype (default: float32 with --fsdp, as `twinpipe train`'s "
        "ShardedAdamW keeps them unless given --optimizer-state-dtype bfloat16; else the "
        "parameters' dtype, as torch's AdamW)",
    )
    parser.add_argument(
        "--master-weights",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a float32 master copy of 16-bit parameters (default: on with --fsdp, as "
        "`twinpipe train` keeps one unless given --no-master-weights)",
    )
    parser.add_argument(
        "--grad-sync",
        choices=("step", "micro-batch"),
        default="step",
        help="with --fsdp: gradients reduced once per step (held unsharded across the "
        "micro-batches until the chunk's last backward) or after every backward",
    )
    parser.add_argument(
        "--reshard-after-forward",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="with --fsdp: free gathered parameters after each forward (2 M all-gathers a "
        "step); the default, --no-reshard-after-forward, holds the part's parameters gathered "
        "from the first forward to the last backward (as `twinpipe train`)",
    )
    parser.add_argument(
        "--recompute",
        choices=("on", "off"),
        default="on",
        help="optimized stack: recompute each attention block in backward (on, as `twinpipe "
        "train` runs by default) or keep its activations (off)",
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
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def _config(args: argparse.Namespace) -> EstimateConfig:
    from models.presets import resolve_model

    model = resolve_model(args.model)
    if args.seq_len is None:
        args.seq_len = min(4096, model.max_position_embeddings)
    if args.seq_len > model.max_position_embeddings:
        raise ValueError(
            f"--seq-len={args.seq_len} is invalid: {args.model} has "
            f"max_position_embeddings={model.max_position_embeddings}; expected 1.."
            f"{model.max_position_embeddings}"
        )
    shard = args.shard_optimizer if args.shard_optimizer is not None else args.dp > 1
    # --fsdp asks for the trainer's layout, so its optimizer's precision comes with it.
    state_dtype = args.optimizer_state_dtype or ("float32" if args.fsdp else "param")
    master = args.master_weights if args.master_weights is not None else args.fsdp
    return EstimateConfig(
        model,
        pp=args.pp,
        dp=args.dp,
        ep=args.ep,
        tp=args.tp,
        etp=args.etp,
        micro_batch_size=args.micro_batch_size,
        seq_len=args.seq_len,
        num_microbatches=args.micro_batches if args.micro_batches is not None else 2 * args.pp,
        dtype=args.dtype,
        stack=args.stack,
        shard_optimizer=shard,
        fsdp=args.fsdp,
        optimizer_state_dtype=state_dtype,
        master_weights=master,
        layers_per_stage=args.layers_per_stage,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        context_parallel_size=args.context_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        moe_latent_size=args.moe_latent_size,
        grad_sync=args.grad_sync,
        reshard_after_forward=args.reshard_after_forward,
        recompute=args.recompute == "on",
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = _config(args)
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
    for row in report.get("partitions", []):
        lines.append(
            f"partition {row['name']:<9} {row['layers_per_stage']}  largest per-rank peak "
            f"{_gib(row['largest_peak_bytes'])}"
        )
    return "\n".join(lines)
