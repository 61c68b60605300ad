"""Stage partitions: even, heuristic, and the estimator's choice."""

import itertools

from models.network import preset
from optimized.estimator import EstimateConfig, largest_peak
from optimized.pipeline.partition import (
    choose_partition,
    even_partition,
    heuristic_partition,
    partition_report,
)


def test_even_and_heuristic():
    assert [len(s) for s in even_partition(10, 4)] == [3, 3, 2, 2]
    assert [len(s) for s in heuristic_partition(10, 4)] == [2, 3, 3, 2]
    assert even_partition(10, 4)[-1] == range(8, 10)


def test_chosen_is_no_worse():
    config = EstimateConfig(
        preset("deepseek-v2-lite"), pp=4, dp=8, ep=8, seq_len=4096, num_microbatches=16,
        dtype="bfloat16", shard_optimizer=True,
    )  # fmt: skip
    chosen = choose_partition(config)
    assert len(chosen) == 8 and sum(len(s) for s in chosen) == 27
    assert chosen[0].start == 0 and all(a.stop == b.start for a, b in itertools.pairwise(chosen))
    peak = largest_peak(config, chosen)
    rows = {row["name"]: row["largest_peak_bytes"] for row in partition_report(config)}
    assert peak == rows["chosen"] <= min(rows["even"], rows["heuristic"])


def test_exhaustive_small():
    config = EstimateConfig(preset("tiny-qwen3-moe", num_hidden_layers=8), pp=2, seq_len=64,
                            num_microbatches=4)  # fmt: skip
    chosen = choose_partition(config)
    assert largest_peak(config, chosen) <= largest_peak(config, even_partition(8, 4))
