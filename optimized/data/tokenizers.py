"""Tokenizers for `prepare_data`: UTF-8 bytes, or a Hugging Face ``tokenizer.json``."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from models.runtime import read_text


class Tokenizer(Protocol):
    """What `prepare_data` needs from a tokenizer."""

    vocab_size: int
    eod_id: int

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text``, without any special tokens added."""

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode` of each text, in order (one call: the batch path of a fast tokenizer)."""

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
        """Text of ``ids``; end-of-document ids are dropped."""

    def describe(self) -> dict:
        """JSON-able description recorded in the prepared folder's sidecar."""


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, and id 256 as end-of-document: vocab_size 257.

    Needs nothing installed and round-trips any text exactly:
    ``decode(encode(s)) == s``. 257 ids fit in ``uint16`` token files. The
    end-of-document id is dropped by `decode` (it marks a boundary, not text).
    """

    vocab_size = 257
    eod_id = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
        array = _as_int_array(ids)
        if array.size and (array.min() < 0 or array.max() > self.eod_id):
            raise ValueError(f"byte tokenizer ids must be in 0..{self.eod_id}")
        return (
            array[array != self.eod_id].astype(np.uint8).tobytes().decode("utf-8", errors="replace")
        )

    def describe(self) -> dict:
        return {"kind": "byte", "vocab_size": self.vocab_size, "eod_id": self.eod_id}


# Special tokens tried, in order, as end-of-document when none is named.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json``, through the ``tokenizers`` package.

    The end-of-document id is ``eod_token`` when given, else the first of
    `EOD_CANDIDATES` the vocabulary holds.
    """

    def __init__(self, path: str | os.PathLike, eod_token: str | None = None):
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as error:
            raise ImportError(
                "HFTokenizer needs the 'tokenizers' package (pip install tokenizers); "
                "or use the byte tokenizer ('byte')"
            ) from error
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer file {str(self.path)!r} does not exist")
        read_text(self.path, "a Hugging Face tokenizer.json")  # binary: named, not parsed
        try:
            self._tokenizer = _HFTokenizer.from_file(str(self.path))
        except Exception as error:  # the package raises plain Exception on a bad file
            raise ValueError(f"cannot read tokenizer {str(self.path)!r}: {error}") from error
        self.vocab_size = int(self._tokenizer.get_vocab_size(with_added_tokens=True))
        names = [eod_token] if eod_token is not None else list(EOD_CANDIDATES)
        found = [(name, self._tokenizer.token_to_id(name)) for name in names]
        found = [(name, token_id) for name, token_id in found if token_id is not None]
        if not found:
            raise ValueError(
                f"tokenizer {str(self.path)!r} has no end-of-document token "
                f"{names[0] if eod_token is not None else 'among ' + ', '.join(names)}; "
                "name one of its tokens as eod_token"
            )
        self.eod_token, self.eod_id = found[0][0], int(found[0][1])
        self._sha256 = hashlib.sha256(self.path.read_bytes()).hexdigest()

    def encode(self, text: str) -> np.ndarray:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int64)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """The ``tokenizers`` package's batch encoding (Rust; threads across the batch
        unless ``TOKENIZERS_PARALLELISM=false``)."""
        batch = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        encodings = batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
        array = _as_int_array(ids)
        return self._tokenizer.decode(array[array != self.eod_id].tolist())

    def describe(self) -> dict:
        return {
            "kind": "hf",
            "path": str(self.path.resolve()),
            "sha256": self._sha256,
            "vocab_size": self.vocab_size,
            "eod_token": self.eod_token,
            "eod_id": self.eod_id,
        }


def load_tokenizer(spec: str | os.PathLike, eod_token: str | None = None) -> Tokenizer:
    """``"byte"`` for `ByteTokenizer`, else the path of a ``tokenizer.json`` (`HFTokenizer`)."""
    if str(spec) == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec, eod_token=eod_token)


def _as_int_array(ids: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    return np.asarray(ids, dtype=np.int64).reshape(-1)
