"""Plain PyTorch ops: the truth the optimized kernels are held against.

Nothing here is fused, padded, deferred or freed early; autograd saves what it
saves. Read each method next to its docstring in `models.network.Ops`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.network import ExpertLayout, causal_mask, eager_attention
from models.runtime import all_to_all, index_add


class ReferenceOps:
    """The plain implementation of `models.network.Ops`."""

    name = "reference"
    recompute_attention = False

    def cross_entropy(self, logits, target, ignore_index=-100, reduction="sum"):
        return F.cross_entropy(
            logits.float(), target, ignore_index=ignore_index, reduction=reduction
        )

    def attention(self, q, k, v, scaling, window=None, sinks=None):
        mask = causal_mask(q.shape[2], window, q.device)
        return eager_attention(q, k, v, mask, scaling, sinks)

    def gather_rows(self, x, index):
        return x.index_select(0, index)

    def scatter_add_rows(self, src, index, num_rows):
        out = src.new_zeros((num_rows,) + tuple(src.shape[1:]))
        return index_add(out, index, src)  # by sort and segment sum in deterministic mode

    def to_expert_order(self, tokens, expert_ids, num_experts, rows=None):
        # Plain: the counts are computed from the ids (``rows``, the host's copy, unused).
        order = torch.argsort(expert_ids, stable=True)
        counts = torch.bincount(expert_ids, minlength=num_experts)
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        positions = torch.empty_like(order)
        positions[order] = torch.arange(order.numel(), device=order.device)
        return tokens.index_select(0, order), ExpertLayout(offsets, positions)

    def from_expert_order(self, grouped, layout):
        return grouped.index_select(0, layout.positions)

    def grouped_linear(self, x, weight, offsets, bias=None, ends=None):
        ends = list(ends) if ends is not None else offsets.tolist()
        outputs, start = [], 0
        for expert, end in enumerate(ends):
            out = x[start:end] @ weight[expert]
            if bias is not None:
                out = out + bias[expert]
            outputs.append(out)
            start = end
        if start < x.shape[0]:  # rows past the last group (padding) map to zeros
            outputs.append(x.new_zeros((x.shape[0] - start, weight.shape[-1])))
        return torch.cat(outputs, 0)

    def silu_and_mul(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def clamped_swiglu(self, x, alpha, limit):
        gate, up = x[..., ::2], x[..., 1::2]
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))  # HF's order: same bf16 roundings

    def all_to_all(self, x, output_split_sizes, input_split_sizes, group):
        return all_to_all(x, output_split_sizes, input_split_sizes, group)
