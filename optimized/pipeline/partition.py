"""Layer ranges for DualPipeV's ``2 * PP`` stages, chosen by the memory estimator.

pp-rank ``r`` holds stages ``r`` and ``2 * PP - 1 - r``, so rank 0 carries both
the embedding (stage 0) and the output layer and loss (the last stage), and
each rank's peak depends on a pair of stages. `choose_partition` picks the
contiguous ranges that minimise the largest estimated per-rank peak:
exhaustively when the number of partitions is small, otherwise by moving one
stage boundary at a time from the better of the even and heuristic splits
while the largest peak drops (one layer moved from any stage to any other, the
boundaries between them shifting).
"""

from __future__ import annotations

import math

from optimized.estimator.config import EstimateConfig
from optimized.estimator.ranks import estimate_rank, largest_peak

EXHAUSTIVE_LIMIT = 3000
"""Search every partition when there are at most this many."""


def _ranges(counts: list[int]) -> list[range]:
    out, start = [], 0
    for count in counts:
        out.append(range(start, start + count))
        start += count
    return out


def even_partition(num_layers: int, num_stages: int) -> list[range]:
    """``num_layers // num_stages`` each, the remainder to the first stages."""
    if num_layers < num_stages:
        raise ValueError(f"num_layers={num_layers} cannot fill num_stages={num_stages} stages")
    base, extra = divmod(num_layers, num_stages)
    return _ranges([base + (stage < extra) for stage in range(num_stages)])


def heuristic_partition(num_layers: int, num_stages: int) -> list[range]:
    """The common heuristic: the remainder goes to the inner stages (the V's bottom, away
    from the embedding and the loss), innermost first."""
    if num_layers < num_stages:
        raise ValueError(f"num_layers={num_layers} cannot fill num_stages={num_stages} stages")
    base, extra = divmod(num_layers, num_stages)
    counts = [base] * num_stages
    middle = (num_stages - 1) / 2
    for stage in sorted(range(num_stages), key=lambda s: (abs(s - middle), s))[:extra]:
        counts[stage] += 1
    return _ranges(counts)


def _counts(partition: list[range]) -> list[int]:
    return [len(stage) for stage in partition]


def _compositions(total: int, parts: int):
    if parts == 1:
        yield [total]
        return
    for first in range(1, total - parts + 2):
        for rest in _compositions(total - first, parts - 1):
            yield [first] + rest


def choose_partition(config: EstimateConfig) -> list[range]:
    """Stage ranges minimising the largest estimated per-rank peak (``config.layers_per_stage``
    is ignored: this is what it would default to)."""
    layers, stages = config.model.num_hidden_layers, config.num_stages
    config = config.replace(layers_per_stage=None)

    # A rank's estimate depends only on its own two stages' layers, and of each layer only
    # on its kind (dense or MoE: the estimator counts no per-index difference), and the
    # search revisits the same pairs many times: remember each rank's peak by its two
    # stages' sequences of kinds.
    peaks: dict[tuple[int, tuple[bool, ...], tuple[bool, ...]], int] = {}
    kinds = config.moe_layers()

    def rank_peak(rank: int, partition: list[range]) -> int:
        first, second = partition[rank], partition[stages - 1 - rank]
        key = (rank, tuple(kinds[i] for i in first), tuple(kinds[i] for i in second))
        if key not in peaks:
            peaks[key] = estimate_rank(config, rank, partition).peak_bytes
        return peaks[key]

    def cost(counts: list[int]) -> tuple[int, list[int]]:
        partition = _ranges(counts)
        return max(rank_peak(rank, partition) for rank in range(config.pp)), counts

    if math.comb(layers - 1, stages - 1) <= EXHAUSTIVE_LIMIT:
        return _ranges(min(cost(c) for c in _compositions(layers, stages))[1])
    best = min(
        cost(_counts(even_partition(layers, stages))),
        cost(_counts(heuristic_partition(layers, stages))),
    )
    improved = True
    while improved:
        improved = False
        for source in range(stages):
            for target in range(stages):
                counts = list(best[1])
                counts[source] -= 1
                counts[target] += 1
                if source == target or counts[source] < 1:
                    continue
                candidate = cost(counts)
                if candidate[0] < best[0]:
                    best, improved = candidate, True
    return _ranges(best[1])


def stage_layers(config: EstimateConfig) -> list[range]:
    """The partition a run uses: ``layers_per_stage`` if given, else the stack's default
    (the optimized stack chooses by estimate, the reference splits evenly)."""
    if config.layers_per_stage is not None:
        return _ranges(list(config.layers_per_stage))
    if config.stack == "optimized":
        return choose_partition(config)
    return even_partition(config.model.num_hidden_layers, config.num_stages)


def partition_report(config: EstimateConfig) -> list[dict]:
    """The chosen, even and heuristic partitions with each one's largest per-rank peak."""
    layers, stages = config.model.num_hidden_layers, config.num_stages
    rows = []
    for name, partition in (
        ("chosen", choose_partition(config)),
        ("even", even_partition(layers, stages)),
        ("heuristic", heuristic_partition(layers, stages)),
    ):
        rows.append(
            {
                "name": name,
                "layers_per_stage": _counts(partition),
                "largest_peak_bytes": largest_peak(config, partition),
            }
        )
    return rows
