"""Per-rank estimates of a whole pipeline: each stack's walk, rank by rank."""

from __future__ import annotations

from optimized.estimator.config import EstimateConfig
from optimized.estimator.memory import RankEstimate
from optimized.estimator.optimized_walk import estimate_rank_optimized
from optimized.estimator.reference_walk import estimate_rank_reference


def estimate_rank(
    config: EstimateConfig, rank: int, partition: list[range], routing=None
) -> RankEstimate:
    """One pp-rank's memory under ``config.stack``'s schedule; ``routing``: the
    `optimized.estimator.routing.ObservedRouting` of one of its ranks (else balanced)."""
    if config.stack == "optimized":
        return estimate_rank_optimized(config, rank, partition, routing)
    return estimate_rank_reference(config, rank, partition, routing)


def estimate_ranks(config: EstimateConfig, partition: list[range]) -> list[RankEstimate]:
    return [estimate_rank(config, rank, partition) for rank in range(config.pp)]


def largest_peak(config: EstimateConfig, partition: list[range]) -> int:
    return max(rank.peak_bytes for rank in estimate_ranks(config, partition))
