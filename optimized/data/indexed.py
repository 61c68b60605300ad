"""Megatron-Core's indexed dataset on disk: ``<prefix>.bin`` + ``<prefix>.idx``, written and
read exactly as ``megatron.core.datasets.indexed_dataset`` does (v0.16), so a folder
twinpipe prepares is one Megatron-LM, NeMo and Megatron-Bridge read, and theirs are ours.

The ``.idx`` file, little-endian throughout:

===========  =============================  ==============================================
offset       type                           what
===========  =============================  ==============================================
0            9 bytes                        ``b"MMIDIDX\\x00\\x00"``
9            u64                            version, 1
17           u8                             dtype code of the tokens (`DTYPE_CODES`)
18           u64                            ``S``, the number of sequences
26           u64                            ``D``, the number of document indices (docs + 1)
34           int32[S]                       sequence lengths, in tokens
34 + 4S      int64[S]                       sequence pointers, in bytes into ``.bin``
34 + 12S     int64[D]                       document indices: document ``d`` holds
                                            sequences ``[doc[d], doc[d + 1])``
===========  =============================  ==============================================

The ``.bin`` file is the tokens, back to back, in the dtype of the header. (Megatron's
multimodal variant adds int8 modes after the document indices; twinpipe neither writes
nor needs them.)

A folder written by ``twinpipe prepare-data`` (the layout both sides of twinpipe agree on):

- ``<prefix>.bin`` and ``<prefix>.idx`` with ``prefix`` = `DEFAULT_PREFIX` (``"tokens"``):
  one document = one sequence, each document's tokens followed by the end-of-document id
  (as Megatron's ``preprocess_data.py --append-eod``), so ``document_indices`` is
  ``0, 1, ..., num_documents``. Tokens are ``uint16`` when the vocabulary has fewer than
  65500 ids, else ``int32`` (Megatron's ``DType.optimal_dtype``; Megatron has no uint32).
- ``twinpipe-data.json`` (`SIDECAR_FILE`), written last, so a folder holding it is
  complete. A JSON object::

    {"format": "twinpipe-indexed", "version": 1,
     "prefix": "tokens",            # the .bin/.idx pair is <folder>/<prefix>.{bin,idx}
     "dtype": "uint16",             # numpy name, equal to the .idx header's code
     "num_tokens": int,             # end-of-document ids included
     "num_documents": int,          # = sequences in the .idx
     "vocab_size": int, "eod_id": int,
     "tokenizer": {...},            # the tokenizer's describe(): kind, path, sha256, ...
     "text_key": "text" | null,     # the JSON key / parquet column read
     "shard": [I, N] | null,        # --shard I/N, when given
     "sources": [{"path", "size", "mtime", "sha256", "documents", "tokens"}, ...],
     "skipped": {"empty": int, "bad": int, "binary": int},
     "recipe": {...}}               # only for the cached default data set

  `optimized.data.preparation.read_sidecar` returns it, checked against the ``.idx``.

This module reads and writes the two files only; the sidecar is `preparation`'s.
"""

from __future__ import annotations

import contextlib
import os
import struct
import uuid
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 34
"""9 magic + 8 version + 1 dtype code + 8 sequence count + 8 document count."""

DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
"""Megatron's ``DType`` enum: code -> numpy dtype."""

DEFAULT_PREFIX = "tokens"
SIDECAR_FILE = "twinpipe-data.json"

_CHUNK = 1 << 20  # elements per block when streaming index arrays


def dtype_code(dtype: np.dtype | type) -> int:
    """Megatron's code of ``dtype``; `ValueError` for one it has no code for."""
    wanted = np.dtype(dtype)
    for code, known in DTYPE_CODES.items():
        if known == wanted:
            return code
    names = ", ".join(d.name for d in DTYPE_CODES.values())
    raise ValueError(f"dtype {wanted.name!r} has no Megatron code: use one of {names}")


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when the vocabulary has fewer than 65500 ids, else ``int32``: what
    Megatron's ``DType.optimal_dtype`` picks, so both tools agree on a corpus's files."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def idx_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.idx")


def bin_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.bin")


