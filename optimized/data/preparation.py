"""``twinpipe prepare-data``'s engine: corpora in, a Megatron indexed dataset out, and the
default data set every machine has.

Why tokens prepared ahead of time: a training step needs ``M x micro_batch_size`` windows
of ``seq_len + 1`` tokens per DP rank. With every document tokenized once, ahead of time,
into one memory-mapped array (each document followed by the end-of-document id), a window
is a slice of it: no tokenizer in the training loop, no per-rank copy of the corpus in
memory (the OS page cache shares it), and a loader's position is a few integers.

The folder's layout (``<prefix>.bin`` + ``<prefix>.idx`` in Megatron-Core's format, and the
``twinpipe-data.json`` sidecar written last) is set down in `optimized.data.indexed`.
`prepare_data` reads with `optimized.data.readers` and encodes with
`optimized.data.encoding`; `read_sidecar` and `open_prepared` are what a reader of a
prepared folder calls.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import sysconfig
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from models.runtime import read_json
from optimized.data.encoding import encode_ordered
from optimized.data.indexed import (
    DEFAULT_PREFIX,
    SIDECAR_FILE,
    IndexedReader,
    IndexedWriter,
    token_dtype,
)
from optimized.data.readers import (
    ReadStats,
    check_first_records,
    read_documents,
    resolve_inputs,
    shard_files,
    sources_of,
)
from optimized.data.tokenizers import ByteTokenizer, Tokenizer

FORMAT_NAME = "twinpipe-indexed"
FORMAT_VERSION = 1
OLD_INDEX_FILE = "index.json"
"""The index of the format before this one (``tokens.bin`` + ``index.json``)."""
CONVERT_COMMAND = "twinpipe prepare-data --convert OLD --out NEW"


@dataclass(slots=True)
class PrepareSummary:
    """What `prepare_data` wrote."""

    out_dir: Path
    """The prepared folder."""
    num_files: int
    """Source files read."""
    num_documents: int
    """Documents written, each followed by the end-of-document id."""
    num_tokens: int
    """Tokens in the ``.bin``, end-of-document ids included."""
    bytes_read: int
    """Bytes of the source files (as stored: compressed files count compressed)."""
    dtype: str
    """Numpy dtype of the tokens."""
    seconds: float
    """Wall time taken."""
    stats: ReadStats = field(default_factory=ReadStats)
    """Empty documents, bad records (skipped with ``skip_bad``), binary and invalid-UTF-8
    text files."""


class _Progress:
    """A tqdm bar over the bytes read, with documents/s and tokens/s beside it."""

    def __init__(self, total_bytes: int, enabled: bool):
        from tqdm import tqdm  # noqa: PLC0415

        self.bar = tqdm(
            total=total_bytes,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc="prepare-data",
            file=sys.stderr,
            mininterval=1.0,
            disable=not enabled,
            dynamic_ncols=True,
        )
        self.start = time.monotonic()

    def read(self, count: int) -> None:
        self.bar.update(count)

    def encoded(self, documents: int, tokens: int) -> None:
        if self.bar.disable:
            return
        seconds = max(time.monotonic() - self.start, 1e-9)
        self.bar.set_postfix_str(
            f"{documents:,} docs, {documents / seconds:,.0f} docs/s, {tokens / seconds:,.0f} tok/s",
            refresh=False,
        )

    def close(self) -> None:
        self.bar.close()


def sidecar_header(writer: IndexedWriter, dtype: np.dtype) -> dict:
    """The fields every prepared folder's sidecar starts with: the format and what
    ``writer`` (finalized) wrote; the caller adds the tokenizer and the sources."""
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "prefix": DEFAULT_PREFIX,
        "dtype": dtype.name,
        "num_tokens": writer.num_tokens,
        "num_documents": writer.num_documents,
    }


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"output {str(out)!r} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        raise FileExistsError(
            f"output {str(out)!r} exists and is not empty: prepare into a new or empty folder "
            "(nothing is ever overwritten)"
        )


def prepare_data(
    inputs: Sequence[str | os.PathLike],
    tokenizer: Tokenizer,
    out_dir: str | os.PathLike,
    progress: bool = True,
    extra_sidecar: dict | None = None,
    workers: int = 1,
    text_key: str = "text",
    skip_bad: bool = False,
    shard: tuple[int, int] | None = None,
) -> PrepareSummary:
    """Tokenize the documents of ``inputs`` into ``out_dir`` (new or empty).

    ``inputs`` are files, folders or globs (`resolve_inputs`); JSON-lines and parquet files
    hold a document per record under ``text_key``, any other file is one document. With
    ``shard = (I, N)`` only the I-th of N parts of the sorted file list is read. A bad
    record raises `optimized.data.readers.BadRecord` unless ``skip_bad``. Every JSON-lines
    file's first record is checked before any work. ``workers`` processes tokenize
    (`optimized.data.encoding`); the output is the same bytes for any number. Nothing
    appears under its final name until complete, the sidecar last; on an error the folder
    is left as it was found. ``extra_sidecar`` is merged into the sidecar.
    """
    start = time.monotonic()
    out = Path(out_dir)
    files = resolve_inputs(inputs, exclude=out)
    if shard is not None:
        files = shard_files(files, *shard)
    _check_out(out)
    check_first_records(files, text_key)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    sources = sources_of(files)
    stats = ReadStats()
    meter = _Progress(sum(s.size for s in sources), progress)
    writer = IndexedWriter(out / DEFAULT_PREFIX, dtype)
    sidecar_tmp = out / f"{SIDECAR_FILE}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        documents = read_documents(sources, text_key, skip_bad, stats, meter.read)
        for numbers, tokens, lengths in encode_ordered(tokenizer, dtype, documents, workers):
            writer.add_documents(tokens, lengths)
            counts = np.bincount(numbers, minlength=len(sources))
            token_counts = np.bincount(numbers, weights=lengths, minlength=len(sources))
            for number in np.flatnonzero(counts):
                sources[number].documents += int(counts[number])
                sources[number].tokens += int(token_counts[number])
            meter.encoded(writer.num_documents, writer.num_tokens)
        if not writer.num_documents:
            raise ValueError(
                f"no text to prepare: {len(files)} files held no document "
                f"({stats.empty} empty, {stats.bad} bad records, {len(stats.binary)} binary)"
            )
        writer.finalize()
        sidecar = {
            **sidecar_header(writer, dtype),
            "vocab_size": tokenizer.vocab_size,
            "eod_id": tokenizer.eod_id,
            "tokenizer": tokenizer.describe(),
            "text_key": text_key,
            "shard": list(shard) if shard is not None else None,
            "sources": [source.as_json() for source in sources],
            "skipped": {"empty": stats.empty, "bad": stats.bad, "binary": len(stats.binary)},
            **(extra_sidecar or {}),
        }
        sidecar_tmp.write_text(json.dumps(sidecar, indent=1) + "\n")
        os.replace(sidecar_tmp, out / SIDECAR_FILE)
    except BaseException:
        writer.abort()
        with contextlib.suppress(FileNotFoundError):
            sidecar_tmp.unlink()
        for name in (f"{DEFAULT_PREFIX}.bin", f"{DEFAULT_PREFIX}.idx"):
            if not (out / SIDECAR_FILE).exists():
                with contextlib.suppress(FileNotFoundError):
                    (out / name).unlink()
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()
        raise
    finally:
        meter.close()
    return PrepareSummary(
        out_dir=out,
        num_files=len(files),
        num_documents=writer.num_documents,
        num_tokens=writer.num_tokens,
        bytes_read=sum(s.size for s in sources),
        dtype=dtype.name,
        seconds=time.monotonic() - start,
        stats=stats,
    )


MEGATRON_FORMAT = "megatron-indexed"
"""The ``format`` `open_prepared` gives a Megatron pair that has no sidecar."""


def _bare_prefix(path: Path) -> Path | None:
    """The Megatron prefix ``path`` names without a sidecar: ``path`` itself when
    ``path.idx`` exists, or a folder's only ``<name>.idx`` that has its ``<name>.bin``."""
    if Path(f"{path}.idx").is_file():
        return path
    if path.is_dir() and not (path / OLD_INDEX_FILE).exists():
        pairs = [p.with_suffix("") for p in path.glob("*.idx") if p.with_suffix(".bin").is_file()]
        if len(pairs) == 1:
            return pairs[0]
    return None


