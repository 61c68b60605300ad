"""The ``[mtp]`` section of a training run, and the MTP loss weight over a run:
``mtp.loss_coef`` and its ``mtp.loss_coef_steps`` changes (DeepSeek-V3 trained with 0.3 for
its first 10 T tokens, then 0.1). The section's docstrings are read as
`optimized.train.config` reads its own."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(slots=True)
class MtpSection:
    """Multi-token prediction (DeepSeek-V3's MTP module, `models.network.mtp`); applied to
    the model's config before anything is built (`optimized.train.objective.with_mtp`)."""

    layers: int | None = field(default=None, metadata={"flag": "mtp-layers"})
    """MTP depth D: one extra decoder layer per depth, depth k predicting the token k + 1
    ahead; 0 trains none. Unset: the model's own (a DeepSeek-V3 config.json's
    num_nextn_predict_layers)."""
    loss_coef: float = field(default=0.1, metadata={"flag": "mtp-loss-coef"})
    """lambda in ``loss + lambda / D * sum_k loss_k`` (Megatron's default 0.1)."""
    loss_coef_steps: str | None = field(default=None, metadata={"flag": "mtp-loss-coef-steps"})
    """Changes of loss_coef during the run: ``STEP:VALUE,...``, steps (1-based) in increasing
    order, each value holding from its step on (DeepSeek-V3: 0.3 then 0.1); unset: none."""


def coef_steps(text: str) -> list[tuple[int, float]]:
    """``mtp.loss_coef_steps`` (``STEP:VALUE,...``) as ``[(step, value)]``; `ValueError`
    saying what is valid when an entry is malformed, a value negative or not finite, or the
    steps not strictly increasing."""
    out: list[tuple[int, float]] = []
    for entry in text.split(","):
        step, sep, value = entry.strip().partition(":")
        try:
            parsed = (int(step), float(value))
        except ValueError:
            parsed = None
        if not sep or parsed is None or parsed[0] < 1:
            raise ValueError(f"entry {entry.strip()!r} must be STEP:VALUE with a step >= 1")
        if not (math.isfinite(parsed[1]) and parsed[1] >= 0):
            raise ValueError(f"entry {entry.strip()!r}: the value must be a finite number >= 0")
        if out and parsed[0] <= out[-1][0]:
            raise ValueError(
                f"steps must increase: {parsed[0]} comes after {out[-1][0]} (STEP:VALUE,... "
                "in order)"
            )
        out.append(parsed)
    return out


def mtp_coef_at(step: int, cfg) -> float:
    """The MTP loss weight of 1-based ``step``: ``mtp.loss_coef`` until the first change of
    ``mtp.loss_coef_steps``, then each change's value from its step on."""
    coef = cfg.mtp.loss_coef
    for start, value in coef_steps(cfg.mtp.loss_coef_steps) if cfg.mtp.loss_coef_steps else ():
        if step >= start:
            coef = value
    return coef


def check_mtp(mtp, check) -> None:
    """The ``[mtp]`` section's checks, as `optimized.train.config.validate_config` makes them
    (``check(ok, key, valid)``)."""
    layers = mtp.layers
    ok = layers is None or (isinstance(layers, int) and not isinstance(layers, bool))
    check(ok and (layers is None or layers >= 0), "mtp.layers",
          "must be an integer >= 0 (the MTP depth D), or unset")  # fmt: skip
    coef = mtp.loss_coef
    check(math.isfinite(coef) and coef >= 0, "mtp.loss_coef", "must be a finite number >= 0")
    if mtp.loss_coef_steps is not None:
        try:
            coef_steps(mtp.loss_coef_steps)
        except ValueError as error:
            check(False, "mtp.loss_coef_steps", str(error))
