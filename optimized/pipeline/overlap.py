"""A decoder layer run stage by stage, and the overlap of one forward with one backward.

`LayerRun` is one micro-batch going through one decoder layer. Its forward is
seven small steps over the layer's five stages (the two all-to-alls split into
*start* and *wait*); its backward is the same seven in reverse. Every stage
runs on detached leaves, so each stage's backward runs on its own:
``torch.autograd.backward(stage outputs, their gradients)``, then the leaves'
``.grad`` go to the stage before.

`OVERLAPPED_LAYER_STEPS` is the whole overlap of DualPipeV's F&B: a forward
layer of one micro-batch interleaved with a backward layer of another, so
that while one side's all-to-all is in flight the other side computes
(attention, experts and their weight gradients):

    B aggregate, B combine start  | F attention, F dispatch start
    B combine wait, B experts, B dispatch start | F dispatch wait, F experts, F combine start
    B dispatch wait, B attention  | F combine wait, F aggregate

The per-expert count exchange (``MoE.exchange_counts``, first in `dispatch_start`) stays a
blocking all-to-all, and its result is the one value a layer's forward reads on the host
(``MoE.split_sizes``: send and receive counts in one copy, the all-to-alls' split sizes and
the grouped expert buffer's rows; the backward reuses them): this step list cannot hide it.
The token dispatch's receive buffer is sized from it, so it must finish before the dispatch
starts, and it can only start once the router has run, at the end of `attention_forward`.
Between the two the list could only place the other side's combine-backward wait and expert
backward; but the combine-backward exchange was started earlier on the same EP group, and
collectives on one group complete in order, so the counts queue behind it either way; and
moving `dispatch_start` after the expert backward would leave the token dispatch, the larger
transfer, with no compute to hide behind. An asynchronous count exchange would move the
same wait, not remove it.

Records keep only what backward needs: the comm stages keep their split sizes
and group, not tensors. Stage-boundary storage nobody reads again is freed
early through the `ExecutionContext` (see `optimized.pipeline.execution`).

A dense layer is asked once (``is_moe``): its attention stage is the whole
layer and the other stages do nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from models.network import (
    AttentionOut,
    CombineOut,
    DecoderLayer,
    DispatchOut,
    MicroBatchBalance,
    SplitSizes,
)
from optimized.pipeline.execution import Exchange, ExecutionContext, start_exchange


def leaf(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` cut from its graph, as the input of the next stage."""
    out = tensor.detach()
    if torch.is_grad_enabled() and out.is_floating_point():
        out.requires_grad_()
    return out


def backward_stage(outputs, grads) -> None:
    """Backward of one stage from its ``outputs`` and their gradients (skips missing ones)."""
    pairs = [
        (out, grad)
        for out, grad in zip(outputs, grads)
        if out is not None and grad is not None and out.requires_grad
    ]
    if pairs:
        torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])


class ExchangeRecord(NamedTuple):
    """What an all-to-all stage keeps for its backward: split sizes and group, no tensors."""

    output_split_sizes: list[int]
    input_split_sizes: list[int]
    group: object


class LayerRun:
    """One micro-batch through one decoder layer, stage by stage (forward, then backward)."""

    def __init__(
        self,
        layer: DecoderLayer,
        ctx: ExecutionContext,
        balance: MicroBatchBalance | None = None,
    ) -> None:
        self.layer, self.ctx, self.ops = layer, ctx, ctx.ops
        self.balance = balance
        """The micro-batch's routing controls in a training forward (None: forward only)."""
        self.is_moe = layer.is_moe
        self.input: torch.Tensor | None = None
        """Set by the caller: the layer's input hidden states (cut into a leaf here)."""
        self.output: torch.Tensor | None = None
        """The layer's output hidden states (root of the aggregate stage's backward)."""
        self.grad_output: torch.Tensor | None = None
        """Set by the caller before backward: the gradient of ``output``."""
        self.grad_input: torch.Tensor | None = None
        """After backward: the gradient of ``input``."""
        self.pending: Exchange | None = None
        # Stage records.
        self.attention: AttentionOut | None = None
        self.dispatch: ExchangeRecord | None = None
        self.recv_counts: torch.Tensor | None = None
        self.sizes: SplitSizes | None = None
        self.received: torch.Tensor | None = None
        self.expert_output: torch.Tensor | None = None
        self.combined: torch.Tensor | None = None
        self.residual: torch.Tensor | None = None
        self.weights: torch.Tensor | None = None
        # Backward carries.
        self.grads: dict[str, torch.Tensor | None] = {}


