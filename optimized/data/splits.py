"""``--split``: each source's documents cut into a training part and a held-out part, by
whole documents, as Megatron's ``--split`` cuts them (`split_documents`).

``99,1`` gives the first 99% of a source's documents (in their order on disk) to training
and the rest to evaluation; a third weight (``949,50,1``: Megatron's test part) is accepted
and its documents are read by neither. Each part is a contiguous range of documents, so of
tokens: its windows (`optimized.data.sources.Windows`) never reach into another part, and no
document is in both.
"""

from __future__ import annotations

import math


def parse_split(text: str) -> list[float]:
    """``"99,1"`` as ``[0.99, 0.01]``: two or three weights (commas or slashes), each a finite
    number >= 0, training's > 0, summing to a positive number; `ValueError` names the part."""
    pieces = [p.strip() for p in text.replace("/", ",").split(",")]
    if not 2 <= len(pieces) <= 3:
        raise ValueError(
            f"{len(pieces)} part(s); expected TRAIN,EVAL (or Megatron's TRAIN,EVAL,TEST), "
            "weights such as 99,1"
        )
    weights = []
    for position, piece in enumerate(pieces, 1):
        try:
            value = float(piece)
        except ValueError:
            raise ValueError(f"part {position} {piece!r} is not a number") from None
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"part {position} = {piece} must be a finite number >= 0")
        weights.append(value)
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"the parts sum to {total:g}; they must sum to a positive number")
    if weights[0] <= 0:
        raise ValueError("the training part (the first) is 0: nothing would be trained on")
    return [w / total for w in weights]


def split_documents(num_documents: int, fractions: list[float]) -> list[int]:
    """Document boundaries ``[0, b1, ..., num_documents]`` of the parts: part ``i`` holds
    documents ``[b_i, b_(i+1))``. Megatron-Core's rule (``convert_split_vector_to_split_matrix``
    and the builder's ``round(bookend * num_documents)``): each boundary is the running sum
    of the fractions times the documents, rounded."""
    bounds, running = [0], 0.0
    for fraction in fractions:
        running += fraction
        bounds.append(min(int(round(running * float(num_documents))), num_documents))
    return bounds
