"""`twinpipe plan`: the DualPipeV layouts of a model that fit a number of GPUs, best first."""

from __future__ import annotations

import argparse
import json
import sys

from optimized.estimator.cli import add_dtype_and_stack, add_routing_controls, with_routing_controls
from optimized.estimator.plan import (
    FSDP_CHOICES,
    OPTIMIZERS,
    RECOMPUTE_CHOICES,
    PlannedLayout,
    PlanRequest,
    parse_size,
    plan,
    smallest_change,
)

GIB = 1024**3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="preset name or a HF config.json / folder")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs (ranks) the job may use")
    parser.add_argument(
        "--gpu-memory", required=True, help="memory per GPU, e.g. 80GiB, 80GB, 512MiB"
    )
    parser.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    parser.add_argument(
        "--global-batch", type=int, required=True, help="sequences per step over all DP ranks"
    )
    add_dtype_and_stack(parser)
    parser.add_argument(
        "--margin", type=float, default=0.1, help="share of GPU memory kept free (default 0.1)"
    )
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="train",
        help="train: twinpipe train's AdamW (float32 state and masters, sharded over DP); "
        "adamw: torch's AdamW, unsharded (what compare's plain stacks run)",
    )
    parser.add_argument(
        "--fsdp",
        choices=FSDP_CHOICES,
        default="auto",
        help="auto: try FSDP2 on and off (off only with --optimizer adamw)",
    )
    parser.add_argument(
        "--recompute",
        choices=RECOMPUTE_CHOICES,
        default="auto",
        help="optimized stack's attention recomputation: auto tries on and off (the "
        "reference never recomputes)",
    )
    add_routing_controls(parser)
    parser.add_argument("--top", type=int, default=10, help="fitting layouts to print")
    parser.add_argument("--json", action="store_true", help="print every layout as JSON")


def run(args: argparse.Namespace) -> int:
    from models.hf import resolve_model

    try:
        model = with_routing_controls(resolve_model(args.model), args)
        if args.seq_len > model.max_position_embeddings:
            raise ValueError(
                f"--seq-len={args.seq_len} is invalid: {args.model} has "
                f"max_position_embeddings={model.max_position_embeddings}; expected 1.."
                f"{model.max_position_embeddings}"
            )
        request = PlanRequest(
            model, gpus=args.gpus, gpu_memory=parse_size(args.gpu_memory),
            seq_len=args.seq_len, global_batch=args.global_batch, stack=args.stack,
            margin=args.margin, dtype=args.dtype, optimizer=args.optimizer, fsdp=args.fsdp,
            recompute=args.recompute,
        )  # fmt: skip
        planned = plan(request)
    except (ValueError, OSError, TypeError) as error:
        print(f"twinpipe plan: error: {error}", file=sys.stderr)
        return 2
    fitting = [p for p in planned if p.fits]
    changes = [] if fitting else smallest_change(request)
    if args.json:
        report = {
            "model": request.model.model_type,
            "gpus": request.gpus,
            "gpu_memory_bytes": request.gpu_memory,
            "margin": request.margin,
            "budget_bytes": request.budget,
            "seq_len": request.seq_len,
            "global_batch": request.global_batch,
            "stack": request.stack,
            "dtype": request.dtype,
            "optimizer": request.optimizer,
            "recompute": request.recompute,
            "layouts": [p.as_dict() for p in planned],
            "fitting": len(fitting),
            "smallest_changes": changes,
        }
        print(json.dumps(report, indent=2))
        return 0
    print(format_plan(request, planned, changes, args.top))
    return 0


def _unit(budget: int) -> tuple[str, int]:
    """GiB for GPU-sized budgets, MiB below one GiB (the tiny presets)."""
    return ("GiB", GIB) if budget >= GIB else ("MiB", 1024**2)


def _row(index: int, p: PlannedLayout, scale: int) -> str:
    c = p.config
    sent = {kind: f"{value / scale:8.2f}" for kind, value in p.traffic.items()}
    return (
        f"{index:>3}  PP{c.pp:<2} DP{c.dp:<3} EP{c.ep:<3} mbs{c.micro_batch_size:<3} "
        f"M{c.num_microbatches:<4} {'on ' if c.fsdp else 'off'}  "
        f"{'on ' if c.recompute and c.stack == 'optimized' else 'off'}     "
        f"{p.largest_peak / scale:8.2f}  "
        f"{p.bubble['idle_fraction']:6.1%} {p.bubble['bubble']:<16} "
        f"{sent['all_to_all']} {sent['p2p']} {sent['data_parallel']}  {p.partition}"
    )


def format_plan(
    request: PlanRequest, planned: list[PlannedLayout], changes: list[str], top: int
) -> str:
    fitting = [p for p in planned if p.fits]
    unit, scale = _unit(request.budget)
    lines = [
        f"{request.model.model_type} on {request.gpus} GPUs of {request.gpu_memory / scale:.2f} "
        f"{unit} (budget {request.budget / scale:.2f} {unit}, margin {request.margin:.0%}), seq "
        f"{request.seq_len}, global batch {request.global_batch}, {request.dtype}, "
        f"{request.stack} stack, {request.optimizer} optimizer",
        f"{len(planned)} layouts, {len(fitting)} fit",
    ]
    if fitting:
        lines.append(
            f"  #  layout                        fsdp recompute  peak {unit}  "
            f"bubble (F=B=W=1)        "
            f"sent {unit}/step: a2a      p2p       DP  layers per stage"
        )
        lines += [_row(i + 1, p, scale) for i, p in enumerate(fitting[:top])]
        if len(fitting) > top:
            lines.append(f"  ... {len(fitting) - top} more (--top, --json)")
        return "\n".join(lines)
    best = planned[0] if planned else None
    if best is None:
        lines.append("no layout: the GPUs, batch and layers admit none (M >= 2 * PP per DP rank)")
    else:
        c = best.config
        peak = best.largest_peak if best.largest_peak is not None else best.lower_bound
        lines.append(
            f"nothing fits; the smallest peak is {peak / scale:.2f} {unit} (PP{c.pp} DP{c.dp} "
            f"EP{c.ep} mbs{c.micro_batch_size} M{c.num_microbatches}"
            f"{' FSDP' if c.fsdp else ''}{' recompute' if c.recompute else ''})"
        )
    if changes:
        lines.append("it would fit with: " + "; or ".join(changes))
    else:
        lines.append("no change tried (more GPUs, shorter sequence, FSDP, recompute) makes it fit")
    return "\n".join(lines)
