"""The training objective beyond plain cross-entropy: which runner may take it, its z-loss
for the log, and the ``[moe]`` section's routing controls applied to the model.

``loss.z_loss`` and ``loss.label_smoothing`` (`optimized.train.config.LossSection`) run
inside the optimized stack's fused output-layer loss
(`optimized.pipeline.dualpipev.SummedLinearCrossEntropy`). The reference stack computes
plain cross-entropy, so a runner that does not take them is refused before any rank
starts (`optimized.train.preflight`), not silently trained on another objective.

The ``[moe]`` section (`optimized.train.config.MoeSection`: load-balancing loss, router
z-loss, expert bias) belongs to the model, not the runner: both stacks compute it
(`models.network.balancing`), so `with_moe` sets it on the `ModelConfig` before anything
is built, and a choice the model cannot take is refused there, before any rank starts.
"""

from __future__ import annotations

import inspect

import torch

from models.network import ModelConfig
from models.runtime import BadInput, Layout, shared_loss
from optimized.train.config import TrainConfig

MOE_FIELDS = {
    "aux_loss": "aux_loss",
    "aux_loss_coef": "aux_loss_coef",
    "z_loss_coef": "router_z_loss_coef",
    "expert_bias": "expert_bias",
    "expert_bias_rate": "expert_bias_rate",
}
"""``[moe]`` key -> the `ModelConfig` field it sets."""


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


def with_moe(cfg: TrainConfig, model: ModelConfig) -> ModelConfig:
    """``model`` with ``cfg.moe`` applied (`MOE_FIELDS`); `BadInput` naming the ``moe.`` key,
    its value and what is valid when this model cannot take it: a form without a
    coefficient, a coefficient for a loss that is off, any control on a model without MoE
    layers."""
    moe = cfg.moe
    changes = {  # unset: the model's own
        field: getattr(moe, key)
        for key, field in MOE_FIELDS.items()
        if getattr(moe, key) is not None
    }
    default = type(moe)()
    asked = [key for key in MOE_FIELDS if getattr(moe, key) != getattr(default, key)]
    if asked and model.moe_layers == 0:
        raise BadInput(
            f"moe.{asked[0]} = {getattr(moe, asked[0])!r} is invalid: the {model.model_type} "
            "model being trained has no MoE layer to balance"
        )
    own = model.balancing().aux_coef if moe.aux_loss_coef is None else moe.aux_loss_coef
    if moe.aux_loss not in ("auto", "none") and not own > 0:
        raise BadInput(
            f"moe.aux_loss = {moe.aux_loss!r} is invalid without a coefficient: this "
            f"{model.model_type} model's config.json gives none, set moe.aux_loss_coef > 0"
        )
    try:
        balanced = model.replace(**changes)
    except ValueError as error:  # ModelConfig.<field>=...: name the [moe] key instead
        text = str(error)
        for key, field in MOE_FIELDS.items():
            text = text.replace(f"ModelConfig.{field}=", f"moe.{key} = ")
        raise BadInput(f"{text} (model {model.model_type})") from None
    if moe.aux_loss_coef is not None and moe.aux_loss_coef > 0 and not balanced.balancing().aux:
        why = (
            "turns the loss off"
            if moe.aux_loss == "none"
            else (f"trains this {model.model_type} model with none (its config.json asks for none)")
        )
        raise BadInput(
            f"moe.aux_loss_coef = {moe.aux_loss_coef!r} is invalid: moe.aux_loss = "
            f"{moe.aux_loss!r} {why}; set moe.aux_loss to pooled, layer or sequence, or "
            "unset the coefficient"
        )
    return balanced


def with_mtp(cfg: TrainConfig, model: ModelConfig) -> ModelConfig:
    """``model`` with ``cfg.mtp`` applied: the depth (unset: the model's own) and the loss
    weight; `BadInput` naming the ``mtp.`` key when the model cannot take it."""
    mtp = cfg.mtp
    changes = {"mtp_loss_coef": mtp.loss_coef}
    if mtp.layers is not None:
        changes["num_mtp_layers"] = mtp.layers
    try:
        return model.replace(**changes)
    except ValueError as error:
        text = str(error)
        for key, field in (("layers", "num_mtp_layers"), ("loss_coef", "mtp_loss_coef")):
            text = text.replace(f"ModelConfig.{field}=", f"mtp.{key} = ")
        raise BadInput(f"{text} (model {model.model_type})") from None
