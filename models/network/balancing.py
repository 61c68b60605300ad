"""Routing controls: what steers tokens to experts, held to one value at every layout.

A MoE router learns from the language-model loss alone to send most tokens to a few
experts: they improve fastest, so they win more tokens, and the rest starve. Trainers
counter it three ways, and twinpipe implements all three exactly as their sources define
them (`Balancing` names the run's choice):

- **a load-balancing loss**, added to the objective with a coefficient. Three forms:

  - ``pooled``, transformers' ``load_balancing_loss_func`` (Qwen3-MoE, GPT-OSS, Mixtral
    with ``output_router_logits``): over every MoE layer of the model and every token of
    one micro-batch, ``C_e`` the copies routed to expert ``e`` and ``P_e`` the summed
    softmax probabilities, ``R = layers x tokens`` rows; ``aux = E * sum_e (C_e / R)(P_e / R)``.
    A balanced router scores ``k``;
  - ``layer``, DeepSeek-V2's ``seq_aux = false``: per layer, ``alpha * E / (T^2 k) *
    sum_e c_e P_e`` over the micro-batch's ``T`` tokens (a balanced layer scores alpha);
  - ``sequence``, DeepSeek-V2's ``seq_aux = true``: the same per sequence, averaged over
    the micro-batch's sequences;

- **router z-loss** (ST-MoE): ``coef * mean_t logsumexp(logits_t)^2`` per layer;
- **aux-loss-free balancing** (DeepSeek-V3's expert bias): a float32 bias per MoE layer,
  added to the scores only to *choose* experts (never to weight them), moved once per
  optimizer step by ``rate * sign(mean - count)`` from the step's token counts.

**The objective.** A step trains on the mean cross-entropy over the global batch plus
``coef x`` the mean over its micro-batches (M per DP rank, DP ranks) of each micro-batch's
balancing terms: what gradient accumulation over micro-batches and data parallelism does
to transformers' per-forward loss. So one micro-batch's terms enter with weight
``1 / (M x DP)`` (`StepBalance.scale`), the same at every layout.

**Gradients without a second backward.** The terms are functions of router outputs only,
and the local ones (``layer``, ``sequence``, z-loss) are known when the router runs. Each
is attached to the layer's residual by `BalanceGradient`, the identity in forward that
gives the term its gradient (``scale x coef``) in the residual's backward: DeepSeek's
``AddAuxiliaryLoss`` trick, which needs no loss to be summed and back-propagated apart.
The ``pooled`` loss is not local: the gradient of layer ``l``'s probabilities is
``coef x scale x E x C_e / R^2``, and ``C`` sums the choices of *every* layer of the
micro-batch, which under pipeline parallelism live on other ranks. So the counts travel
with the micro-batch (DESIGN.md, "Routing controls are training state"): each stage adds
its layers' ``[C, P]`` to a ``[2, E]`` float32 tensor sent beside the activation, the loss
stage holds the micro-batch's totals, and the totals ride back beside the gradient, so
every router's backward finds ``C`` on the micro-batch's `MicroBatchBalance` before it
runs. The cost is ``8 E`` bytes a forward message and ``4 E`` a backward one, and no
collective, no wait and no host read. A collective instead would have to run at a point
every pipeline rank reaches for that micro-batch: no such point exists in DualPipeV's
interleaved order without stalling it.

**Counts** are float32 in the messages (whole numbers, exact to 2^24 copies per expert and
micro-batch) and int64 in the step's load (`StepBalance.load`), never the activations'
dtype: in bfloat16 an expert's count of 257 is 256 and the bias's sign flips.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

AUX_FORMS = ("none", "pooled", "layer", "sequence")
"""The load-balancing loss forms (see the module docstring)."""


@dataclass(frozen=True, slots=True)
class Balancing:
    """The routing controls a run trains with, resolved from the model's config and the run's
    ``[moe]`` section (`models.network.ModelConfig.balancing`)."""

    aux_form: str = "none"
    """Load-balancing loss: one of `AUX_FORMS`."""
    aux_coef: float = 0.0
    """Its coefficient (transformers' ``router_aux_loss_coef``, DeepSeek's ``aux_loss_alpha``)."""
    z_coef: float = 0.0
    """Router z-loss coefficient (0: off)."""
    expert_bias: bool = False
    """Aux-loss-free balancing: each MoE layer's router chooses on scores plus a bias."""
    bias_rate: float = 1e-3
    """How far one optimizer step moves the bias (``rate`` in ``rate * sign(mean - count)``)."""

    def __post_init__(self) -> None:
        if self.aux_form not in AUX_FORMS:
            raise ValueError(
                f"moe.aux_loss={self.aux_form!r} is invalid: expected one of {AUX_FORMS}"
            )
        for name in ("aux_coef", "z_coef", "bias_rate"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value < 0 or value != value:
                raise ValueError(f"moe.{name}={value!r} is invalid: expected a float >= 0")

    @property
    def aux(self) -> bool:
        """A load-balancing loss is on (a form and a positive coefficient)."""
        return self.aux_form != "none" and self.aux_coef > 0

    @property
    def pooled(self) -> bool:
        """The pooled loss is on: its counts travel with the micro-batch."""
        return self.aux and self.aux_form == "pooled"

    @property
    def records(self) -> bool:
        """Routers must hand their outputs to a `MicroBatchBalance` (a loss term is on)."""
        return self.aux or self.z_coef > 0

    @property
    def active(self) -> bool:
        return self.records or self.expert_bias


NONE = Balancing()


class RouterRecord:
    """One router call's outputs, as a balancing term needs them.

    ``logits [T, E]`` (z-loss), ``probs [T, E]`` float32 softmax over all experts (the
    losses' ``P``; differentiable), ``experts [T, k]`` the experts used (chosen with the
    bias, or replayed), ``counts [E]`` int64 copies routed to each, ``batch [B, S]``."""

    __slots__ = ("layer", "logits", "probs", "experts", "counts", "batch")

    def __init__(self, layer, logits, probs, experts, counts, batch) -> None:
        self.layer, self.logits, self.probs = layer, logits, probs
        self.experts, self.counts, self.batch = experts, counts, batch


# ----------------------------------------------------------------------- terms
def layer_aux(record: RouterRecord, alpha: float) -> torch.Tensor:
    """DeepSeek-V2's ``seq_aux = false`` loss of one layer (differentiable in ``probs``)."""
    tokens, experts = record.probs.shape
    k = record.experts.shape[-1]
    share = record.counts.float() * (experts / (tokens * k))  # fi: 1 when balanced
    return alpha * (record.probs.mean(dim=0) * share).sum()


def sequence_aux(record: RouterRecord, alpha: float) -> torch.Tensor:
    """DeepSeek-V2's ``seq_aux = true`` loss of one layer: per sequence ``b``,
    ``sum_e ce[b, e] * mean_s p[b, s, e]`` with ``ce`` the sequence's copies per expert over
    ``S k / E``; the mean over sequences, times ``alpha``."""
    batch, seq = record.batch
    experts = record.probs.shape[-1]
    k = record.experts.shape[-1]
    per_sequence = record.experts.view(batch, seq * k)
    ce = torch.zeros(batch, experts, dtype=torch.float32, device=per_sequence.device)
    ce.scatter_add_(1, per_sequence, torch.ones_like(per_sequence, dtype=torch.float32))
    ce = ce * (experts / (seq * k))
    mean_probs = record.probs.view(batch, seq, experts).mean(dim=1)
    return alpha * (ce * mean_probs).sum(dim=1).mean()


def z_loss(record: RouterRecord, coef: float) -> torch.Tensor:
    """ST-MoE's router z-loss of one layer: ``coef * mean_t logsumexp(logits_t)^2``."""
    return coef * torch.logsumexp(record.logits.float(), dim=-1).square().mean()


def pooled_aux(counts: torch.Tensor, prob_sums: torch.Tensor, rows: int) -> torch.Tensor:
    """transformers' pooled loss from a micro-batch's totals: ``E sum_e (C_e/R)(P_e/R)``."""
    experts = counts.shape[-1]
    return experts * ((counts / rows) * (prob_sums / rows)).sum()


def pooled_gradient(counts: torch.Tensor, rows: int, weight: float) -> torch.Tensor:
    """The gradient of ``weight x pooled_aux`` with respect to any layer's ``P`` (float32)."""
    experts = counts.shape[-1]
    return counts.float() * (weight * experts / (rows * rows))


def expert_bias_update(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's aux-loss-free step, in place: ``bias += rate * sign(mean - count)``:
    an expert below the mean load gains bias, one above loses it. ``counts`` are the
    step's copies per expert summed over every replica of the layer (int64 or float32)."""
    load = counts.to(torch.float64)
    bias.add_(torch.sign(load.mean() - load).to(bias.dtype), alpha=rate)


# ------------------------------------------------------------ gradient carrier
class BalanceGradient(torch.autograd.Function):
    """Identity on ``carrier`` (a tensor whose gradient always flows: the layer's residual);
    in its backward, ``term`` receives ``gradient()``, computed then (DeepSeek's
    ``AddAuxiliaryLoss``, with the gradient bound late so the pooled counts can arrive)."""

    @staticmethod
    def forward(ctx, carrier, term, gradient: Callable[[], torch.Tensor]):
        ctx.gradient = gradient
        return carrier.view_as(carrier)

    @staticmethod
    def backward(ctx, grad):
        return grad, ctx.gradient(), None


# ---------------------------------------------------------------- step objects
class StepBalance:
    """One rank's balancing state for one training step: the load its routers saw (for the
    bias and the metrics), and its share of the step's balancing losses (for the report).

    Made by the stack's schedule at the start of a training step and handed, one
    `MicroBatchBalance` per micro-batch and chunk, to the layers it runs; a forward-only
    pass gets none, so it changes nothing."""

    def __init__(
        self,
        balancing: Balancing,
        moe_layers: int,
        num_experts: int,
        units: int,
        device: torch.device,
    ) -> None:
        self.balancing = balancing
        self.moe_layers = moe_layers
        """MoE layers in the whole model (the pooled loss's rows are this x tokens)."""
        self.num_experts = num_experts
        self.scale = 1.0 / units
        """The weight of one micro-batch's terms: 1 / (M x DP)."""
        self.device = device
        self.load: dict[int, torch.Tensor] = {}
        """Copies routed to each expert this step, per local MoE layer, int64 ``[E]``."""
        zero = torch.zeros((), dtype=torch.float32, device=device)
        self.aux = zero.clone()
        """This rank's share of the step's load-balancing loss (its weight included)."""
        self.z = zero.clone()
        """This rank's share of the step's z-loss."""

    def micro_batch(self, stats: torch.Tensor | None = None) -> MicroBatchBalance:
        """The balance of a micro-batch's forward through one chunk; ``stats``: the pooled
        ``[2, E]`` sums of the stages before (None: the micro-batch starts here)."""
        if stats is None and self.balancing.pooled:
            stats = torch.zeros(2, self.num_experts, dtype=torch.float32, device=self.device)
        return MicroBatchBalance(self, stats)


class MicroBatchBalance:
    """One micro-batch on one chunk of one rank: what its routers record, what their terms
    need in backward. The pooled totals arrive through `receive_totals` (or `close`)."""

    def __init__(self, step: StepBalance, stats: torch.Tensor | None) -> None:
        self.step = step
        self.stats = stats
        """Pooled form: ``[2, E]`` float32: counts and probability sums so far."""
        self.totals: torch.Tensor | None = None
        """Pooled form: the micro-batch's ``[E]`` counts over every layer (set before its
        backward: by the loss stage, or beside the incoming gradient)."""
        self.rows = 0
        """Pooled form: layers x tokens of the whole micro-batch."""

    def record(self, carrier: torch.Tensor, record: RouterRecord) -> torch.Tensor:
        """Count the layer's load and attach its terms' gradients to ``carrier``."""
        step, balancing = self.step, self.step.balancing
        counts = record.counts.detach()
        load = step.load.get(record.layer)
        step.load[record.layer] = counts.clone() if load is None else load + counts
        terms = []
        if balancing.aux and balancing.aux_form in ("layer", "sequence"):
            form = layer_aux if balancing.aux_form == "layer" else sequence_aux
            terms.append(form(record, balancing.aux_coef))
            step.aux = step.aux + terms[-1].detach() * step.scale
        if balancing.z_coef > 0:
            terms.append(z_loss(record, balancing.z_coef))
            step.z = step.z + terms[-1].detach() * step.scale
        if terms:
            total = terms[0] if len(terms) == 1 else sum(terms)
            carrier = BalanceGradient.apply(carrier, total, self._local_gradient(total))
        if balancing.pooled:
            prob_sums = record.probs.sum(dim=0)
            self.rows = step.moe_layers * record.probs.shape[0]
            self.stats = self.stats + torch.stack([counts.float(), prob_sums.detach()])
            carrier = BalanceGradient.apply(carrier, prob_sums, self._pooled_gradient)
        return carrier

    def _local_gradient(self, term: torch.Tensor) -> Callable[[], torch.Tensor]:
        weight = self.step.scale

        def gradient() -> torch.Tensor:
            return torch.full_like(term, weight)

        return gradient

    def _pooled_gradient(self) -> torch.Tensor:
        if self.totals is None:
            raise RuntimeError(
                "pooled load-balancing loss: a router's backward ran before the micro-batch's "
                "totals arrived (the schedule must pass them beside the gradient)"
            )
        weight = self.step.scale * self.step.balancing.aux_coef
        return pooled_gradient(self.totals, self.rows, weight)

    def close(self, tokens: int) -> torch.Tensor | None:
        """At the loss stage: the micro-batch's totals are this chunk's stats. Adds the pooled
        loss to the step's share and returns the ``[E]`` totals to send back (None: the
        pooled form is off)."""
        step = self.step
        if not step.balancing.pooled or step.moe_layers == 0:
            return None
        self.rows = step.moe_layers * tokens
        value = pooled_aux(self.stats[0], self.stats[1], self.rows)
        step.aux = step.aux + value * (step.balancing.aux_coef * step.scale)
        self.totals = self.stats[0].clone()
        return self.totals

    def receive_totals(self, totals: torch.Tensor) -> None:
        """Before this chunk's backward: the micro-batch's totals, from downstream."""
        self.totals = totals


__all__ = [
    "AUX_FORMS",
    "NONE",
    "Balancing",
    "BalanceGradient",
    "MicroBatchBalance",
    "RouterRecord",
    "StepBalance",
    "expert_bias_update",
    "layer_aux",
    "pooled_aux",
    "pooled_gradient",
    "sequence_aux",
    "z_loss",
]
