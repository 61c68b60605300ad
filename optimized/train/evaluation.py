"""Held-out evaluation during `twinpipe train`: the validation loss and perplexity.

The held-out data (`optimized.data.corpus.held_out`: ``--eval-data``, else ``--split``'s
held-out part) gives ``data.eval_batches`` global batches, the first ones of its blend from
the run's seed: the same batches at every evaluation, whatever the layout. Every rank
reads the whole global batch (no collective for the data), and the runner's forward-only
pass (`models.runtime.PipelineRunner.evaluate`: DualPipeV's forward chunks under
``no_grad``) takes the mean loss over it: no graph, no gradient, no optimizer step, and no
routing control moves or counts (a forward-only pass records no `StepBalance`, so the
expert biases and the logged expert load are the training steps' alone). With FSDP2 each
unit's gathered parameters are freed after the pass, as a training step leaves them.

The validation loss is the mean over the batches of each one's mean token loss (the
batches hold the same number of tokens), the plain cross-entropy without z-loss, label
smoothing or balancing terms; the perplexity is ``exp`` of it.
"""

from __future__ import annotations

import math

import torch

from optimized.data.corpus import held_out
from optimized.train.config import TrainConfig


class Evaluation:
    """The run's held-out evaluation on this rank (`Evaluation.of`: None without held-out
    data)."""

    def __init__(self, cfg: TrainConfig, corpus, runner, device: torch.device, fsdp: bool):
        self.corpus, self.runner, self.device, self.fsdp = corpus, runner, device, fsdp
        self.every, self.count, self.seed = cfg.data.eval_every, cfg.data.eval_batches, cfg.seed
        data = cfg.data
        self.global_batch = cfg.parallel.dp * data.micro_batches * data.micro_batch_size

    @classmethod
    def of(cls, cfg: TrainConfig, data_spec: str, runner, device, fsdp: bool):
        corpus = held_out(data_spec, cfg.data.eval_path, cfg.data.split, cfg.data.seq_len)
        return None if corpus is None else cls(cfg, corpus, runner, device, fsdp)

    def due(self, done: int, steps: int) -> bool:
        """Whether the run evaluates after step ``done`` (1-based): every ``eval_every``
        steps, and after the last."""
        return done == steps or bool(self.every and done % self.every == 0)

    def run(self) -> tuple[float, float]:
        """``(validation loss, perplexity)`` of the weights as they are now."""
        losses = []
        for inputs, labels in self.corpus.batches(self.seed, self.count, self.global_batch):
            losses.append(self.runner.evaluate(inputs.to(self.device), labels.to(self.device)))
            sync = getattr(self.runner.schedule, "gradient_sync", None)
            if self.fsdp and sync is not None:
                for unit in sync.all_units():
                    unit.reshard()  # a forward-only pass leaves them gathered
        loss = sum(losses) / len(losses)
        return loss, math.exp(loss) if loss < 700 else math.inf
