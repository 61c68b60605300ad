"""The tolerance policy of `twinpipe compare` (DESIGN.md's numerics policy), and a
whole-tensor comparison for one process (the verdict: `harness.compare.verdict`).
"""

from __future__ import annotations

from harness.compare.inplace import Row, compare_sums, pair_sums

# DESIGN.md's numerics policy: (loss relative error, gradient 1 - cos, gradient relative L2
# error). 1 - cos cannot see a gradient scaled as a whole (a cross-entropy gradient 1% too
# large keeps it at 0), so float32 also bounds each gradient's relative L2 error, at the
# error its 1 - cos bound allows (rel ~ sqrt(2 (1 - cos))); correct stacks measure 1e-6
# (tiny presets, optimized vs reference) and 3e-7 (oracle vs reference, step 0). In bfloat16
# the noise floor (`harness.compare.noise_floor`) judges each gradient's error; the fixed bounds
# are a backstop on direction only.
TOLERANCES = {
    ("oracle", "float32"): (1e-6, 1e-10, 1e-5),
    ("pipeline", "float32"): (1e-5, 1e-8, 1e-4),
    ("oracle", "bfloat16"): (1e-2, 1e-2, None),
    ("pipeline", "bfloat16"): (1e-2, 1e-2, None),
}


def tolerance(baseline: str, candidate: str, dtype: str) -> dict[str, float | None]:
    kind = "oracle" if "oracle" in (baseline, candidate) else "pipeline"
    loss_rel, grad_cos, grad_rel = TOLERANCES[(kind, dtype)]
    return {"loss_rel": loss_rel, "grad_one_minus_cos": grad_cos, "grad_rel": grad_rel}


def compare_tensors(base: dict, cand: dict) -> list[Row]:
    """Per parameter of two whole-tensor dicts in one process: (name, relative L2 error,
    1 - cos), worst first (`harness.compare.inplace.rows_worst_first`). The harness itself never
    holds whole models; this is for tests and one-process tools."""
    missing = sorted(set(base) ^ set(cand))
    if missing:
        raise RuntimeError(f"the two stacks hold different parameters: {missing[:5]}")
    return compare_sums({name: pair_sums(cand[name], base[name]) for name in base})
