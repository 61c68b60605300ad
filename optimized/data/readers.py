"""Readers of corpora as they ship: JSON lines (plain, ``.gz``, ``.zst``), parquet, and
plain text files, named by files, folders or glob patterns.

Every reader streams: a JSON-lines file is read line by line through its decompressor, a
parquet file batch by batch (``pyarrow``'s ``iter_batches``), so memory stays bounded
whatever a file's size (a plain text file is one document and is read whole). Each
source's bytes are hashed (sha256) as they are read, for the prepared folder's sidecar.

A record that is not a JSON object, lacks the text key, or holds no string there is a
`BadRecord`: the file, the line or row, and the field. With ``skip_bad`` it is counted in
`ReadStats` instead (the first few are kept for the report). Empty documents are counted,
never yielded. Blank lines of a JSON-lines file are not records.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
COMPRESSIONS = (".gz", ".zst")
PARQUET_SUFFIXES = (".parquet", ".pq")
BINARY_SNIFF_BYTES = 8000
"""A plain text file with a NUL byte in its first this many bytes is binary (git's rule)."""
KEPT_BAD = 10
"""How many bad records `ReadStats` keeps word of (all are counted)."""


class BadRecord(ValueError):
    """A record that holds no text where ``--text-key`` says: names file, place and field."""

    def __init__(self, path: Path, where: str, field_name: str, why: str):
        self.path, self.where, self.field, self.why = path, where, field_name, why
        super().__init__(f"{path}: {where}: field {field_name!r}: {why}")


@dataclass(slots=True)
class Source:
    """One input file as read: what the sidecar records of it."""

    path: Path
    size: int
    mtime: float
    sha256: str = ""
    documents: int = 0
    tokens: int = 0

    def as_json(self) -> dict:
        return {
            "path": str(self.path.resolve()),
            "size": self.size,
            "mtime": self.mtime,
            "sha256": self.sha256,
            "documents": self.documents,
            "tokens": self.tokens,
        }


@dataclass(slots=True)
class ReadStats:
    """What the readers met besides documents."""

    empty: int = 0
    bad: int = 0
    binary: list[Path] = field(default_factory=list)
    bad_examples: list[str] = field(default_factory=list)
    replaced: dict[Path, int] = field(default_factory=dict)
    """Plain text files with invalid UTF-8, and how many bytes became U+FFFD."""

    def count_bad(self, error: BadRecord) -> None:
        self.bad += 1
        if len(self.bad_examples) < KEPT_BAD:
            self.bad_examples.append(str(error))


def file_kind(path: Path) -> str:
    """``"jsonl"``, ``"parquet"`` or ``"text"``, by the name's suffixes."""
    name = path.name.lower()
    for compression in ("", *COMPRESSIONS):
        if any(name.endswith(suffix + compression) for suffix in JSONL_SUFFIXES):
            return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return "text"


def resolve_inputs(
    inputs: Sequence[str | os.PathLike], exclude: str | os.PathLike | None = None
) -> list[Path]:
    """Files named by ``inputs``: files, folders (every non-hidden file below, sorted)
    or glob patterns (``**`` allowed, sorted). Order follows ``inputs``; repeats are
    dropped, and so is everything under ``exclude`` (the output folder). Raises
    `FileNotFoundError` naming an input that matches nothing."""
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


def parse_shard(spec: str) -> tuple[int, int]:
    """``"I/N"`` as ``(I, N)`` with ``0 <= I < N``; `ValueError` saying what is valid."""
    parts = str(spec).split("/")
    try:
        index, count = (int(part) for part in parts)
    except ValueError:
        raise ValueError(f"{spec!r} is not I/N (two integers, e.g. 0/8)") from None
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"{spec!r} is outside 0 <= I < N (N >= 1)")
    return index, count


