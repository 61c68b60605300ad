"""The routers of the four families: which experts each token takes, and with what weight.

Parameter and buffer names are those of Hugging Face transformers 5's modules (``gate.weight``,
``gate.e_score_correction_bias``; GPT-OSS ``router.weight`` and ``router.bias``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from models.network.config import ModelConfig


def _at(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values[t, index[t, j]]``: by indexing, which saves the indices for backward (the
    ``[T, k]`` index and a ``[T, 1]`` row index), not ``values`` as ``gather`` would."""
    rows = torch.arange(values.shape[0], device=values.device).unsqueeze(1)
    return values[rows, index]


def max_group_scores(ranked: torch.Tensor, n_group: int) -> torch.Tensor:
    """DeepSeek-V2: each of the ``n_group`` groups of ``ranked [T, E]`` scored by its best."""
    return ranked.view(ranked.shape[0], n_group, -1).max(dim=-1).values


def top2_group_scores(ranked: torch.Tensor, n_group: int) -> torch.Tensor:
    """DeepSeek-V3 (``noaux_tc``): each group scored by the sum of its two best."""
    return ranked.view(ranked.shape[0], n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)


def keep_groups(
    ranked: torch.Tensor, groups: torch.Tensor, topk_group: int, fill: float
) -> torch.Tensor:
    """``ranked [T, E]`` with every expert outside the ``topk_group`` best of ``groups
    [T, G]`` set to ``fill``: transformers' group mask, op for op."""
    chosen = torch.topk(groups, topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(groups).scatter_(1, chosen, 1)
    keep = group_mask.unsqueeze(-1).expand(-1, -1, ranked.shape[1] // groups.shape[1])
    return ranked.masked_fill(~keep.reshape(ranked.shape).bool(), fill)


class Routing(NamedTuple):
    """What a router call gives: ``weights [T, k]`` and ``experts [T, k]`` for the dispatch;
    for the balancing terms (`models.network.balancing`), when asked, ``logits [T, E]`` and
    ``probs [T, E]``, the float32 distribution over all experts the losses use: the softmax,
    or DeepSeek-V3's sigmoid scores divided by their sum (its paper's balance loss); None
    otherwise."""

    weights: torch.Tensor
    experts: torch.Tensor
    logits: torch.Tensor | None = None
    probs: torch.Tensor | None = None


class Router(nn.Module):
    """Top-k routing of each family. Returns a `Routing`: ``weights [T, k]``, ``experts [T, k]``.

    DeepSeek-V2: float32 softmax over all experts, greedy or group-limited top-k,
    times ``routed_scaling_factor``. DeepSeek-V3: float32 sigmoid scores; the experts
    chosen on scores + ``e_score_correction_bias`` within the ``topk_group`` groups whose two
    best biased scores sum highest; weights the unbiased scores at the chosen experts,
    divided by their sum (+1e-20) with ``norm_topk_prob``, times ``routed_scaling_factor``.
    Qwen3-MoE: logits in the model dtype, float32 softmax, top-k, optional renormalisation.
    GPT-OSS: linear with bias, top-k on raw logits, softmax over the k. A routing tape
    (`models.network.routing`) can record the choices or replay another stack's.

    With ``expert_bias`` (aux-loss-free balancing), ``e_score_correction_bias`` (a float32
    buffer, training state: checkpointed, never a parameter) is added to what the top-k
    ranks -- the scores, or GPT-OSS's logits -- and to nothing else: the weights stay the
    unbiased scores at the chosen experts.
    """

    FLOAT32_BUFFERS = ("e_score_correction_bias",)
    """Buffers that stay float32 whatever the model's dtype (`models.network.build_part`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.family = c.model_type
        self.top_k, self.num_experts = c.num_experts_per_tok, c.num_experts
        self.weight = nn.Parameter(torch.empty(c.num_experts, c.hidden_size))
        if self.family == "gpt_oss":
            self.bias = nn.Parameter(torch.zeros(c.num_experts))
        if c.expert_bias:
            bias = torch.zeros(c.num_experts, dtype=torch.float32)
            self.register_buffer("e_score_correction_bias", bias)
        else:
            self.e_score_correction_bias = None
        self.topk_method, self.n_group, self.topk_group = c.topk_method, c.n_group, c.topk_group
        self.group_score = top2_group_scores if self.family == "deepseek_v3" else max_group_scores
        """How group-limited routing scores a group (a seam: `harness.compare.planted`)."""
        self.scale = c.routed_scaling_factor
        self.norm_topk_prob = c.norm_topk_prob
        self.tape = None
        """A `models.network.RoutingTape` recording or replaying the choices (harness, tests)."""
        self.tape_key = ""

    def _choice(self, values: torch.Tensor) -> torch.Tensor:
        """What the top-k ranks: ``values`` (detached), plus the expert bias when there is one."""
        ranked = values.detach()
        if self.e_score_correction_bias is not None:
            ranked = ranked.float() + self.e_score_correction_bias
        return ranked

    def forward(self, x: torch.Tensor, record: bool = False) -> Routing:
        """The call's `Routing`; ``record``: also the logits and all-expert probabilities.
        (Called through the module, so that hooks -- FSDP2's gathers, the harness's routing
        counts -- see every call.)"""
        biased = self.e_score_correction_bias is not None
        if self.family == "gpt_oss":
            logits = F.linear(x, self.weight, self.bias)
            ranked = self._choice(logits)
            own = torch.topk(ranked, self.top_k, dim=-1)[1]
            index = self._routed(own, logits, x, ranked if biased else None)
            top_values = _at(logits, index)
            weights = F.softmax(top_values, dim=-1, dtype=top_values.dtype)
            probs = logits.softmax(dim=-1, dtype=torch.float32) if record else None
            return Routing(weights, index, logits if record else None, probs)
        if self.family == "qwen3_moe":  # HF: logits in the model's dtype, softmax in float32
            logits = F.linear(x, self.weight)
        else:  # DeepSeek upcasts input and weight
            logits = F.linear(x.float(), self.weight.float())
        if self.family == "deepseek_v3":
            return self._route_v3(logits, x, record)
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        keep = (logits, scores) if record else (None, None)
        if self.family == "qwen3_moe":
            ranked = self._choice(scores)
            own = torch.topk(ranked, self.top_k, dim=-1)[1]
            index = self._routed(own, scores, x, ranked if biased else None)
            weights = _at(scores, index)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return Routing(weights.to(x.dtype), index, *keep)
        ranked, masked = self._choice(scores), None  # selection only: nothing of it is saved
        if biased:
            masked = ranked
        groups = None
        if self.topk_method == "group_limited_greedy":
            groups = self.group_score(ranked, self.n_group)
            # HF masks the dropped groups with 0 (softmax scores are positive); biased
            # scores can be negative, so they are masked with -inf (as DeepSeek-V3 does).
            fill = float("-inf") if biased else 0.0
            ranked = masked = keep_groups(ranked, groups, self.topk_group, fill)
        own = torch.topk(ranked, self.top_k, dim=-1, sorted=False)[1]
        index = self._routed(own, scores, x, masked, groups if biased else None)
        return Routing(_at(scores, index) * self.scale, index, *keep)

    def _route_v3(self, logits: torch.Tensor, x: torch.Tensor, record: bool) -> Routing:
        """DeepSeek-V3's ``noaux_tc`` routing, as transformers' ``DeepseekV3TopkRouter``."""
        scores = logits.sigmoid()
        ranked = self._choice(scores)  # selection only: nothing of it is saved
        groups = self.group_score(ranked, self.n_group)
        masked = keep_groups(ranked, groups, self.topk_group, float("-inf"))
        own = torch.topk(masked, self.top_k, dim=-1, sorted=False)[1]
        index = self._routed(own, scores, x, masked, groups)
        weights = _at(scores, index)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        probs = scores / scores.sum(dim=-1, keepdim=True) if record else None
        return Routing(weights * self.scale, index, logits if record else None, probs)

    def _routed(
        self, own: torch.Tensor, scores: torch.Tensor, x: torch.Tensor, ranked=None, groups=None
    ) -> torch.Tensor:
        """The expert indices used: this router's own top-k, unless a tape replays others.

        The weights are always this router's scores gathered at the indices used, so the
        gradient path is the same whether the indices are its own or replayed. ``ranked``:
        what the top-k ranked, when not ``scores`` (the biased scores, dropped groups at
        -inf); ``groups``: the group scores that chose the groups kept.
        """
        if self.tape is None:
            return own
        if self.family == "gpt_oss":  # the tape compares probabilities over all experts
            scores = scores.detach().float().softmax(dim=-1)
        return self.tape.route(self.tape_key, scores, own, x.dtype, ranked, groups)
