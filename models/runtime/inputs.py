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


def read_text(path: str | os.PathLike, expected: str) -> str:
    """The text of ``path``, a UTF-8 text file. A binary file (a NUL byte, or bytes that
    are not UTF-8: an image, an archive, a checkpoint's tensors) is a `BadInput` naming
    the file, the first offending byte and ``expected`` (what the file should hold), not
    a decoding traceback; an unreadable one is the ``OSError``."""
    data = Path(path).read_bytes()
    nul = data.find(b"\0")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        nul = error.start if nul < 0 else min(nul, error.start)
    else:
        if nul < 0:
            return text
    raise BadInput(
        f"{str(path)!r} is not a text file (byte 0x{data[nul]:02x} at offset {nul} is "
        f"{'a NUL' if data[nul] == 0 else 'not UTF-8'}); expected {expected}"
    )


def read_json(path: str | os.PathLike, expected: str) -> object:
    """``path`` parsed as JSON (`read_text`); `BadInput` naming the file, where the JSON
    breaks and ``expected`` when it does not parse."""
    text = read_text(path, expected)
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise BadInput(
            f"{str(path)!r} is not valid JSON ({error.msg} at line {error.lineno} column "
            f"{error.colno}); expected {expected}"
        ) from None


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
