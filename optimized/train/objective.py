"""The training objective beyond plain cross-entropy: which runner may take it, and its
z-loss for the log.

``loss.z_loss`` and ``loss.label_smoothing`` (`optimized.train.config.LossSection`) run
inside the optimized stack's fused output-layer loss
(`optimized.pipeline.dualpipev.SummedLinearCrossEntropy`). The reference stack computes
plain cross-entropy, so a runner that does not take them is refused before any rank
starts (`optimized.train.preflight`), not silently trained on another objective.
"""

from __future__ import annotations

import inspect

import torch

from models.runtime import BadInput, Layout, shared_loss
from optimized.train.config import TrainConfig


def objective_options(cfg: TrainConfig, runner: type) -> dict[str, float]:
    """The keywords ``runner`` is built with: none for plain cross-entropy (every runner
    takes that), else ``label_smoothing`` and ``z_loss``, which only the optimized runner
    has (`BadInput` naming both keys otherwise)."""
    if not (cfg.loss.z_loss or cfg.loss.label_smoothing):
        return {}
    if "z_loss" not in inspect.signature(runner.__init__).parameters:
        raise BadInput(
            f"loss.z_loss = {cfg.loss.z_loss} and loss.label_smoothing = "
            f"{cfg.loss.label_smoothing} need the optimized stack's runner; "
            f"{runner.__module__}:{runner.__name__} computes plain cross-entropy only"
        )
    return {"label_smoothing": cfg.loss.label_smoothing, "z_loss": cfg.loss.z_loss}


def mean_z_loss(schedule, layout: Layout) -> torch.Tensor:
    """The step's mean z-loss on every rank, from the schedule's shares on pp-rank 0 (as
    `models.runtime.shared_loss` gives the loss), on the device, unread."""
    return shared_loss(schedule.z_loss, layout)
