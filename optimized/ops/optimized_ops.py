"""`OptimizedOps`: the optimized stack's implementation of `models.network.Ops`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from models.network import ExpertLayout
from models.runtime import all_to_all
from optimized.ops.activations import clamped_swiglu, silu_and_mul
from optimized.ops.attention import flash_attention
from optimized.ops.cross_entropy import cross_entropy
from optimized.ops.expert_order import gather_from_grouped, scatter_for_grouped_gemm
from optimized.ops.gather import padded_index_gather, scatter_add_rows
from optimized.ops.grouped_linear import WeightGradStore, grouped_linear


class OptimizedOps:
    """Fused, padded and deferrable versions of every op in `models.network.Ops`.

    ``weight_grad_store``, when given, receives the expert weight gradients of
    `grouped_linear` while it is enabled (see `WeightGradStore`). ``recompute_attention``
    (default on) is the stack's one memory-for-time switch: off, decoder layers keep the
    attention block's activations as the reference does and its backward reruns nothing.
    """

    name = "optimized"
    recompute_attention: bool
    """Decoder layers keep only the attention block's input and recompute the block in
    backward (selective recomputation): its projections, rotary copies and q/k/v are the
    largest activations once the fused attention has dropped the ``S x S`` probabilities.
    Costs one more forward of the block per backward."""
    attention_blocks = None
    """How attention launches (`flash_attention`'s ``blocks``): None, the default per device;
    `optimized.ops.attention_blocks.AUTOTUNED` tunes on the interpreter too (tests of the
    pre-tuning path, `optimized.ops.tuning`)."""

    def __init__(
        self, weight_grad_store: WeightGradStore | None = None, recompute_attention: bool = True
    ) -> None:
        if not isinstance(recompute_attention, bool):
            raise ValueError(
                f"OptimizedOps.recompute_attention={recompute_attention!r} is invalid: "
                f"expected True or False"
            )
        self.weight_grad_store = weight_grad_store
        self.recompute_attention = recompute_attention

    def cross_entropy(
        self,
        logits: torch.Tensor,
        target: torch.Tensor,
        ignore_index: int = -100,
        reduction: str = "sum",
    ) -> torch.Tensor:
        """The fused Triton loss; the logits buffer is consumed (holds the gradient)."""
        return cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scaling: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Fused attention that saves no ``S x S`` probabilities (see `flash_attention`)."""
        return flash_attention(q, k, v, scaling, window, sinks, blocks=self.attention_blocks)

    def gather_rows(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return padded_index_gather(x, index)

    def scatter_add_rows(
        self, src: torch.Tensor, index: torch.Tensor, num_rows: int
    ) -> torch.Tensor:
        return scatter_add_rows(src, index, num_rows)

    def to_expert_order(
        self,
        tokens: torch.Tensor,
        expert_ids: torch.Tensor,
        num_experts: int,
        rows: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, ExpertLayout]:
        """Groups padded to 128-row multiples: ``offsets[-1]`` is the padded row count.
        Given ``rows`` (host-known rows per expert), nothing is read back."""
        return scatter_for_grouped_gemm(tokens, expert_ids, num_experts, group_rows=rows)

    def from_expert_order(self, grouped: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
        return gather_from_grouped(grouped, layout)

    def grouped_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        offsets: torch.Tensor,
        bias: torch.Tensor | None = None,
        ends: Sequence[int] | None = None,
    ) -> torch.Tensor:
        return grouped_linear(x, weight, offsets, bias, self.weight_grad_store, ends)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)

    def clamped_swiglu(self, x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        return clamped_swiglu(x, alpha, limit)

    def all_to_all(
        self,
        x: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        return all_to_all(x, output_split_sizes, input_split_sizes, group)
