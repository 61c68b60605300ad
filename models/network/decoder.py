"""A MoE decoder layer as the five stages that DualPipeV overlaps.

| stage | work | comm? |
|---|---|---|
| 1 attention | norm, attention, norm, shared experts, router, dispatch layout | no |
| 2 dispatch | all-to-all of routed tokens to expert ranks | yes |
| 3 experts | gather into expert order, grouped expert MLP, scatter back | no |
| 4 combine | all-to-all of expert outputs back | yes |
| 5 aggregate | weight by router scores, sum, residual | no |

Each stage takes the previous stage's record and returns its own. The tensors
in a record are what the next stage reads; a scheduler may detach them into
leaves so that each stage's backward runs on its own (the optimized DualPipeV
does; `DecoderLayer.forward` just chains the stages). A dense layer is the
degenerate case: stage 1 does the whole layer and stages 2-5 pass it through,
so no caller needs a second code path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from models.network.balancing import MicroBatchBalance, RouterRecord
from models.network.config import ModelConfig
from models.network.host_copy import HostCopy
from models.network.layers import DenseMLP, Experts, RMSNorm, build_attention
from models.network.router import Router


class RoutePlan(NamedTuple):
    """Non-differentiable bookkeeping of one layer's dispatch (lives from stage 1 to 5)."""

    token_index: torch.Tensor
    """``[N]`` long: source token (row of the flattened batch) of each sorted routed copy."""
    counts: torch.Tensor
    """``[2, EP * E_local]`` long. Row 0: routed copies this rank sends to each global
    expert. Row 1, filled by `MoE.exchange_counts` (EP > 1): rows this rank receives per
    (source rank, local expert), source-major. One tensor, so that both reach the host in
    one copy (`MoE.split_sizes`)."""
    num_tokens: int
    """Tokens in the micro-batch (rows of the flattened batch)."""
    hidden_shape: torch.Size
    """Shape of the layer's input hidden states, ``[B, S, H]``."""


class SplitSizes(NamedTuple):
    """A MoE layer's dispatch sizes on the host: what the all-to-alls and the grouped expert
    buffer are sized from (`MoE.split_sizes`: one device-to-host copy per layer and
    micro-batch, which the backward reuses)."""

    send: list[int]
    """Rows this rank sends to each EP rank."""
    receive: list[int]
    """Rows this rank receives from each EP rank."""
    expert_rows: list[int]
    """Rows this rank receives for each of its local experts (from all sources)."""


class AttentionOut(NamedTuple):
    """Stage 1: everything up to the router."""

    residual: torch.Tensor
    """``[B, S, H]`` hidden after attention's residual, plus shared experts (or the dense MLP)."""
    sorted_tokens: torch.Tensor
    """``[N, H]`` routed copies of the normed tokens, ordered by global expert id."""
    sorted_weights: torch.Tensor
    """``[N]`` router weights of the sorted copies."""
    plan: RoutePlan | None
    """None for a dense layer."""


class DispatchOut(NamedTuple):
    """Stage 2: the routed tokens on their expert ranks."""

    tokens: torch.Tensor
    """``[R, H]`` tokens received from every EP rank, each source's rows in expert order."""
    recv_counts: torch.Tensor | None
    """``[EP, E_local]`` long: rows received from each source rank for each local expert
    (None for a dense layer)."""
    sizes: SplitSizes | None
    """The same counts on the host, summed as the exchanges need them (None: dense)."""


class ExpertsOut(NamedTuple):
    """Stage 3: expert outputs, rows in the order they were received."""

    tokens: torch.Tensor


class CombineOut(NamedTuple):
    """Stage 4: expert outputs back on the rank of their token, in sorted order."""

    tokens: torch.Tensor


class ExpertParallel(NamedTuple):
    """Where this rank sits in the expert-parallel group."""

    group: dist.ProcessGroup | None
    rank: int
    size: int


SINGLE = ExpertParallel(None, 0, 1)


