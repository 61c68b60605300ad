"""`twinpipe compare`: run two stacks side by side on the same weights and data.

Sides are ``oracle`` (the whole model on one process, the whole global batch),
``reference`` (plain DualPipeV) and ``optimized`` (the production stack). Both
pipeline sides run inside one launched world, one after the other, on the same
ranks; the oracle runs in this process. Per step the harness compares the loss,
every parameter's gradient (gathered across expert shards), the parameters after
AdamW, and, per rank, the peak memory broken down by category.

Two pipeline sides compare at the same expert choices (``--routing pinned``, the
default): the candidate replays the baseline's routing; its router scores must agree
with the baseline's within the dtype's bound, and every choice it would have made
differently must be a near-tie that their difference explains (`models.routing`). Top-k is
discontinuous; without this a single bfloat16 rounding at a near-tie swaps a
token's expert and moves the router's gradient by a whole expert's contribution.
``--routing free`` lets each side route itself, to see that effect.

With no arguments this is the project's main job: tiny DeepSeek-V2 at PP=2,
DP=2, EP=2 on CPU, reference against optimized.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from harness.compare_checks import (
    _add_estimates,
    _memory_ranks,
    _routing_summary,
    build_report,
    format_estimates,
)
from harness.compare_communication import communication_section
from models import CheckpointWeights, SeededWeights, resolve_model
from models.distributed import ParallelConfig, RankFailed, launch, make_layout
from models.model import is_expert_parameter
from models.training import OptimizerConfig, synthetic_batch

STACKS = {
    "reference": "reference.pipeline:ReferencePipeline",
    "optimized": "optimized.pipeline:OptimizedPipeline",
    "optimized-fsdp": "optimized.pipeline.sharding:ShardedOptimizedPipeline",
}
SIDES = ("oracle",) + tuple(STACKS)


def _stack_class(name: str):
    module, cls = STACKS[name].split(":")
    return getattr(importlib.import_module(module), cls)


# -------------------------------------------------------------- on each rank
def _rank_main(
    model,
    parallel,
    source,
    stacks,
    steps,
    optimizer,
    track_memory,
    progress,
    pin_routing=False,
    count_routing=False,
):
    """One rank of the launched world: run each pipeline stack for ``steps`` steps.

    With ``pin_routing`` the first stack records its routers' choices and the second
    replays them (`models.routing`); the second's record carries the replay's result.
    ``pin_routing="balanced"``: both stacks route by `models.routing.BalancedRouting`.
    Each step's collective and p2p calls are counted (`harness.compare_communication`).
    """
    from models.communication import counted_step  # noqa: PLC0415
    from models.routing import BalancedRouting, RoutingTape, attach_routing_tape  # noqa: PLC0415

    layout = make_layout(parallel)
    results: dict[str, Any] = {}
    results["coords"] = (layout.pp_rank, layout.dp_rank, layout.ep_rank)
    balanced = pin_routing == "balanced"
    tape = RoutingTape() if pin_routing and not balanced and len(stacks) == 2 else None
    for index, stack in enumerate(stacks):
        torch.manual_seed(parallel.seed)
        pipeline = _stack_class(stack)(model, parallel, layout, source, optimizer)
        record = {"loss": [], "grads": [], "params": [], "time": [], "memory": [], "eval": None}
        record["communication"] = []
        counter = None
        if count_routing:  # each step's expert choices, for the observed-routing estimate
            from harness.routing_counts import RoutingCounter  # noqa: PLC0415

            counter = RoutingCounter(pipeline.part, model.num_experts)
            record["routing_counts"] = []
        replay = None
        if balanced:
            attach_routing_tape(pipeline.part, BalancedRouting())
        if tape is not None:
            replay = tape if index == 0 else tape.replay()
            attach_routing_tape(pipeline.part, replay)
        tracker = None
        if track_memory:
            from harness.memory import MemoryTracker  # noqa: PLC0415

            tracker = MemoryTracker("cuda" if torch.cuda.is_available() else "cpu")
            # A stack whose optimizer is no torch Optimizer names its state tensors itself.
            state = getattr(pipeline, "optimizer_state", pipeline.optimizer)
            tracker.register(parameters=pipeline.part, optimizer_state=state)
            pipeline.observer = tracker.mark
        for step in range(steps):
            ids, labels = synthetic_batch(model, parallel, step)
            start = time.perf_counter()
            if counter is not None:
                counter.start_step()
            if tracker is not None:
                with tracker.step(), counted_step(layout, record["communication"]):
                    loss = pipeline.forward_backward(ids, labels)
                    pipeline.optimizer_step()
                summary = dict(tracker.breakdown())
                summary["total"] = tracker.peak_bytes
                summary["peak_moment"] = tracker.peak_moment
                record["memory"].append(summary)
            else:
                with counted_step(layout, record["communication"]):
                    loss = pipeline.forward_backward(ids, labels)
                    pipeline.optimizer_step()
            record["time"].append(time.perf_counter() - start)
            if counter is not None:
                record["routing_counts"].append(counter.end_step())
            record["loss"].append(loss)
            record["grads"].append(_named(pipeline.part, grads=True))
            record["params"].append(_named(pipeline.part, grads=False))
            if progress and layout.rank == 0:
                print(f"  [{stack}] step {step + 1}/{steps}  loss {loss:.6f}", file=sys.stderr)
        pipeline.observer = None
        if counter is not None:
            counter.close()
        ids, labels = synthetic_batch(model, parallel, steps)
        record["eval"] = pipeline.evaluate(ids, labels)
        if replay is not None and index == 1:
            record["routing"] = replay.result()
        results[stack] = record
        del pipeline
    return results


def _named(part: torch.nn.Module, grads: bool) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in part.named_parameters():
        tensor = param.grad if grads else param.detach()
        if isinstance(tensor, DTensor):  # FSDP2's row shard: the whole tensor (a collective)
            tensor = tensor.full_tensor()
        out[name] = tensor.detach().float().clone()
    return out


def _assemble(per_rank: list[dict], stack: str, key: str, step: int, ep: int) -> dict:
    """Whole-model tensors from rank shards: experts from dp-block 0 by ep-rank, the rest
    from dp-rank 0."""
    full: dict[str, torch.Tensor] = {}
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for result in per_rank:
        _, dp_rank, ep_rank = result["coords"]
        for name, tensor in result[stack][key][step].items():
            if is_expert_parameter(name):
                if dp_rank < ep:
                    shards.setdefault(name, {})[ep_rank] = tensor
            elif dp_rank == 0:
                full[name] = tensor
    for name, parts in shards.items():
        full[name] = torch.cat([parts[r] for r in sorted(parts)], dim=0)
    return full


# ---------------------------------------------------------------- the oracle
def _run_oracle(model, parallel, source, steps, optimizer) -> dict:
    from reference.oracle import Oracle  # noqa: PLC0415

    oracle = Oracle(model, source, optimizer, parallel.torch_dtype)
    record = {"loss": [], "grads": [], "params": [], "time": [], "memory": [], "eval": None}
    for step in range(steps):
        ids, labels = synthetic_batch(model, parallel, step)
        start = time.perf_counter()
        loss = oracle.forward_backward(ids, labels)
        oracle.optimizer_step()
        record["time"].append(time.perf_counter() - start)
        record["loss"].append(loss)
        record["grads"].append(_named(oracle.model, grads=True))
        record["params"].append(_named(oracle.model, grads=False))
    record["eval"] = oracle.evaluate(*synthetic_batch(model, parallel, steps))
    return record


def _bisect(args, model, parallel, source) -> dict | None:
    """Re-run micro-batch 0 of step 0 stage by stage on both stacks' ops."""
    from harness.bisect import bisect, stack_ops  # noqa: PLC0415

    ids, labels = synthetic_batch(model, parallel, 0)
    size = parallel.micro_batch_size
    tol = 1e-5 if parallel.dtype == "float32" else 1e-2
    print("  bisecting micro-batch 0 stage by stage ...", file=sys.stderr)
    found = bisect(
        model, source, stack_ops(args.baseline), stack_ops(args.candidate),
        ids[:size], labels[:size], tolerance=tol, seed=parallel.seed, dtype=parallel.torch_dtype,
    )  # fmt: skip
    if found is None:
        print(
            "  bisect: every stage agrees on one process; look at the schedule or the collectives",
            file=sys.stderr,
        )
        return None
    print(f"  {found.describe()}", file=sys.stderr)
    return {f: getattr(found, f) for f in found.__slots__}


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
        help="pinned: the candidate replays the baseline's expert choices; its router scores "
        "must agree and its own choices may differ only at near-ties (two pipeline sides); "
        "free: each side routes itself; balanced: both take the same perfectly balanced "
        "choices (token t to experts (t k + i) mod E), so the communication estimate is exact",
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
        default="on",
        help="optimized-fsdp: free gathered parameters after each forward (on), or hold them "
        "from a unit's first forward to its last backward (off)",
    )
    parser.add_argument(
        "--estimate-routing",
        choices=("balanced", "observed"),
        default="balanced",
        help="the memory estimate beside each measured peak: balanced routing, or the routing "
        "counts the run saw (the balanced figure shown beside it)",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip per-rank memory tracking")
    parser.add_argument("--timeout", type=float, default=300.0, help="collective timeout, s")


def _pin(routing: str) -> bool | str:
    """What `_rank_main` takes: True to pin, ``"balanced"``, or False (free)."""
    return "balanced" if routing == "balanced" else routing == "pinned"


def _bad(message: str) -> int:
    print(f"twinpipe compare: error: {message}", file=sys.stderr)
    return 2


def _argument_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments on their own (before any file is read), if anything."""
    import math  # noqa: PLC0415

    from models.inputs import BadInput, check_output_dir, check_output_file  # noqa: PLC0415

    for side in ("baseline", "candidate"):
        if getattr(args, side) not in SIDES:
            return f"--{side}={getattr(args, side)!r} is not one of {SIDES}"
    if args.baseline == args.candidate:
        return f"--baseline and --candidate are both {args.baseline!r}; pick two stacks"
    if args.steps < 1:
        return f"--steps={args.steps} must be at least 1"
    if args.routing == "balanced" and "oracle" in (args.baseline, args.candidate):
        return "--routing balanced pins two pipeline sides; the oracle routes itself"
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


def _write_outputs(args: argparse.Namespace, report: dict) -> bool:
    """Write ``--json`` and ``--out``; a write that fails goes to a rescue folder, named on
    stderr. True when everything went where it was asked."""
    from harness.report import write_report  # noqa: PLC0415
    from models.inputs import write_or_rescue  # noqa: PLC0415

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
    problem = _argument_problem(args)
    if problem:
        return _bad(problem)
    parallel = ParallelConfig(
        pp=args.pp, dp=args.dp, ep=args.ep, micro_batch_size=args.micro_batch_size,
        micro_batches=args.micro_batches, seq_len=args.seq_len, dtype=args.dtype, seed=args.seed,
        grad_sync=args.grad_sync, reshard_after_forward=args.reshard_after_forward == "on",
    )  # fmt: skip
    try:
        model = resolve_model(args.checkpoint or args.model)
        parallel.validate(model)
        if args.checkpoint:
            from models.inputs import check_hf_checkpoint  # noqa: PLC0415

            check_hf_checkpoint(args.checkpoint, model, "--checkpoint")
        # The ranks read their own slices of the weights; a checkpoint is checked here first.
        source = (
            CheckpointWeights(args.checkpoint, model)
            if args.checkpoint
            else SeededWeights(model, args.seed)
        )
    except (ValueError, OSError) as error:
        return _bad(str(error))
    optimizer = OptimizerConfig(lr=args.lr)

    stacks = [s for s in (args.baseline, args.candidate) if s != "oracle"]
    print(
        f"twinpipe compare: {args.model} PP={parallel.pp} DP={parallel.dp} EP={parallel.ep} "
        f"M={parallel.micro_batches} mbs={parallel.micro_batch_size} seq={parallel.seq_len} "
        f"{parallel.dtype}, {args.steps} steps: {args.baseline} vs {args.candidate}",
        file=sys.stderr,
    )
    records: dict[str, dict] = {}
    memory_ranks: list[dict] = []
    communication = None
    if "oracle" in (args.baseline, args.candidate):
        print("  [oracle] running on one process", file=sys.stderr)
        records["oracle"] = _run_oracle(model, parallel, source, args.steps, optimizer)
    if stacks:
        print(f"  launching {parallel.world_size} ranks for {', '.join(stacks)}", file=sys.stderr)
        try:
            per_rank = launch(
                _rank_main,
                parallel.world_size,
                (model, parallel, source, stacks, args.steps, optimizer,
                 not args.no_memory, True, _pin(args.routing),
                 args.estimate_routing == "observed"),
                timeout_s=args.timeout,
            )  # fmt: skip
        except RankFailed as error:  # a crash or a signal, never "outside tolerance" (1)
            print(f"twinpipe compare: a rank failed:\n{error}", file=sys.stderr)
            return 128 + error.signal if error.signal else 3
        for stack in stacks:
            routing = _routing_summary(per_rank, stack)
            records[stack] = {
                **({"routing": routing} if routing else {}),
                "loss": per_rank[0][stack]["loss"],
                "eval": per_rank[0][stack]["eval"],
                "time": [max(r[stack]["time"][s] for r in per_rank) for s in range(args.steps)],
                "grads": [
                    _assemble(per_rank, stack, "grads", s, parallel.ep) for s in range(args.steps)
                ],
                "params": [
                    _assemble(per_rank, stack, "params", s, parallel.ep) for s in range(args.steps)
                ],
            }
        if len(stacks) == 2:
            communication = communication_section(
                per_rank, model, parallel, (args.baseline, args.candidate), args.routing
            )
        if len(stacks) == 2 and not args.no_memory:
            memory_ranks = _memory_ranks(per_rank, args.baseline, args.candidate)
            observed = per_rank if args.estimate_routing == "observed" else None
            _add_estimates(memory_ranks, model, parallel, (args.baseline, args.candidate), observed)
    report = build_report(args, model, parallel, records, memory_ranks)
    if args.routing == "balanced" and stacks:
        report["routing"] = {"mode": "balanced"}
    if communication:
        report["communication"] = communication
    if args.bisect and not report["passed"]:
        report["bisect"] = _bisect(args, model, parallel, source)
    from harness.report import format_table  # noqa: PLC0415

    print(format_table(report))
    if memory_ranks:
        estimates = format_estimates(memory_ranks, (args.baseline, args.candidate))
        if estimates:
            print("\nmemory estimate beside the measured peak\n" + estimates)
    if not _write_outputs(args, report):
        return 3
    return 0 if report["passed"] else 1
