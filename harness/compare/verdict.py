"""The verdict of a compare run and its report, from the scalars the ranks sent back.

Which steps are judged:

- lockstep (two pipeline stacks, the default): every step, and the forward-only
  evaluation after the last; each starts from the same state on both sides;
- free-running pipelines (``--trajectory free``): step 0 only; later steps are reported
  as information (loss curves side by side, divergence per step);
- against the oracle: every step, lockstep or free-running (float32 holds it to
  DESIGN.md's bounds); free-running, the gradients at step 0 only.

What is judged per step: the loss (relative error), every parameter's gradient (``1 -
cos``, worst first), the routing replay (router scores within the dtype's bound, every swap
a near-tie its scores explain). Nothing non-finite passes, judged step or not: a loss,
gradient or parameter that is NaN or infinite on either side fails the run, the baseline's
NaN against the candidate's finite value (a stack that zeroes NaNs) as well. In bfloat16
lockstep with the noise floor on, the score bound and the candidate's closeness to the
float32 truth come from `harness.compare.noise_floor`, and DESIGN.md's bounds stay as the
backstop. The parameters after each update are measured and reported (AdamW's first steps
move elements whose gradient is within rounding of zero by a whole ``lr``, so they are no
pass/fail figure). The routing controls (the balancing losses, the load, the expert
biases) are judged by `harness.compare.balancing`.
"""

from __future__ import annotations

import math
from typing import Any

from harness.compare import noise_floor
from harness.compare.balancing import balancing_section
from harness.compare.estimates import add_estimates
from harness.compare.inplace import compare_sums, group_of
from harness.compare.mtp import mtp_section
from harness.compare.tolerances import tolerance
from harness.report import git_commit, machine_line


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b != 0 else abs(a)


def _routing(
    per_rank: list[dict], step: int | None, limits: dict | None, side: str = "candidate"
) -> dict | None:
    """The replays of ``side`` (the candidate; against the oracle, the pipeline) at one step
    (or the evaluation) over all ranks."""
    results = [(rank, _replays(r, step).get(side)) for rank, r in enumerate(per_rank)]
    results = [(rank, res) for rank, res in results if res is not None]
    if not results:
        return None
    drift = {}
    for _, res in results:
        for router, value in res.router_drift.items():
            drift[router] = max(value, drift.get(router, 0.0))
    return {
        "choices": sum(r.choices for _, r in results),
        "swaps": sum(len(r.swaps) for _, r in results),
        "max_gap": max(r.max_gap() for _, r in results),
        "score_drift": max(r.worst_drift[0] for _, r in results),
        # With the noise floor each router has its own limit (the reference's own drift).
        "drift_limit": dict(limits) if limits is not None else results[0][1].drift_limit,
        "router_drift": drift,
        "problems": [f"rank {rank}: {p}" for rank, r in results for p in r.problems(limits)],
    }


def _replays(result: dict, step: int | None) -> dict:
    """A rank's routing replays at one step (None: the evaluation), by stack key."""
    return result["steps"][step].routing if step is not None else result["eval"]["routing"]


def _drifts(per_rank: list[dict], step: int | None) -> dict[str, dict[str, float]]:
    """Each side's worst score drift from the recording (the truth), per router."""
    out: dict[str, dict[str, float]] = {}
    for r in per_rank:
        for side, res in _replays(r, step).items():
            for router, value in res.router_drift.items():
                out.setdefault(side, {})[router] = max(value, out.get(side, {}).get(router, 0))
    return out