# ---------------------------------------------------------------- forward stages
def attention_forward(run: LayerRun) -> None:
    """Stage 1: norm, attention, shared experts, router (a dense layer: all of it)."""
    run.input = leaf(run.input)
    with run.ctx.stage():
        a = run.layer.attention(run.input, run.ops, run.balance)
    run.attention = a
    if not run.is_moe:
        run.output = a.residual


def dispatch_start(run: LayerRun) -> None:
    """Stage 2a: exchange the counts, start sending the sorted tokens to their experts."""
    if not run.is_moe:
        return
    mlp, plan = run.layer.mlp, run.attention.plan
    run.recv_counts = mlp.exchange_counts(plan.counts)
    run.sizes = mlp.split_sizes(plan.counts)  # the layer's one wait on the device
    receive, send = run.sizes.receive, run.sizes.send
    run.dispatch = ExchangeRecord(receive, send, mlp.ep.group)
    tokens = run.attention.sorted_tokens
    run.pending = start_exchange(tokens.detach(), receive, send, mlp.ep.group)
    run.ctx.free_after("sorted_tokens", tokens, run.pending)


def dispatch_wait(run: LayerRun) -> None:
    """Stage 2b: the routed tokens have arrived (the sorted tokens are freed now)."""
    if not run.is_moe:
        return
    run.received = leaf(run.pending.wait())
    run.pending = None


def experts_forward(run: LayerRun) -> None:
    """Stage 3: group by local expert, grouped expert MLP, restore the received order."""
    if not run.is_moe:
        return
    with run.ctx.stage():
        run.expert_output = run.layer.mlp.run_experts(
            DispatchOut(run.received, run.recv_counts, run.sizes), run.ops
        )
    # The experts read the received rows into their own grouped buffer.
    run.ctx.free_now("received_tokens", run.received, still_read=(run.expert_output,))


def combine_start(run: LayerRun) -> None:
    """Stage 4a: start sending the expert outputs back to the ranks of their tokens."""
    if not run.is_moe:
        return
    receive, send, group = run.dispatch
    out = run.expert_output
    run.pending = start_exchange(out.detach(), send, receive, group)
    run.ctx.free_after("expert_output", out, run.pending)


def combine_wait(run: LayerRun) -> None:
    """Stage 4b: the expert outputs are back (the sent buffer is freed now)."""
    if not run.is_moe:
        return
    run.combined = leaf(run.pending.wait())
    run.pending = None


def aggregate_forward(run: LayerRun) -> None:
    """Stage 5: weight by the router, sum per token, add the residual."""
    if not run.is_moe:
        return
    a = run.attention
    run.residual, run.weights = leaf(a.residual), leaf(a.sorted_weights)
    cut = AttentionOut(run.residual, None, run.weights, a.plan)
    with run.ctx.stage():
        run.output = run.layer.aggregate(cut, CombineOut(run.combined), run.ops)
    # The residual add keeps nothing: attention's output residual is only a root now.
    run.ctx.free_now("residual", a.residual, still_read=(run.output,))
    if not torch.is_grad_enabled():
        run.attention = run.combined = run.residual = run.weights = None


FORWARD_STEPS = (
    attention_forward,
    dispatch_start,
    dispatch_wait,
    experts_forward,
    combine_start,
    combine_wait,
    aggregate_forward,
)


# --------------------------------------------------------------- backward stages
def aggregate_backward(run: LayerRun) -> None:
    if not run.is_moe:
        return
    backward_stage((run.output,), (run.grad_output,))
    run.grads = {"residual": run.residual.grad, "weights": run.weights.grad}
    run.grad_output = run.output = run.residual = run.weights = None


def combine_backward_start(run: LayerRun) -> None:
    if not run.is_moe:
        return
    receive, send, group = run.dispatch
    run.pending = start_exchange(_grad_of(run.combined), receive, send, group)
    run.combined = None


