"""`twinpipe compare`'s ranks for several runs in one launch, as the multi-run tests use them."""

from __future__ import annotations

from collections.abc import Sequence

from harness.compare.lockstep import run_rank
from harness.compare.rank import RankPlan
from harness.compare.verdict import build_report
from models.network import SeededWeights
from models.runtime import OptimizerConfig, launch


def _run_plans(plans: list[RankPlan]) -> list[dict]:
    return [run_rank(plan) for plan in plans]


def compare_in_one_launch(
    plans: Sequence[RankPlan], labels: Sequence[str | None] | None = None
) -> list[dict]:
    """Each plan run in turn on the same ranks (one launch; the plans share a world size),
    and each plan's report, labelled by ``labels`` (a preset's name, aligned with
    ``plans``)."""
    worlds = {plan.parallel.world_size for plan in plans}
    assert len(worlds) == 1, f"one launch runs one world size, not {sorted(worlds)}"
    per_rank = launch(_run_plans, worlds.pop(), (list(plans),))
    labels = labels if labels is not None else [None] * len(plans)
    return [
        build_report(plan, [rank[i] for rank in per_rank], label)
        for i, (plan, label) in enumerate(zip(plans, labels, strict=True))
    ]


def planted_reports(
    model, parallel, plants: Sequence[str], label: str | None = None, noise_floor: bool = False
) -> dict[str | None, dict]:
    """The correct stack (key None) and each plant, one launch: the reference as baseline,
    the optimized stack as candidate, one step, no memory tracking (the bugs are planted
    and removed in the ranks)."""
    weights = SeededWeights(model)
    plans = [
        RankPlan(
            model,
            parallel,
            weights,
            "reference",
            "optimized",
            1,
            OptimizerConfig(),
            noise_floor=noise_floor,
            track_memory=False,
            progress=False,
            plant=plant,
        )  # fmt: skip
        for plant in (None, *plants)
    ]
    reports = compare_in_one_launch(plans, [label] * len(plans))
    return dict(zip((None, *plants), reports, strict=True))
