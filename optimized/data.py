"""Training data: tokenizers, one memory-mapped token file, and a resumable sharded loader.

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
from dataclasses import dataclass
from pathlib import Path
from typing import IO, NamedTuple, Protocol

import numpy as np
import torch

FORMAT_NAME = "twinpipe-tokens"
FORMAT_VERSION = 1
TOKENS_FILE = "tokens.bin"
INDEX_FILE = "index.json"

# --------------------------------------------------------------------------- tokenizers


class Tokenizer(Protocol):
    """What `prepare_data` needs from a tokenizer."""

    vocab_size: int
    eod_id: int

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text``, without any special tokens added."""

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
        """Text of ``ids``; end-of-document ids are dropped."""

    def describe(self) -> dict:
        """JSON-able description recorded in ``index.json``."""


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


# --------------------------------------------------------------------------- preparation


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits, else ``uint32``."""
    return np.dtype(np.uint16 if vocab_size <= 65536 else np.uint32)


def resolve_inputs(inputs: Sequence[str | os.PathLike]) -> list[Path]:
    """Files named by ``inputs``: files, folders (every non-hidden file below, sorted)
    or glob patterns (``**`` allowed, sorted). Order follows ``inputs``; repeats are
    dropped. Raises `FileNotFoundError` naming an input that matches nothing."""
    files: list[Path] = []
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
) -> PrepareSummary:
    """Tokenize every file of ``inputs`` (one document each) into ``out_dir``.

    Files are read as UTF-8 (invalid bytes become U+FFFD). Both outputs are written
    under temporary names and renamed when complete, ``index.json`` last, so a crash
    never leaves a folder that looks prepared. ``extra_index`` is merged into the
    index (e.g. how a cached data set was chosen).
    """
    start = time.monotonic()
    files = resolve_inputs(inputs)
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
    num_tokens = bytes_read = 0
    eod = np.array([tokenizer.eod_id], dtype=dtype)
    try:
        with open(tokens_tmp, "wb") as sink:
            for number, path in enumerate(files, start=1):
                stat = path.stat()
                raw = path.read_bytes()
                ids = tokenizer.encode(raw.decode("utf-8", errors="replace"))
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
        description = tokenizer.describe()
        index = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "dtype": dtype.name,
            "num_tokens": num_tokens,
            "num_documents": len(files),
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
        num_files=len(files),
        num_documents=len(files),
        num_tokens=num_tokens,
        bytes_read=bytes_read,
        dtype=dtype.name,
        seconds=time.monotonic() - start,
    )


# --------------------------------------------------------------------------- dataset


def read_index(data_dir: str | os.PathLike) -> dict:
    """The ``index.json`` of a prepared folder, checked against its ``tokens.bin``."""
    folder = Path(data_dir)
    index_path = folder / INDEX_FILE
    if not index_path.is_file():
        raise FileNotFoundError(
            f"{str(folder)!r} is not a prepared data folder (no {INDEX_FILE}); "
            "run `twinpipe prepare-data`"
        )
    index = json.loads(index_path.read_text())
    if index.get("format") != FORMAT_NAME or index.get("version") != FORMAT_VERSION:
        raise ValueError(f"{str(index_path)!r} is not a {FORMAT_NAME} v{FORMAT_VERSION} index")
    expected = index["num_tokens"] * np.dtype(index["dtype"]).itemsize
    actual = (folder / TOKENS_FILE).stat().st_size
    if actual != expected:
        raise ValueError(
            f"{str(folder / TOKENS_FILE)!r} holds {actual} bytes, index says {expected}"
        )
    return index


class TokenDataset:
    """Non-overlapping windows of ``seq_len + 1`` tokens over a prepared folder.

    ``dataset[i]`` is an int64 tensor of ``seq_len + 1`` tokens: inputs are
    ``[:-1]``, labels ``[1:]``. The token file is memory-mapped, never read whole.
    """

    def __init__(self, data_dir: str | os.PathLike, seq_len: int):
        if seq_len < 1:
            raise ValueError(f"seq_len = {seq_len} is invalid: must be >= 1")
        self.data_dir = Path(data_dir)
        self.index = read_index(self.data_dir)
        self.seq_len = seq_len
        self.num_tokens = int(self.index["num_tokens"])
        self.vocab_size = int(self.index["vocab_size"])
        self.eod_id = int(self.index["eod_id"])
        self.tokens = np.memmap(
            self.data_dir / TOKENS_FILE,
            dtype=np.dtype(self.index["dtype"]),
            mode="r",
            shape=(self.num_tokens,),
        )
        self.num_samples = max(0, (self.num_tokens - 1) // seq_len)
        if self.num_samples == 0:
            raise ValueError(
                f"{str(self.data_dir)!r} holds {self.num_tokens} tokens, too few for one "
                f"sample of seq_len + 1 = {seq_len + 1}"
            )

    @property
    def document_offsets(self) -> list[int]:
        """Start of each document, and the total token count at the end."""
        return self.index["document_offsets"]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> torch.Tensor:
        if not -self.num_samples <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        i %= self.num_samples
        start = i * self.seq_len
        return torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))

    def gather(self, sample_ids: np.ndarray) -> torch.Tensor:
        """Windows of ``sample_ids`` (any shape ``S``) as an int64 tensor ``S + [seq_len+1]``."""
        ids = np.asarray(sample_ids, dtype=np.int64)
        starts = ids.reshape(-1, 1) * self.seq_len + np.arange(self.seq_len + 1)
        windows = self.tokens[starts].astype(np.int64)
        return torch.from_numpy(windows.reshape(*ids.shape, self.seq_len + 1))


# --------------------------------------------------------------------------- sampling


class ShardedSampler:
    """Which samples each DP rank reads at each step, resumable to the exact sample.

    Every epoch is a permutation of ``range(num_samples)`` drawn from ``(seed, epoch)``
    (identity when ``shuffle`` is false). Steps take consecutive global batches of
    ``dp_size * samples_per_rank`` from it; DP rank ``r`` gets the ``r``-th slice of
    each. Ranks are therefore disjoint and together cover the epoch; the tail shorter
    than a global batch is skipped (a different tail each epoch, when shuffled).

    The position is ``(epoch, offset)`` into the epoch's permutation and does not
    depend on ``dp_size``: a restart with another DP layout but the same global batch
    reads the same global batches.
    """

    def __init__(
        self,
        num_samples: int,
        samples_per_rank: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ):
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank = {dp_rank} is invalid for dp_size = {dp_size}")
        if samples_per_rank < 1:
            raise ValueError(f"samples_per_rank = {samples_per_rank} is invalid: must be >= 1")
        global_batch = samples_per_rank * dp_size
        if num_samples < global_batch:
            raise ValueError(
                f"num_samples = {num_samples} is fewer than one global batch of "
                f"{global_batch} (= {dp_size} DP ranks x {samples_per_rank}); "
                "use more data, a shorter seq_len or smaller batches"
            )
        self.num_samples, self.samples_per_rank = num_samples, samples_per_rank
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self.global_batch = global_batch
        self.epoch, self.offset = 0, 0
        self._order_epoch: int | None = None
        self._order = np.empty(0, dtype=np.int64)

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """All sample ids of ``epoch``, in the order steps read them."""
        if self._order_epoch != epoch:
            if self.shuffle:
                rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
                self._order = rng.permutation(self.num_samples).astype(np.int64)
            else:
                self._order = np.arange(self.num_samples, dtype=np.int64)
            self._order_epoch = epoch
        return self._order

    def shard(self, epoch: int) -> np.ndarray:
        """Every sample id this rank reads in ``epoch``, in reading order."""
        used = self.epoch_order(epoch)[: self.steps_per_epoch * self.global_batch]
        return used.reshape(-1, self.dp_size, self.samples_per_rank)[:, self.dp_rank].reshape(-1)

    def next_ids(self) -> np.ndarray:
        """This rank's sample ids for the next step; advances the position."""
        if self.offset + self.global_batch > self.num_samples:
            self.epoch, self.offset = self.epoch + 1, 0
        start = self.offset + self.dp_rank * self.samples_per_rank
        ids = self.epoch_order(self.epoch)[start : start + self.samples_per_rank].copy()
        self.offset += self.global_batch
        return ids

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "num_samples", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key} = {state[key]!r} but this sampler has "
                    f"{getattr(self, key)!r}; resume with the same data, seq_len and seed"
                )
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if epoch < 0 or not 0 <= offset <= self.num_samples:
            raise ValueError(f"sampler state epoch = {epoch}, offset = {offset} is invalid")
        self.epoch, self.offset = epoch, offset


