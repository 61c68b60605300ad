"""`twinpipe compare`: run two stacks side by side on the same weights and data.

Sides: ``oracle`` (the whole model and global batch on one process), ``reference``,
``optimized`` and ``optimized-fsdp`` (as `twinpipe train` runs it), in one launched world,
step by step, on the same ranks (`harness.compare.lockstep`); each rank compares what it
holds, only scalars come back (`harness.compare.inplace`). Per step: the loss, every
gradient, the router scores, the parameters after the update, the routing controls
(`harness.compare.controls`), each stack's peak memory per rank and category.

Lockstep (``--trajectory lockstep``, the default; against the oracle too): the candidate
starts each step from the baseline's state (the pipeline from the oracle's), so each step
measures that step's arithmetic; bfloat16 is judged against a float32 truth
(`harness.compare.noise_floor`). Pinned (``--routing pinned``, the default; against the
oracle too): the candidate replays the baseline's expert choices (`models.network.routing`).
The ranks compute on one device chosen before any starts (``--device``), deterministic on
CUDA unless ``--deterministic off`` (`models.runtime.determinism`).

With no arguments this is the project's main job: tiny DeepSeek-V2 at PP=2, DP=2, EP=2 (on
the CPU, unless the machine has four GPUs), reference against optimized, float32.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

from harness.compare import controls
from harness.compare.bisect import Divergence, bisect_rank
from harness.compare.estimates import format_estimates
from harness.compare.lockstep import run_rank
from harness.compare.planted import PLANTS
from harness.compare.planted_balancing import plant_problem
from harness.compare.rank import RankPlan
from harness.compare.stacks import SIDES, STACKS, device_problem
from harness.compare.verdict import build_report
from models.hf import checked_weights, resolve_model
from models.network import SeededWeights
from models.runtime import (
    DeviceError,
    DevicePlan,
    OptimizerConfig,
    ParallelConfig,
    RankFailed,
    even_partition,
    launch,
    resolve_device,
)

__all__ = ["SIDES", "STACKS", "add_arguments", "run"]


def shared_partition(model, parallel: ParallelConfig, sides: tuple[str, str]):
    """Layers per stage for both stacks, or None when each stack's own choice is the same.

    In-place comparison needs each parameter on the same rank in both stacks; where the
    optimized stack's memory-chosen partition differs from the reference's even one, both
    run the optimized stack's."""
    pipelines = [s for s in sides if s != "oracle"]
    if not any(s.startswith("optimized") for s in pipelines) or len(pipelines) < 2:
        return None
    from optimized.pipeline import default_partition  # noqa: PLC0415

    chosen = default_partition(model, parallel)
    even = even_partition(model.num_hidden_layers, 2 * parallel.pp)

    def per_rank(stages: list[list[int]]) -> list[set[int]]:
        return [set(stages[r]) | set(stages[2 * parallel.pp - 1 - r]) for r in range(parallel.pp)]

    if "reference" not in pipelines or per_rank(chosen) == per_rank(even):
        return None
    return chosen


def _bisect(plan: RankPlan, device: DevicePlan, timeout_s: float) -> dict | None:
    """Re-run micro-batch 0 of step 0 stage by stage on both stacks' ops, in one rank
    process on the run's device with the run's planted bug (`bisect_rank`; tiny models)."""
    print("  bisecting micro-batch 0 stage by stage (one rank) ...", file=sys.stderr)
    one = dataclasses.replace(device, local_ranks=1, gpu_names=device.gpu_names[:1])
    try:
        (found,) = launch(bisect_rank, 1, (plan,), timeout_s=timeout_s, device=one)
    except RankFailed as error:
        print(f"  bisect failed:\n{error}", file=sys.stderr)
        return None
    if found is None:
        print(
            "  bisect: every stage agrees on one process; look at the schedule or the collectives",
            file=sys.stderr,
        )
        return None
    print(f"  {Divergence(**found).describe()}", file=sys.stderr)
    return found


