"""The optimized DualPipeV: the reference's eight phases, with overlapped F&B and zero bubble.

Same V placement and phase structure as the reference schedule (rank r holds
stage r as chunk 0 and stage 2 * PP - 1 - r as chunk 1; the loss sits on rank 0),
so the two can be held side by side. What differs:

- **F&B overlap.** In the main phase (and the F1&B0 of nB1F1B0) one
  micro-batch's forward on one chunk runs interleaved, stage by stage, with
  another micro-batch's backward on the other chunk
  (`optimized.pipeline.overlap.OVERLAPPED_LAYER_STEPS`): while one side's dispatch or
  combine all-to-all is in flight, the other side computes.
- **Zero bubble.** In nB1W1F1, the second half of nB1B0 and nWB0, a backward
  defers the expert weight gradients into the step's `WeightGradStore` and the
  W steps run them. Overlapped pairs never defer: their expert weight
  gradients run while the pair's all-to-alls are in flight.
- **Memory.** Stages run on detached leaves with early frees of stage-boundary
  storage (`optimized.pipeline.overlap`), the loss uses the fused in-place
  cross-entropy, experts the padded gather and grouped GEMM of the optimized ops.

Point-to-point traffic: one stream per direction and chunk, each its own process
group (`models.runtime.p2p`: NCCL matches sends to receives in order per pair and ignores
tags, so no two streams may share a group), sends posted at once, receives posted
when the data is needed (an overlapped pair receives both its inputs first). A
send's buffer is freed as soon as the send is known complete, and that moment is
read off the schedule, not off the timing
(`optimized.estimator.schedule.send_completions`): once this rank has received
a message its peer sent *after* taking ours, ours is done, and waiting it cannot
block. (gloo's send work reports completion only once waited, so polling would
hold every send to the end of the step.) Sends with no such reply are waited at
the end of the step. Receive buffers and the loss accumulators live on the part's
device.

Routing controls travel as in the reference (`reference.dualpipev`): a `MicroBatchBalance`
per training forward of a micro-batch through a chunk, and with the pooled load-balancing
loss on, the ``[2, E]`` sums after the activation and the ``[E]`` totals after the
gradient, on the same stream. A message and its sums are one message to the send-completion
rule: posted together, received together, known complete together.
"""

from __future__ import annotations

from collections import deque
from contextlib import nullcontext
from typing import NamedTuple

import torch

from models.network import IGNORE_INDEX, MicroBatchBalance, StepBalance
from models.runtime import (
    BACKWARD,
    FORWARD,
    Layout,
    PointToPoint,
    TorchPointToPoint,
    scheduled_step,
    step_balance,
)
from optimized.estimator.schedule import send_completions
from optimized.ops import linear_cross_entropy
from optimized.pipeline.execution import ExecutionContext
from optimized.pipeline.mtp_stage import MtpStage
from optimized.pipeline.overlap import (
    LayerRun,
    backward_layers,
    backward_stage,
    forward_layers,
    leaf,
    overlapped_layers,
)