class IndexedWriter:
    """Writes ``<prefix>.bin`` and ``<prefix>.idx``, one document at a time.

    Memory is bounded whatever the number of documents: tokens go straight to the
    ``.bin``, lengths to a temporary side file, and `finalize` streams the ``.idx``
    from it in blocks. Both files are written under temporary names and renamed by
    `finalize` (``.bin`` first, ``.idx`` last); `abort` (or leaving a ``with`` block by
    an exception) removes them, so a crash never leaves a pair that looks complete.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type):
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        self.code = dtype_code(self.dtype)
        tag = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._bin_tmp = Path(f"{bin_path(self.prefix)}{tag}")
        self._idx_tmp = Path(f"{idx_path(self.prefix)}{tag}")
        self._len_tmp = Path(f"{self.prefix}.lengths{tag}")
        self._bin = open(self._bin_tmp, "wb")  # noqa: SIM115 (closed by finalize/abort)
        self._lengths = open(self._len_tmp, "wb")  # noqa: SIM115
        self.num_documents = 0
        self.num_tokens = 0
        self._done = False

    def add_document(self, tokens: np.ndarray) -> None:
        """Append ``tokens`` as one document of one sequence."""
        array = np.asarray(tokens)
        self.add_documents(array.astype(self.dtype, copy=False), np.array([array.size]))

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append several documents at once: ``tokens`` back to back, ``lengths[i]`` tokens
        each (one sequence per document)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != np.asarray(tokens).size:
            raise ValueError(f"lengths sum to {int(lengths.sum())}, tokens hold {tokens.size}")
        if lengths.size and int(lengths.max()) > np.iinfo(np.int32).max:
            raise ValueError("a sequence longer than 2**31 - 1 tokens does not fit an int32 length")
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self._lengths.write(lengths.astype(np.int32).tobytes())
        self.num_documents += int(lengths.size)
        self.num_tokens += int(lengths.sum())

    def finalize(self) -> None:
        """Write the ``.idx`` and move both files to their names."""
        self._bin.close()
        self._lengths.close()
        count = self.num_documents
        itemsize = self.dtype.itemsize
        with open(self._idx_tmp, "wb") as out:
            out.write(MAGIC + struct.pack("<Q", VERSION) + struct.pack("<B", self.code))
            out.write(struct.pack("<Q", count) + struct.pack("<Q", count + 1))
            lengths = np.memmap(self._len_tmp, dtype=np.int32, mode="r") if count else None
            for start in range(0, count, _CHUNK):
                out.write(lengths[start : start + _CHUNK].tobytes())
            pointer = 0
            for start in range(0, count, _CHUNK):
                block = lengths[start : start + _CHUNK].astype(np.int64) * itemsize
                ends = np.cumsum(block) + pointer
                out.write((ends - block).tobytes())
                pointer = int(ends[-1])
            del lengths
            for start in range(0, count + 1, _CHUNK):
                out.write(
                    np.arange(start, min(start + _CHUNK, count + 1), dtype=np.int64).tobytes()
                )
        os.replace(self._bin_tmp, bin_path(self.prefix))
        os.replace(self._idx_tmp, idx_path(self.prefix))
        self._len_tmp.unlink()
        self._done = True

    def abort(self) -> None:
        """Close and remove whatever this writer has written (nothing once finalized)."""
        self._bin.close()
        self._lengths.close()
        if not self._done:
            for leftover in (self._bin_tmp, self._idx_tmp, self._len_tmp):
                with contextlib.suppress(FileNotFoundError):
                    leftover.unlink()

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None and not self._done:
            self.finalize()
        else:
            self.abort()


class IndexedReader:
    """A Megatron ``<prefix>.idx`` + ``<prefix>.bin`` pair, memory-mapped.

    Python memory is O(1) in the number of documents: every array is a view of a memory
    map, nothing is parsed per document. The header is checked, and so are the sizes:
    `ValueError` naming the file for a wrong magic, version or dtype code, an ``.idx``
    shorter than its counts say, or a ``.bin`` shorter than its last pointer says.
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = Path(prefix)
        self.idx_path, self.bin_path = idx_path(self.prefix), bin_path(self.prefix)
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise FileNotFoundError(
                    f"{str(path)!r} does not exist (an indexed dataset is "
                    "<prefix>.idx + <prefix>.bin)"
                )
        size = self.idx_path.stat().st_size
        with open(self.idx_path, "rb") as stream:
            head = stream.read(HEADER_BYTES)
        where = f"{str(self.idx_path)!r}"
        if head[:9] != MAGIC[: len(head[:9])] or len(head) >= 9 and head[:9] != MAGIC:
            raise ValueError(
                f"{where} is not a Megatron indexed dataset index: its first bytes are "
                f"{head[:9]!r}, expected {MAGIC!r}"
            )
        if len(head) < HEADER_BYTES:
            raise ValueError(f"{where} is truncated: {size} bytes, a header needs {HEADER_BYTES}")
        version, code = struct.unpack("<QB", head[9:18])
        if version != VERSION:
            raise ValueError(f"{where} has version {version}; only version {VERSION} is known")
        if code not in DTYPE_CODES:
            raise ValueError(
                f"{where} has dtype code {code}; known codes are 1..8 "
                f"({', '.join(f'{c}={d.name}' for c, d in DTYPE_CODES.items())})"
            )
        self._dtype = DTYPE_CODES[code]
        sequences, documents = struct.unpack("<QQ", head[18:34])
        needed = HEADER_BYTES + 12 * sequences + 8 * documents
        if size < needed:
            raise ValueError(
                f"{where} is truncated: {size} bytes, its header says {sequences} sequences "
                f"and {documents} document indices, which need {needed}"
            )
        self._idx = np.memmap(self.idx_path, dtype=np.uint8, mode="r")
        buffer = memoryview(self._idx)
        self.sequence_lengths = np.frombuffer(buffer, np.int32, sequences, HEADER_BYTES)
        self.sequence_pointers = np.frombuffer(
            buffer, np.int64, sequences, HEADER_BYTES + 4 * sequences
        )
        self.document_indices = np.frombuffer(
            buffer, np.int64, documents, HEADER_BYTES + 12 * sequences
        )
        bin_size = self.bin_path.stat().st_size
        end = 0
        if sequences:
            end = (
                int(self.sequence_pointers[-1])
                + int(self.sequence_lengths[-1]) * self._dtype.itemsize
            )
        if bin_size < end:
            raise ValueError(
                f"{str(self.bin_path)!r} is truncated: {bin_size} bytes, its index "
                f"{str(self.idx_path.name)!r} points to {end}"
            )
        self._bin_size = bin_size
        self._bin: np.memmap | None = None

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def num_sequences(self) -> int:
        return int(self.sequence_lengths.size)

    @property
    def num_documents(self) -> int:
        return max(0, int(self.document_indices.size) - 1)

    @property
    def num_tokens(self) -> int:
        """Tokens in the ``.bin`` up to the end of its last sequence."""
        if not self.num_sequences:
            return 0
        last = int(self.sequence_pointers[-1]) // self._dtype.itemsize
        return last + int(self.sequence_lengths[-1])

    def _bin_map(self) -> np.memmap:
        if self._bin is None:
            if self._bin_size == 0:  # mmap cannot map an empty file
                self._bin = np.zeros(0, dtype=self._dtype)
            else:
                self._bin = np.memmap(
                    self.bin_path,
                    dtype=self._dtype,
                    mode="r",
                    shape=(self._bin_size // self._dtype.itemsize,),
                )
        return self._bin

    @property
    def tokens(self) -> np.ndarray:
        """Every token of the ``.bin`` as one flat memory-mapped array (the sequences are
        contiguous: what `IndexedWriter` and Megatron's builder write)."""
        return self._bin_map()[: self.num_tokens]

    def sequence(self, i: int) -> np.ndarray:
        """Tokens of sequence ``i`` (a view of the memory map)."""
        if not -self.num_sequences <= i < self.num_sequences:
            raise IndexError(f"sequence {i} out of range for {self.num_sequences} sequences")
        start = int(self.sequence_pointers[i]) // self._dtype.itemsize
        return self._bin_map()[start : start + int(self.sequence_lengths[i])]

    def __len__(self) -> int:
        return self.num_sequences

    def close(self) -> None:
        """Drop the memory maps (arrays taken from them stay valid until released)."""
        self._bin = None

    def __repr__(self) -> str:
        return (
            f"IndexedReader({str(self.prefix)!r}: {self.num_sequences} sequences, "
            f"{self.num_tokens} tokens, {self.dtype.name})"
        )