def _nonfinite(records: list, evaluation: dict) -> list[str]:
    """Every loss, gradient and parameter that is not finite on either side, at every step
    and the evaluation, judged or not: NaN never passes, and a finite value against a NaN
    (a stack that dropped or zeroed one) is a failure like two NaNs are."""
    problems = []
    for step, record in enumerate(records):
        losses = {side: record.loss[side] for side in ("baseline", "candidate")}
        bad = [f"{side} {value}" for side, value in losses.items() if not math.isfinite(value)]
        if bad:
            problems.append(f"step {step}: loss not finite ({', '.join(bad)}; "
                            f"the other side {'also' if len(bad) == 2 else 'finite'})")  # fmt: skip
        for what, sums in (("gradient", record.grads), ("parameter", record.params)):
            names = sorted(name for name, s in sums.items() if not s.finite)
            if names:
                problems.append(f"step {step}: {what}s not finite on a side: "
                                f"{', '.join(names[:3])}{' ...' * (len(names) > 3)}")  # fmt: skip
    bad = [f"{side} {evaluation[side]}" for side in ("baseline", "candidate")
           if not math.isfinite(evaluation[side])]  # fmt: skip
    if bad:
        problems.append(f"evaluation: loss not finite ({', '.join(bad)})")
    return problems


def _memory(per_rank: list[dict], sides: tuple[str, str]) -> list[dict]:
    ranks = []
    for rank, result in enumerate(per_rank):
        entry: dict[str, Any] = {"rank": rank, "coords": list(result["coords"])}
        for key in ("baseline", "candidate"):
            figures = [s.memory[key] for s in result["steps"] if s.memory.get(key)]
            if len(figures) != len(result["steps"]):
                return []
            # The step whose peak is shown, so the estimate beside it is that step's.
            step = max(range(len(figures)), key=lambda s: figures[s]["total"])
            entry[key] = {**figures[step], "step": step, "steps": [m["total"] for m in figures]}
        b, c = entry["baseline"], entry["candidate"]
        entry["ratio"] = c["total"] / b["total"] if b["total"] else None
        entry["activation_ratio"] = (
            c["activations"] / b["activations"] if b["activations"] else None
        )
        held, params = max(s.held for s in result["steps"]), result["param_bytes"]
        entry["harness"] = {
            "held_bytes": held,
            "parameter_bytes": params,
            "held_per_parameter_copy": held / params if params else None,
            "spilled_bytes": max(s.spilled for s in result["steps"]),
            "rss_peak_bytes": result["rss_bytes"],
        }
        truth = [s.memory["truth"] for s in result["steps"] if s.memory.get("truth")]
        if truth:  # the float32 truth's step: its own peak plus what the bf16 stacks kept
            total = max(t["total"] + t["held"] for t in truth)
            added = total - max(b["total"], c["total"])
            entry["harness"].update(
                truth_step_bytes=total,
                truth_step_added_bytes=added,
                truth_step_added_per_parameter_copy=added / params if params else None,
            )
        ranks.append(entry)
    return ranks


def _grads(records: list[dict]) -> dict[str, Any]:
    rel, cos, worst = [], [], {}
    for record in records:
        rows = compare_sums(record.grads)
        rel.append(max((r.rel for r in rows), default=0.0))
        cos.append(rows[0].one_minus_cos if rows else 0.0)  # rows are worst first
        for row in rows[:5]:
            if row.name not in worst or row.one_minus_cos > worst[row.name][2]:
                worst[row.name] = (row.name, row.rel, row.one_minus_cos)
    ordered = sorted(worst.values(), key=lambda w: (w[2], w[1]), reverse=True)[:8]
    return {"max_rel_error": rel, "max_one_minus_cos": cos, "worst": [list(w) for w in ordered]}


