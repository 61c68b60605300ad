"""DualPipeV, written to be read next to the figure.

PP ranks hold 2 * PP stages in a V: rank r holds stage r (chunk 0) and stage
2 * PP - 1 - r (chunk 1). Stage 0 (with the embedding) and stage 2 * PP - 1
(with the final norm, output layer and loss) both live on rank 0; on the last
rank chunk 0 hands its output straight to chunk 1.

`step` runs the eight phases of the schedule for this rank. This is the
reference: an overlapped pair ``F&B`` runs as F, then B; a backward computes
weight gradients at once, so the W steps have nothing left to do. The step
structure stays the paper's so that a reader can check it line by line.

Communication: activations and gradients travel point to point, one stream per
direction and chunk, each its own process group (`models.runtime.p2p`: NCCL ignores tags and
matches sends to receives in order per pair, which one stream per group makes right).
Sends are posted as soon as a tensor exists and waited at the end of the step;
receives are posted when the data is needed. Because the schedule is a valid DualPipeV
order, this never deadlocks. Receive buffers and the loss live on the part's device.

Routing controls (`models.network.balancing`): each training forward of a micro-batch
through a chunk gets a `MicroBatchBalance` of the step's `StepBalance`, which counts the
load and attaches the balancing terms. With the pooled load-balancing loss on, the
micro-batch's ``[2, E]`` counts and probability sums travel as a second message after the
activation on the same stream, and its ``[E]`` totals as a second message after the
gradient; a forward-only pass sends neither and changes nothing.

``sequential = True`` runs the same actions one micro-batch at a time instead (F0 F1 B1
B0 for each micro-batch on every rank): the same gradients, with one micro-batch per
stage in flight. The harness's float32 truth runs so (`harness.compare.lockstep`): in float32
the DualPipeV order would hold twice the bytes the bfloat16 stacks hold in their own
order, and the truth is not there to be timed, only to be exact.
"""

from __future__ import annotations

from collections import deque

import torch

from models.network import MtpStep, StepBalance, mtp_loss
from models.runtime import (
    BACKWARD,
    FORWARD,
    Layout,
    PointToPoint,
    TorchPointToPoint,
    scheduled_step,
    step_balance,
)


