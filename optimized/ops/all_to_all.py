"""Differentiable `all_to_all_single` for expert dispatch and combine."""

from __future__ import annotations

import torch
import torch.distributed as dist


class AllToAll(torch.autograd.Function):
    """`all_to_all_single` whose backward sends gradients back the way rows came."""

    @staticmethod
    def forward(ctx, x, output_split_sizes, input_split_sizes, group):
        ctx.output_split_sizes = output_split_sizes
        ctx.input_split_sizes = input_split_sizes
        ctx.group = group
        out = x.new_empty((sum(output_split_sizes),) + tuple(x.shape[1:]))
        dist.all_to_all_single(
            out, x.contiguous(), output_split_sizes, input_split_sizes, group=group
        )
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        grad_in = grad_out.new_empty((sum(ctx.input_split_sizes),) + tuple(grad_out.shape[1:]))
        dist.all_to_all_single(
            grad_in,
            grad_out.contiguous(),
            ctx.input_split_sizes,
            ctx.output_split_sizes,
            group=ctx.group,
        )
        return grad_in, None, None, None


def all_to_all(
    x: torch.Tensor,
    output_split_sizes: list[int],
    input_split_sizes: list[int],
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Rows of ``x`` exchanged by split sizes; the identity when ``group`` is None or size 1."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    if sum(input_split_sizes) != x.shape[0]:
        raise ValueError(
            f"input_split_sizes sum to {sum(input_split_sizes)} but x has {x.shape[0]} rows"
        )
    return AllToAll.apply(x, list(output_split_sizes), list(input_split_sizes), group)