def build_report(plan, per_rank: list[dict], label: str | None = None) -> dict:
    """The report of a compare run (`harness.report` documents its keys); ``label``: how
    the model was named (a preset or a config path)."""
    parallel, model = plan.parallel, plan.model
    records = per_rank[0]["steps"]
    lockstep = per_rank[0]["lockstep"]
    oracle = "oracle" in (plan.baseline, plan.candidate)
    # Free-running, a later step's gradients measure AdamW's amplified rounding, not that
    # step's arithmetic: free-running against the oracle only the loss is judged there.
    judged = list(range(plan.steps)) if lockstep or oracle else [0]
    grads_judged = list(range(plan.steps)) if lockstep else [0]
    tol = tolerance(plan.baseline, plan.candidate, parallel.dtype)
    floor = lockstep and any(r.grads_truth is not None for r in records)
    tokens = parallel.micro_batches * parallel.micro_batch_size * parallel.seq_len * parallel.dp

    loss_b = [r.loss["baseline"] for r in records]
    loss_c = [r.loss["candidate"] for r in records]
    loss_rel = [_rel(c, b) for b, c in zip(loss_b, loss_c, strict=True)]
    grads = _grads(records)
    params = [max((r.rel for r in compare_sums(rec.params)), default=0.0) for rec in records]
    evaluation = per_rank[0]["eval"]["loss"]
    eval_rel = _rel(evaluation["candidate"], evaluation["baseline"])

    problems: list[str] = []
    floor_steps, routing_steps = [], []
    replayer = "baseline" if plan.candidate == "oracle" else "candidate"
    for step in range(plan.steps):
        limits = None
        if floor:
            verdict = noise_floor.judge_step(records[step], _drifts(per_rank, step), tokens)
            floor_steps.append(verdict)
            limits = noise_floor.router_limits(_drifts(per_rank, step))
        routing_steps.append(_routing(per_rank, step, limits, replayer))
    eval_limits = noise_floor.router_limits(_drifts(per_rank, None)) if floor else None
    eval_routing = _routing(per_rank, None, eval_limits, replayer)
    problems += _nonfinite(records, evaluation)
    for step in judged:
        if loss_rel[step] > tol["loss_rel"]:
            problems.append(f"step {step}: loss differs by {loss_rel[step]:.3g} (relative)")
        if step not in grads_judged:
            continue
        if grads["max_one_minus_cos"][step] > tol["grad_one_minus_cos"]:
            worst = compare_sums(records[step].grads)[0]
            problems.append(
                f"step {step}: gradient {worst.name} 1 - cos = {worst.one_minus_cos:.3g}"
            )
        if tol["grad_rel"] is not None and grads["max_rel_error"][step] > tol["grad_rel"]:
            worst = max(compare_sums(records[step].grads), key=lambda row: row.rel)
            problems.append(
                f"step {step}: gradient {worst.name} relative error {worst.rel:.3g}"
                f" (limit {tol['grad_rel']:.3g})"
            )
        if routing_steps[step]:
            problems += [f"step {step}: {p}" for p in routing_steps[step]["problems"]]
        if floor:
            problems += [f"step {step}: noise floor: {p}" for p in floor_steps[step]["problems"]]
    if lockstep or oracle:
        if math.isfinite(eval_rel) and eval_rel > tol["loss_rel"]:
            problems.append(f"evaluation: loss differs by {eval_rel:.3g} (relative)")
        if eval_routing and lockstep:  # free-running, routing after step 0 is information
            problems += [f"evaluation: {p}" for p in eval_routing["problems"]]
    balancing, balancing_problems = balancing_section(plan, per_rank, judged, tol["loss_rel"])
    problems += balancing_problems
    mtp, mtp_problems = mtp_section(plan, per_rank[0]["steps"], judged, tol["loss_rel"])
    problems += mtp_problems
    report: dict[str, Any] = {
        "passed": not problems,
        "problems": problems,
        "config": {
            "model": label or model.model_type,
            "pp": parallel.pp,
            "dp": parallel.dp,
            "ep": parallel.ep,
            "micro_batches": parallel.micro_batches,
            "micro_batch_size": parallel.micro_batch_size,
            "seq_len": parallel.seq_len,
            "dtype": parallel.dtype,
            "steps": plan.steps,
            "seed": parallel.seed,
            "lr": plan.optimizer.lr,
            "trajectory": "lockstep" if lockstep else "free",
            "routing": plan.routing,
            "noise_floor": floor,
            "grad_sync": parallel.grad_sync,
            "reshard_after_forward": parallel.reshard_after_forward,
            "stages": plan.stages,
            "plant": plan.plant,
        },  # fmt: skip
        "baseline": plan.baseline,
        "candidate": plan.candidate,
        "loss": {"baseline": loss_b, "candidate": loss_c, "rel_error": loss_rel},
        "eval_loss": {
            "baseline": evaluation["baseline"],
            "candidate": evaluation["candidate"],
            "rel_error": eval_rel,
        },  # fmt: skip
        "grads": grads,
        "params": {"max_rel_error": params},
        "time": {
            key: [
                max(r["steps"][s].time.get(key, 0.0) for r in per_rank) for s in range(plan.steps)
            ]
            for key in ("baseline", "candidate")
        },  # fmt: skip
        "tolerance": tol,
        "trajectory": {
            "mode": "lockstep" if lockstep else "free",
            "judged_steps": judged,
            "divergence": {"loss_rel": loss_rel, "grad_one_minus_cos": grads["max_one_minus_cos"]},
        },
        "git_commit": git_commit(),
        "machine": machine_line(),
    }
    if balancing is not None:
        report["balancing"] = balancing
    if mtp is not None:
        report["mtp"] = mtp
    if per_rank[0].get("device"):  # rank 0's (`harness.compare.arithmetic`); all ranks alike
        report["device"] = per_rank[0]["device"]
    if floor:
        report["loss"]["truth"] = [r.loss["truth"] for r in records]
        report["eval_loss"]["truth"] = evaluation["truth"]
        report["noise_floor"] = {
            "settings": noise_floor.SETTINGS,
            "steps": floor_steps,
            "eval": noise_floor.judge_loss(evaluation),
        }
        if not report["noise_floor"]["eval"]["passed"]:
            problems.append("evaluation: noise floor: loss " + str(report["noise_floor"]["eval"]))
            report["passed"] = False
    from harness.compare.ops_audit import summarize  # noqa: PLC0415

    audit, audit_problems = summarize(per_rank, plan.steps)
    if audit is not None:
        report["ops_audit"] = audit
        problems += audit_problems
        report["passed"] = not problems
    report["routing"] = {"mode": "free"}
    if any(routing_steps):
        summary = dict(routing_steps[0])
        for step in routing_steps[1:] + [eval_routing]:
            if step:
                summary["choices"] += step["choices"]
                summary["swaps"] += step["swaps"]
                summary["max_gap"] = max(summary["max_gap"], step["max_gap"])
                summary["score_drift"] = max(summary["score_drift"], step["score_drift"])
        summary["problems"] = [p for p in problems if "rout" in p]
        summary["recorded_by"] = "truth" if floor else "oracle" if oracle else "baseline"
        if floor:  # per router, the tightest limit of any step (each step's in steps[*])
            tightest: dict[str, float] = {}
            for step in routing_steps + [eval_routing]:
                for router, limit in ((step or {}).get("drift_limit") or {}).items():
                    tightest[router] = min(limit, tightest.get(router, limit))
            summary["drift_limit"] = tightest
        summary["steps"] = routing_steps
        report["routing"] = {"mode": "pinned", **summary}
    if plan.routing == "balanced" and "oracle" not in (plan.baseline, plan.candidate):
        report["routing"] = {"mode": "balanced"}
    sides = (plan.baseline, plan.candidate)
    if "oracle" not in sides:
        from harness.compare.communication import communication_section  # noqa: PLC0415

        communication = communication_section(per_rank, model, parallel, sides, plan.routing)
        if communication:
            report["communication"] = communication
    memory = _memory(per_rank, sides)
    if memory:
        observed = per_rank if plan.count_routing else None
        add_estimates(memory, model, parallel, sides, observed, plan.stages)
        report["memory"] = {"ranks": memory}
    return report


__all__ = ["build_report", "group_of"]
