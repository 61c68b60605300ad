"""Folders of the format before Megatron's (``tokens.bin`` + ``index.json``) into prepared
folders of today's (`optimized.data.indexed`), never touching the old folder.

The old ``tokens.bin`` is already tokens back to back with an end-of-document id after
each document, which is what a Megatron ``.bin`` holds; its ``index.json`` gave each
document's start. The conversion copies the tokens (``uint16`` as they are; ``uint32``
ones become ``int32``, Megatron having no unsigned 32-bit code) block by block, writes the
``.idx`` from the offsets, and carries the tokenizer and sources into the sidecar.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import numpy as np

from models.runtime import read_json
from optimized.data.indexed import DEFAULT_PREFIX, SIDECAR_FILE, IndexedWriter, token_dtype
from optimized.data.preparation import OLD_INDEX_FILE, sidecar_header

OLD_TOKENS_FILE = "tokens.bin"
OLD_FORMAT = ("twinpipe-tokens", 1)
_BLOCK_DOCUMENTS = 1 << 16


def read_old_index(folder: str | os.PathLike) -> dict:
    """The old format's ``index.json``, checked against its ``tokens.bin``."""
    folder = Path(folder)
    path = folder / OLD_INDEX_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{str(folder)!r} is not a prepared folder of the old format (no {OLD_INDEX_FILE})"
        )
    index = read_json(path, "the old format's index.json (tokens.bin + index.json)")
    if not isinstance(index, dict) or (index.get("format"), index.get("version")) != OLD_FORMAT:
        raise ValueError(f"{str(path)!r} is not a {OLD_FORMAT[0]} v{OLD_FORMAT[1]} index")
    expected = int(index["num_tokens"]) * np.dtype(index["dtype"]).itemsize
    actual = (folder / OLD_TOKENS_FILE).stat().st_size
    if actual != expected:
        raise ValueError(
            f"{str(folder / OLD_TOKENS_FILE)!r} holds {actual} bytes, index says {expected}"
        )
    offsets = index["document_offsets"]
    if offsets[0] != 0 or offsets[-1] != index["num_tokens"] or np.any(np.diff(offsets) < 1):
        raise ValueError(f"{str(path)!r}: document_offsets do not cover its tokens in order")
    return index


def convert_old_folder(old: str | os.PathLike, new: str | os.PathLike) -> dict:
    """Write ``new`` (new or empty) from the old-format folder ``old``; return the sidecar.
    ``old`` is only read. On an error ``new`` is left as it was found."""
    old, new = Path(old), Path(new)
    index = read_old_index(old)
    if new.exists() and (not new.is_dir() or any(new.iterdir())):
        raise FileExistsError(f"output {str(new)!r} exists and is not an empty folder")
    if new.resolve() == old.resolve():
        raise ValueError("the converted folder must be another folder than the old one")
    vocab = int(index["vocab_size"])
    dtype = token_dtype(vocab)
    offsets = np.asarray(index["document_offsets"], dtype=np.int64)
    tokens = np.memmap(old / OLD_TOKENS_FILE, dtype=np.dtype(index["dtype"]), mode="r")
    created = not new.exists()
    new.mkdir(parents=True, exist_ok=True)
    writer = IndexedWriter(new / DEFAULT_PREFIX, dtype)
    try:
        for first in range(0, offsets.size - 1, _BLOCK_DOCUMENTS):
            bounds = offsets[first : first + _BLOCK_DOCUMENTS + 1]
            block = tokens[bounds[0] : bounds[-1]]
            writer.add_documents(block.astype(dtype), np.diff(bounds))
        writer.finalize()
        sidecar = {
            **sidecar_header(writer, dtype),
            "vocab_size": vocab,
            "eod_id": int(index["eod_id"]),
            "tokenizer": index.get("tokenizer"),
            "text_key": None,
            "shard": None,
            "sources": [{**source, "documents": 1} for source in index.get("sources", [])],
            "skipped": {"empty": 0, "bad": 0, "binary": 0},
            "converted_from": str(old.resolve()),
        }
        staged = new / f"{SIDECAR_FILE}.tmp-{os.getpid()}"
        staged.write_text(json.dumps(sidecar, indent=1) + "\n")
        os.replace(staged, new / SIDECAR_FILE)
    except BaseException:
        writer.abort()
        for name in (
            f"{DEFAULT_PREFIX}.bin",
            f"{DEFAULT_PREFIX}.idx",
            f"{SIDECAR_FILE}.tmp-{os.getpid()}",
        ):
            with contextlib.suppress(FileNotFoundError):
                (new / name).unlink()
        if created:
            with contextlib.suppress(OSError):
                new.rmdir()
        raise
    return sidecar
