"""What every stack's training step shares: data, stage partition, gradient reduction, AdamW.

These are not optimizations, only the rules that make two stacks comparable:
the same global batch cut the same way, the loss as the mean over every
labelled token of the global batch, the same gradient reductions and the same
optimizer, whatever PP, DP, EP or M.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from models.network import (
    IGNORE_INDEX,
    ModelConfig,
    StepBalance,
    expert_bias_update,
    is_expert_parameter,
    mtp_step,
    shift_labels,
)
from models.runtime.distributed import Layout, ParallelConfig


@dataclass(slots=True)
class OptimizerConfig:
    """AdamW settings shared by every stack in a comparison."""

    lr: float = 1e-3
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam moment decay rates."""
    eps: float = 1e-8
    """Adam denominator epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""

    def build(self, parameters) -> torch.optim.AdamW:
        return torch.optim.AdamW(
            parameters, lr=self.lr, betas=self.betas, eps=self.eps,
            weight_decay=self.weight_decay, foreach=False,
        )  # fmt: skip


def synthetic_batch(
    model: ModelConfig,
    parallel: ParallelConfig,
    step: int,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: random token ids from the seed, labels shifted as HF does.

    ``[DP * M * micro_batch_size, seq_len]`` ids and labels; every stack draws the same.
    They are drawn on the CPU (the same ids on every device) and moved to ``device``.
    """
    generator = torch.Generator().manual_seed(parallel.seed * 100_003 + step + 1)
    ids = torch.randint(
        0, model.vocab_size, (parallel.global_batch, parallel.seq_len), generator=generator
    )
    if device is not None:
        ids = ids.to(device)
    return ids, shift_labels(ids)


def token_count(labels: torch.Tensor) -> torch.Tensor:
    """Labelled tokens of a global batch (at least 1): the denominator of the mean loss, as
    a 0-dim long tensor on the labels' device. The schedules only divide by it, so it is
    never read on the host (dividing by it or by the same Python int gives the same bits)."""
    return (labels != IGNORE_INDEX).sum().clamp(min=1)


