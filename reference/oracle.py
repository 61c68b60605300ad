"""The oracle: the whole model on one process, the whole global batch at once, AdamW.

The routing controls are written here from their sources' own code, plainly, so that the
pipelines' way of computing them (terms attached to the residual, pooled counts carried
beside the activations, `models.network.balancing`) is held against something that shares
none of it: every router's probabilities and choices of the whole batch are kept, each
micro-batch's loss is computed from them as transformers' ``load_balancing_loss_func`` and
DeepSeek-V2's ``MoEGate`` compute it, and autograd does the rest.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.network import IGNORE_INDEX, ModelConfig, RouterRecord, WeightSource, build_part
from models.runtime import OptimizerConfig, moe_routers
from reference.ops import ReferenceOps


class _Recorder:
    """Keeps every router call's record of one forward (what `MicroBatchBalance` receives in
    the pipelines); attaches nothing."""

    def __init__(self, config: ModelConfig) -> None:
        self.step = self  # the routers ask ``balance.step.balancing``
        self.balancing = config.balancing()
        self.records: list[RouterRecord] = []

    def record(self, carrier: torch.Tensor, record: RouterRecord) -> torch.Tensor:
        self.records.append(record)
        return carrier


def _pooled(records: list[RouterRecord], experts: int, k: int) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` over one micro-batch's router calls."""
    probs = torch.cat([r.probs for r in records])  # [layers x tokens, E]
    chosen = torch.cat([r.experts for r in records])
    tokens_per_expert = F.one_hot(chosen, experts).float().sum(dim=(0, 1)) / probs.shape[0]
    router_prob_per_expert = probs.mean(dim=0)
    return experts * torch.sum(tokens_per_expert * router_prob_per_expert)


def _deepseek(record: RouterRecord, alpha: float, seq_aux: bool, experts: int) -> torch.Tensor:
    """DeepSeek-V2's ``MoEGate`` auxiliary loss of one layer over one micro-batch."""
    batch, seq = record.batch
    topk_idx = record.experts
    k = topk_idx.shape[-1]
    scores = record.probs
    if seq_aux:
        scores_for_seq_aux = scores.view(batch, seq, -1)
        ce = torch.zeros(batch, experts, device=scores.device)
        ce.scatter_add_(
            1, topk_idx.view(batch, -1), torch.ones(batch, seq * k, device=scores.device)
        ).div_(seq * k / experts)
        return (ce * scores_for_seq_aux.mean(dim=1)).sum(dim=1).mean() * alpha
    mask_ce = F.one_hot(topk_idx.view(-1), num_classes=experts)
    ce = mask_ce.float().mean(0)
    return (scores.mean(0) * ce * experts).sum() * alpha


def _unit(record: RouterRecord, first: int, count: int) -> RouterRecord:
    """``record`` restricted to sequences ``[first, first + count)``."""
    seq = record.batch[1]
    rows = slice(first * seq, (first + count) * seq)
    return RouterRecord(
        record.layer,
        None if record.logits is None else record.logits[rows],
        None if record.probs is None else record.probs[rows],
        record.experts[rows],
        None,
        (count, seq),
    )