def _megatron_sidecar(prefix: Path, reader: IndexedReader) -> dict:
    """What a sidecar would say of a pair Megatron (or NeMo, or datatrove) wrote: no
    tokenizer is known, so ``vocab_size`` and ``eod_id`` are None."""
    return {
        "format": MEGATRON_FORMAT,
        "version": 1,
        "prefix": prefix.name,
        "dtype": reader.dtype.name,
        "num_tokens": reader.num_tokens,
        "num_documents": reader.num_documents,
        "vocab_size": None,
        "eod_id": None,
        "tokenizer": None,
        "sources": [],
    }


def open_prepared(data_dir: str | os.PathLike) -> tuple[dict, IndexedReader]:
    """A prepared folder's sidecar and its memory-mapped tokens, checked against each
    other. A Megatron pair without a sidecar (a folder holding one ``<name>.idx`` +
    ``<name>.bin``, or the prefix ``<folder>/<name>`` itself) opens too, its sidecar
    made up with no tokenizer (`MEGATRON_FORMAT`). `FileNotFoundError` or `ValueError`
    naming the folder when it is none of these (an old-format folder is named as such,
    with the command that converts it)."""
    folder = Path(data_dir)
    path = folder / SIDECAR_FILE
    if not path.is_file():
        bare = _bare_prefix(folder)
        if bare is not None:
            reader = IndexedReader(bare)
            return _megatron_sidecar(bare, reader), reader
        if (folder / OLD_INDEX_FILE).is_file():
            raise ValueError(
                f"{str(folder)!r} is a prepared folder of the old format (tokens.bin + "
                f"{OLD_INDEX_FILE}); convert it once, into a new folder: {CONVERT_COMMAND}"
            )
        raise FileNotFoundError(
            f"{str(folder)!r} is not a prepared data folder (no {SIDECAR_FILE}, and no "
            "Megatron <name>.idx + <name>.bin pair); run `twinpipe prepare-data`"
        )
    wanted = f"a {FORMAT_NAME} v{FORMAT_VERSION} sidecar written by `twinpipe prepare-data`"
    sidecar = read_json(path, wanted)
    if not isinstance(sidecar, dict):
        raise ValueError(f"{str(path)!r} holds no JSON object: expected {wanted}")
    if sidecar.get("format") != FORMAT_NAME or sidecar.get("version") != FORMAT_VERSION:
        raise ValueError(f"{str(path)!r} is not {wanted}")
    prefix = sidecar.get("prefix")
    if not isinstance(prefix, str) or not prefix or "/" in prefix or prefix.startswith("."):
        raise ValueError(f"{str(path)!r}: prefix {prefix!r} is not a file name in {str(folder)!r}")
    reader = IndexedReader(folder / prefix)
    said = (sidecar.get("dtype"), sidecar.get("num_tokens"), sidecar.get("num_documents"))
    found = (reader.dtype.name, reader.num_tokens, reader.num_sequences)
    if said != found:
        raise ValueError(
            f"{str(path)!r} says dtype, tokens, documents = {said}, but {prefix}.idx holds "
            f"{found}: the folder was changed after it was prepared"
        )
    return sidecar, reader


def read_sidecar(data_dir: str | os.PathLike) -> dict:
    """The sidecar of a prepared folder, checked against its ``.idx`` (`open_prepared`)."""
    return open_prepared(data_dir)[0]


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
        "format": f"{FORMAT_NAME}-{FORMAT_VERSION}",
    }


def _is_current(folder: Path, recipe: dict) -> bool:
    try:
        return read_sidecar(folder).get("recipe") == recipe
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
            extra_sidecar={"recipe": recipe},
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
