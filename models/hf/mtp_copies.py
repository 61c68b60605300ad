"""DeepSeek-V3's MTP layers' copies of the embedding and the output head, checked on read.

A published DeepSeek-V3 folder stores, in each multi-token-prediction layer, a copy of the
main model's embedding (``model.layers.{N}.embed_tokens.weight``) and output layer
(``model.layers.{N}.shared_head.head.weight``), as `models.hf.hf_layout.to_hf_state_dict`
also writes them. twinpipe's MTP layer shares the main model's own (`models.network.mtp`),
so a copy is not loaded: it is read once and held equal to what it copies. A folder where
they differ was trained with untied copies, and loading it would silently change the MTP
layer; it is refused, naming both tensors and the first row that differs.

Both are ``vocab x hidden`` (1.85 GB each in bf16 for DeepSeek-V3): they are compared a
block of rows at a time (`BLOCK_BYTES` of each, in float32), one pair at a time, read by
the same row reader as the weights (FP8 ones dequantised), so the check holds two blocks
and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from models.hf.hf_layout import MTP_COPIES, CheckpointError
from models.network import ModelConfig

BLOCK_BYTES = 32 << 20
"""The float32 bytes of each tensor held at once while comparing."""


def copy_names(config: ModelConfig) -> dict[str, str]:
    """Each MTP layer's copy on disk -> the main model's tensor it copies."""
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    main = dict(zip(MTP_COPIES, ("model.embed_tokens.weight", head), strict=True))
    first = config.num_hidden_layers
    return {
        f"model.layers.{layer}{suffix}": main[suffix]
        for layer in range(first, first + config.num_mtp_layers)
        for suffix in MTP_COPIES
    }


def compare_copies(
    copies: dict, config: ModelConfig, read: Callable[[str, torch.Tensor, int], None], where: str
) -> None:
    """Hold each copy in ``copies`` (name -> stored tensor, with ``shape``; a folder may
    lack them) equal to its main tensor, ``read(name, out, first_row)`` filling ``out``
    with rows of either; `CheckpointError` naming every pair that differs."""
    shape = (config.vocab_size, config.hidden_size)
    problems = []
    for copy, main in copy_names(config).items():
        if copy not in copies:
            continue
        if tuple(copies[copy].shape) != shape:
            problems.append(
                f"{copy}: expected {list(shape)} (a copy of {main}), found "
                f"{list(copies[copy].shape)} (in {copies[copy].file})"
            )
            continue
        row = first_difference(copy, main, shape, read)
        if row is not None:
            problems.append(f"{copy} differs from {main} (first at row {row})")
    if problems:
        raise CheckpointError(
            f"checkpoint {where}: the MTP layer shares the main model's embedding and output "
            "head, but its copies on disk are not theirs:\n  " + "\n  ".join(problems)
        )


def first_difference(
    copy: str, main: str, shape: tuple[int, int], read: Callable[[str, torch.Tensor, int], None]
) -> int | None:
    """The first row where ``copy`` and ``main`` (both ``shape``) differ, None if none."""
    rows, cols = shape
    per = max(1, BLOCK_BYTES // (4 * cols))
    for first in range(0, rows, per):
        count = min(per, rows - first)
        a = torch.empty((count, cols), dtype=torch.float32)
        b = torch.empty((count, cols), dtype=torch.float32)
        read(copy, a, first)
        read(main, b, first)
        if not torch.equal(a, b):
            return first + int((a != b).any(dim=1).nonzero()[0])
    return None
