"""Weighted blends of sources: Megatron's ``--data-path`` syntax, the order every rank
computes alike, each source's epochs, and the position a checkpoint keeps.

``--data "0.7 web/ 0.3 code/"`` weighs each path; ``--data "a/ b/"`` (paths alone: several
prepared folders, or the pieces of one corpus ``prepare-data --shard`` wrote) weighs each by
its tokens. `parse_blend` reads it.

The order (`Blend`), the same on every rank and at every layout, from the seed:

1. *which source* sample ``n`` (0-based, counted over the whole run) comes from:
   Tijdeman's rule (`blend_sources`), which keeps what Megatron's greedy rule
   (``build_blending_indices``) aims for: in every prefix of ``n`` samples each source's
   count is within one sample of ``weight * n`` (within ``1 - 1/(2S - 2)`` of it, for
   ``S`` sources);
2. *which of its samples*: the source's ``k``-th draw is sample ``k mod N`` of its epoch
   ``k // N`` (``N``: its windows, `optimized.data.sources.Windows`), each epoch a
   permutation drawn from ``(seed, source, epoch)``. A source that runs out starts its
   next epoch, reshuffled, and the loader reports it (`Blend.notes`).

The position is the number of samples taken and each source's count (so its epoch and
its offset in it): a few integers, independent of DP, checkpointed by `BlendLoader`'s
``state_dict``. A resume at another DP layout with the same global batch reads the same
global batches.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np
import torch


def parse_blend(text: str) -> list[tuple[float | None, str]]:
    """``"0.7 web/ 0.3 code/"`` as ``[(0.7, "web/"), (0.3, "code/")]``; paths alone as
    ``[(None, path), ...]``. `ValueError` names the entry: an odd count, a weight that is
    not a number, negative or not finite, weights summing to zero, weighted and unweighted
    paths mixed."""
    words = text.split()
    if not words:
        raise ValueError("the blend is empty: give PATH [PATH ...] or WEIGHT PATH [...]")
    if _number(words[0]) is None:
        numbers = [w for w in words if _number(w) is not None]
        if numbers:
            raise ValueError(
                f"{numbers[0]!r} looks like a weight, but the blend starts with the path "
                f"{words[0]!r}: give every path a weight (WEIGHT PATH ...) or none"
            )
        return [(None, w) for w in words]
    if len(words) % 2:
        raise ValueError(
            f"{len(words)} words: a weighted blend is pairs WEIGHT PATH, the last weight "
            f"{words[-2]!r} or path {words[-1]!r} has no partner"
        )
    pairs = []
    for i in range(0, len(words), 2):
        weight, path = _number(words[i]), words[i + 1]
        where = f"entry {i // 2 + 1} ({words[i]} {path})"
        if weight is None:
            raise ValueError(f"{where}: the weight {words[i]!r} is not a number")
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"{where}: the weight {words[i]} must be a finite number >= 0")
        pairs.append((weight, path))
    total = sum(w for w, _ in pairs)
    if total <= 0:
        raise ValueError(f"the weights sum to {total:g}; they must sum to a positive number")
    return pairs


def _number(word: str) -> float | None:
    try:
        return float(word)
    except ValueError:
        return None


def blend_sources(weights: Sequence[float], counts: np.ndarray, start: int, n: int) -> np.ndarray:
    """The sources of samples ``start .. start + n - 1`` (0-based); ``counts`` (each source's
    samples before ``start``) is advanced in place.

    Tijdeman's rule (the chairman assignment problem, 1980): with ``S`` sources and
    ``d = 1 / (2S - 2)``, sample ``t = n + 1`` (1-based) goes to the source with the earliest
    deadline ``(count + 1 - d) / weight`` among those owed at least ``d``
    (``weight * t - count >= d``), the first on a tie. Every prefix of ``t`` samples then
    holds each source within ``1 - d`` of ``weight * t``: within one sample, as Megatron's
    greedy rule aims for, where that rule can stray past it (``tests/test_blend.py``)."""
    w = [float(x) for x in weights]
    c = [int(x) for x in counts]
    owed = 1.0 / (2 * len(w) - 2) if len(w) > 1 else 0.0
    live = [s for s in range(len(w)) if w[s] > 0]
    picked = np.empty(n, dtype=np.int64)
    for i in range(n):
        t = start + i + 1
        best, due = live[0], math.inf
        for s in live:
            if w[s] * t - c[s] >= owed - 1e-12:
                deadline = (c[s] + 1 - owed) / w[s]
                if deadline < due:
                    best, due = s, deadline
        c[best] += 1
        picked[i] = best
    counts[:] = c
    return picked


class Blend:
    """The global sample order over sources of ``sizes`` samples each, weighted
    ``weights`` (normalised here), from ``seed`` (see the module docstring)."""

    def __init__(
        self,
        sizes: Sequence[int],
        weights: Sequence[float],
        seed: int = 0,
        shuffle: bool = True,
        names: Sequence[str] | None = None,
    ):
        if len(sizes) != len(weights) or not sizes:
            raise ValueError(f"{len(sizes)} sources and {len(weights)} weights")
        total = float(sum(weights))
        if not total > 0 or any(w < 0 for w in weights):
            raise ValueError(f"weights {list(weights)} must be >= 0 and sum to more than 0")
        self.weights = [float(w) / total for w in weights]
        self.sizes = [int(s) for s in sizes]
        self.names = list(names or (f"source {i}" for i in range(len(sizes))))
        for name, size, weight in zip(self.names, self.sizes, self.weights, strict=True):
            if size < 1 and weight > 0:
                raise ValueError(f"{name} holds no sample, but has weight {weight:g}")
        self.seed, self.shuffle = seed, shuffle
        self.position = 0
        self.counts = np.zeros(len(sizes), dtype=np.int64)
        self.notes: list[str] = []
        """Lines to log: sources that ran out and started a new epoch (the caller empties it)."""
        self._orders: dict[tuple[int, int], np.ndarray] = {}

    def order(self, source: int, epoch: int) -> np.ndarray:
        """Source ``source``'s samples in epoch ``epoch``'s order."""
        key = (source, epoch)
        if key not in self._orders:
            size = self.sizes[source]
            if self.shuffle:
                rng = np.random.Generator(np.random.PCG64([self.seed, source, epoch]))
                order = rng.permutation(size)
            else:
                order = np.arange(size)
            self._orders = {k: v for k, v in self._orders.items() if k[0] != source}
            self._orders[key] = order.astype(np.int64)
        return self._orders[key]

    def take(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The next ``n`` samples as ``(sources, sample ids)``; advances the position."""
        before = self.counts.copy()
        sources = blend_sources(self.weights, self.counts, self.position, n)
        self.position += n
        ids = np.empty(n, dtype=np.int64)
        for s in np.unique(sources):
            rows = np.flatnonzero(sources == s)
            draws = before[s] + np.arange(rows.size)
            size = self.sizes[s]
            epochs = draws // size
            for epoch in np.unique(epochs):
                mine = epochs == epoch
                ids[rows[mine]] = self.order(int(s), int(epoch))[draws[mine] % size]
            first, last = -(-int(before[s]) // size), int((self.counts[s] - 1) // size)
            for epoch in range(max(first, 1), last + 1):  # epochs whose first draw is here
                self.notes.append(
                    f"data: {self.names[s]} ran out after epoch {epoch} of its "
                    f"{size} samples; epoch {epoch + 1} starts, reshuffled"
                )
        return sources, ids

    def epochs(self) -> list[int]:
        """Each source's current epoch (0-based: the epoch its next sample comes from)."""
        return [int(c // s) if s else 0 for c, s in zip(self.counts, self.sizes, strict=True)]

    def state_dict(self) -> dict:
        return {
            "position": self.position,
            "counts": [int(c) for c in self.counts],
            "epochs": self.epochs(),
            "offsets": [int(c % s) if s else 0 for c, s in zip(self.counts, self.sizes)],
            "seed": self.seed,
            "shuffle": self.shuffle,
            "sizes": self.sizes,
            "weights": self.weights,
            "names": self.names,
        }

    def load_state_dict(self, state: dict) -> None:
        if "position" not in state:
            raise ValueError(
                "the checkpoint's data position is the single-folder loader's of an earlier "
                "twinpipe; resume it with that version, or branch with --init-from"
            )
        for key in ("seed", "shuffle", "sizes"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"the checkpoint's data has {key} = {state[key]!r}, this run's "
                    f"{getattr(self, key)!r} ({', '.join(self.names)}); resume with the same "
                    "data, seq_len, split and seed"
                )
        if not np.allclose(state["weights"], self.weights, rtol=1e-12, atol=0):
            raise ValueError(f"the checkpoint's blend weights {state['weights']} are not this "
                             f"run's {self.weights}")  # fmt: skip
        counts = np.asarray(state["counts"], dtype=np.int64)
        if counts.sum() != state["position"] or (counts < 0).any():
            raise ValueError(f"the checkpoint's data position {state} is inconsistent")
        self.position, self.counts = int(state["position"]), counts
        self.notes = []


class BlendBatch(NamedTuple):
    """One step's data for one DP rank: ``M`` micro-batches of ``micro_batch_size``."""

    inputs: torch.Tensor
    """int64 ``[M, micro_batch_size, seq_len]``."""
    labels: torch.Tensor
    """int64 ``[M, micro_batch_size, seq_len]``: ``inputs`` shifted left by one token."""
    sources: torch.Tensor
    """int64 ``[M, micro_batch_size]``: the blend's source of each sample."""
    sample_ids: torch.Tensor
    """int64 ``[M, micro_batch_size]``: which window of its source each sample is."""
    digest: int
    """A 64-bit hash of the whole global batch's (source, sample) pairs, the same on every
    rank: runs compare their sequences of global batches by it."""


def global_digest(sources: np.ndarray, ids: np.ndarray) -> int:
    pairs = np.stack([sources, ids]).astype("<i8")
    return int.from_bytes(hashlib.blake2b(pairs.tobytes(), digest_size=8).digest(), "little")


class BlendLoader:
    """Endless `BlendBatch`es for one DP rank: each step takes the next global batch of
    ``dp_size * micro_batches * micro_batch_size`` samples of the blend, and DP rank ``r``
    reads the ``r``-th slice; ``state_dict`` for restarts."""

    def __init__(
        self,
        blend: Blend,
        windows: Sequence,
        micro_batches: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
    ):
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank = {dp_rank} is invalid for dp_size = {dp_size}")
        self.blend, self.windows = blend, list(windows)
        self.shape = (micro_batches, micro_batch_size)
        self.per_rank = micro_batches * micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size

    def __iter__(self) -> Iterator[BlendBatch]:
        return self

    def __next__(self) -> BlendBatch:
        sources, ids = self.blend.take(self.per_rank * self.dp_size)
        digest = global_digest(sources, ids)
        rows = slice(self.dp_rank * self.per_rank, (self.dp_rank + 1) * self.per_rank)
        windows = gather(self.windows, sources[rows], ids[rows]).reshape(*self.shape, -1)
        return BlendBatch(windows[..., :-1], windows[..., 1:],
                          torch.from_numpy(sources[rows].reshape(self.shape)),
                          torch.from_numpy(ids[rows].reshape(self.shape)), digest)  # fmt: skip

    def state_dict(self) -> dict:
        return {"blend": self.blend.state_dict(), "seq_len": self.windows[0].seq_len}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seq_len") != self.windows[0].seq_len:
            raise ValueError(f"the checkpoint's data has seq_len = {state.get('seq_len')}, "
                             f"this run's {self.windows[0].seq_len}")  # fmt: skip
        self.blend.load_state_dict(state.get("blend", state))


def gather(windows: Sequence, sources: np.ndarray, ids: np.ndarray) -> torch.Tensor:
    """The windows of ``(sources, ids)`` pairs, ``[n, seq_len + 1]`` int64, in their order."""
    out = torch.empty(len(ids), windows[0].seq_len + 1, dtype=torch.int64)
    for s in np.unique(sources):
        rows = np.flatnonzero(sources == s)
        out[torch.from_numpy(rows)] = windows[int(s)].gather(ids[rows])
    return out