class SummedLinearCrossEntropy(NamedTuple):
    """The fused output layer and cross-entropy, summed over tokens, and its z-loss part
    (`OutputLayer.fused_loss` calls it through the module, so FSDP2 gathers a sharded
    ``weight`` around it). Label smoothing and z-loss are the trainer's options
    (``loss.label_smoothing``, ``loss.z_loss``); the reference stack has neither."""

    label_smoothing: float = 0.0
    z_loss: float = 0.0

    def __call__(
        self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return linear_cross_entropy(
            hidden, weight, labels, ignore_index=IGNORE_INDEX, reduction="sum",
            label_smoothing=self.label_smoothing, lse_square_scale=self.z_loss,
            return_z_loss=True,
        )  # fmt: skip


class ChunkRun(NamedTuple):
    """One micro-batch's forward through one chunk, waiting for its backward."""

    micro_batch: int
    balance: MicroBatchBalance | None
    """Its routing controls (`models.network.balancing`)."""
    input: torch.Tensor | None
    """The received activation (a leaf), or None where the chunk starts at the embedding."""
    embedded: torch.Tensor | None
    """The embedding output (root of the embedding's backward) on the first stage."""
    layers: list[LayerRun]
    output: torch.Tensor
    """The last layer's output, or the loss share on the last stage."""
    head_input: torch.Tensor | None
    """The leaf the loss stage started from (the last stage only)."""


class _Send(NamedTuple):
    """A posted send, held until it is known complete."""

    handle: object
    tensor: torch.Tensor
    extra: tuple
    """``(handle, tensor)`` of the balancing sums posted after it (empty: none)."""
    free_when_sent: bool
    """Free the storage once sent (a forward's output: only its backward root is left)."""
    complete_after: int | None
    """Receives after which the peer has certainly taken it (`send_completions`)."""


class OptimizedDualPipeV:
    """Runs one training or evaluation step of DualPipeV on this pipeline rank."""

    def __init__(
        self,
        part,
        chunks: tuple[list[int], list[int]],
        layout: Layout,
        loss: SummedLinearCrossEntropy | None = None,
        recompute_attention: bool = True,
    ) -> None:
        self.part = part
        self.recompute_attention = recompute_attention
        """Each step's ops recompute the attention block in backward (`OptimizedOps`)."""
        self.loss_fn = loss or SummedLinearCrossEntropy()
        """The loss stage's objective (plain cross-entropy unless the trainer sets options)."""
        self.chunks = chunks
        self.layout = layout
        self.rank, self.num_ranks = layout.pp_rank, layout.pp
        self.is_first, self.is_last = self.rank == 0, self.rank == self.num_ranks - 1
        self.observer = None
        """Optional ``observer(moment, micro_batch)`` called at each action (memory tracking)."""
        self.record_frees = False
        """Keep the list of early frees in the last step's context (tests)."""
        self.context: ExecutionContext | None = None
        """The last step's execution context."""
        self.gradient_sync = None
        """Optional `optimized.pipeline.gradient_sync.GradientSync`, told of every backward
        (before it runs) and every W step (after): FSDP2 reduces at the schedule's marks."""
        self.p2p: PointToPoint = TorchPointToPoint()
        """How tensors travel to the neighbours, on the layout's stream groups
        (`models.runtime.p2p`)."""
        self.balance: StepBalance | None = None
        """The last training step's routing controls (load, balancing losses)."""
        self.mtp = None
        """What the next step's MTP loss needs (`models.network.MtpStep`, set by the runner)."""
        self.mtp_stage = MtpStage(part, self.loss_fn)
        """The MTP module at the loss stage (`optimized.pipeline.mtp_stage`)."""

    @property
    def mtp_losses(self) -> torch.Tensor | None:
        return self.mtp_stage.losses

    @property
    def mtp_correct(self) -> torch.Tensor | None:
        return self.mtp_stage.correct

    defers_weight_gradients = True
    """Zero-bubble backwards leave expert weight gradients to W steps (`sync_marks`)."""

    # ------------------------------------------------------------------ step
    def step(self, micro_batches, token_count: int, forward_only: bool = False) -> torch.Tensor:
        """Run all micro-batches; return this rank's share of the mean loss (0 off rank 0).
        A device-wide synchronisation inside is refused (`models.runtime.device_sync`)."""
        with scheduled_step():
            return self._step(micro_batches, token_count, forward_only)

    def _step(self, micro_batches, token_count: int, forward_only: bool = False) -> torch.Tensor:
        """Run all micro-batches; return this rank's share of the mean loss (0 off rank 0)."""
        self._begin(micro_batches, token_count, forward_only)
        if forward_only:
            self.phase = "forward-only"
            with torch.no_grad():
                for _ in range(self.num_micro_batches):
                    self.F(0)
                for _ in range(self.num_micro_batches):
                    self.F(1)
            return self._end()

        r, pp, m = self.rank, self.num_ranks, self.num_micro_batches
        self.phase = "nF0"
        for _ in range(2 * (pp - r - 1)):
            self.F(0)
        self.phase = "nF0F1"
        for _ in range(r + 1):
            self.F(0)
            self.F(1)
        self.phase = "nB1W1F1"
        for _ in range(pp - r - 1):
            self.B(1, defer=True)
            self.W()
            self.F(1)
        self.phase = "nF0B1F1B0"
        for i in range(m - 2 * pp + r + 1):
            if i == 0 and self.is_last:  # not overlapped, to shrink the bubble (as DualPipe)
                self.F(0)
                self.B(1)
            else:
                self.FB(0, 1)
            self.FB(1, 0)
        self.phase = "nB1F1B0"
        for _ in range(pp - r - 1):
            self.B(1)
            self.FB(1, 0)
        self.phase = "nB1B0"
        defer = False
        for i in range(r + 1):
            if i == (r + 1) // 2 and r % 2 == 1:
                defer = True
            self.B(1, defer=defer)
            if i == (r + 1) // 2 and r % 2 == 0:
                defer = True
            self.B(0, defer=defer)
        self.phase = "nWB0"
        for _ in range(pp - r - 1):
            self.W()
            self.B(0, defer=True)
        self.phase = "nW"
        for _ in range(r + 1):
            self.W()
        return self._end()

    # ------------------------------------------------------- the actions
    def F(self, chunk: int) -> None:
        """Forward of the next micro-batch through this rank's stage ``chunk``."""
        j = self._next_forward(chunk)
        self._observe(f"F{chunk}", j)
        start = self._forward_input(chunk, j)
        hidden = forward_layers(start.layers, start.hidden)
        self._forward_output(chunk, start, hidden)

    def B(self, chunk: int, defer: bool = False) -> None:
        """Backward of the oldest forwarded micro-batch of ``chunk``; ``defer``: ZB backward."""
        run = self.saved[chunk].popleft()
        self._observe(f"B{chunk}", run.micro_batch)
        self._before_backward(chunk)
        store = self.context.weight_grads
        with store.deferring() if defer else nullcontext():
            grad = self._backward_start(chunk, run)
            grad = backward_layers(run.layers, grad)
            self._backward_end(chunk, run, grad)

    def FB(self, forward_chunk: int, backward_chunk: int) -> None:
        """Overlapped forward of ``forward_chunk`` and backward of ``backward_chunk`` (never ZB)."""
        j = self._next_forward(forward_chunk)
        run = self.saved[backward_chunk].popleft()
        self._observe(f"F{forward_chunk}&B{backward_chunk}", j)
        self._before_backward(backward_chunk)
        start = self._forward_input(forward_chunk, j)
        grad = self._backward_start(backward_chunk, run)
        hidden, grad = overlapped_layers(start.layers, start.hidden, run.layers, grad)
        self._forward_output(forward_chunk, start, hidden)
        self._backward_end(backward_chunk, run, grad)

    def W(self) -> None:
        """Run the oldest deferred backward's expert weight gradients."""
        self._observe("W", None)
        self.context.weight_grads.pop()
        if self.gradient_sync is not None:
            self.gradient_sync.after_weight()

    # -------------------------------------------- chunk ends: embed, loss, p2p
    def forward_balance(self, stats: torch.Tensor | None) -> MicroBatchBalance | None:
        """The routing controls of one micro-batch's forward through one chunk: the step's
        `MicroBatchBalance` in training, none in a forward-only pass (which counts nothing
        and changes nothing). A method of this stack's own, so that a planted bug
        (`harness.compare.planted`) can replace it here and leave the reference's alone."""
        return self.balance.micro_batch(stats) if self.training else None

    class _Start(NamedTuple):
        micro_batch: int
        balance: MicroBatchBalance | None
        input: torch.Tensor | None
        embedded: torch.Tensor | None
        hidden: torch.Tensor
        layers: list[LayerRun]

    def _forward_input(self, chunk: int, j: int) -> _Start:
        stats, embedded = None, None
        if chunk == 0 and self.is_first:
            embedded = self.part.embed(self.micro_batches[j][0])
        else:
            received, stats = self._receive_activation(chunk)
            received = leaf(received)
        balance = self.forward_balance(stats)
        layers = [LayerRun(self.part.layer(i), self.context, balance) for i in self.chunks[chunk]]
        if embedded is not None:
            return self._Start(j, balance, None, embedded, embedded, layers)
        return self._Start(j, balance, received, None, received, layers)

    def _forward_output(self, chunk: int, start: _Start, hidden: torch.Tensor) -> None:
        head_input = None
        if chunk == 1 and self.is_first:
            head_input = leaf(hidden)
            ids, labels = self.micro_batches[start.micro_batch]
            output = self._loss_sum(head_input, labels) / self.token_count
            self.loss = self.loss + output.detach()
            if self.mtp is not None and start.balance is not None:  # training
                mtp = self.mtp_stage.objective(head_input, ids, labels, self.mtp, start.balance)
                output = output + mtp
            if start.balance is not None:
                start.balance.close(ids.numel())
        else:
            self._send_activation(chunk, hidden, start.balance)
            output = hidden
        if torch.is_grad_enabled():
            self.saved[chunk].append(
                ChunkRun(start.micro_batch, start.balance, start.input, start.embedded,
                         start.layers, output, head_input)
            )  # fmt: skip

    def _loss_sum(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss stage: final norm, then output layer and cross-entropy fused by token chunk.

        The head's gradients are finished in the forward a chunk of logits at a
        time, so no ``[tokens, vocab]`` logits wait here for the backward.
        """
        normed = self.part.model.norm(hidden)
        loss, z_loss = self.part.lm_head.fused_loss(normed, labels, self.loss_fn)
        self.z_loss = self.z_loss + z_loss.detach() / self.token_count
        return loss

    def _backward_start(self, chunk: int, run: ChunkRun) -> torch.Tensor:
        """The gradient of the chunk's last layer output."""
        if chunk == 1 and self.is_first:
            run.output.backward()
            return run.head_input.grad
        grad, totals = self._receive_gradient(chunk)
        if totals is not None:
            run.balance.receive_totals(totals)
        return grad

    def _backward_end(self, chunk: int, run: ChunkRun, grad: torch.Tensor) -> None:
        if run.embedded is not None:
            backward_stage((run.embedded,), (grad,))
        else:
            self._send_gradient(chunk, grad, run.balance.totals if self.pooled else None)

    def _before_backward(self, chunk: int) -> None:
        if self.gradient_sync is not None:
            self.gradient_sync.before_backward(chunk)

    def _next_forward(self, chunk: int) -> int:
        j = self.forwarded[chunk]
        self.forwarded[chunk] += 1
        return j

    def _observe(self, action: str, micro_batch: int | None) -> None:
        if self.observer is not None:
            self.observer(f"{self.phase}:{action}", micro_batch)

    # -------------------------------------------------------- communication
    def _receive_activation(self, chunk: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The activation and, with the pooled loss on, the micro-batch's pooled sums."""
        if chunk == 1 and self.is_last:
            return self.local_activations.popleft()
        src = self.rank - 1 if chunk == 0 else self.rank + 1
        return self._recv(src, FORWARD, chunk, self.stats_shape if self.pooled else None)

    def _send_activation(self, chunk: int, tensor: torch.Tensor, balance) -> None:
        stats = balance.stats if self.pooled else None
        if chunk == 0 and self.is_last:
            self.local_activations.append((tensor, stats))
            return
        dst = self.rank + 1 if chunk == 0 else self.rank - 1
        # Once sent, the output is only the root of its layer's backward: free it then.
        self._send(tensor.detach(), dst, FORWARD, chunk, free_when_sent=True, extra=stats)

    def _receive_gradient(self, chunk: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The gradient and, with the pooled loss on, the micro-batch's ``[E]`` totals."""
        if chunk == 0 and self.is_last:
            return self.local_gradients.popleft()
        src = self.rank + 1 if chunk == 0 else self.rank - 1
        return self._recv(src, BACKWARD, chunk, self.stats_shape[1:] if self.pooled else None)

    def _send_gradient(self, chunk: int, tensor: torch.Tensor, totals) -> None:
        if chunk == 1 and self.is_last:
            self.local_gradients.append((tensor, totals))
            return
        dst = self.rank - 1 if chunk == 0 else self.rank + 1
        self._send(tensor, dst, BACKWARD, chunk, extra=totals)

    def _send(
        self,
        tensor: torch.Tensor,
        pp_rank: int,
        direction: str,
        chunk: int,
        free_when_sent: bool = False,
        extra: torch.Tensor | None = None,
    ) -> None:
        """Post ``tensor`` (and ``extra``, the balancing sums, after it on the same stream)."""
        tensor = tensor.contiguous()
        group = self.layout.streams.pick(direction, chunk)
        peer = self.layout.global_rank(pp_rank)
        handle = self.p2p.isend(tensor, peer, group)
        posted = ()
        if extra is not None:
            extra = extra.contiguous()
            posted = (self.p2p.isend(extra, peer, group), extra)
        index = len(self.sent)
        self.sent.append(None)
        complete_after = self.completions[index] if index < len(self.completions) else None
        self.pending_sends.append(_Send(handle, tensor, posted, free_when_sent, complete_after))

    def _recv(
        self, pp_rank: int, direction: str, chunk: int, stats_shape=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A message from ``pp_rank``, and the float32 balancing sums that follow it when
        ``stats_shape`` is given (None otherwise)."""
        tensor = torch.empty(self.activation_shape, dtype=self.dtype, device=self.device)
        group = self.layout.streams.pick(direction, chunk)
        peer = self.layout.global_rank(pp_rank)
        self.p2p.irecv(tensor, peer, group).wait()
        stats = None
        if stats_shape is not None:
            stats = torch.empty(stats_shape, dtype=torch.float32, device=self.device)
            self.p2p.irecv(stats, peer, group).wait()
        self.received += 1
        self._finish_sends(self.received)
        return tensor, stats

    def _finish_sends(self, received: int | None) -> None:
        """Wait and free the sends known complete after ``received`` receives (None: all)."""
        pending = []
        for send in self.pending_sends:
            if received is not None and (
                send.complete_after is None or send.complete_after > received
            ):
                pending.append(send)
                continue
            send.handle.wait()
            if send.extra:
                send.extra[0].wait()
            if send.free_when_sent and self.training:
                self.context.free_now("sent_activation", send.tensor)
        self.pending_sends = pending

    # ------------------------------------------------------------ bookkeeping
    def _begin(self, micro_batches, token_count: int, forward_only: bool = False) -> None:
        self.context = ExecutionContext(self.record_frees, self.recompute_attention)
        self.micro_batches = micro_batches
        self.num_micro_batches = len(micro_batches)
        self.token_count = token_count
        batch, seq = micro_batches[0][0].shape
        self.activation_shape = (batch, seq, self.part.config.hidden_size)
        parameter = next(self.part.parameters())
        self.dtype, self.device = parameter.dtype, parameter.device
        self.forwarded = [0, 0]
        self.saved: tuple[deque, deque] = (deque(), deque())
        self.local_activations: deque = deque()
        self.local_gradients: deque = deque()
        self.pending_sends: list[_Send] = []
        self.sent: list[None] = []
        self.received = 0
        self.training = not forward_only
        self.completions: list[int | None] = []  # forward-only: every send waits for the end
        if self.training:
            self.completions = send_completions(self.rank, self.num_ranks, self.num_micro_batches)
        self.loss = torch.zeros((), dtype=torch.float32, device=self.device)
        self.z_loss = torch.zeros((), dtype=torch.float32, device=self.device)
        """This rank's share of the step's mean z-loss (part of ``loss``), for logging."""
        if self.training:
            self.balance = step_balance(
                self.part.config, self.num_micro_batches, self.layout, self.device
            )
        self.pooled = self.training and self.balance.balancing.pooled
        self.stats_shape = (2, self.part.config.num_experts)
        self.mtp_stage.begin(self.device)

    def _end(self) -> torch.Tensor:
        self._finish_sends(None)
        assert not self.saved[0] and not self.saved[1], "a forward was never backwarded"
        assert self.forwarded == [self.num_micro_batches] * 2
        self.context.finish()
        return self.loss
