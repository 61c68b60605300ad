"""DeepSeek-V3's multi-token prediction (MTP, its report's section 2.2), for any depth D.

Depth ``k = 1..D`` is one more decoder layer (``model.layers.{num_hidden_layers + k - 1}``
in the published checkpoint) that predicts the token ``k + 1`` ahead of each position:

    h'_i = eh_proj(cat(enorm(Emb(t_{i+k})), hnorm(h_i^{k-1})))
    h_i^k = shared_head.norm(DecoderLayer(h')_i)          logits_i^k = Head(h_i^k)

- **The order of the concatenation** is the embedding first, as the published weights,
  vLLM's ``deepseek_mtp.py``, SGLang and Megatron-Core's ``multi_token_prediction.py``
  have it (the report's equation writes the reverse).
- **The final norm**: ``h^0`` is the main model's final hidden state *after* its final
  norm (``model.norm``), what its own head reads: vLLM feeds the drafter the target model's
  normed output, and Megatron-Core the decoder's output after its final layernorm. Depth
  ``k > 1`` takes depth ``k - 1``'s state after its ``shared_head.norm`` (Megatron-Core's
  chaining), so every depth receives the normed state its head reads.
- **The layer** is a full decoder layer of the model's kind (MLA and a MoE MLP with the
  model's router for DeepSeek); its router is balanced like every MoE layer's (it counts
  in the pooled loss, its bias moves, its load is in the statistics).
- ``Emb`` and ``Head`` are the main model's own embedding and output layer, shared: the
  module holds none of its own. (The published files hold copies, ``embed_tokens`` and
  ``shared_head.head``, read once and checked equal: `models.hf`.)

**Targets** (`mtp_labels`): depth ``k`` at position ``i`` predicts ``t_{i+k+1}``, which
is ``labels[i + k]`` (``labels[i] = t_{i+1}``). A target is kept only when every token
between is a labelled token of the same document: positions past the sequence's end are
ignored (never wrapped around), and so is any whose ``t_{i+1} .. t_{i+k}`` holds a
``-100`` or the end-of-document token of packed data (``eod_id``: the loader writes one
after each document, `optimized.train.loader`). Inputs past the end (`mtp_input_ids`) are
token 0: causal attention keeps them out of every kept position, and their loss is ignored.

**The loss**: ``L = L_main + (lambda / D) sum_k L_k``, each ``L_k`` the mean cross-entropy
over its kept positions of the global batch (`MtpStep` carries their counts, computed once
from the global labels like the main loss's).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from models.network.config import ModelConfig
from models.network.decoder import SINGLE, DecoderLayer, ExpertParallel
from models.network.layers import RMSNorm

IGNORE_INDEX = -100


class SharedHead(nn.Module):
    """``shared_head``: the norm before the shared output layer (the published files also
    hold ``shared_head.head``, a copy of the output layer, which the module shares)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.model_type == "gpt_oss")


class MTPLayer(DecoderLayer):
    """Depth ``depth`` of the MTP module: a decoder layer of the model's kind with the
    projection of its two inputs in front and its head's norm behind."""

    def __init__(self, config: ModelConfig, depth: int, ep: ExpertParallel = SINGLE) -> None:
        super().__init__(config, config.num_hidden_layers + depth - 1, ep)
        self.depth = depth
        gpt_oss = config.model_type == "gpt_oss"
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps, gpt_oss)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps, gpt_oss)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = SharedHead(config)

    def fsdp_modules(self) -> list[nn.Module]:
        """A decoder layer's FSDP2 units (`DecoderLayer.fsdp_modules`) with the input norms
        and the projection in front and the head's norm behind; not the shared embedding
        and output layer (the main model's units)."""
        return [self.enorm, self.hnorm, self.eh_proj, *super().fsdp_modules(),
                self.shared_head.norm]  # fmt: skip

    def project(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """``eh_proj(cat(enorm(embedded), hnorm(hidden)))``: the embedding first."""
        return self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))

    def run(self, hidden, embedded, ops, balance=None) -> torch.Tensor:
        """The depth's normed output from the previous depth's normed state and the
        embeddings of the tokens ``depth`` ahead."""
        return self.shared_head.norm(self(self.project(hidden, embedded), ops, balance))


def mtp_input_ids(input_ids: torch.Tensor, depth: int) -> torch.Tensor:
    """``t_{i+depth}`` at each position ``i`` (``[B, S]``); token 0 past the end."""
    out = torch.zeros_like(input_ids)
    if depth < input_ids.shape[1]:
        out[:, : input_ids.shape[1] - depth] = input_ids[:, depth:]
    return out