def combine_backward_wait(run: LayerRun) -> None:
    if not run.is_moe:
        return
    run.grads["expert_output"] = run.pending.wait()
    run.pending = None


def experts_backward(run: LayerRun) -> None:
    """Expert input gradients, and weight gradients (deferred to the store in a ZB backward)."""
    if not run.is_moe:
        return
    backward_stage((run.expert_output,), (run.grads.pop("expert_output"),))
    run.expert_output = None


def dispatch_backward_start(run: LayerRun) -> None:
    if not run.is_moe:
        return
    receive, send, group = run.dispatch
    run.pending = start_exchange(_grad_of(run.received), send, receive, group)
    run.received = run.recv_counts = run.sizes = None


def dispatch_backward_wait(run: LayerRun) -> None:
    if not run.is_moe:
        return
    run.grads["sorted_tokens"] = run.pending.wait()
    run.pending = run.dispatch = None


def attention_backward(run: LayerRun) -> None:
    a = run.attention
    if not run.is_moe:
        backward_stage((a.residual,), (run.grad_output,))
    else:
        grads = run.grads
        backward_stage(
            (a.residual, a.sorted_tokens, a.sorted_weights),
            (grads["residual"], grads["sorted_tokens"], grads["weights"]),
        )
    run.grad_input = _grad_of(run.input)
    run.attention = run.input = run.output = run.grad_output = None
    run.grads = {}


def _grad_of(tensor: torch.Tensor) -> torch.Tensor:
    grad = tensor.grad
    if grad is None:  # nothing flowed (e.g. no routed token reached this rank)
        grad = torch.zeros_like(tensor)
    return grad


BACKWARD_STEPS = (
    aggregate_backward,
    combine_backward_start,
    combine_backward_wait,
    experts_backward,
    dispatch_backward_start,
    dispatch_backward_wait,
    attention_backward,
)

FORWARD, BACKWARD = "F", "B"

OVERLAPPED_LAYER_STEPS = (
    (BACKWARD, aggregate_backward),
    (BACKWARD, combine_backward_start),
    (FORWARD, attention_forward),
    (FORWARD, dispatch_start),
    (BACKWARD, combine_backward_wait),
    (BACKWARD, experts_backward),
    (BACKWARD, dispatch_backward_start),
    (FORWARD, dispatch_wait),
    (FORWARD, experts_forward),
    (FORWARD, combine_start),
    (BACKWARD, dispatch_backward_wait),
    (BACKWARD, attention_backward),
    (FORWARD, combine_wait),
    (FORWARD, aggregate_forward),
)
"""One forward layer and one backward layer, interleaved (the F&B of DualPipeV)."""


# ---------------------------------------------------------------- whole chunks
def forward_layers(runs: list[LayerRun], hidden: torch.Tensor) -> torch.Tensor:
    """Forward through ``runs`` in order; returns the last layer's output."""
    for run in runs:
        run.input = hidden
        for step in FORWARD_STEPS:
            step(run)
        hidden = run.output
    return hidden


def backward_layers(runs: list[LayerRun], grad: torch.Tensor) -> torch.Tensor:
    """Backward through ``runs`` (given in forward order); returns the input's gradient."""
    for run in reversed(runs):
        run.grad_output = grad
        for step in BACKWARD_STEPS:
            step(run)
        grad = run.grad_input
    return grad


def overlapped_layers(
    forward_runs: list[LayerRun],
    hidden: torch.Tensor,
    backward_runs: list[LayerRun],
    grad: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of one chunk interleaved with backward of another, layer pair by layer pair.

    ``backward_runs`` are in forward order (they run reversed). Where the chunks
    have different layer counts, the extra layers run on their own.
    """
    backward_order = list(reversed(backward_runs))
    for index in range(max(len(forward_runs), len(backward_order))):
        f = forward_runs[index] if index < len(forward_runs) else None
        b = backward_order[index] if index < len(backward_order) else None
        if f is not None:
            f.input = hidden
        if b is not None:
            b.grad_output = grad
        for side, step in OVERLAPPED_LAYER_STEPS:
            run = f if side == FORWARD else b
            if run is not None:
                step(run)
        if f is not None:
            hidden = f.output
        if b is not None:
            grad = b.grad_input
    return hidden, grad
