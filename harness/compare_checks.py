"""What `twinpipe compare` checks and reports: the tolerance policy, per-parameter errors,
the verdict, the routing and memory sections, and the estimates beside measured peaks.
"""

from __future__ import annotations

import math
import platform
import sys

import torch

from harness.report import git_commit

# DESIGN.md's numerics policy: (loss relative error, gradient 1 - cos).
TOLERANCES = {
    ("oracle", "float32"): (1e-6, 1e-10),
    ("pipeline", "float32"): (1e-5, 1e-8),
    ("oracle", "bfloat16"): (1e-2, 1e-2),
    ("pipeline", "bfloat16"): (1e-2, 1e-2),
}


def tolerance(baseline: str, candidate: str, dtype: str) -> dict[str, float]:
    kind = "oracle" if "oracle" in (baseline, candidate) else "pipeline"
    loss_rel, grad_cos = TOLERANCES[(kind, dtype)]
    return {"loss_rel": loss_rel, "grad_one_minus_cos": grad_cos}


# ------------------------------------------------------------- comparisons
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    denom = b.norm().item()
    diff = (a - b).norm().item()
    if denom == 0:
        return 0.0 if diff == 0 else math.inf
    return diff / denom


def _one_minus_cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    na, nb = a.norm().item(), b.norm().item()
    if na == 0 and nb == 0:
        return 0.0
    if na == 0 or nb == 0:
        return 1.0
    return max(0.0, 1.0 - (a @ b).item() / (na * nb))


def compare_tensors(base: dict, cand: dict) -> list[tuple[str, float, float]]:
    """Per parameter: (name, relative L2 error, 1 - cos), worst first by 1 - cos."""
    missing = sorted(set(base) ^ set(cand))
    if missing:
        raise RuntimeError(f"the two stacks hold different parameters: {missing[:5]}")
    rows = []
    for name in base:
        a, b = cand[name], base[name]
        if not torch.isfinite(a).all() or not torch.isfinite(b).all():
            rows.append((name, math.inf, math.inf))
            continue
        rows.append((name, _rel(a, b), _one_minus_cos(a, b)))
    return sorted(rows, key=lambda row: (row[2], row[1]), reverse=True)


def build_report(args, model, parallel, records: dict[str, dict], memory_ranks) -> dict:
    base, cand = records[args.baseline], records[args.candidate]
    tol = tolerance(args.baseline, args.candidate, parallel.dtype)
    loss_rel = [
        abs(c - b) / abs(b) if b != 0 else abs(c) for b, c in zip(base["loss"], cand["loss"])
    ]
    grad_rel, grad_cos, param_rel, worst = [], [], [], {}
    for step in range(args.steps):
        rows = compare_tensors(base["grads"][step], cand["grads"][step])
        grad_rel.append(max(r[1] for r in rows))
        grad_cos.append(max(r[2] for r in rows))
        for name, rel, cos in rows[:5]:
            if name not in worst or cos > worst[name][2]:
                worst[name] = (name, rel, cos)
        prow = compare_tensors(base["params"][step], cand["params"][step])
        param_rel.append(max(r[1] for r in prow))
    eval_rel = abs(cand["eval"] - base["eval"]) / abs(base["eval"])
    finite = all(math.isfinite(x) for x in base["loss"] + cand["loss"] + grad_cos + grad_rel)
    routing = cand.get("routing")
    passed = (
        finite
        and max(loss_rel) <= tol["loss_rel"]
        and max(grad_cos) <= tol["grad_one_minus_cos"]
        and eval_rel <= tol["loss_rel"]
        and not (routing and routing["problems"])
    )
    report = {
        "passed": bool(passed),
        "config": {
            "model": args.model,
            "pp": parallel.pp,
            "dp": parallel.dp,
            "ep": parallel.ep,
            "micro_batches": parallel.micro_batches,
            "micro_batch_size": parallel.micro_batch_size,
            "seq_len": parallel.seq_len,
            "dtype": parallel.dtype,
            "steps": args.steps,
            "seed": parallel.seed,
            "lr": args.lr,
        },
        "baseline": args.baseline,
        "candidate": args.candidate,
        "loss": {"baseline": base["loss"], "candidate": cand["loss"], "rel_error": loss_rel},
        "eval_loss": {"baseline": base["eval"], "candidate": cand["eval"], "rel_error": eval_rel},
        "grads": {
            "max_rel_error": grad_rel,
            "max_one_minus_cos": grad_cos,
            "worst": [list(w) for w in sorted(worst.values(), key=lambda w: -w[2])[:8]],
        },
        "params": {"max_rel_error": param_rel},
        "time": {"baseline": base["time"], "candidate": cand["time"]},
        "tolerance": tol,
        "git_commit": git_commit(),
        "machine": f"{platform.node()} {platform.machine()} torch {torch.__version__}",
    }
    report["routing"] = routing or {"mode": "free"}
    if memory_ranks:
        report["memory"] = {"ranks": memory_ranks}
    return report


def _routing_summary(per_rank: list[dict], stack: str) -> dict | None:
    """The candidate's replay over all ranks: choices, swaps, worst gap, problems."""
    results = [r[stack]["routing"] for r in per_rank if "routing" in r[stack]]
    if not results:
        return None
    return {
        "mode": "pinned",
        "choices": sum(r.choices for r in results),
        "swaps": sum(len(r.swaps) for r in results),
        "max_gap": max(r.max_gap() for r in results),
        "score_drift": max(r.worst_drift[0] for r in results),
        "drift_limit": results[0].drift_limit,
        "problems": [f"rank {rank}: {p}" for rank, r in enumerate(results) for p in r.problems()],
    }


