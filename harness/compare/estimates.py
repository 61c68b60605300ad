"""The memory estimates `twinpipe compare` puts beside each measured peak: the estimator's
figure for the same step and stack (and, with ``--estimate-routing observed``, for the
routing the step saw), and Megatron's formula; the console's table of them.
"""

from __future__ import annotations

import sys


def stack_estimate(model, layout: dict, stack: str, parallel, first_step: bool, routing=None):
    """`estimate_for_compare` of a compare side: ``optimized-fsdp`` is the optimized walk with
    FSDP2 and `ShardedAdamW`'s state (float32 moments and, for 16-bit parameters, float32
    masters) under the run's gradient-sync and reshard settings."""
    from optimized.estimator import estimate_for_compare  # noqa: PLC0415

    if stack == "optimized-fsdp":
        return estimate_for_compare(
            model, layout, "optimized", fsdp=True, shard_optimizer=True,
            optimizer_state_dtype="float32", master_weights=True, first_step=first_step,
            routing=routing, grad_sync=parallel.grad_sync,
            reshard_after_forward=parallel.reshard_after_forward,
        )  # fmt: skip
    return estimate_for_compare(model, layout, stack, first_step=first_step, routing=routing)


def add_estimates(
    memory_ranks: list[dict],
    model,
    parallel,
    sides: tuple[str, str],
    per_rank=None,
    stages=None,
) -> None:
    """Put the memory estimator's per-rank peak (and Megatron's formula) beside each measured
    peak, with the relative error of each. The estimate is of the step measured: step 0
    runs before AdamW has any state (``first_step``), later steps with it. With
    ``per_rank`` (the ranks' records, with ``routing_counts``) the estimate is of the
    routing that step saw (`optimized.estimator.routing`), the balanced one beside it.
    ``stages``: the layers per stage both stacks ran (None: each stack's own choice).
    A peak is compared without its library ``workspaces`` (cuBLAS's on CUDA; 0 on CPU)."""
    try:
        from optimized.estimator import received_loads  # noqa: PLC0415
    except ImportError:
        return
    layout = dict(
        pp=parallel.pp, dp=parallel.dp, ep=parallel.ep,
        micro_batch_size=parallel.micro_batch_size, seq_len=parallel.seq_len,
        num_microbatches=parallel.micro_batches, dtype=parallel.dtype,
        layers_per_stage=[len(stage) for stage in stages] if stages else None,
        recompute=parallel.recompute,
    )  # fmt: skip

    def run(stack: str, first: bool, routing=None):
        return stack_estimate(model, layout, stack, parallel, first, routing)

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
            # The library workspaces (cuBLAS, on CUDA) are no part of any stack's model.
            measured = entry[key]["total"] - (entry[key].get("workspaces") or 0)
            estimate = {
                "step": step,
                "first_step": step == 0,
                "routing": "balanced",
                "measured_bytes": measured,
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
                f"{entry['rank']:<5} {stack:<11} {label:<5} "
                f"{est.get('measured_bytes', entry[key]['total']):>13,}  "
                f"{est['peak_bytes']:>12,} ({est['error']:+.2%}){beside}  "
                f"{est['megatron_bytes']:>12,.0f} ({est['megatron_error']:+.1%})"
            )
    return "\n".join(lines) if len(lines) > 1 else ""
