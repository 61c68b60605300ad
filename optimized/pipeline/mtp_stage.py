"""The MTP module at the optimized stack's loss stage (DeepSeek-V3's multi-token prediction,
`models.network.mtp`).

DualPipeV puts the embedding and the output head on pp-rank 0, whose second chunk is the
loss stage, so the MTP module runs there on the parameters it shares: no parameter and no
activation crosses ranks for it (DeepSeek-V3's report, section 3.2.3). Each depth runs as
one plain decoder layer under autograd (with the part's ops: its expert weight gradients
are computed at once, not deferred to a W step), and its loss uses the stack's fused output
layer and cross-entropy, so no ``[tokens, vocab]`` logits wait for the backward. The main
loss and the MTP losses are one scalar, whose backward the loss stage already runs.

The seams (`MtpStage.input_ids`, `labels`, `embed`, `project`, `weight`) are methods so
that a planted bug (`harness.compare.planted`) can replace one on this stack alone.
"""

from __future__ import annotations

import torch

from models.network import IGNORE_INDEX, MtpStep, mtp_input_ids, mtp_labels, top1_rows


class MtpStage:
    """A step's MTP on the loss stage: its objective per micro-batch, and its figures."""

    def __init__(self, part, loss_fn) -> None:
        self.part, self.loss_fn = part, loss_fn
        self.losses: torch.Tensor | None = None
        """``[D]`` float32: this rank's share of each depth's mean loss this step."""
        self.correct: torch.Tensor | None = None
        """``[D]`` long: this rank's kept positions predicted right (top-1) this step."""

    def begin(self, device: torch.device) -> None:
        depths = self.part.config.num_mtp_layers
        self.losses = torch.zeros(depths, dtype=torch.float32, device=device)
        self.correct = torch.zeros(depths, dtype=torch.long, device=device)

    # ----------------------------------------------------------------- seams
    def input_ids(self, ids: torch.Tensor, depth: int) -> torch.Tensor:
        return mtp_input_ids(ids, depth)

    def labels(self, labels: torch.Tensor, depth: int, eod_id: int | None) -> torch.Tensor:
        return mtp_labels(labels, depth, eod_id)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.part.embed(ids)

    def project(self, layer, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        return layer.project(hidden, embedded)

    def weight(self, step: MtpStep, depth: int) -> torch.Tensor:
        return step.weight(depth)

    # ------------------------------------------------------------------- run
    def objective(self, head_input, ids, labels, step: MtpStep, balance) -> torch.Tensor:
        """``(lambda / D) sum_k`` of this micro-batch's share of each ``L_k``, from the main
        model's last hidden state ``head_input`` (before its final norm)."""
        part = self.part
        hidden = part.model.norm(head_input)  # h^0: what the main head reads
        objective = torch.zeros((), dtype=torch.float32, device=head_input.device)
        for layer in part.mtp_layers:
            k = layer.depth
            embedded = self.embed(self.input_ids(ids, k))
            out = layer(self.project(layer, hidden, embedded), part.ops, balance)
            hidden = layer.shared_head.norm(out)
            target = self.labels(labels, k, step.eod_id)
            summed, _ = part.lm_head.fused_loss(hidden, target, self.loss_fn)
            objective = objective + summed * self.weight(step, k)
            self.losses[k - 1] += summed.detach().float() / step.counts[k - 1]
            # Through the output layer's registered method, as the loss: FSDP2 gathers its
            # weight around the call (with reshard-after-forward it is sharded here).
            self.correct[k - 1] += part.lm_head.fused_loss(hidden.detach(), target, top1_correct)
        return objective


@torch.no_grad()
def top1_correct(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor):
    """Kept positions whose most likely token is the target, the logits made
    `top1_rows` tokens at a time (the fused loss keeps none)."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    target = target.reshape(-1)
    correct = torch.zeros((), dtype=torch.long, device=hidden.device)
    block = top1_rows(weight.shape[0])
    for first in range(0, hidden.shape[0], block):
        rows = slice(first, first + block)
        best = (hidden[rows] @ weight.t()).argmax(dim=-1)
        correct += ((best == target[rows]) & (target[rows] != IGNORE_INDEX)).sum()
    return correct
