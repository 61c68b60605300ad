"""The tolerance policy of `twinpipe compare`, a whole-tensor comparison for one process,
and the memory estimates put beside measured peaks (the verdict: `harness.verdict`).
"""

from __future__ import annotations

import sys

from harness.inplace import Row, compare_sums, pair_sums

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
def compare_tensors(base: dict, cand: dict) -> list[Row]:
    """Per parameter of two whole-tensor dicts in one process: (name, relative L2 error,
    1 - cos), worst first (`harness.inplace.rows_worst_first`). The harness itself never
    holds whole models; this is for tests and one-process tools."""
    missing = sorted(set(base) ^ set(cand))
    if missing:
        raise RuntimeError(f"the two stacks hold different parameters: {missing[:5]}")
    return compare_sums({name: pair_sums(cand[name], base[name]) for name in base})


def _add_estimates(
    memory_ranks: list[dict], model, parallel, sides: tuple[str, str], stages=None
) -> None:
    """Put the memory estimator's per-rank peak (and Megatron's formula) beside each measured
    peak, with the relative error of each. ``stages``: the layers per stage both stacks ran
    (None: each stack's own choice)."""
    try:
        from optimized.estimator import estimate_for_compare  # noqa: PLC0415
    except ImportError:
        return
    layout = dict(
        pp=parallel.pp, dp=parallel.dp, ep=parallel.ep,
        micro_batch_size=parallel.micro_batch_size, seq_len=parallel.seq_len,
        num_microbatches=parallel.micro_batches, dtype=parallel.dtype,
        layers_per_stage=[len(stage) for stage in stages] if stages else None,
    )  # fmt: skip
    for key, stack in zip(("baseline", "candidate"), sides):
        try:
            if stack == "optimized-fsdp":
                # ShardedAdamW: float32 moments and, for 16-bit parameters, float32 masters.
                report = estimate_for_compare(
                    model, layout, "optimized", fsdp=True, shard_optimizer=True,
                    optimizer_state_dtype="float32", master_weights=True,
                )  # fmt: skip
            else:
                report = estimate_for_compare(model, layout, stack)
        except (ValueError, TypeError) as error:
            print(f"  estimate for {stack} unavailable: {error}", file=sys.stderr)
            continue
        megatron = report["megatron"]["total_bytes"]
        for entry in memory_ranks:
            pp_rank = entry["rank"] // parallel.dp
            estimated = report["ranks"][pp_rank]["peak_bytes"]
            measured = entry[key]["total"]
            entry[key]["estimate"] = {
                "peak_bytes": estimated,
                "error": estimated / measured - 1 if measured else None,
                "megatron_bytes": megatron,
                "megatron_error": megatron / measured - 1 if measured else None,
            }


def format_estimates(memory_ranks: list[dict], sides: tuple[str, str]) -> str:
    """The estimator's and Megatron's peaks beside each measured one."""
    lines = ["rank  stack       measured peak  estimate (err)          megatron (err)"]
    for entry in memory_ranks:
        for key, stack in zip(("baseline", "candidate"), sides):
            est = entry[key].get("estimate")
            if not est:
                continue
            lines.append(
                f"{entry['rank']:<5} {stack:<11} {entry[key]['total']:>13,}  "
                f"{est['peak_bytes']:>12,} ({est['error']:+.1%})  "
                f"{est['megatron_bytes']:>12,.0f} ({est['megatron_error']:+.1%})"
            )
    return "\n".join(lines) if len(lines) > 1 else ""