def micro_batches_of(
    ids: torch.Tensor, labels: torch.Tensor, parallel: ParallelConfig, dp_rank: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This data-parallel rank's M micro-batches of a global batch."""
    size = parallel.micro_batch_size
    first = dp_rank * parallel.micro_batches * size
    rows = [slice(first + j * size, first + (j + 1) * size) for j in range(parallel.micro_batches)]
    return [(ids[r], labels[r]) for r in rows]


def even_partition(num_layers: int, num_stages: int) -> list[list[int]]:
    """Contiguous layer ranges per stage; the first ``num_layers % num_stages`` get one more."""
    base, extra = divmod(num_layers, num_stages)
    stages, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        stages.append(list(range(start, start + size)))
        start += size
    return stages


def rank_chunks(stages: list[list[int]], pp_rank: int) -> tuple[list[int], list[int]]:
    """The V placement: pp-rank r holds stage r (chunk 0) and stage 2 * PP - 1 - r (chunk 1)."""
    return stages[pp_rank], stages[len(stages) - 1 - pp_rank]


def reduce_gradients(part: torch.nn.Module, layout: Layout) -> None:
    """Sum gradients over data-parallel ranks: non-expert over DP, experts over their replicas.

    Every parameter gets a gradient (zeros where none flowed) so that all ranks
    take part in the same collectives.
    """
    for name, param in part.named_parameters():
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        if is_expert_parameter(name):
            if layout.dp // layout.ep > 1:
                dist.all_reduce(param.grad, group=layout.expert_replica_group)
        elif layout.dp > 1:
            dist.all_reduce(param.grad, group=layout.dp_group)


def shared_loss(loss: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The global mean loss on every rank, from the per-rank shares on pp-rank 0, as a 0-dim
    float32 tensor on the loss's device: collectives only, nothing read on the host."""
    loss = loss.detach().float().clone()
    if layout.dp > 1:
        dist.all_reduce(loss, group=layout.dp_group)
    if layout.pp > 1:
        dist.broadcast(loss, src=layout.global_rank(0), group=layout.pp_group)
    return loss


def shared_mtp(schedule, layout: Layout) -> torch.Tensor | None:
    """The step's MTP figures on every rank, ``[2, D]`` float32: each depth's loss ``L_k``
    (the global mean) and its top-1 accuracy over its kept positions, from the schedule's
    shares on pp-rank 0 (`shared_loss`'s collectives); None without MTP."""
    step = getattr(schedule, "mtp", None)
    if step is None or getattr(schedule, "mtp_losses", None) is None:
        return None
    values = torch.stack([schedule.mtp_losses.float(), schedule.mtp_correct.float()])
    if layout.dp > 1:
        dist.all_reduce(values, group=layout.dp_group)
    if layout.pp > 1:
        dist.broadcast(values, src=layout.global_rank(0), group=layout.pp_group)
    values[1] = values[1] / step.counts.float()
    return values


def step_balance(
    config: ModelConfig, micro_batches: int, layout: Layout, device: torch.device
) -> StepBalance:
    """A rank's `models.network.StepBalance` for one training step of ``micro_batches`` per
    DP rank: one micro-batch's balancing terms weigh ``1 / (M x DP)``."""
    return StepBalance(
        config.balancing(), config.routed_layers, config.num_experts, micro_batches * layout.dp,
        device,
    )  # fmt: skip


def moe_routers(part: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """``{layer: router}`` of the MoE layers ``part`` holds, in layer order."""
    found = {}
    for layer in [*getattr(part, "decoder_layers", []), *getattr(part, "mtp_layers", [])]:
        if layer.is_moe:
            found[layer.layer] = layer.mlp.router_module
    return dict(sorted(found.items()))


def step_load(part: torch.nn.Module, balance: StepBalance | None, layout: Layout) -> torch.Tensor:
    """The step's copies per expert of each MoE layer ``part`` holds, summed over every
    replica of the layer (the DP group, which holds EP; never PP): ``[layers, E]`` int64 in
    `moe_routers` order, on the device; nothing is read on the host. One all-reduce."""
    routers = moe_routers(part)
    if not routers or balance is None:
        return torch.zeros(len(routers), 0, dtype=torch.long)
    experts = balance.num_experts
    zero = torch.zeros(experts, dtype=torch.long, device=balance.device)
    load = torch.stack([balance.load.get(layer, zero) for layer in routers])
    if layout.dp > 1:
        dist.all_reduce(load, group=layout.dp_group)
    return load


def update_expert_biases(part: torch.nn.Module, load: torch.Tensor, rate: float) -> None:
    """Each MoE router's expert bias moved once for the step (`expert_bias_update`) from
    ``load`` (`step_load`). Routers without a bias are left alone."""
    for row, router in zip(load, moe_routers(part).values()):
        if router.e_score_correction_bias is not None:
            expert_bias_update(router.e_score_correction_bias, row, rate)


def shared_balancing(balance: StepBalance | None, layout: Layout) -> torch.Tensor:
    """The step's load-balancing loss and z-loss, ``[2]`` float32 on every rank (every rank's
    share summed over DP and PP): collectives only, nothing read on the host."""
    if balance is None:
        return torch.zeros(2)
    values = torch.stack([balance.aux, balance.z]).float()
    if layout.dp > 1:
        dist.all_reduce(values, group=layout.dp_group)
    if layout.pp > 1:
        dist.all_reduce(values, group=layout.pp_group)
    return values


def share_loss(loss: torch.Tensor, layout: Layout) -> float:
    """`shared_loss`, read on the host."""
    return float(shared_loss(loss, layout))


class PipelineRunner:
    """What a stack's per-rank runner does with its part, schedule and optimizer.

    A stack builds ``self.part`` (this rank's layers), ``self.schedule`` (an object
    whose ``step(micro_batches, token_count, forward_only)`` runs DualPipeV and returns
    this rank's loss share) and ``self.optimizer``; the step rules are the same for
    every stack, so the harness drives them the same way.
    """

    name = "pipeline"
    parallel: ParallelConfig
    layout: Layout
    eod_id: int | None = None
    """The data's end-of-document token: MTP targets never cross it (`models.network.mtp`)."""
    mtp_coef: float | None = None
    """This step's MTP loss weight (the trainer's ``mtp.loss_coef_steps``); None: the
    model's ``mtp_loss_coef``."""

    def set_mtp_step(self, labels: torch.Tensor) -> None:
        """Tell the schedule what the global batch's MTP loss needs (`models.network.MtpStep`)."""
        self.schedule.mtp = mtp_step(self.part.config, labels, self.eod_id, self.mtp_coef)

    def mtp_values(self) -> torch.Tensor | None:
        """`shared_mtp` of the last step (collectives on every rank); None without MTP."""
        return shared_mtp(self.schedule, self.layout)

    def forward_backward(self, ids: torch.Tensor, labels: torch.Tensor) -> float:
        """Forward and backward of one global batch; gradients reduced, not yet applied."""
        return float(self.forward_backward_on_device(ids, labels))

    def forward_backward_on_device(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """`forward_backward` with the loss left on the device, unread (`shared_loss`): a
        trainer reads it once a step together with the other logged scalars."""
        self.optimizer.zero_grad(set_to_none=True)
        batches = micro_batches_of(ids, labels, self.parallel, self.layout.dp_rank)
        self.set_mtp_step(labels)
        loss = self.schedule.step(batches, token_count(labels))
        reduce_gradients(self.part, self.layout)
        return shared_loss(loss, self.layout)

    @property
    def balance(self) -> StepBalance | None:
        """The last training step's `models.network.StepBalance` (None before the first)."""
        return getattr(self.schedule, "balance", None)

    def step_load(self) -> torch.Tensor:
        """`step_load` of the last training step, reduced once and kept while that step's
        `StepBalance` lives (every rank of the DP group must ask for a step's load, or none:
        it is one all-reduce). Kept beside it, not by it: the next step's start drops both,
        so nothing of a step outlives it into the next one's memory, whoever asked."""
        balance = self.balance
        if balance is None:
            return step_load(self.part, None, self.layout)
        loads = self.__dict__.setdefault("_loads", weakref.WeakKeyDictionary())
        if balance not in loads:
            loads[balance] = step_load(self.part, balance, self.layout)
        return loads[balance]

    def balancing_values(self) -> torch.Tensor:
        """`shared_balancing` of the last training step (collectives on every rank)."""
        return shared_balancing(self.balance, self.layout)

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.update_expert_biases()

    def update_expert_biases(self) -> None:
        """The step's expert-bias move (aux-loss-free balancing), once per optimizer step."""
        balancing = self.part.config.balancing()
        if balancing.expert_bias and self.balance is not None:
            update_expert_biases(self.part, self.step_load(), balancing.bias_rate)

    def train_step(self, ids: torch.Tensor, labels: torch.Tensor) -> float:
        loss = self.forward_backward(ids, labels)
        self.optimizer_step()
        return loss

    @torch.no_grad()
    def evaluate(self, ids: torch.Tensor, labels: torch.Tensor) -> float:
        """Forward-only loss of a global batch: no graphs are built."""
        batches = micro_batches_of(ids, labels, self.parallel, self.layout.dp_rank)
        loss = self.schedule.step(batches, token_count(labels), forward_only=True)
        return share_loss(loss, self.layout)

    @property
    def observer(self):
        """``observer(moment, micro_batch)`` called at every schedule action (memory tracking)."""
        return self.schedule.observer

    @observer.setter
    def observer(self, callback) -> None:
        self.schedule.observer = callback
