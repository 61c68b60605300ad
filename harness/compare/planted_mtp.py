"""Multi-token prediction's bugs, planted in the optimized stack (`harness.compare.planted`).

Each is a bug an implementation of DeepSeek-V3's MTP (`models.network.mtp`) could ship, and
each replaces one seam of the optimized stack's loss stage
(`optimized.pipeline.mtp_stage.MtpStage`), which only that stack runs:

- ``mtp-depth-one-short``: depth ``k`` learns the target ``k`` ahead instead of ``k + 1``
  (depth 1 predicts what the main head predicts);
- ``mtp-concat-swapped``: ``eh_proj`` reads ``cat(hnorm(h), enorm(Emb))``, the report's
  written order, not the published weights' (the embedding first);
- ``mtp-embedding-detached``: the MTP's embedding lookup keeps its gradient out of the
  shared embedding (a copy instead of the shared parameter);
- ``mtp-loss-not-divided-by-d``: the MTP losses weigh ``lambda`` each, not ``lambda / D``;
- ``mtp-labels-wrapped``: the targets rolled around the sequence (``torch.roll``) instead of
  ignored past its end, so the last positions learn the sequence's first tokens.

`plant_problem` says when one cannot show (no MTP, or ``D = 1`` for the division).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

Patch = Iterator[tuple[Any, str, Any]]


def _stage() -> Any:
    from optimized.pipeline import MtpStage  # noqa: PLC0415

    return MtpStage


def _depth_one_short() -> Patch:
    stage = _stage()
    original = stage.labels

    def planted(self, labels, depth, eod_id):
        return original(self, labels, depth - 1, eod_id)

    yield stage, "labels", planted


def _concat_swapped() -> Patch:
    def planted(self, layer, hidden, embedded):
        return layer.eh_proj(torch.cat([layer.hnorm(hidden), layer.enorm(embedded)], dim=-1))

    yield _stage(), "project", planted


def _embedding_detached() -> Patch:
    def planted(self, ids):
        return self.part.embed(ids).detach()

    yield _stage(), "embed", planted


def _not_divided_by_d() -> Patch:
    def planted(self, step, depth):
        return step.coef / step.counts[depth - 1]

    yield _stage(), "weight", planted


def _labels_wrapped() -> Patch:
    def planted(self, labels, depth, eod_id):
        return torch.roll(labels, -depth, dims=1)

    yield _stage(), "labels", planted


MTP_PATCHES: dict[str, Callable[[], Patch]] = {
    "mtp-depth-one-short": _depth_one_short,
    "mtp-concat-swapped": _concat_swapped,
    "mtp-embedding-detached": _embedding_detached,
    "mtp-loss-not-divided-by-d": _not_divided_by_d,
    "mtp-labels-wrapped": _labels_wrapped,
}
"""Each plant's patches, ``(owner, attribute, replacement)`` (`harness.compare.planted`)."""
MTP_PLANTS = tuple(MTP_PATCHES)


def plant_problem(name: str, model: Any) -> str | None:
    """Why plant ``name`` cannot show on ``model``, or None."""
    if name not in MTP_PLANTS:
        return None
    if not model.num_mtp_layers:
        return f"--plant={name!r} breaks multi-token prediction, which is off: add --mtp-layers"
    if name == "mtp-loss-not-divided-by-d" and model.num_mtp_layers < 2:
        return f"--plant={name!r} shows only with two depths or more: use --mtp-layers 2"
    return None