def shard_files(files: Sequence[Path], index: int, count: int) -> list[Path]:
    """The ``index``-th of ``count`` contiguous parts of ``files`` sorted by path (part
    sizes differ by at most one file). `ValueError` when that part is empty."""
    ordered = sorted(files, key=lambda p: str(p.resolve()))
    part = ordered[index * len(ordered) // count : (index + 1) * len(ordered) // count]
    if not part:
        raise ValueError(
            f"{index}/{count} is an empty part: the inputs hold {len(ordered)} files, fewer "
            f"than {count} parts"
        )
    return part


class _Hashing(io.RawIOBase):
    """A binary file read through: hashes and counts every byte, reports progress."""

    def __init__(self, raw, on_bytes: Callable[[int], None] | None):
        self.raw, self.on_bytes = raw, on_bytes
        self.digest = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        count = self.raw.readinto(buffer)
        if count:
            self.digest.update(memoryview(buffer)[:count])
            if self.on_bytes is not None:
                self.on_bytes(count)
        return count

    def drain(self) -> None:
        """Read to the end (a decompressor may stop before its trailer's last bytes)."""
        block = bytearray(1 << 20)
        while self.readinto(block):
            pass


class _Zstd(io.RawIOBase):
    """A zstd stream of one or more frames, decompressed; `EOFError` when the file ends
    inside a frame (zstandard's own stream reader returns what it has, silently)."""

    def __init__(self, raw: _Hashing, decompressor):
        self.raw, self.decompressor = raw, decompressor
        self.frame = decompressor.decompressobj()
        self.pending, self.offset, self.fed = b"", 0, False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self.offset >= len(self.pending):
            self.pending, self.offset = b"", 0
            chunk = self.raw.read(1 << 20)
            if not chunk:
                if self.fed and not self.frame.eof:
                    raise EOFError("the zstd stream ends inside a frame (a truncated file)")
                return 0
            while chunk:
                if self.frame.eof:  # the next frame starts in the rest
                    self.frame, self.fed = self.decompressor.decompressobj(), False
                self.pending += self.frame.decompress(chunk)
                self.fed = True
                chunk = self.frame.unused_data if self.frame.eof else b""
        count = min(len(buffer), len(self.pending) - self.offset)
        buffer[:count] = memoryview(self.pending)[self.offset : self.offset + count]
        self.offset += count
        return count


def _stream_errors() -> tuple[type[BaseException], ...]:
    """What a corrupt or truncated compressed stream raises."""
    try:
        import zstandard  # noqa: PLC0415
    except ImportError:
        return (OSError, EOFError)
    return (OSError, EOFError, zstandard.ZstdError)


def _open_lines(path: Path, hashing: _Hashing) -> io.BufferedIOBase:
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=io.BufferedReader(hashing, 1 << 20), mode="rb")
    if name.endswith(".zst"):
        try:
            import zstandard  # noqa: PLC0415
        except ImportError as error:
            raise ImportError(
                f"{path} is zstd-compressed: reading it needs the 'zstandard' package "
                "(pip install zstandard, or twinpipe's 'data' extra)"
            ) from error
        return io.BufferedReader(_Zstd(hashing, zstandard.ZstdDecompressor()), 1 << 20)
    return io.BufferedReader(hashing, 1 << 20)


def _record_text(line: bytes, path: Path, number: int, key: str) -> str:
    where = f"line {number}"
    try:
        record = json.loads(line)
    except (ValueError, UnicodeDecodeError) as error:
        raise BadRecord(path, where, key, f"malformed JSON ({error})") from None
    if not isinstance(record, dict):
        raise BadRecord(path, where, key, f"a JSON {type(record).__name__}, not an object")
    if key not in record:
        keys = ", ".join(map(repr, list(record)[:8])) or "none"
        raise BadRecord(path, where, key, f"missing (the record's keys: {keys}); see --text-key")
    text = record[key]
    if not isinstance(text, str):
        raise BadRecord(path, where, key, f"a JSON {type(text).__name__}, not a string")
    return text


def _jsonl(source: Source, key: str, skip_bad: bool, stats: ReadStats, on_bytes) -> Iterator[str]:
    with open(source.path, "rb") as raw:
        hashing = _Hashing(raw, on_bytes)
        stream = _open_lines(source.path, hashing)
        try:
            for number, line in enumerate(stream, start=1):
                if not line.strip():
                    continue
                try:
                    text = _record_text(line, source.path, number, key)
                except BadRecord as error:
                    if not skip_bad:
                        raise
                    stats.count_bad(error)
                    continue
                yield text
        except _stream_errors() as error:  # a corrupt or truncated compressed stream
            raise BadRecord(source.path, "the file", key, f"cannot be read ({error})") from None
        hashing.drain()
    source.sha256 = hashing.digest.hexdigest()


