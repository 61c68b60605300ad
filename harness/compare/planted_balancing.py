"""Peers' routing-control bugs, planted in the optimized stack (`harness.compare.planted`).

Each is a bug a trainer in this field shipped (issue 37), and each leaves the loss where
it was: only the balancing losses' gradients, the load or the expert biases move, which is
why `twinpipe compare` judges them (`harness.compare.balancing`).

- ``bias-every-micro-batch``: the bias moves after every micro-batch's forward, from that
  micro-batch's counts, instead of once per optimizer step (torchtitan #1304);
- ``bias-counts-not-summed-over-dp``: each DP rank moves its bias from its own counts
  (the sum over the layer's replicas is skipped), so the replicas drift apart;
- ``bias-counts-bf16``: the counts are kept and summed in bfloat16, which holds integers
  exactly only to 256 (Megatron PR #7081: the bias update's sign flipped);
- ``aux-grad-scaled-by-1/M-twice``: the balancing terms' gradient carries 1/M once more
  than their weight in the objective (Megatron PR #5798: proportional to 1/micro-batch);
- ``aux-grad-scaled-by-dp``: that gradient multiplied by the DP size (Megatron #3672);
- ``bias-skipped-on-stage-without-moe``: a pipeline rank whose first chunk holds no MoE
  layer skips the bias update, so the MoE layers of its other chunk never move (the
  torchtitan #1689 and #3666 family: a stage or a family whose hook is missing);
- ``forward-only-updates-bias``: a forward-only pass (evaluation) counts its load and
  moves the bias (torchtitan #4148: eval forwards leaking into the update).

Where the optimized stack shares the code with the reference, a plant replaces the
optimized stack's own seam: `optimized.pipeline.OptimizedDualPipeV.forward_balance` (the
`models.network.MicroBatchBalance` of each forward), and the runner methods that
`OptimizedPipeline` and `ShardedOptimizedPipeline` inherit from
`models.runtime.PipelineRunner` (``step_load``, ``update_expert_biases``, ``evaluate``),
set on those two classes alone.

`plant_problem` says when a plant cannot show at a run's settings (the control it breaks
is off, DP is 1, the counts stay below 257, no rank's first chunk is dense).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from harness.compare.planted_mtp import MTP_PLANTS
from harness.compare.planted_mtp import plant_problem as mtp_plant_problem
from models.network import MicroBatchBalance, ModelConfig, expert_bias_update
from models.runtime import (
    ParallelConfig,
    moe_routers,
    step_balance,
    step_load,
    update_expert_biases,
)

Patch = Iterator[tuple[Any, str, Any]]

BALANCING_PLANTS = (
    "bias-every-micro-batch",
    "bias-counts-not-summed-over-dp",
    "bias-counts-bf16",
    "aux-grad-scaled-by-1/M-twice",
    "aux-grad-scaled-by-dp",
    "bias-skipped-on-stage-without-moe",
    "forward-only-updates-bias",
)

_ONE_REPLICA = SimpleNamespace(dp=1)
"""A layout for `models.runtime.step_load` that sums over no replica."""

BF16_EXACT = 256
"""The largest count bfloat16 holds exactly with every integer below it."""


def _runners() -> tuple[type, ...]:
    from optimized.pipeline import OptimizedPipeline, ShardedOptimizedPipeline  # noqa: PLC0415

    return OptimizedPipeline, ShardedOptimizedPipeline


def _schedule() -> type:
    from optimized.pipeline import OptimizedDualPipeV  # noqa: PLC0415

    return OptimizedDualPipeV


def _balances(kind: Callable[[Any, MicroBatchBalance], MicroBatchBalance | None]) -> Patch:
    """The optimized schedule's training forwards get ``kind(schedule, balance)`` instead."""
    schedule = _schedule()
    original = schedule.forward_balance

    def forward_balance(self, stats):
        balance = original(self, stats)
        return None if balance is None else kind(self, balance)

    yield schedule, "forward_balance", forward_balance


# ---------------------------------------------------------------- the bias
class _EveryMicroBatch(MicroBatchBalance):
    """Moves each router's bias as soon as the micro-batch's counts are known."""

    routers: dict[int, Any] = {}

    def record(self, carrier, record):
        carrier = super().record(carrier, record)
        bias = self.routers[record.layer].e_score_correction_bias
        if bias is not None:
            with torch.no_grad():
                expert_bias_update(bias, record.counts, self.step.balancing.bias_rate)
        return carrier


def _bias_every_micro_batch() -> Patch:
    def kind(schedule, balance):
        planted = _EveryMicroBatch(balance.step, balance.stats)
        planted.routers = moe_routers(schedule.part)
        return planted

    yield from _balances(kind)
    for runner in _runners():
        yield runner, "update_expert_biases", lambda self: None


def _local_load(self) -> torch.Tensor:
    return step_load(self.part, self.balance, _ONE_REPLICA)


def _bf16_load(self) -> torch.Tensor:
    counts = step_load(self.part, self.balance, _ONE_REPLICA).to(torch.bfloat16)
    if self.layout.dp > 1:  # a bfloat16 sum: float32 on the wire, rounded as bf16 adds round
        summed = counts.float()
        dist.all_reduce(summed, group=self.layout.dp_group)
        counts = summed.to(torch.bfloat16)
    return counts.to(torch.long)