class ReferenceDualPipeV:
    """Runs one training or evaluation step of DualPipeV on this pipeline rank."""

    def __init__(self, part, chunks: tuple[list[int], list[int]], layout: Layout, ops) -> None:
        self.part = part
        self.chunks = chunks
        self.layout = layout
        self.ops = ops
        self.rank, self.num_ranks = layout.pp_rank, layout.pp
        self.is_first, self.is_last = self.rank == 0, self.rank == self.num_ranks - 1
        self.observer = None
        """Optional ``observer(moment, micro_batch)`` called at each action (memory tracking)."""
        self.sequential = False
        """Run one micro-batch at a time through the whole V (see the module docstring)."""
        self.gradient_sync = None
        """Optional object told of every backward before it runs (``before_backward(chunk)``):
        FSDP2 (`twinpipe train` can shard this stack too) reduces at the chunk's last one."""
        self.p2p: PointToPoint = TorchPointToPoint()
        """How tensors travel to the neighbours, on the layout's stream groups
        (`models.runtime.p2p`)."""
        self.balance: StepBalance | None = None
        """The last training step's routing controls (load, balancing losses)."""
        self.mtp: MtpStep | None = None
        """What the next step's MTP loss needs (set by the runner; None: no MTP)."""

    defers_weight_gradients = False
    """A backward computes its weight gradients at once; the W steps complete nothing."""

    # ------------------------------------------------------------------ step
    def step(self, micro_batches, token_count: int, forward_only: bool = False) -> torch.Tensor:
        """Run all micro-batches; return this rank's share of the mean loss (0 off rank 0).
        A device-wide synchronisation inside is refused (`models.runtime.device_sync`)."""
        with scheduled_step():
            return self._step(micro_batches, token_count, forward_only)

    def _step(self, micro_batches, token_count: int, forward_only: bool = False) -> torch.Tensor:
        """Run all micro-batches; return this rank's share of the mean loss (0 off rank 0).

        ``micro_batches`` is a list of ``(input_ids, labels)``; ``token_count``
        is the number of labelled tokens in the whole global batch, so that the
        loss is the global mean whatever the layout.
        """
        self._begin(micro_batches, token_count, forward_only)
        if forward_only:
            self.phase = "forward-only"
            with torch.no_grad():
                for _ in range(self.num_micro_batches):
                    self.F(0)
                for _ in range(self.num_micro_batches):
                    self.F(1)
            return self._end()

        if self.sequential:
            self.phase = "sequential"
            for _ in range(self.num_micro_batches):
                self.F(0)
                self.F(1)
                self.B(1)
                self.B(0)
            return self._end()
        r, pp, m = self.rank, self.num_ranks, self.num_micro_batches
        # Phase 1, nF0: fill the V's left arm.
        self.phase = "nF0"
        for _ in range(2 * (pp - r - 1)):
            self.F(0)
        # Phase 2, nF0F1.
        self.phase = "nF0F1"
        for _ in range(r + 1):
            self.F(0)
            self.F(1)
        # Phase 3, nB1W1F1: zero-bubble backward of chunk 1.
        self.phase = "nB1W1F1"
        for _ in range(pp - r - 1):
            self.B(1)
            self.W()
            self.F(1)
        # Phase 4, nF0B1F1B0: the main loop, two overlapped pairs F0&B1 and F1&B0.
        self.phase = "nF0B1F1B0"
        for _ in range(m - 2 * pp + r + 1):
            self.F(0)
            self.B(1)
            self.F(1)
            self.B(0)
        # Phase 5, nB1F1B0.
        self.phase = "nB1F1B0"
        for _ in range(pp - r - 1):
            self.B(1)
            self.F(1)
            self.B(0)
        # Phase 6, nB1B0.
        self.phase = "nB1B0"
        for _ in range(r + 1):
            self.B(1)
            self.B(0)
        # Phase 7, nWB0.
        self.phase = "nWB0"
        for _ in range(pp - r - 1):
            self.W()
            self.B(0)
        # Phase 8, nW: drain.
        self.phase = "nW"
        for _ in range(r + 1):
            self.W()
        return self._end()

    # ------------------------------------------------------- the four actions
    def F(self, chunk: int) -> None:
        """Forward of the next micro-batch through this rank's stage ``chunk``."""
        j = self.forwarded[chunk]
        self.forwarded[chunk] += 1
        self._observe(f"F{chunk}", j)
        input_ids, labels = self.micro_batches[j]
        stats = None
        if chunk == 0 and self.is_first:
            leaf, hidden = None, self.part.embed(input_ids)
        else:
            leaf, stats = self._receive_activation(chunk)
            if torch.is_grad_enabled():
                leaf.requires_grad_()
            hidden = leaf
        balance = self.balance.micro_batch(stats) if self.training else None
        for index in self.chunks[chunk]:
            hidden = self.part.layer(index)(hidden, self.ops, balance)
        if chunk == 1 and self.is_first:
            loss = self.part.loss_sum(hidden, labels) / self.token_count
            self.loss = self.loss + loss.detach()
            output = loss
            if self.mtp is not None and balance is not None:  # training: after the main loss
                normed = self.part.model.norm(hidden)
                mtp = mtp_loss(self.part, normed, input_ids, labels, self.mtp, balance)
                output = loss + mtp.objective
                self.mtp_losses += mtp.losses
                self.mtp_correct += mtp.correct
            if balance is not None:
                balance.close(input_ids.numel())
        else:
            self._send_activation(chunk, hidden.detach(), balance)
            output = hidden
        if torch.is_grad_enabled():
            self.saved[chunk].append((leaf, output, balance))

    def B(self, chunk: int) -> None:
        """Backward of the oldest forwarded micro-batch of stage ``chunk`` (weights at once)."""
        leaf, output, balance = self.saved[chunk].popleft()
        self._observe(f"B{chunk}", self.backwarded[chunk])
        self.backwarded[chunk] += 1
        if self.gradient_sync is not None:
            self.gradient_sync.before_backward(chunk)
        if chunk == 1 and self.is_first:
            output.backward()
        else:
            grad, totals = self._receive_gradient(chunk)
            if totals is not None:
                balance.receive_totals(totals)
            torch.autograd.backward(output, grad)
        if leaf is not None:
            self._send_gradient(chunk, leaf.grad, balance.totals if self.pooled else None)

    def W(self) -> None:
        """Deferred weight gradients: none in the reference, which computes them in B.

        The step still reports itself, so both stacks mark the same sequence of actions."""
        self._observe("W", None)

    def _observe(self, action: str, micro_batch: int | None) -> None:
        if self.observer is not None:
            self.observer(f"{self.phase}:{action}", micro_batch)

    # -------------------------------------------------------- communication
    def _receive_activation(self, chunk: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The activation and, with the pooled loss on, the micro-batch's pooled sums."""
        if chunk == 1 and self.is_last:
            return self.local_activations.popleft()
        src = self.rank - 1 if chunk == 0 else self.rank + 1
        activation = self._recv(src, FORWARD, chunk)
        stats = self._recv(src, FORWARD, chunk, self.stats_shape) if self.pooled else None
        return activation, stats

    def _send_activation(self, chunk: int, tensor: torch.Tensor, balance) -> None:
        stats = balance.stats if self.pooled else None
        if chunk == 0 and self.is_last:
            self.local_activations.append((tensor, stats))
            return
        dst = self.rank + 1 if chunk == 0 else self.rank - 1
        self._send(tensor, dst, FORWARD, chunk)
        if stats is not None:
            self._send(stats, dst, FORWARD, chunk)

    def _receive_gradient(self, chunk: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The gradient and, with the pooled loss on, the micro-batch's ``[E]`` totals."""
        if chunk == 0 and self.is_last:
            return self.local_gradients.popleft()
        src = self.rank + 1 if chunk == 0 else self.rank - 1
        grad = self._recv(src, BACKWARD, chunk)
        totals = self._recv(src, BACKWARD, chunk, self.stats_shape[1:]) if self.pooled else None
        return grad, totals

    def _send_gradient(self, chunk: int, tensor: torch.Tensor, totals) -> None:
        if chunk == 1 and self.is_last:
            self.local_gradients.append((tensor, totals))
            return
        dst = self.rank - 1 if chunk == 0 else self.rank + 1
        self._send(tensor, dst, BACKWARD, chunk)
        if totals is not None:
            self._send(totals, dst, BACKWARD, chunk)

    def _send(self, tensor: torch.Tensor, pp_rank: int, direction: str, chunk: int) -> None:
        tensor = tensor.contiguous()
        group = self.layout.streams.pick(direction, chunk)
        handle = self.p2p.isend(tensor, self.layout.global_rank(pp_rank), group)
        self.pending_sends.append((handle, tensor))

    def _recv(self, pp_rank: int, direction: str, chunk: int, stats_shape=None) -> torch.Tensor:
        """A message from ``pp_rank``: an activation or gradient, or (``stats_shape``) the
        float32 balancing sums that follow it on the same stream."""
        shape, dtype = self.activation_shape, self.dtype
        if stats_shape is not None:
            shape, dtype = stats_shape, torch.float32
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        group = self.layout.streams.pick(direction, chunk)
        self.p2p.irecv(tensor, self.layout.global_rank(pp_rank), group).wait()
        return tensor

    # ------------------------------------------------------------ bookkeeping
    def _begin(self, micro_batches, token_count: int, forward_only: bool = False) -> None:
        self.micro_batches = micro_batches
        self.num_micro_batches = len(micro_batches)
        self.token_count = token_count
        batch, seq = micro_batches[0][0].shape
        self.activation_shape = (batch, seq, self.part.config.hidden_size)
        parameter = next(self.part.parameters())
        self.dtype, self.device = parameter.dtype, parameter.device
        self.forwarded = [0, 0]
        self.backwarded = [0, 0]
        self.saved = (deque(), deque())
        self.local_activations: deque = deque()
        self.local_gradients: deque = deque()
        self.pending_sends: list = []
        self.loss = torch.zeros((), dtype=torch.float32, device=self.device)
        self.training = torch.is_grad_enabled() and not forward_only
        if self.training:
            self.balance = step_balance(
                self.part.config, self.num_micro_batches, self.layout, self.device
            )
        self.pooled = self.training and self.balance.balancing.pooled
        depths = self.part.config.num_mtp_layers
        self.mtp_losses = torch.zeros(depths, dtype=torch.float32, device=self.device)
        self.mtp_correct = torch.zeros(depths, dtype=torch.long, device=self.device)
        self.stats_shape = (2, self.part.config.num_experts)

    def _end(self) -> torch.Tensor:
        for handle, _ in self.pending_sends:
            handle.wait()
        assert not self.saved[0] and not self.saved[1], "a forward was never backwarded"
        assert self.forwarded == [self.num_micro_batches] * 2
        self.pending_sends = []
        return self.loss