class DecoderLayer(nn.Module):
    """One decoder layer: attention, then a dense MLP or routed + shared experts."""

    def __init__(self, config: ModelConfig, layer: int, ep: ExpertParallel = SINGLE) -> None:
        super().__init__()
        self.config, self.layer = config, layer
        self.is_moe = config.is_moe_layer(layer)
        self.ep = ep
        self.input_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, config.model_type == "gpt_oss"
        )
        self.self_attn = build_attention(config, layer)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, config.model_type == "gpt_oss"
        )
        if not self.is_moe:
            self.mlp = DenseMLP(config.hidden_size, config.intermediate_size)
        else:
            self.mlp = MoE(config, ep, layer)

    def fsdp_modules(self) -> list[nn.Module]:
        """The layer's modules that FSDP2 shards over the DP group, each its own unit and
        each called through its own ``forward`` by both stacks: the norms, the attention,
        and the dense MLP or the router and the shared experts. Not the routed experts
        (``mlp.experts``: sharded over the expert replicas). The one list of a layer's units
        (`optimized.pipeline.sharding` shards them, `optimized.estimator.communication`
        counts them); it reads modules only, so a meta-device layer serves."""
        modules = [self.input_layernorm, self.self_attn, self.post_attention_layernorm]
        if not self.is_moe:
            return [*modules, self.mlp]
        shared = self.mlp.shared_experts
        return [*modules, self.mlp.router_module, *([shared] if shared is not None else [])]

    # ------------------------------------------------------------------ stages
    def attention(
        self, hidden: torch.Tensor, ops, balance: MicroBatchBalance | None = None
    ) -> AttentionOut:
        """Stage 1: norm, attention, residual, norm, shared experts or dense MLP, router.

        ``balance``: the micro-batch's routing controls in a training forward (the load is
        counted and the balancing terms attached, `models.network.balancing`); None in a
        forward-only pass, which changes nothing."""
        if getattr(ops, "recompute_attention", False) and torch.is_grad_enabled():
            # Selective recomputation (Korthikanti et al.): keep only the block's input and
            # rerun norm, projections and attention in backward.
            attended = checkpoint(self._attention_block, hidden, ops, use_reentrant=False)
        else:
            attended = self._attention_block(hidden, ops)
        h = hidden + attended
        x = self.post_attention_layernorm(h)
        if not self.is_moe:
            empty = x.new_empty((0, x.shape[-1]))
            return AttentionOut(h + self.mlp(x), empty, empty.new_empty(0), None)
        return self.mlp.route(h, x, ops, balance)

    def _attention_block(self, hidden: torch.Tensor, ops) -> torch.Tensor:
        return self.self_attn(self.input_layernorm(hidden), ops)

    def dispatch(self, a: AttentionOut, ops) -> DispatchOut:
        """Stage 2: send each routed copy to the EP rank that holds its expert."""
        if a.plan is None:
            return DispatchOut(a.sorted_tokens, None, None)
        return self.mlp.dispatch(a, ops)

    def experts(self, d: DispatchOut, ops) -> ExpertsOut:
        """Stage 3: group received rows by local expert, run the experts, restore the order."""
        if d.recv_counts is None:
            return ExpertsOut(d.tokens)
        return ExpertsOut(self.mlp.run_experts(d, ops))

    def combine(self, a: AttentionOut, e: ExpertsOut, d: DispatchOut, ops) -> CombineOut:
        """Stage 4: send expert outputs back to the ranks of their tokens."""
        if a.plan is None:
            return CombineOut(e.tokens)
        return CombineOut(self.mlp.combine(e.tokens, d.sizes, ops))

    def aggregate(self, a: AttentionOut, c: CombineOut, ops) -> torch.Tensor:
        """Stage 5: weight expert outputs by the router, sum per token, add the residual."""
        if a.plan is None:
            return a.residual
        weighted = c.tokens * a.sorted_weights.unsqueeze(-1).to(c.tokens.dtype)
        routed = ops.scatter_add_rows(weighted, a.plan.token_index, a.plan.num_tokens)
        return a.residual + routed.view(a.plan.hidden_shape)

    def forward(
        self, hidden: torch.Tensor, ops, balance: MicroBatchBalance | None = None
    ) -> torch.Tensor:
        a = self.attention(hidden, ops, balance)
        d = self.dispatch(a, ops)
        e = self.experts(d, ops)
        c = self.combine(a, e, d, ops)
        return self.aggregate(a, c, ops)