# ---------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny-deepseek-v2", help="preset or config.json path")
    parser.add_argument("--checkpoint", help="Hugging Face checkpoint folder for the weights")
    parser.add_argument("--pp", type=int, default=2, help="pipeline-parallel ranks")
    parser.add_argument("--dp", type=int, default=2, help="data-parallel ranks")
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel ranks (divides dp)")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--micro-batch-size", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=2, help="training steps")
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and data")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--baseline", default="reference", help=f"one of {SIDES}")
    parser.add_argument("--candidate", default="optimized", help=f"one of {SIDES}")
    parser.add_argument("--json", help="write the report JSON here")
    parser.add_argument("--out", help="write report.json, report.md and plots to this folder")
    parser.add_argument(
        "--bisect",
        action="store_true",
        help="when the stacks disagree, name the first layer, stage and tensor that diverges",
    )
    parser.add_argument(
        "--routing",
        choices=("pinned", "free", "balanced"),
        default="pinned",
        help="pinned: the candidate replays the baseline's expert choices (in bfloat16 "
        "lockstep, the float32 truth's; against the oracle, the pipeline the oracle's); its "
        "router scores must agree and its own choices may differ only at near-ties; free: "
        "each side routes itself; "
        "balanced: both take the same perfectly balanced choices (token t to experts "
        "(t k + i) mod E), so the communication estimate is exact",
    )
    parser.add_argument(
        "--grad-sync",
        choices=("step", "micro-batch"),
        default="step",
        help="optimized-fsdp: reduce each FSDP unit's gradients once per step (at the "
        "schedule's last backward) or after every backward",
    )
    parser.add_argument(
        "--reshard-after-forward",
        choices=("on", "off"),
        default="off",
        help="optimized-fsdp: free gathered parameters after each forward (on), or hold them "
        "from a unit's first forward to its last backward (off, as `twinpipe train`)",
    )
    parser.add_argument(
        "--recompute",
        choices=("on", "off"),
        default="on",
        help="optimized stacks: recompute each attention block in backward (on, the default) "
        "or keep its activations as the reference does (off: more memory, less work)",
    )
    parser.add_argument(
        "--estimate-routing",
        choices=("balanced", "observed"),
        default="balanced",
        help="the memory estimate beside each measured peak: balanced routing, or the routing "
        "counts the run saw (the balanced figure shown beside it)",
    )
    parser.add_argument(
        "--trajectory",
        choices=("lockstep", "free"),
        default="lockstep",
        help="lockstep: the candidate starts every step from the baseline's parameters and "
        "optimizer state (against the oracle, the pipeline from the oracle's), and every step "
        "is judged; free: each side follows its own trajectory, judged at step 0 only",
    )
    parser.add_argument(
        "--deterministic", choices=("auto", "on", "off"), default="auto",
        help="the same bits every run (models.runtime.determinism): repeated-index sums by "
        "sort and segment sum, torch's deterministic algorithms, tuners pinned; auto: on CUDA",
    )  # fmt: skip
    parser.add_argument(
        "--noise-floor",
        choices=("on", "off"),
        default="on",
        help="bfloat16 lockstep: run each step in float32 too and judge the candidate's error "
        "against it relative to the reference's (off: DESIGN.md's fixed bounds only)",
    )
    parser.add_argument(
        "--plant",
        choices=PLANTS,
        help="plant a known bug in the optimized stack (harness.compare.planted): the run "
        "must fail",
    )
    parser.add_argument(
        "--ops-audit",
        choices=("on", "off"),
        default="on",
        help="bfloat16: check the candidate's ops on the run's own inputs against plain "
        "PyTorch and a float32 truth: index ops exactly, numeric ops for error and bias "
        "(harness.compare.ops_audit)",
    )
    parser.add_argument(
        "--device",
        default="auto",
        help="where the ranks compute: auto (one GPU per rank when there are enough, else the "
        "CPU, saying so), cuda or cpu (models.runtime.device); --bisect runs on the same device",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip per-rank memory tracking")
    parser.add_argument("--timeout", type=float, default=300.0, help="collective timeout, s")
    controls.add_arguments(parser)


def _bad(message: str) -> int:
    print(f"twinpipe compare: error: {message}", file=sys.stderr)
    return 2


def _argument_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments on their own (before any file is read), if anything."""
    from models.runtime import BadInput, check_output_dir, check_output_file  # noqa: PLC0415

    for side in ("baseline", "candidate"):
        if getattr(args, side) not in SIDES:
            return f"--{side}={getattr(args, side)!r} is not one of {SIDES}"
    if args.baseline == args.candidate:
        return f"--baseline and --candidate are both {args.baseline!r}; pick two stacks"
    if args.steps < 1:
        return f"--steps={args.steps} must be at least 1"
    if args.routing == "balanced" and "oracle" in (args.baseline, args.candidate):
        return "--routing balanced pins two pipeline sides; the oracle routes itself"
    if args.plant and "optimized" not in args.baseline + args.candidate:
        return f"--plant={args.plant!r} plants a bug in the optimized stack; compare it"
    if not (math.isfinite(args.lr) and args.lr > 0):
        return f"--lr={args.lr!r} is invalid: expected a finite learning rate > 0"
    if args.seed < 0:
        return f"--seed={args.seed} is invalid: expected an integer >= 0"
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        return f"--timeout={args.timeout!r} is invalid: expected a finite number of seconds > 0"
    try:
        if args.json:
            check_output_file(args.json, "--json")
        if args.out:
            check_output_dir(args.out, "--out")
    except BadInput as error:
        return str(error)
    return None


def _plan(args: argparse.Namespace) -> tuple[RankPlan, DevicePlan] | int:
    """The run every rank does and the device they do it on (resolved once, here, before
    any rank starts), or exit code 2 with the bad input named."""
    problem = _argument_problem(args)
    if problem:
        return _bad(problem)
    parallel = ParallelConfig(
        pp=args.pp, dp=args.dp, ep=args.ep, micro_batch_size=args.micro_batch_size,
        micro_batches=args.micro_batches, seq_len=args.seq_len, dtype=args.dtype, seed=args.seed,
        grad_sync=args.grad_sync, reshard_after_forward=args.reshard_after_forward == "on",
        recompute=args.recompute == "on",
    )  # fmt: skip
    try:
        model = controls.with_controls(resolve_model(args.checkpoint or args.model), args)
        parallel.validate(model)
    except (ValueError, OSError) as error:
        return _bad(str(error))
    try:
        # The ranks read their own slices of the weights; a checkpoint is checked here first.
        source = (
            checked_weights(args.checkpoint, model)
            if args.checkpoint
            else SeededWeights(model, args.seed)
        )
    except (ValueError, OSError) as error:
        return _bad(f"--checkpoint {args.checkpoint!r}: {error}")
    sides = (args.baseline, args.candidate)
    try:
        layout = f"PP {parallel.pp} x DP {parallel.dp}"
        device = resolve_device(args.device, parallel.world_size, layout)
    except DeviceError as error:
        return _bad(str(error))
    stages = shared_partition(model, parallel, sides)
    problem = device_problem(sides, device.kind) or plant_problem(args.plant, model, parallel,
                                                                  stages)  # fmt: skip
    if problem:
        return _bad(problem)
    return RankPlan(
        model=model, parallel=parallel, weights=source, baseline=args.baseline,
        candidate=args.candidate, steps=args.steps, optimizer=OptimizerConfig(lr=args.lr),
        trajectory=args.trajectory, routing=args.routing,
        noise_floor=args.noise_floor == "on" and parallel.dtype != "float32",
        track_memory=not args.no_memory, progress=True,
        stages=stages, plant=args.plant,
        count_routing=args.estimate_routing == "observed", ops_audit=args.ops_audit == "on",
        deterministic=args.deterministic == "on" or (args.deterministic == "auto"
                                                     and device.kind == "cuda"),
    ), device  # fmt: skip


def _write_outputs(args: argparse.Namespace, report: dict) -> bool:
    """Write ``--json`` and ``--out``; a write that fails goes to a rescue folder, named on
    stderr. True when everything went where it was asked."""
    from harness.report import write_report  # noqa: PLC0415
    from models.runtime import write_or_rescue  # noqa: PLC0415

    def write_json(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=2, default=str)

    rescued = False
    if args.json:
        rescued |= write_or_rescue(args.json, write_json, "the report JSON", "compare")[1]
    if args.out:
        written, lost = write_or_rescue(args.out, lambda p: write_report(report, p), "the report",
                                        "compare")  # fmt: skip
        rescued |= lost
        if not lost:
            print(f"report written to {args.out}: {', '.join(p.name for p in written.values())}")
    return not rescued


def run(args: argparse.Namespace) -> int:
    planned = _plan(args)
    if isinstance(planned, int):
        return planned
    plan, device = planned
    parallel = plan.parallel
    print(
        f"twinpipe compare: {args.model} PP={parallel.pp} DP={parallel.dp} EP={parallel.ep} "
        f"M={parallel.micro_batches} mbs={parallel.micro_batch_size} seq={parallel.seq_len} "
        f"{parallel.dtype}, {args.steps} steps: {args.baseline} vs {args.candidate}"
        + (f", bug planted: {args.plant}" if args.plant else ""),
        file=sys.stderr,
    )
    if device.note:
        print(device.note, file=sys.stderr)
    print(f"  launching {parallel.world_size} ranks on {device.describe()}", file=sys.stderr)
    try:
        per_rank = launch(
            run_rank, parallel.world_size, (plan,), timeout_s=args.timeout, device=device
        )
    except RankFailed as error:  # a crash or a signal, never "outside tolerance" (1)
        print(f"twinpipe compare: a rank failed:\n{error}", file=sys.stderr)
        return 128 + error.signal if error.signal else 3
    report = build_report(plan, per_rank, args.model)
    report.get("device", {})["requested"] = device.requested  # what --device said
    if args.bisect and not report["passed"]:
        report["bisect"] = _bisect(plan, device, args.timeout)
    from harness.report import format_table  # noqa: PLC0415

    print(format_table(report))
    memory_ranks = (report.get("memory") or {}).get("ranks") or []
    if memory_ranks:
        estimates = format_estimates(memory_ranks, (args.baseline, args.candidate))
        if estimates:
            print("\nmemory estimate beside the measured peak\n" + estimates)
    if not _write_outputs(args, report):
        return 3
    return 0 if report["passed"] else 1