def _load(method: Callable[[Any], torch.Tensor]) -> Patch:
    for runner in _runners():
        yield runner, "step_load", method


def _skip_without_moe() -> Patch:
    for runner in _runners():
        original = runner.update_expert_biases

        def update_expert_biases(self, _original=original):
            config = self.part.config
            if any(config.is_moe_layer(layer) for layer in self.schedule.chunks[0]):
                _original(self)

        yield runner, "update_expert_biases", update_expert_biases


def _forward_only_updates_bias() -> Patch:
    schedule = _schedule()
    original_balance = schedule.forward_balance

    def forward_balance(self, stats):
        if self.training:
            return original_balance(self, stats)
        passing = getattr(self, "forward_only_balance", None)
        return passing.micro_batch(None) if passing is not None else None

    yield schedule, "forward_balance", forward_balance
    for runner in _runners():
        original = runner.evaluate

        def evaluate(self, ids, labels, _original=original):
            device = next(self.part.parameters()).device
            passing = step_balance(self.part.config, self.parallel.micro_batches, self.layout,
                                   device)  # fmt: skip
            self.schedule.forward_only_balance = passing
            try:
                loss = _original(self, ids, labels)
            finally:
                self.schedule.forward_only_balance = None
            load = step_load(self.part, passing, self.layout)
            update_expert_biases(self.part, load, self.part.config.balancing().bias_rate)
            return loss

        yield runner, "evaluate", evaluate


# ---------------------------------------------------------------- the aux gradient
class _ScaledGradient(MicroBatchBalance):
    """The balancing terms' gradient times ``factor``; their values as they are."""

    factor = 1.0

    def _local_gradient(self, term):
        gradient = super()._local_gradient(term)
        return lambda: gradient() * self.factor

    def _pooled_gradient(self):
        return super()._pooled_gradient() * self.factor


def _scaled_gradient(factor: Callable[[Any], float]) -> Patch:
    def kind(schedule, balance):
        planted = _ScaledGradient(balance.step, balance.stats)
        planted.factor = factor(schedule)
        return planted

    yield from _balances(kind)


BALANCING_PATCHES: dict[str, Callable[[], Patch]] = {
    "bias-every-micro-batch": _bias_every_micro_batch,
    "bias-counts-not-summed-over-dp": lambda: _load(_local_load),
    "bias-counts-bf16": lambda: _load(_bf16_load),
    "aux-grad-scaled-by-1/M-twice": lambda: _scaled_gradient(lambda s: 1 / s.num_micro_batches),
    "aux-grad-scaled-by-dp": lambda: _scaled_gradient(lambda s: float(s.layout.dp)),
    "bias-skipped-on-stage-without-moe": _skip_without_moe,
    "forward-only-updates-bias": _forward_only_updates_bias,
}
"""Each plant's patches, ``(owner, attribute, replacement)`` (`harness.compare.planted`)."""


# ---------------------------------------------------------------- when one shows
def plant_problem(
    name: str | None, model: ModelConfig, parallel: ParallelConfig, stages: list | None
) -> str | None:
    """Why plant ``name`` could not show at these settings (None: it can, or it is no
    balancing plant). ``stages``: the layers per stage both stacks run (None: the optimized
    stack's own choice)."""
    if name in MTP_PLANTS:
        return mtp_plant_problem(name, model)
    if name not in BALANCING_PLANTS:
        return None
    controls = model.balancing()
    if name.startswith("aux-") and not controls.aux:
        return (
            f"--plant={name!r} scales the load-balancing loss's gradient, and none is on: "
            "choose one with --aux-loss FORM --aux-loss-coef C"
        )
    if not name.startswith("aux-") and not controls.expert_bias:
        return f"--plant={name!r} breaks the expert bias, which is off: add --expert-bias"
    if name.endswith("-dp") and parallel.dp < 2:
        return f"--plant={name!r} shows only across DP ranks: use --dp 2 or more"
    copies = parallel.global_batch * parallel.seq_len * model.num_experts_per_tok
    if name == "bias-counts-bf16" and copies / model.num_experts <= BF16_EXACT:
        return (
            f"--plant={name!r}: an expert's mean count per step ({copies // model.num_experts})"
            f" is at most {BF16_EXACT}, which bfloat16 holds exactly: raise --seq-len, "
            "--micro-batches or --micro-batch-size"
        )
    if name == "bias-skipped-on-stage-without-moe":
        if stages is None:
            from optimized.pipeline import default_partition  # noqa: PLC0415

            stages = default_partition(model, parallel)
        firsts = [stages[rank] for rank in range(parallel.pp)]
        if all(any(model.is_moe_layer(layer) for layer in chunk) for chunk in firsts):
            return (
                f"--plant={name!r}: every pipeline rank's first chunk holds an MoE layer "
                f"(stages {stages}); the bug needs one that holds none (tiny-deepseek-v2 at "
                "--pp 2: its first layer is dense)"
            )
    return None