def _parquet_file(path: Path):
    try:
        import pyarrow.parquet as pq  # noqa: PLC0415
    except ImportError as error:
        raise ImportError(
            f"{path} is parquet: reading it needs the 'pyarrow' package "
            "(pip install pyarrow, or twinpipe's 'data' extra)"
        ) from error
    try:
        return pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises ArrowInvalid and friends
        raise BadRecord(path, "the file", "-", f"is not a parquet file ({error})") from None


def _parquet_column(path: Path, key: str):
    parquet = _parquet_file(path)
    names = parquet.schema_arrow.names
    if key not in names:
        shown = ", ".join(map(repr, names[:8]))
        raise BadRecord(
            path, "the schema", key, f"no such column (columns: {shown}); see --text-key"
        )
    kind = parquet.schema_arrow.field(key).type
    if str(kind) not in ("string", "large_string", "string_view"):
        raise BadRecord(path, "the schema", key, f"a column of {kind}, not strings")
    return parquet


def _parquet(source: Source, key: str, skip_bad: bool, stats: ReadStats, on_bytes) -> Iterator[str]:
    try:
        parquet = _parquet_column(source.path, key)
    except BadRecord as error:
        if not skip_bad or error.where != "the schema":
            raise
        rows = _parquet_file(source.path).metadata.num_rows
        stats.count_bad(error)
        stats.bad += rows - 1
        parquet, rows = None, 0
    if parquet is not None:
        rows = max(1, parquet.metadata.num_rows)
        row = done = 0
        for batch in parquet.iter_batches(batch_size=1024, columns=[key]):
            for text in batch.column(0).to_pylist():
                row += 1
                if text is None:
                    error = BadRecord(source.path, f"row {row}", key, "null, not a string")
                    if not skip_bad:
                        raise error
                    stats.count_bad(error)
                    continue
                yield text
            if on_bytes is not None:
                now = source.size * row // rows
                on_bytes(now - done)
                done = now
    digest = hashlib.sha256()
    with open(source.path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    source.sha256 = digest.hexdigest()


def _text(source: Source, stats: ReadStats, on_bytes) -> Iterator[str]:
    raw = source.path.read_bytes()
    source.sha256 = hashlib.sha256(raw).hexdigest()
    if on_bytes is not None:
        on_bytes(len(raw))
    if b"\0" in raw[:BINARY_SNIFF_BYTES]:
        stats.binary.append(source.path)
        return
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        escaped = raw.decode("utf-8", errors="surrogateescape")
        stats.replaced[source.path] = sum(1 for ch in escaped if "\udc80" <= ch <= "\udcff")
        text = raw.decode("utf-8", errors="replace")
    yield text


def read_documents(
    sources: Sequence[Source],
    text_key: str = "text",
    skip_bad: bool = False,
    stats: ReadStats | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> Iterator[tuple[int, str]]:
    """``(source number, text)`` of every non-empty document of ``sources``, in order.
    Fills each source's ``sha256`` once it is read to the end; ``on_bytes(n)`` is told of
    every ``n`` bytes read from disk (for a progress bar)."""
    stats = stats if stats is not None else ReadStats()
    for number, source in enumerate(sources):
        kind = file_kind(source.path)
        if kind == "jsonl":
            texts = _jsonl(source, text_key, skip_bad, stats, on_bytes)
        elif kind == "parquet":
            texts = _parquet(source, text_key, skip_bad, stats, on_bytes)
        else:
            texts = _text(source, stats, on_bytes)
        for text in texts:
            if text:
                yield number, text
            else:
                stats.empty += 1


def sources_of(files: Sequence[Path]) -> list[Source]:
    """A `Source` per file, its size and mtime taken now."""
    stats = [path.stat() for path in files]
    return [Source(path, s.st_size, s.st_mtime) for path, s in zip(files, stats, strict=True)]


def check_first_records(files: Sequence[Path], text_key: str) -> None:
    """Each JSON-lines file's first record and each parquet file's schema, checked before
    any work starts: a wrong ``--text-key`` fails in a second, not an hour in."""
    for path in files:
        kind = file_kind(path)
        if kind == "parquet":
            _parquet_column(path, text_key)
        elif kind == "jsonl":
            with open(path, "rb") as raw:
                stream = _open_lines(path, _Hashing(raw, None))
                try:
                    for number, line in enumerate(stream, start=1):
                        if line.strip():
                            _record_text(line, path, number, text_key)
                            break
                except _stream_errors() as error:
                    raise BadRecord(
                        path, "the file", text_key, f"cannot be read ({error})"
                    ) from None