def _memory_ranks(per_rank: list[dict], baseline: str, candidate: str) -> list[dict]:
    ranks = []
    for rank, result in enumerate(per_rank):
        if baseline not in result or candidate not in result:
            return []
        peaks = []
        for side in (baseline, candidate):
            steps = list(enumerate(result[side]["memory"]))
            if not steps:
                return []
            # The step whose peak is shown, so the estimate beside it is that step's.
            step, peak = max(steps, key=lambda item: item[1]["total"])
            peaks.append({**peak, "step": step})
        b, c = peaks
        ranks.append(
            {
                "rank": rank,
                "baseline": b,
                "candidate": c,
                "ratio": c["total"] / b["total"] if b["total"] else None,
                "activation_ratio": c["activations"] / b["activations"]
                if b["activations"]
                else None,
            }
        )
    return ranks


def _add_estimates(
    memory_ranks: list[dict], model, parallel, sides: tuple[str, str], per_rank=None
) -> None:
    """Put the memory estimator's per-rank peak (and Megatron's formula) beside each measured
    peak, with the relative error of each. The estimate is of the step measured: step 0
    runs before AdamW has any state (``first_step``), later steps with it. With
    ``per_rank`` (the ranks' records, with ``routing_counts``) the estimate is of the
    routing that step saw (`optimized.estimator.routing`), the balanced one beside it."""
    try:
        from optimized.estimator import estimate_for_compare  # noqa: PLC0415
        from optimized.estimator.routing import received_loads  # noqa: PLC0415
    except ImportError:
        return
    layout = dict(
        pp=parallel.pp, dp=parallel.dp, ep=parallel.ep,
        micro_batch_size=parallel.micro_batch_size, seq_len=parallel.seq_len,
        num_microbatches=parallel.micro_batches, dtype=parallel.dtype,
    )  # fmt: skip

    def run(stack: str, first: bool, routing=None):
        if stack == "optimized-fsdp":
            # ShardedAdamW: float32 moments and, for 16-bit parameters, float32 masters.
            return estimate_for_compare(
                model, layout, "optimized", fsdp=True, shard_optimizer=True,
                optimizer_state_dtype="float32", master_weights=True, first_step=first,
                routing=routing, grad_sync=parallel.grad_sync,
                reshard_after_forward=parallel.reshard_after_forward,
            )  # fmt: skip
        return estimate_for_compare(model, layout, stack, first_step=first, routing=routing)

    for key, stack in zip(("baseline", "candidate"), sides):
        steps = {entry[key].get("step") for entry in memory_ranks}
        reports, observed = {}, {}
        try:
            for step in steps:
                reports[step] = run(stack, step == 0)
                if per_rank is not None and "routing_counts" in per_rank[0].get(stack, {}):
                    counts = {
                        r: res[stack]["routing_counts"][step] for r, res in enumerate(per_rank)
                    }
                    loads = received_loads(counts, parallel.dp, parallel.ep, model.num_experts)
                    mine = {e["rank"]: loads[e["rank"]] for e in memory_ranks
                            if e[key].get("step") == step}  # fmt: skip
                    observed.update(run(stack, step == 0, mine)["observed_ranks"])
        except (ValueError, TypeError) as error:
            print(f"  estimate for {stack} unavailable: {error}", file=sys.stderr)
            continue
        for entry in memory_ranks:
            step = entry[key].get("step")
            report = reports[step]
            megatron = report["megatron"]["total_bytes"]
            pp_rank = entry["rank"] // parallel.dp
            balanced = report["ranks"][pp_rank]["peak_bytes"]
            measured = entry[key]["total"]
            estimate = {
                "step": step,
                "first_step": step == 0,
                "routing": "balanced",
                "peak_bytes": balanced,
                "error": balanced / measured - 1 if measured else None,
                "megatron_bytes": megatron,
                "megatron_error": megatron / measured - 1 if measured else None,
            }
            if entry["rank"] in observed:
                seen = observed[entry["rank"]]["peak_bytes"]
                estimate.update(
                    routing="observed",
                    peak_bytes=seen,
                    error=seen / measured - 1 if measured else None,
                    balanced_peak_bytes=balanced,
                    balanced_error=balanced / measured - 1 if measured else None,
                )
            entry[key]["estimate"] = estimate


def format_estimates(memory_ranks: list[dict], sides: tuple[str, str]) -> str:
    """The estimator's and Megatron's peaks beside each measured one."""
    observed = any(
        entry[key].get("estimate", {}).get("routing") == "observed"
        for entry in memory_ranks
        for key in ("baseline", "candidate")
    )
    head = "observed routing (err)  balanced (err)       " if observed else "estimate (err)       "
    lines = [f"rank  stack       step  measured peak  {head}   megatron (err)"]
    for entry in memory_ranks:
        for key, stack in zip(("baseline", "candidate"), sides):
            est = entry[key].get("estimate")
            if not est:
                continue
            step = est.get("step")
            # Step 0 runs before AdamW has state: its estimate counts none (Megatron's does).
            label = f"{step} (no optimizer state)" if est.get("first_step") else f"{step}"
            beside = ""
            if "balanced_peak_bytes" in est:
                beside = f"  {est['balanced_peak_bytes']:>12,} ({est['balanced_error']:+.2%})"
            lines.append(
                f"{entry['rank']:<5} {stack:<11} {label:<5} {entry[key]['total']:>13,}  "
                f"{est['peak_bytes']:>12,} ({est['error']:+.2%}){beside}  "
                f"{est['megatron_bytes']:>12,.0f} ({est['megatron_error']:+.1%})"
            )
    return "\n".join(lines) if len(lines) > 1 else ""
