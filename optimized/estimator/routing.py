"""Routing a run actually saw, for estimates that use it instead of balanced routing.

The estimator's default assumes every expert is picked equally often, so every EP rank
receives as many rows as it sends. A real router is skewed: at EP > 1 one rank receives
more than another and its peak is higher, and in the optimized stack an expert a few rows
over a multiple of the grouped GEMM's alignment pays a whole extra block. `twinpipe
compare --estimate-routing observed` counts each router call's choices on every rank
(`expert_histograms`), `received_loads` turns the EP group's counts into the rows each
rank's local experts receive, and `ObservedRouting` hands the walk one `EstimateConfig`
per MoE layer and micro-batch with that ``expert_load``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from optimized.estimator.config import EstimateConfig


@dataclass(slots=True)
class ObservedRouting:
    """Rows each local expert of one rank received, per (MoE layer, micro-batch) of a step."""

    load: Mapping[tuple[int, int], tuple[int, ...]]
    """``(layer, micro_batch) -> rows per local expert``; layers missing are dense."""
    _configs: dict = field(default_factory=dict, init=False, repr=False)

    def config_for(self, config: EstimateConfig, layer: int, micro_batch: int) -> EstimateConfig:
        """``config`` with the load of ``layer`` in ``micro_batch`` (itself for dense layers)."""
        load = self.load.get((layer, micro_batch))
        if load is None:
            return config
        key = (id(config), load)
        if key not in self._configs:
            self._configs[key] = config.replace(expert_load=tuple(load))
        return self._configs[key]


def received_loads(
    histograms: Mapping[int, Mapping[tuple[int, int], Sequence[int]]],
    dp: int,
    ep: int,
    num_experts: int,
) -> dict[int, dict[tuple[int, int], tuple[int, ...]]]:
    """Per global rank, the rows its local experts receive, from every rank's send counts.

    ``histograms[rank][(layer, micro_batch)]`` is how many of ``rank``'s routed copies chose
    each of the ``num_experts`` experts. Ranks ``p * dp + block * ep + e`` (``e < ep``) form
    an EP group (`models.runtime.make_layout`) and EP rank ``e`` holds experts
    ``[e * E / ep, (e + 1) * E / ep)``: it receives, for each of them, the sum over its group.
    """
    local = num_experts // ep
    out: dict[int, dict[tuple[int, int], tuple[int, ...]]] = {}
    for rank in histograms:
        pp_rank, dp_rank = divmod(rank, dp)
        block, ep_rank = divmod(dp_rank, ep)
        group = [pp_rank * dp + block * ep + e for e in range(ep)]
        mine = range(ep_rank * local, (ep_rank + 1) * local)
        loads = {}
        for key in histograms[rank]:
            loads[key] = tuple(
                sum(int(histograms[peer][key][expert]) for peer in group) for expert in mine
            )
        out[rank] = loads
    return out


__all__ = ["ObservedRouting", "received_loads"]