class Oracle:
    """Single-process training step that every pipeline is held against."""

    name = "oracle"

    def __init__(
        self,
        model: ModelConfig,
        source: WeightSource,
        optimizer: OptimizerConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        micro_batch_size: int | None = None,
    ) -> None:
        """``micro_batch_size``: sequences per micro-batch of the layout it stands for (the
        balancing losses are per micro-batch; None: the whole batch is one)."""
        self.model = build_part(model, source, ops=ReferenceOps(), dtype=dtype, device=device)
        self.part = self.model
        self.config = model
        self.micro_batch_size = micro_batch_size
        self.optimizer = optimizer.build(self.model.parameters())
        self.values = torch.zeros(2)
        """The last step's load-balancing loss and z-loss."""
        self.load: torch.Tensor | None = None
        """The last step's copies per expert of every MoE layer, ``[layers, E]``."""
        self.eod_id: int | None = None
        """The data's end-of-document token (MTP targets never cross it)."""
        self.mtp_coef: float | None = None
        """This step's MTP loss weight; None: the model's ``mtp_loss_coef``."""
        self.mtp: torch.Tensor | None = None
        """The last step's MTP figures, ``[2, D]``: each depth's loss and top-1 accuracy."""

    def forward_backward(self, ids: torch.Tensor, labels: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        recorder = _Recorder(self.config)
        hidden = self.model.embed(ids)
        for layer in self.model.decoder_layers:
            hidden = layer(hidden, self.model.ops, recorder)
        count = (labels != IGNORE_INDEX).sum().clamp(min=1)
        loss = self.model.loss_sum(hidden, labels) / count
        mtp = self._mtp(hidden, ids, labels, recorder)
        aux, z = self._balancing(recorder.records, ids.shape[0])
        (loss + mtp + aux + z).backward()
        self.values = torch.stack([aux.detach(), z.detach()]).float()
        self.load = self._load(recorder.records)
        for param in self.model.parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        return float(loss.detach())

    def _mtp(self, hidden, ids, labels, recorder) -> torch.Tensor:
        """DeepSeek-V3's MTP objective ``(lambda / D) sum_k L_k``, from its report's
        equations position by position (`models.network.mtp` says which conventions)."""
        model, depths = self.model, self.config.num_mtp_layers
        if not depths:
            return torch.zeros((), device=hidden.device)
        lam = self.config.mtp_loss_coef if self.mtp_coef is None else self.mtp_coef
        batch, seq = ids.shape
        h = model.model.norm(hidden)  # h^0: the main model's final state, after its norm
        objective, figures = 0.0, []
        for k, layer in enumerate(model.mtp_layers, start=1):
            # Emb(t_{i+k}) at position i; no token past the end (0 there: never labelled).
            ahead = [[int(ids[b, i + k]) if i + k < seq else 0 for i in range(seq)]
                     for b in range(batch)]  # fmt: skip
            emb = model.embed(torch.tensor(ahead, device=ids.device))
            h_in = layer.eh_proj(torch.cat([layer.enorm(emb), layer.hnorm(h)], dim=-1))
            h = layer.shared_head.norm(layer(h_in, model.ops, recorder))
            logits = model.lm_head(h).reshape(batch * seq, -1)
            # Target t_{i+k+1} = labels[i+k], kept when t_{i+1}..t_{i+k} are labelled tokens
            # of one document.
            target = []
            for b in range(batch):
                for i in range(seq):
                    between = [int(labels[b, i + j]) for j in range(k) if i + j < seq]
                    kept = i + k < seq and all(
                        t != IGNORE_INDEX and t != self.eod_id for t in between
                    )
                    target.append(int(labels[b, i + k]) if kept else IGNORE_INDEX)
            target = torch.tensor(target, device=ids.device)
            valid = target != IGNORE_INDEX
            count = valid.sum().clamp(min=1)
            # In float32, as the main loss (`reference.ops.ReferenceOps.cross_entropy`).
            ce = F.cross_entropy(logits.float(), target, ignore_index=IGNORE_INDEX,
                                 reduction="sum") / count  # fmt: skip
            objective = objective + lam / depths * ce
            accuracy = ((logits.argmax(-1) == target) & valid).sum() / count
            figures.append(torch.stack([ce.detach().float(), accuracy.float()]))
        self.mtp = torch.stack(figures, dim=1)
        return objective

    def mtp_values(self) -> torch.Tensor | None:
        return self.mtp

    def _balancing(self, records: list[RouterRecord], batch: int) -> tuple[torch.Tensor, ...]:
        """The mean over micro-batches of each one's load-balancing loss and z-loss."""
        config, balancing = self.config, self.config.balancing()
        zero = torch.zeros((), device=self.model.lm_head.weight.device)
        aux, z = zero, zero
        size = self.micro_batch_size or batch
        units = [_unit_records(records, first, size) for first in range(0, batch, size)]
        for unit in units:
            if balancing.aux and balancing.aux_form == "pooled":
                k = config.num_experts_per_tok
                aux = aux + balancing.aux_coef * _pooled(unit, config.num_experts, k)
            elif balancing.aux:
                sequence = balancing.aux_form == "sequence"
                for record in unit:
                    term = _deepseek(record, balancing.aux_coef, sequence, config.num_experts)
                    aux = aux + term
            if balancing.z_coef > 0:
                for record in unit:
                    lse = torch.logsumexp(record.logits.float(), dim=-1)
                    z = z + balancing.z_coef * (lse**2).mean()
        return aux / len(units), z / len(units)

    def _load(self, records: list[RouterRecord]) -> torch.Tensor:
        experts = self.config.num_experts
        rows = [
            F.one_hot(r.experts.reshape(-1), experts).sum(dim=0)
            for r in sorted(records, key=lambda r: r.layer)
        ]
        return torch.stack(rows) if rows else torch.zeros(0, experts, dtype=torch.long)

    def optimizer_step(self) -> None:
        self.optimizer.step()
        balancing = self.config.balancing()
        if balancing.expert_bias and self.load is not None:
            with torch.no_grad():
                for counts, router in zip(self.load, moe_routers(self.model).values()):
                    mean = counts.double().mean()
                    step = torch.sign(mean - counts.double()).float() * balancing.bias_rate
                    router.e_score_correction_bias += step

    def balancing_values(self) -> torch.Tensor:
        return self.values

    def step_load(self) -> torch.Tensor | None:
        return self.load

    def train_step(self, ids: torch.Tensor, labels: torch.Tensor) -> float:
        loss = self.forward_backward(ids, labels)
        self.optimizer_step()
        return loss

    @torch.no_grad()
    def evaluate(self, ids: torch.Tensor, labels: torch.Tensor) -> float:
        return float(self.model.loss(ids, labels))


def _unit_records(records: list[RouterRecord], first: int, count: int) -> list[RouterRecord]:
    return [_unit(r, first, count) for r in records]
