"""The seam between the model math and the two stacks.

Model code in `models/` is written once and calls an ``Ops`` object for every
operation where the reference and the optimized stack differ. `reference.ops`
gives the plain PyTorch version of each; `optimized.ops` gives the fused and
memory-saving one. Tests and the harness hold the two against each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist


class ExpertLayout(NamedTuple):
    """Where each routed token row went when rows were grouped by expert.

    ``offsets[e]`` is the (exclusive) end row of expert ``e``'s group in the
    grouped buffer, as int32 cumulative offsets that `F.grouped_mm` takes; a
    stack may pad groups, so ``offsets[-1]`` can exceed the number of tokens.
    ``positions[i]`` is the row of the grouped buffer that holds input row ``i``.
    """

    offsets: torch.Tensor
    positions: torch.Tensor
    ends: tuple[int, ...] | None = None
    """``offsets`` as host integers, when the stack knows them without reading the device
    (a MoE layer's split sizes): the float32 grouped GEMM's per-group loop runs on them."""


class Ops(Protocol):
    """Every operation the two stacks implement differently."""

    recompute_attention: bool
    """Whether decoder layers recompute the attention block in backward instead of keeping
    its activations (the plain stack keeps them)."""

    def cross_entropy(
        self,
        logits: torch.Tensor,
        target: torch.Tensor,
        ignore_index: int = -100,
        reduction: str = "sum",
    ) -> torch.Tensor:
        """Token cross-entropy of ``logits [N, V]`` against ``target [N]``, in float32."""
        ...

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scaling: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal softmax attention of ``q [B, h, S, D]`` over ``k [B, h_kv, S, D]`` and
        ``v [B, h_kv, S, Dv]``, keys limited to the last ``window`` positions when given, with
        one extra per-head logit ``sinks [h]`` that takes probability mass (GPT-OSS).
        Returns ``[B, S, h * Dv]``."""
        ...

    def gather_rows(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``x[index]`` for a 1-D long ``index``: the dispatch gather."""
        ...

    def scatter_add_rows(
        self, src: torch.Tensor, index: torch.Tensor, num_rows: int
    ) -> torch.Tensor:
        """A ``[num_rows, H]`` tensor with ``src[i]`` added into row ``index[i]``."""
        ...

    def to_expert_order(
        self,
        tokens: torch.Tensor,
        expert_ids: torch.Tensor,
        num_experts: int,
        rows: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, ExpertLayout]:
        """Rows of ``tokens`` grouped by ``expert_ids`` (stable within a group). ``rows``,
        each expert's row count when the caller knows it on the host (a MoE layer's split
        sizes, `models.network.SplitSizes`), lets a stack size its buffer without reading
        the ids back from the device (on a GPU, a stop of the host)."""
        ...

    def from_expert_order(self, grouped: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
        """The inverse of `to_expert_order`: row ``i`` is ``grouped[positions[i]]``."""
        ...

    def grouped_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        offsets: torch.Tensor,
        bias: torch.Tensor | None = None,
        ends: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Per-group ``x_g @ weight[g] (+ bias[g])`` with ``weight [E, in, out]``; ``ends``:
        ``offsets`` on the host, when known (`ExpertLayout.ends`)."""
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` where ``x = [gate | up]`` along the last dimension."""
        ...

    def clamped_swiglu(self, x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        """GPT-OSS's activation on interleaved ``x[..., ::2] = gate``, ``x[..., 1::2] = up``:
        ``(up.clamp(-limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = gate.clamp(max=limit)``.
        """
        ...

    def all_to_all(
        self,
        x: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        """Differentiable `all_to_all_single`; the identity when ``group`` is None or size 1."""
        ...
