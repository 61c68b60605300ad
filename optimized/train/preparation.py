"""Training data prepared ahead of time: one memory-mapped token file per folder, and the
default data set every machine has.

Why one flat token file: a training step needs ``M x micro_batch_size`` windows of
``seq_len + 1`` tokens per DP rank. With every document tokenized once, ahead of time,
into a single array (each document followed by the end-of-document id), a window is a
slice of a ``numpy.memmap`` -- no tokenizer in the training loop, no per-rank copy of
the corpus in memory (the OS page cache shares it), and the loader's position is two
integers, so a restart resumes at the exact sample.

Layout of a prepared folder (written by `prepare_data`):

- ``tokens.bin``: the token ids, native little-endian, ``uint16`` when the vocabulary
  has at most 65536 ids (every id fits), else ``uint32``.
- ``index.json``: dtype, number of tokens, document offsets (``document_offsets[i]`` is
  where document ``i`` starts; its end-of-document token sits at
  ``document_offsets[i + 1] - 1``), the tokenizer's description, and every source file
  with its size, mtime and sha256. It is written last, so a folder with an
  ``index.json`` is complete.

Samples are non-overlapping windows: sample ``i`` is ``tokens[i*L : i*L + L + 1]`` for
``L = seq_len`` (inputs are the first ``L``, labels the last ``L``; consecutive windows
share only the one token that is a label of one and the first input of the next).
Windows run across document boundaries; the end-of-document id tells the model where a
document stops.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import sys
import sysconfig
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np

from models.runtime import read_json
from optimized.data.tokenizers import ByteTokenizer, Tokenizer

FORMAT_NAME = "twinpipe-tokens"
FORMAT_VERSION = 1
TOKENS_FILE = "tokens.bin"
INDEX_FILE = "index.json"


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits, else ``uint32``."""
    return np.dtype(np.uint16 if vocab_size <= 65536 else np.uint32)


def resolve_inputs(
    inputs: Sequence[str | os.PathLike], exclude: str | os.PathLike | None = None
) -> list[Path]:
    """Files named by ``inputs``: files, folders (every non-hidden file below, sorted)
    or glob patterns (``**`` allowed, sorted). Order follows ``inputs``; repeats are
    dropped, and so is everything under ``exclude`` (the output folder: a second run must
    not read the first one's ``tokens.bin``). Raises `FileNotFoundError` naming an input
    that matches nothing."""
    files: list[Path] = []
    skip = Path(exclude).resolve() if exclude is not None else None
    for item in inputs:
        text = str(item)
        path = Path(text)
        if path.is_file():
            found = [path]
        elif path.is_dir():
            found = sorted(
                p for p in path.rglob("*") if p.is_file() and not _is_hidden(p.relative_to(path))
            )
        elif glob.has_magic(text):
            found = sorted(Path(p) for p in glob.glob(text, recursive=True) if Path(p).is_file())
        else:
            raise FileNotFoundError(f"input {text!r} is not a file, folder or glob pattern")
        if skip is not None:
            kept = [p for p in found if not p.resolve().is_relative_to(skip)]
            if found and not kept:
                raise FileNotFoundError(
                    f"input {text!r}: every file it names lies in the output folder {str(skip)!r}"
                )
            found = kept
        if not found:
            raise FileNotFoundError(f"input {text!r} matches no files")
        files.extend(found)
    unique: dict[Path, Path] = {}
    for path in files:
        unique.setdefault(path.resolve(), path)
    return list(unique.values())


def _is_hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


@dataclass(slots=True)
class PrepareSummary:
    """What `prepare_data` wrote."""

    out_dir: Path
    """The folder holding ``tokens.bin`` and ``index.json``."""
    num_files: int
    """Source files read (each is one document)."""
    num_documents: int
    """Documents written, each followed by the end-of-document id."""
    num_tokens: int
    """Tokens in ``tokens.bin``, end-of-document ids included."""
    bytes_read: int
    """Bytes of source text read."""
    dtype: str
    """Numpy dtype of ``tokens.bin``."""
    seconds: float
    """Wall time taken."""
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    """Files left out, and why (``binary``, ``empty``)."""
    replaced: dict[Path, int] = field(default_factory=dict)
    """Files with invalid UTF-8, and how many bytes became U+FFFD in each."""


BINARY_SNIFF_BYTES = 8000
"""A file with a NUL byte in its first this many bytes is binary (git's rule)."""


def _decode(raw: bytes) -> tuple[str, int]:
    """``raw`` as UTF-8 text (invalid bytes become U+FFFD) and how many bytes were invalid."""
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError:
        escaped = raw.decode("utf-8", errors="surrogateescape")
        invalid = sum(1 for ch in escaped if "\udc80" <= ch <= "\udcff")
        return raw.decode("utf-8", errors="replace"), invalid


