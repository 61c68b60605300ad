"""`twinpipe compare`'s routing controls: the flags that turn them on for a comparison.

The flags are the trainer's ``[moe]`` names (`models.network.Balancing`): ``--aux-loss``
(``auto``: what the model's config asks; ``none``; or a form of
`models.network.balancing.AUX_FORMS`), ``--aux-loss-coef``, ``--z-loss-coef``,
``--expert-bias`` and ``--expert-bias-rate``; and multi-token prediction's ``--mtp-layers``
and ``--mtp-loss-coef`` (the ``[mtp]`` section). They are applied to the `ModelConfig` before
any rank starts (`with_controls`), so both stacks and the oracle train with the same
objective, and a bad value exits 2 naming its flag. A flag that would change nothing is
refused too: a coefficient for a loss that is off, a rate for a bias that is off.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

from models.network import AUX_FORMS, ModelConfig

FLAGS = {
    "aux_loss": "--aux-loss",
    "aux_loss_coef": "--aux-loss-coef",
    "router_z_loss_coef": "--z-loss-coef",
    "expert_bias": "--expert-bias",
    "expert_bias_rate": "--expert-bias-rate",
}
"""`ModelConfig` field -> the flag that sets it."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("routing controls (the trainer's [moe] section)")
    group.add_argument(
        "--aux-loss",
        choices=("auto", *AUX_FORMS),
        default="auto",
        help="load-balancing loss: auto (what the model's config asks), none, pooled "
        "(transformers'), layer or sequence (DeepSeek-V2's)",
    )
    group.add_argument(
        "--aux-loss-coef", type=float, help="its coefficient (default: the config's)"
    )
    group.add_argument(
        "--z-loss-coef", type=float, help="router z-loss coefficient (default: the config's)"
    )
    group.add_argument(
        "--expert-bias",
        action="store_true",
        help="aux-loss-free balancing: a float32 bias per MoE layer, moved once per step",
    )
    group.add_argument(
        "--expert-bias-rate", type=float, help="how far a step moves the bias (default 1e-3)"
    )
    group.add_argument(
        "--mtp-layers", type=int, help="multi-token prediction's depth D (default: the config's)"
    )
    group.add_argument(
        "--mtp-loss-coef", type=float, help="the MTP losses' weight lambda (default 0.1)"
    )


def with_controls(model: ModelConfig, args: argparse.Namespace) -> ModelConfig:
    """``model`` with the flags' routing controls; `ValueError` naming the flag when one is
    invalid or changes nothing."""
    for field in ("aux_loss_coef", "router_z_loss_coef", "expert_bias_rate"):
        value = getattr(args, field.removeprefix("router_"))
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{FLAGS[field]}={value!r} is invalid: expected a finite float >= 0")
    if args.mtp_layers is not None and args.mtp_layers < 0:
        raise ValueError(f"--mtp-layers={args.mtp_layers!r} is invalid: expected an integer >= 0")
    if args.mtp_loss_coef is not None and not (
        math.isfinite(args.mtp_loss_coef) and args.mtp_loss_coef >= 0
    ):
        raise ValueError(
            f"--mtp-loss-coef={args.mtp_loss_coef!r} is invalid: expected a finite float >= 0"
        )
    changes = {"aux_loss": args.aux_loss}
    if args.mtp_layers is not None:
        changes["num_mtp_layers"] = args.mtp_layers
    if args.mtp_loss_coef is not None:
        changes["mtp_loss_coef"] = args.mtp_loss_coef
    if args.aux_loss_coef is not None:
        changes["aux_loss_coef"] = args.aux_loss_coef
    if args.z_loss_coef is not None:
        changes["router_z_loss_coef"] = args.z_loss_coef
    if args.expert_bias:
        changes["expert_bias"] = True
    if args.expert_bias_rate is not None:
        changes["expert_bias_rate"] = args.expert_bias_rate
    try:
        controlled = dataclasses.replace(model, **changes)
    except ValueError as error:
        if args.aux_loss not in ("auto", "none") and not (args.aux_loss_coef or 0) > 0:
            raise ValueError(
                f"--aux-loss={args.aux_loss!r} needs a positive coefficient and the model's "
                "config gives none: add --aux-loss-coef"
            ) from error
        raise ValueError(f"the routing controls: {error}") from error
    balancing = controlled.balancing()
    if args.aux_loss_coef is not None and not balancing.aux and args.aux_loss_coef > 0:
        raise ValueError(
            f"--aux-loss-coef={args.aux_loss_coef!r} changes nothing: no load-balancing loss "
            f"is on; choose one with --aux-loss {{{','.join(AUX_FORMS[1:])}}}"
        )
    if args.expert_bias_rate is not None and not balancing.expert_bias:
        raise ValueError(
            f"--expert-bias-rate={args.expert_bias_rate!r} changes nothing: the expert bias "
            "is off; add --expert-bias"
        )
    return controlled