def mtp_labels(labels: torch.Tensor, depth: int, eod_id: int | None = None) -> torch.Tensor:
    """Depth ``depth``'s target at each position (see the module docstring): ``labels``
    shifted left by ``depth``, ``-100`` past the end and wherever ``t_{i+1} .. t_{i+depth}``
    holds an ignored label or ``eod_id``."""
    seq = labels.shape[1]
    out = torch.full_like(labels, IGNORE_INDEX)
    if depth >= seq:
        return out
    kept = seq - depth
    target = labels[:, depth:].clone()
    for j in range(depth):
        between = labels[:, j : j + kept]
        broken = between == IGNORE_INDEX
        if eod_id is not None:
            broken |= between == eod_id
        target.masked_fill_(broken, IGNORE_INDEX)
    out[:, :kept] = target
    return out


class MtpStep(NamedTuple):
    """What a step's MTP loss needs beyond its micro-batches (`mtp_step`)."""

    counts: torch.Tensor
    """``[D]`` long: kept positions of each depth in the whole global batch (at least 1),
    the denominators of the ``L_k`` (on the labels' device, never read on the host)."""
    coef: float
    """lambda: this step's weight of the MTP losses."""
    eod_id: int | None
    """The end-of-document token of packed data (None: no packing)."""

    @property
    def depths(self) -> int:
        return int(self.counts.shape[0])

    def weight(self, depth: int) -> torch.Tensor:
        """``lambda / D / count_k``: the weight of depth ``depth``'s summed cross-entropy."""
        return (self.coef / self.depths) / self.counts[depth - 1]


def mtp_step(
    config: ModelConfig,
    labels: torch.Tensor,
    eod_id: int | None = None,
    coef: float | None = None,
) -> MtpStep | None:
    """The `MtpStep` of a global batch's ``labels`` (None when ``config`` has no MTP);
    ``coef`` None: the config's ``mtp_loss_coef``."""
    depths = config.num_mtp_layers
    if not depths:
        return None
    counts = torch.stack(
        [(mtp_labels(labels, k, eod_id) != IGNORE_INDEX).sum() for k in range(1, depths + 1)]
    )
    coef = config.mtp_loss_coef if coef is None else coef
    return MtpStep(counts.clamp(min=1), float(coef), eod_id)


class MtpOut(NamedTuple):
    """One micro-batch's MTP at the loss stage."""

    objective: torch.Tensor
    """``(lambda / D) sum_k`` of this micro-batch's share of ``L_k``: what its backward adds."""
    losses: torch.Tensor
    """``[D]`` float32: this micro-batch's share of each ``L_k`` (detached)."""
    correct: torch.Tensor
    """``[D]`` long: kept positions whose top-1 prediction is the target (detached)."""


def mtp_loss(part, normed: torch.Tensor, input_ids, labels, step: MtpStep, balance) -> MtpOut:
    """The reference computation of a micro-batch's MTP from the main model's normed final
    hidden state, on ``part`` (a `models.network.CausalLM` holding the embedding, the head
    and the MTP layers), with plain logits and ``part.ops.cross_entropy``."""
    ops = part.ops
    hidden, objective = normed, normed.new_zeros((), dtype=torch.float32)
    losses, correct = [], []
    for layer in part.mtp_layers:
        k = layer.depth
        hidden = layer.run(hidden, part.embed(mtp_input_ids(input_ids, k)), ops, balance)
        logits = part.lm_head(hidden)
        target = mtp_labels(labels, k, step.eod_id)
        correct.append(top1_correct(logits.detach(), target))
        summed = ops.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
            ignore_index=IGNORE_INDEX, reduction="sum",
        )  # fmt: skip
        objective = objective + summed * step.weight(k)
        losses.append(summed.detach().float() / step.counts[k - 1])
    return MtpOut(objective, torch.stack(losses), torch.stack(correct))


TOP1_LOGITS = 1 << 24
"""Logits per block of a top-1 figure made from the hidden state (the production stack's,
`optimized.pipeline.mtp_stage.top1_correct`, which its fused loss leaves no logits for):
`top1_rows` tokens at a time, so at most about 16 M logits exist at once (32 MiB in
16-bit), under the fused loss's own vocabulary chunk at DeepSeek-V3's shape (4,096 tokens x
7,168 columns): whole ``[tokens, vocab]`` blocks were 1.06 GB there. The estimator counts
the same block (`optimized.estimator.mtp_memory`)."""


def top1_rows(vocab: int) -> int:
    """Tokens per block of the top-1 logits over a ``vocab``-wide output layer."""
    return max(1, TOP1_LOGITS // vocab)


def top1_correct(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Kept positions whose most likely token is the target (a proxy for speculative
    decoding's acceptance, as Megatron-Core logs it)."""
    return ((logits.argmax(dim=-1) == target) & (target != IGNORE_INDEX)).sum()


__all__ = [
    "IGNORE_INDEX",
    "MTPLayer",
    "MtpOut",
    "MtpStep",
    "SharedHead",
    "mtp_input_ids",
    "mtp_labels",
    "mtp_loss",
    "mtp_step",
    "top1_correct",
    "top1_rows",
]
