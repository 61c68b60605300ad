"""What a user hands a command, checked before any work or process group starts.

Every subcommand writes something at the end (a checkpoint, a report, a token file, a
page). A path that cannot be written used to be found out there, after the work: a
whole training run lost to a read-only ``--checkpoint-dir``. So each output path is
checked first -- its kind (folder or file), and that it can be created and written,
by creating a probe file, since permission bits say nothing to root or to a read-only
mount -- and a write that still fails at the end goes to a rescue folder that the
command names (`write_or_rescue`).

The checks live here, the lowest layer, because both `optimized.train`'s commands and
`harness`'s use them, and `optimized` may not import `harness`. Each raises `BadInput`
(a ``ValueError``) naming the flag, the value, and what would be valid; the commands turn
it into exit code 2.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


class BadInput(ValueError):
    """An argument, file or folder a command cannot use; the message names which and why."""


def _can_write_in(folder: Path) -> str | None:
    """None when a file can be created in ``folder``; else why not."""
    try:
        handle, probe = tempfile.mkstemp(dir=folder, prefix=".twinpipe-write-check-")
    except OSError as error:
        return error.strerror or str(error)
    os.close(handle)
    os.unlink(probe)
    return None


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_output_dir(path: str | os.PathLike, flag: str) -> Path:
    """``path`` as a folder this process can write into: an existing, writable folder, or
    one that can be created (its nearest existing ancestor is a writable folder). Nothing
    is created."""
    folder = Path(path)
    if folder.exists():
        if not folder.is_dir():
            raise BadInput(f"{flag} {str(path)!r}: exists and is not a folder")
        why = _can_write_in(folder)
        if why:
            raise BadInput(f"{flag} {str(path)!r}: cannot write in this folder ({why})")
        return folder
    ancestor = _nearest_existing(folder)
    if not ancestor.is_dir():
        raise BadInput(
            f"{flag} {str(path)!r}: cannot be created, {str(ancestor)!r} is a file, not a folder"
        )
    why = _can_write_in(ancestor)
    if why:
        raise BadInput(f"{flag} {str(path)!r}: cannot be created in {str(ancestor)!r} ({why})")
    return folder


def check_output_file(path: str | os.PathLike, flag: str) -> Path:
    """``path`` as a file this process can create or replace: not a folder, and its folder
    exists or can be created and is writable. Nothing is created or changed."""
    file = Path(path)
    if file.is_dir():
        raise BadInput(f"{flag} {str(path)!r}: is a folder; expected a file path")
    if str(path).endswith(("/", os.sep)):
        raise BadInput(f"{flag} {str(path)!r}: ends with a separator; expected a file path")
    try:
        check_output_dir(file.parent, "its folder")
    except BadInput as error:
        raise BadInput(f"{flag} {str(path)!r}: {error}") from None
    if file.exists() and not os.access(file, os.W_OK):
        raise BadInput(f"{flag} {str(path)!r}: the file exists and is not writable")
    return file


def check_input_file(path: str | os.PathLike, flag: str) -> Path:
    """``path`` as an existing, readable file."""
    file = Path(path)
    if not file.exists():
        raise BadInput(f"{flag} {str(path)!r}: no such file")
    if file.is_dir():
        raise BadInput(f"{flag} {str(path)!r}: is a folder; expected a file")
    if not os.access(file, os.R_OK):
        raise BadInput(f"{flag} {str(path)!r}: the file is not readable")
    return file


def rescue_folder() -> Path:
    """A fresh folder for outputs whose own path failed at the end of the work."""
    folder = Path(tempfile.gettempdir()) / f"twinpipe-rescue-{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True)
    return folder


def write_or_rescue(
    path: str | os.PathLike, write: Callable[[Path], T], what: str, command: str
) -> tuple[T, bool]:
    """``write(path)``; when that fails with an ``OSError``, ``write`` into a rescue folder
    instead and say where on stderr. Returns ``(write's result, rescued)``."""
    try:
        return write(Path(path)), False
    except OSError as error:
        target = rescue_folder() / Path(path).name
        result = write(target)
        print(
            f"twinpipe {command}: error: could not write {what} to {str(path)!r} "
            f"({error.strerror or error}); it is at {str(target)!r} instead",
            file=sys.stderr,
        )
        return result, True


def respect_umask(paths: Iterable[str | os.PathLike]) -> None:
    """Give files the mode a plain ``open`` would: ``0o666`` less the user's umask
    (safetensors creates its files ``0o600``, which hides a shared export from the team)."""
    mask = os.umask(0)
    os.umask(mask)
    for path in paths:
        os.chmod(path, 0o666 & ~mask)


# ------------------------------------------------------------------ checkpoints in
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def _safetensors_header(file: Path) -> dict[str, dict]:
    """Tensor name -> ``{"dtype", "shape", "data_offsets"}`` from a safetensors header;
    `BadInput` when the file is not safetensors or is shorter than its header says."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 0 or 8 + length > size:
            raise BadInput(f"{file} is truncated or not a safetensors file ({size} bytes)")
        try:
            header = json.loads(f.read(length))
        except ValueError as error:
            raise BadInput(f"{file}: unreadable safetensors header ({error})") from None
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    for name, info in tensors.items():
        end = 8 + length + info["data_offsets"][1]
        if end > size:
            raise BadInput(
                f"{file} is truncated: it has {size} bytes, but tensor {name} "
                f"({info['dtype']} {info['shape']}) ends at byte {end}"
            )
    return tensors


def check_hf_checkpoint(path: str | os.PathLike, config, flag: str) -> None:
    """A Hugging Face checkpoint folder that holds ``config``'s model: its ``config.json``
    is of the same family, every tensor is there with its shape, no file is truncated, and
    every weight is a float. Reads only ``config.json``, the index and the headers.

    (The checkpoints helper's ``validate_checkpoint`` does the same in `models.checkpoint`;
    when it lands, this becomes a call to it.)
    """
    from models.checkpoint import INDEX_NAME, WEIGHTS_NAME, expected_hf_shapes  # noqa: PLC0415
    from models.config import ModelConfig  # noqa: PLC0415

    folder = Path(path)
    if not folder.is_dir():
        raise BadInput(f"{flag} {str(path)!r}: expected a Hugging Face checkpoint folder")
    try:
        own = ModelConfig.from_hf(folder)
    except (ValueError, OSError) as error:
        raise BadInput(f"{flag} {str(path)!r}: {error}") from None
    if own.model_type != config.model_type:
        raise BadInput(
            f"{flag} {str(path)!r} holds a {own.model_type} model, not the "
            f"{config.model_type} model being run"
        )
    if (folder / WEIGHTS_NAME).is_file():
        files = [folder / WEIGHTS_NAME]
    elif (folder / INDEX_NAME).is_file():
        try:
            weight_map = json.loads((folder / INDEX_NAME).read_text())["weight_map"]
            files = sorted({folder / shard for shard in weight_map.values()})
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise BadInput(f"{folder / INDEX_NAME}: no readable weight_map ({error})") from None
        for file in files:
            if not file.is_file():
                raise BadInput(f"{flag} {str(path)!r}: shard {file.name} of the index is missing")
    else:
        raise BadInput(f"{flag} {str(path)!r}: no weights, expected {WEIGHTS_NAME} or {INDEX_NAME}")
    found: dict[str, tuple[str, list[int], Path]] = {}
    for file in files:
        for name, info in _safetensors_header(file).items():
            found[name] = (info["dtype"], info["shape"], file)
    expected = {n: list(s) for n, s in expected_hf_shapes(config).items()}
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    problems = [f"missing {n} {s}" for n, s in expected.items() if n not in found]
    problems += [f"unexpected {n}" for n in found if n not in expected and n not in tied]
    problems += [
        f"{n}: expected shape {s}, found {found[n][1]} (in {found[n][2].name})"
        for n, s in expected.items()
        if n in found and list(found[n][1]) != s
    ]
    problems += [
        f"{n}: dtype {d} is no float weight; expected one of {', '.join(FLOAT_DTYPES)}"
        f" (in {f.name})"
        for n, (d, _, f) in found.items()
        if d not in FLOAT_DTYPES
    ]
    if problems:
        shown = problems[:12] + ([f"... and {len(problems) - 12} more"] if problems[12:] else [])
        raise BadInput(
            f"{flag} {str(path)!r} does not hold the {config.model_type} model being run:\n  "
            + "\n  ".join(shown)
        )
