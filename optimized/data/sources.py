"""What a blend's paths name, opened for training: a prepared folder or a bare Megatron
prefix; and `Windows`, a source's samples.

A path of ``--data`` is one of:

- a folder `twinpipe prepare-data` wrote: ``tokens.bin`` + ``tokens.idx`` (Megatron-Core's
  indexed dataset, `optimized.data.indexed`) and the ``twinpipe-data.json`` sidecar
  (tokenizer, vocabulary, end-of-document id; `optimized.data.preparation`);
- a bare Megatron prefix ``path/prefix`` (``prefix.bin`` + ``prefix.idx``, as
  megatron-core's ``IndexedDatasetBuilder`` writes them), no sidecar: its tokenizer is
  unknown, its ids are held against the model's vocabulary instead.

(A folder of twinpipe's first format, ``tokens.bin`` + ``index.json``, is refused with the
command that converts it: `optimized.data.preparation.open_prepared`.)

Every array is a memory map (the index included): opening a source parses nothing per
document. A sample is a window of ``seq_len + 1`` tokens: window ``i`` of a token range
``[first, end)`` is ``tokens[first + i*L : first + i*L + L + 1]``, so the windows of a
range never read past it (`optimized.data.splits` cuts sources into such ranges).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class Source:
    """One opened path of a blend."""

    name: str
    """The path as the blend gives it."""
    tokens: np.ndarray
    """Every token, one flat memory-mapped array."""
    num_documents: int
    vocab_size: int | None
    """The tokenizer's vocabulary; None: unknown (a bare Megatron prefix)."""
    eod_id: int | None
    tokenizer: dict | None
    """The tokenizer's description (its ``describe()``); None: unknown."""
    document_starts: np.ndarray
    """The index's sequence pointers (memory-mapped): where each sequence starts, in bytes."""
    starts_scale: int = 1
    """``document_starts`` values per token (the pointers are bytes: the itemsize)."""
    document_sequences: np.ndarray | None = None
    """The index's document indices (document -> its first sequence); None: one sequence
    per document."""

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def document_start(self, document: int) -> int:
        """The token where ``document`` starts (``num_documents``: the end)."""
        if document >= self.num_documents:
            return self.num_tokens
        row = document
        if self.document_sequences is not None:
            row = int(self.document_sequences[document])
            if row >= self.document_starts.shape[0]:
                return self.num_tokens
        return int(self.document_starts[row]) // self.starts_scale

    def describe(self) -> str:
        tokenizer = (self.tokenizer or {}).get("kind", "unknown tokenizer")
        return f"{self.name} ({self.num_tokens:,} tokens, {tokenizer})"


def open_source(path: str | os.PathLike) -> Source:
    """The source ``path`` names: a prepared folder, or a Megatron pair without a sidecar
    (`optimized.data.preparation.open_prepared` opens both, and names an old-format folder
    with the command that converts it); `ValueError` or `OSError` saying why it is none."""
    from optimized.data.preparation import open_prepared  # noqa: PLC0415

    sidecar, reader = open_prepared(path)
    return _indexed(str(path), reader, sidecar)


def _indexed(name: str, reader, sidecar: dict | None) -> Source:
    side = sidecar or {}
    vocab, eod = side.get("vocab_size"), side.get("eod_id")
    return Source(
        name, reader.tokens, reader.num_documents, None if vocab is None else int(vocab),
        None if eod is None else int(eod), side.get("tokenizer"), reader.sequence_pointers,
        reader.dtype.itemsize, reader.document_indices,
    )  # fmt: skip


def largest_token(tokens: np.ndarray) -> int:
    """The largest id of ``tokens``, read in blocks of 16M (only asked when the data's
    tokenizer may hold ids beyond the model's vocabulary)."""
    block = 1 << 24
    return max((int(tokens[i : i + block].max()) for i in range(0, len(tokens), block)), default=-1)


class Windows:
    """The samples of a token range ``[first, end)`` of ``tokens``: non-overlapping windows
    of ``seq_len + 1`` (inputs ``[:-1]``, labels ``[1:]``)."""

    def __init__(self, tokens: np.ndarray, first: int, end: int, seq_len: int, name: str = ""):
        if seq_len < 1:
            raise ValueError(f"seq_len = {seq_len} is invalid: must be >= 1")
        self.tokens, self.first, self.end, self.seq_len = tokens, first, end, seq_len
        self.name = name
        self.num_samples = max(0, (end - first - 1) // seq_len)

    def __len__(self) -> int:
        return self.num_samples

    def gather(self, ids: np.ndarray) -> torch.Tensor:
        """Windows ``ids`` (any shape ``S``) as an int64 tensor ``S + [seq_len + 1]``."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_samples):
            raise IndexError(f"{self.name}: samples {ids.min()}..{ids.max()} out of range "
                             f"for {self.num_samples}")  # fmt: skip
        starts = self.first + ids.reshape(-1, 1) * self.seq_len + np.arange(self.seq_len + 1)
        windows = self.tokens[starts].astype(np.int64)
        return torch.from_numpy(windows.reshape(*ids.shape, self.seq_len + 1))
