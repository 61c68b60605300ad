"""The expert load a training step shows: how many tokens each expert of each MoE layer got.

A router that collapses onto a few experts looks healthy until the loss stalls: the
starved experts stop learning, the crowded ones carry the model. So every step of a MoE
model records, per MoE layer of the whole model (in layer order, `ExpertLoad.figures`):

- ``expert_load``: the copies routed to each expert this step (every token's top-k
  choices), summed over the data-parallel ranks: the global batch's load;
- ``load_max_over_mean``: the busiest expert's load over the mean (1: balanced; E / k:
  every token on the same k experts);
- ``expert_bias_min`` / ``expert_bias_max`` (with ``moe.expert_bias``): the range of the
  bias the routers chose with in this step, before the step's own update;

and for the step: ``aux_loss`` and ``router_z_loss``, the balancing terms as the objective
holds them (coefficient included, mean over the global batch's micro-batches), and
``load_max_over_mean_worst``, the worst layer's ratio: the one number the log line carries.

How it stays within a step's rules. A rank knows the load of the layers it holds, for its
own DP rank's tokens (`models.network.StepBalance.load`); the step wants every layer's,
summed over DP. So each rank writes what it holds into one float64 vector laid out for the
whole model, zeros elsewhere: its counts, its layers' bias range (data-parallel rank 0
only: the replicas' biases are equal) and its shares of the two losses. One all-reduce
over every rank (the ``world`` group) sums it: over DP the counts and the shares, over PP
the layers, each of which one pipeline rank holds. That is the one collective this adds to
a step, ``8 x (L x (E + 2) + 2)`` bytes for ``L`` MoE layers of ``E`` experts, counted as
the step's traffic like any other; the vector is then read on the host together with the
loss and the gradient norm, in the step's one read (`optimized.train.metrics.LoggedScalars`),
so it adds no host synchronisation. float64 holds the counts exactly (below 2^53).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from models.network import ModelConfig, StepBalance
from models.runtime import Layout, moe_routers

FIELDS = (
    "moe_layers",
    "expert_load",
    "load_max_over_mean",
    "load_max_over_mean_worst",
    "expert_bias_min",
    "expert_bias_max",
    "aux_loss",
    "router_z_loss",
)
"""The metrics record's keys `ExpertLoad.figures` fills (`optimized.train.metrics.StepMetrics`)."""


class ExpertLoad:
    """One rank's part of the step's expert-load figures (see the module docstring)."""

    def __init__(
        self, config: ModelConfig, part: torch.nn.Module, layout: Layout, device: torch.device
    ) -> None:
        total = config.num_hidden_layers + config.num_mtp_layers
        self.layers = [i for i in range(total) if config.is_moe_layer(i)]
        """The model's MoE layers (the MTP module's last), in order: the rows of every
        per-layer figure."""
        self.experts = config.num_experts
        self.balancing = config.balancing()
        self.device = device
        self.routers = moe_routers(part)
        """This rank's MoE layers: ``{layer: router}``."""
        row = {layer: index for index, layer in enumerate(self.layers)}
        self.rows = torch.tensor(
            [row[layer] for layer in self.routers], dtype=torch.long, device=device
        )
        """Where this rank's layers sit among `layers` (made once: no copy in a step)."""
        self.writes_bias = self.balancing.expert_bias and layout.dp_rank == 0 and self.routers
        self.world = dist.get_world_size() if dist.is_initialized() else 1

    @classmethod
    def of(cls, runner, layout: Layout) -> ExpertLoad | None:
        """For ``runner``'s part (None: a model without MoE layers has no load to show)."""
        config = runner.part.config
        if config.moe_layers == 0:
            return None
        device = next(runner.part.parameters()).device
        return cls(config, runner.part, layout, device)

    @property
    def size(self) -> int:
        """Elements of the gathered vector: loads, bias minima, bias maxima, aux, z."""
        return len(self.layers) * (self.experts + 2) + 2

    def gather(self, balance: StepBalance) -> torch.Tensor:
        """The step's figures of every layer on every rank, as one float64 vector on the
        device, unread (one all-reduce over the world; see the module docstring)."""
        count, experts = len(self.layers), self.experts
        values = torch.zeros(self.size, dtype=torch.float64, device=self.device)
        if self.routers:
            zero = torch.zeros(experts, dtype=torch.long, device=self.device)
            load = torch.stack([balance.load.get(layer, zero) for layer in self.routers])
            values[: count * experts].view(count, experts).index_copy_(0, self.rows, load.double())
        if self.writes_bias:
            bias = torch.stack([r.e_score_correction_bias for r in self.routers.values()])
            low, high = torch.aminmax(bias, dim=1)
            start = count * experts
            values[start : start + count].index_copy_(0, self.rows, low.double())
            values[start + count : start + 2 * count].index_copy_(0, self.rows, high.double())
        values[-2:].copy_(torch.stack([balance.aux, balance.z]))
        if self.world > 1:
            dist.all_reduce(values)
        return values

    def figures(self, values: list[float]) -> dict:
        """The metrics record's fields (`FIELDS`) from the gathered vector, read on the host."""
        count, experts = len(self.layers), self.experts
        load = [[round(v) for v in values[r * experts : (r + 1) * experts]] for r in range(count)]
        ratios = [max(row) * experts / max(sum(row), 1) for row in load]
        start = count * experts
        bias = self.balancing.expert_bias
        return {
            "moe_layers": self.layers,
            "expert_load": load,
            "load_max_over_mean": ratios,
            "load_max_over_mean_worst": max(ratios),
            "expert_bias_min": values[start : start + count] if bias else None,
            "expert_bias_max": values[start + count : start + 2 * count] if bias else None,
            "aux_loss": values[-2] if self.balancing.aux else None,
            "router_z_loss": values[-1] if self.balancing.z_coef > 0 else None,
        }


def traffic_bytes(config: ModelConfig) -> int:
    """Bytes of the tensor `ExpertLoad.gather` all-reduces each step (0: no MoE layer): what a
    communication model adds per step, over the world group."""
    layers = config.routed_layers
    return 0 if layers == 0 else 8 * (layers * (config.num_experts + 2) + 2)