def _skip_reason(raw: bytes, skip_empty: bool) -> str | None:
    if not raw:
        return "empty" if skip_empty else None
    return "binary (a NUL byte)" if b"\0" in raw[:BINARY_SNIFF_BYTES] else None


class _Progress:
    """One line on stderr at most every ``interval`` seconds: files done and bytes read."""

    def __init__(self, total_files: int, total_bytes: int, enabled: bool, stream: IO[str]):
        self.total_files, self.total_bytes = total_files, total_bytes
        self.enabled, self.stream = enabled, stream
        self.start = self.last = time.monotonic()
        self.printed = False

    def update(self, files: int, bytes_read: int, tokens: int, final: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or now - self.last < 1.0 and not (final and self.printed):
            return
        self.last, self.printed = now, True
        self.stream.write(
            f"prepare-data: {files}/{self.total_files} files, "
            f"{bytes_read / 1e6:.1f}/{self.total_bytes / 1e6:.1f} MB, "
            f"{tokens:,} tokens, {now - self.start:.1f}s\n"
        )
        self.stream.flush()


def prepare_data(
    inputs: Sequence[str | os.PathLike],
    tokenizer: Tokenizer,
    out_dir: str | os.PathLike,
    progress: bool = True,
    extra_index: dict | None = None,
    skip_empty: bool = True,
) -> PrepareSummary:
    """Tokenize every file of ``inputs`` (one document each) into ``out_dir``.

    Files are read as UTF-8; invalid bytes become U+FFFD, counted per file in the
    summary's ``replaced``. Binary files (a NUL byte early on) and, with ``skip_empty``,
    empty ones are left out and listed in ``skipped``; when nothing is left, `ValueError`.
    Nothing under ``out_dir`` is read. Both outputs are written under temporary names
    and renamed when complete, ``index.json`` last, so a crash never leaves a folder that
    looks prepared. ``extra_index`` is merged into the index (e.g. how a cached data set
    was chosen).
    """
    start = time.monotonic()
    files = resolve_inputs(inputs, exclude=out_dir)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"output {str(out)!r} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    suffix = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tokens_tmp, index_tmp = out / (TOKENS_FILE + suffix), out / (INDEX_FILE + suffix)
    sizes = [path.stat().st_size for path in files]
    meter = _Progress(len(files), sum(sizes), progress, sys.stderr)
    offsets, sources = [0], []
    skipped: list[tuple[Path, str]] = []
    replaced: dict[Path, int] = {}
    num_tokens = bytes_read = 0
    eod = np.array([tokenizer.eod_id], dtype=dtype)
    try:
        with open(tokens_tmp, "wb") as sink:
            for number, path in enumerate(files, start=1):
                stat = path.stat()
                raw = path.read_bytes()
                why = _skip_reason(raw, skip_empty)
                if why:
                    skipped.append((path, why))
                    continue
                text, invalid = _decode(raw)
                if invalid:
                    replaced[path] = invalid
                ids = tokenizer.encode(text)
                if ids.size and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
                    raise ValueError(f"tokenizer produced ids outside its vocabulary for {path}")
                sink.write(ids.astype(dtype).tobytes())
                sink.write(eod.tobytes())
                num_tokens += int(ids.size) + 1
                bytes_read += len(raw)
                offsets.append(num_tokens)
                sources.append(
                    {
                        "path": str(path.resolve()),
                        "size": len(raw),
                        "mtime": stat.st_mtime,
                        "sha256": hashlib.sha256(raw).hexdigest(),
                        "tokens": int(ids.size) + 1,
                    }
                )
                meter.update(number, bytes_read, num_tokens)
        if not sources:
            raise ValueError(
                f"no text to prepare: every input file was skipped ({len(skipped)}: "
                + ", ".join(f"{p} ({why})" for p, why in skipped[:5])
                + (", ..." if len(skipped) > 5 else "")
                + ")"
            )
        description = tokenizer.describe()
        index = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "dtype": dtype.name,
            "num_tokens": num_tokens,
            "num_documents": len(sources),
            "vocab_size": tokenizer.vocab_size,
            "eod_id": tokenizer.eod_id,
            "tokenizer": description,
            "document_offsets": offsets,
            "sources": sources,
            **(extra_index or {}),
        }
        index_tmp.write_text(json.dumps(index, indent=1) + "\n")
        os.replace(tokens_tmp, out / TOKENS_FILE)
        os.replace(index_tmp, out / INDEX_FILE)
    finally:
        for leftover in (tokens_tmp, index_tmp):
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()
    meter.update(len(files), bytes_read, num_tokens, final=True)
    return PrepareSummary(
        out_dir=out,
        num_files=len(sources),
        num_documents=len(sources),
        num_tokens=num_tokens,
        bytes_read=bytes_read,
        dtype=dtype.name,
        seconds=time.monotonic() - start,
        skipped=skipped,
        replaced=replaced,
    )