class Batch(NamedTuple):
    """One step's data for one DP rank: ``M`` micro-batches of ``micro_batch_size``."""

    inputs: torch.Tensor
    """int64 ``[M, micro_batch_size, seq_len]``."""
    labels: torch.Tensor
    """int64 ``[M, micro_batch_size, seq_len]``: ``inputs`` shifted left by one token."""
    sample_ids: torch.Tensor
    """int64 ``[M, micro_batch_size]``: which windows of the dataset these are."""
    epoch: int
    """Epoch the samples were drawn from."""


class TokenLoader:
    """Endless iterator of `Batch`es for one DP rank, with ``state_dict`` for restarts."""

    def __init__(
        self,
        dataset: TokenDataset,
        micro_batches: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ):
        sizes = {"micro_batches": micro_batches, "micro_batch_size": micro_batch_size}
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} = {value} is invalid: must be >= 1")
        self.dataset = dataset
        self.micro_batches, self.micro_batch_size = micro_batches, micro_batch_size
        self.sampler = ShardedSampler(
            len(dataset), micro_batches * micro_batch_size, dp_rank, dp_size, seed, shuffle
        )

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        ids = self.sampler.next_ids().reshape(self.micro_batches, self.micro_batch_size)
        epoch = self.sampler.epoch
        windows = self.dataset.gather(ids)
        return Batch(windows[..., :-1], windows[..., 1:], torch.from_numpy(ids), epoch)

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict(), "seq_len": self.dataset.seq_len}

    def load_state_dict(self, state: dict) -> None:
        if state["seq_len"] != self.dataset.seq_len:
            raise ValueError(
                f"loader state has seq_len = {state['seq_len']} but this loader has "
                f"{self.dataset.seq_len}"
            )
        self.sampler.load_state_dict(state["sampler"])


# --------------------------------------------------------------------------- default data

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