class MoE(nn.Module):
    """Router, routed experts (this rank's shard) and optional shared experts."""

    def __init__(self, config: ModelConfig, ep: ExpertParallel, layer: int = 0) -> None:
        super().__init__()
        self.layer = layer
        """The decoder layer this MoE belongs to (the load and balancing terms are per layer)."""
        if config.num_experts % ep.size:
            raise ValueError(
                f"expert parallelism {ep.size} must divide num_experts={config.num_experts}"
            )
        self.ep = ep
        self.num_experts = config.num_experts
        self.num_local = config.num_experts // ep.size
        self.family = config.model_type
        router = Router(config)
        if self.family == "gpt_oss":
            self.router = router
        else:
            self.gate = router
        self.experts = Experts(config, ep.rank * self.num_local, self.num_local)
        self.host_counts = HostCopy()
        """Where `split_sizes` reads the counts (a pinned buffer on a GPU, made once)."""
        if config.n_shared_experts:
            self.shared_experts = DenseMLP(
                config.hidden_size, config.moe_intermediate_size * config.n_shared_experts
            )
        else:
            self.shared_experts = None

    @property
    def router_module(self) -> Router:
        return self.router if self.family == "gpt_oss" else self.gate

    def route(
        self, h: torch.Tensor, x: torch.Tensor, ops, balance: MicroBatchBalance | None = None
    ) -> AttentionOut:
        tokens = x.reshape(-1, x.shape[-1])
        records = balance is not None and balance.step.balancing.records
        weights, experts, logits, probs = self.router_module(tokens, record=records)
        flat_experts = experts.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        top_k = experts.shape[1]
        token_index = order // top_k
        # A scatter-add, not `torch.bincount`: on CUDA bincount reads the largest id on the
        # host to size its output. Row 1 is for the receive counts (`exchange_counts`).
        counts = torch.zeros((2, self.num_experts), dtype=torch.long, device=x.device)
        counts[0].index_add_(0, flat_experts, torch.ones_like(flat_experts))
        sorted_tokens = ops.gather_rows(tokens, token_index)
        sorted_weights = weights.reshape(-1)[order]
        residual = h if self.shared_experts is None else h + self.shared_experts(x)
        if balance is not None:
            batch = tuple(x.shape[:2])
            record = RouterRecord(self.layer, logits, probs, experts, counts[0], batch)
            residual = balance.record(residual, record)
        plan = RoutePlan(token_index, counts, tokens.shape[0], x.shape)
        return AttentionOut(residual, sorted_tokens, sorted_weights, plan)

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """``[EP, E_local]`` rows this rank will receive per (source rank, local expert),
        written into row 1 of the plan's ``counts`` (at EP 1: row 0 itself). On the device:
        nothing is read back here."""
        if self.ep.size == 1:
            return counts[0].view(1, self.num_local)
        dist.all_to_all_single(counts[1], counts[0], group=self.ep.group)
        return counts[1].view(self.ep.size, self.num_local)

    def split_sizes(self, counts: torch.Tensor) -> SplitSizes:
        """The layer's `SplitSizes` from the plan's ``counts`` after `exchange_counts`: the
        one device-to-host copy of the layer's dispatch (send and receive counts together,
        through a buffer the layer keeps)."""
        ep, local = self.ep.size, self.num_local
        rows = self.host_counts.tolist(counts[: 2 if ep > 1 else 1])
        send, receive = rows[0], rows[-1]

        def per_rank(row: list[int]) -> list[int]:
            return [sum(row[r * local : (r + 1) * local]) for r in range(ep)]

        expert_rows = [sum(receive[r * local + e] for r in range(ep)) for e in range(local)]
        return SplitSizes(per_rank(send), per_rank(receive), expert_rows)

    def dispatch(self, a: AttentionOut, ops) -> DispatchOut:
        recv_counts = self.exchange_counts(a.plan.counts)
        sizes = self.split_sizes(a.plan.counts)
        received = ops.all_to_all(a.sorted_tokens, sizes.receive, sizes.send, self.ep.group)
        return DispatchOut(received, recv_counts, sizes)

    def run_experts(self, d: DispatchOut, ops) -> torch.Tensor:
        local_ids = torch.arange(self.num_local, device=d.tokens.device).repeat(self.ep.size)
        expert_ids = torch.repeat_interleave(
            local_ids, d.recv_counts.reshape(-1), output_size=d.tokens.shape[0]
        )
        grouped, layout = ops.to_expert_order(
            d.tokens, expert_ids, self.num_local, rows=d.sizes.expert_rows
        )
        out = self.experts(grouped, layout.offsets, ops, layout.ends)
        return ops.from_expert_order(out, layout)

    def combine(self, tokens: torch.Tensor, sizes: SplitSizes, ops) -> torch.Tensor:
        return ops.all_to_all(tokens, sizes.send, sizes.receive, self.ep.group)