def read_index(data_dir: str | os.PathLike) -> dict:
    """The ``index.json`` of a prepared folder, checked against its ``tokens.bin``."""
    folder = Path(data_dir)
    index_path = folder / INDEX_FILE
    if not index_path.is_file():
        raise FileNotFoundError(
            f"{str(folder)!r} is not a prepared data folder (no {INDEX_FILE}); "
            "run `twinpipe prepare-data`"
        )
    wanted = f"a {FORMAT_NAME} v{FORMAT_VERSION} index written by `twinpipe prepare-data`"
    index = read_json(index_path, wanted)
    if not isinstance(index, dict):
        raise ValueError(f"{str(index_path)!r} holds no JSON object: expected {wanted}")
    if index.get("format") != FORMAT_NAME or index.get("version") != FORMAT_VERSION:
        raise ValueError(f"{str(index_path)!r} is not a {FORMAT_NAME} v{FORMAT_VERSION} index")
    expected = index["num_tokens"] * np.dtype(index["dtype"]).itemsize
    actual = (folder / TOKENS_FILE).stat().st_size
    if actual != expected:
        raise ValueError(
            f"{str(folder / TOKENS_FILE)!r} holds {actual} bytes, index says {expected}"
        )
    return index


DEFAULT_DATASET_NAME = "stdlib-byte"
DEFAULT_MAX_BYTES = 16_000_000
_SKIPPED_STDLIB_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir``, else ``$TWINPIPE_CACHE``, else ``~/.cache/twinpipe``."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("TWINPIPE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "twinpipe"


def stdlib_sources(max_bytes: int = DEFAULT_MAX_BYTES) -> list[Path]:
    """The standard library's ``*.py`` files sorted by relative path, taken while their
    total stays within ``max_bytes`` (installed packages are left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIPPED_STDLIB_DIRS and not d.startswith(".")]
        found.extend(Path(folder, name) for name in names if name.endswith(".py"))
    found.sort(key=lambda path: path.relative_to(root).as_posix())
    chosen, total = [], 0
    for path in found:
        size = path.stat().st_size
        if total + size > max_bytes:
            continue
        chosen.append(path)
        total += size
    return chosen


def _recipe(max_bytes: int) -> dict:
    return {
        "name": DEFAULT_DATASET_NAME,
        "stdlib": sysconfig.get_paths()["stdlib"],
        "python": sys.version.split()[0],
        "max_bytes": max_bytes,
    }


def _is_current(folder: Path, recipe: dict) -> bool:
    try:
        return read_index(folder).get("recipe") == recipe
    except (OSError, ValueError, KeyError):
        return False


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` across processes (POSIX); a no-op elsewhere, where
    the atomic rename in `default_dataset` still keeps readers safe."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def default_dataset(
    cache_dir: str | os.PathLike | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    progress: bool = False,
) -> Path:
    """A prepared folder of real text every machine has: the standard library's source,
    byte-tokenized, at most ``max_bytes`` of it. Built on first use under
    ``cache_root(cache_dir)/data/stdlib-byte`` and rebuilt if the Python installation or
    ``max_bytes`` changed. Safe when several processes call it at once: they take a lock
    file, and the folder appears by an atomic rename of a complete temporary one.
    """
    data_root = cache_root(cache_dir) / "data"
    final = data_root / DEFAULT_DATASET_NAME
    recipe = _recipe(max_bytes)
    if _is_current(final, recipe):
        return final
    data_root.mkdir(parents=True, exist_ok=True)
    with _file_lock(data_root / f"{DEFAULT_DATASET_NAME}.lock"):
        if _is_current(final, recipe):
            return final
        building = data_root / f".{DEFAULT_DATASET_NAME}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        prepare_data(
            stdlib_sources(max_bytes),
            ByteTokenizer(),
            building,
            progress=progress,
            extra_index={"recipe": recipe},
            skip_empty=False,  # empty modules are documents of the recipe too
        )
        if final.exists():  # stale: move it aside, then swap the new one in
            stale = data_root / f".{DEFAULT_DATASET_NAME}.old-{uuid.uuid4().hex[:8]}"
            os.rename(final, stale)
            os.rename(building, final)
            for leftover in stale.iterdir():
                leftover.unlink()
            stale.rmdir()
        else:
            try:
                os.rename(building, final)
            except OSError:  # no lock on this platform and another process won the race
                if not _is_current(final, recipe):
                    raise
                for leftover in building.iterdir():
                    leftover.unlink()
                building.rmdir()
    return final
