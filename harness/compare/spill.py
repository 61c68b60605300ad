"""The float32 truth's gradients, spilled to a file while the bfloat16 stacks run.

The noise floor (`harness.compare.noise_floor`) compares each bfloat16 stack's gradients with the
float32 truth's of the same step, so the truth's gradients must outlive both stacks'
backward passes. Held in memory they are two copies of the rank's bfloat16 parameters:
with the baseline's gradients held aside, the harness would add three copies to the rank's
training footprint instead of one. Written to a file (one sequential write per step), they
cost nothing resident: the pages are the kernel's to drop once written back. The comparison
reads them back one tensor at a time (`LoadedPieces`), so at most one tensor is
resident on top of the stacks.

The file lives in the system's temporary folder (``TMPDIR``), is unlinked when the step's
comparison is done (`close`), and when the process ends in any way Python can see.
"""

from __future__ import annotations

import os
import tempfile
import weakref
from collections.abc import Iterator, Mapping

import torch

from harness.compare.inplace import Piece
from harness.compare.instruments import Instrument
from harness.compare.record import StepRecord
from models.hf import read_exactly


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class SpilledGradients(Mapping[str, torch.Tensor]):
    """A name -> gradient mapping whose tensors live in a file; reading one loads it."""

    def __init__(self, grads: dict[str, torch.Tensor]) -> None:
        """Writes ``grads`` (emptied as it goes, so each tensor is freed once written)."""
        fd, self.path = tempfile.mkstemp(prefix="twinpipe-truth-", suffix=".grad")
        self._finalizer = weakref.finalize(self, _remove, self.path)
        self._where: dict[str, tuple[int, torch.Size, torch.dtype, torch.device]] = {}
        offset = 0
        with os.fdopen(fd, "wb") as file:
            for name in list(grads):
                tensor = grads.pop(name).detach()
                device = tensor.device
                flat = tensor.reshape(-1).contiguous().cpu()
                file.write(memoryview(flat.view(torch.uint8).numpy()))
                self._where[name] = (offset, tensor.shape, tensor.dtype, device)
                offset += flat.numel() * flat.element_size()
                del tensor, flat
        self.nbytes = offset

    def __getitem__(self, name: str) -> torch.Tensor:
        offset, shape, dtype, device = self._where[name]
        out = torch.empty(shape, dtype=dtype)
        with open(self.path, "rb", buffering=0) as file:
            file.seek(offset)
            read_exactly(file, out.reshape(-1), f"{self.path} ({name})")
        return out.to(device)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def placeholder(self, name: str) -> torch.Tensor | None:
        """A meta tensor shaped like ``name``'s gradient (None when there is none)."""
        if name not in self._where:
            return None
        _, shape, dtype, _ = self._where[name]
        return torch.empty(shape, dtype=dtype, device="meta")

    def close(self) -> None:
        self._finalizer()


class ParkedTensors:
    """Tensors held in mappings (an optimizer's per-parameter state) whose bytes wait in a
    file until `restore` puts equal tensors back in the same places.

    The float32 truth's step (`harness.compare.lockstep`) needs nothing of the bfloat16 stacks'
    optimizer: parked, AdamW's two moments (two copies of the rank's parameters in their
    dtype) are not resident beside the truth's float32 parameters, gradients and
    activations. Nothing else may hold a parked tensor meanwhile, or its memory stays.
    """

    def __init__(self, slots: list[tuple[dict, str]]) -> None:
        fd, self.path = tempfile.mkstemp(prefix="twinpipe-parked-", suffix=".bin")
        self._finalizer = weakref.finalize(self, _remove, self.path)
        self._slots: list[tuple[dict, str, torch.Size, torch.dtype, torch.device]] = []
        self.nbytes = 0
        with os.fdopen(fd, "wb") as file:
            for mapping, key in slots:
                tensor = mapping.pop(key)
                flat = tensor.detach().reshape(-1).contiguous().cpu()
                file.write(memoryview(flat.view(torch.uint8).numpy()))
                self._slots.append((mapping, key, tensor.shape, tensor.dtype, tensor.device))
                self.nbytes += flat.numel() * flat.element_size()
                del tensor, flat

    def restore(self) -> None:
        """Every parked tensor back in its place, then the file removed."""
        with open(self.path, "rb", buffering=0) as file:
            for mapping, key, shape, dtype, device in self._slots:
                out = torch.empty(shape, dtype=dtype)
                read_exactly(file, out.reshape(-1), f"{self.path} ({key})")
                mapping[key] = out.to(device)
        self._slots = []
        self._finalizer()


class LoadedPieces(Mapping[str, Piece]):
    """Pieces whose tensors are read from a `SpilledGradients` one at a time, when asked."""

    def __init__(self, shapes: dict[str, Piece], source: SpilledGradients) -> None:
        self._shapes = shapes
        self._source = source

    def __getitem__(self, name: str) -> Piece:
        piece = self._shapes[name]
        return Piece(self._source[name], piece.start, piece.counts)

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)


class TruthSpill(Instrument):
    """The rank's spill instrument: the files of the float32 truth's step, AdamW's parked
    moments (`park`, `restore`) and the truth's spilled gradients (`spill`); each step's
    bytes into the record, and every file removed by the step's end."""

    def __init__(self) -> None:
        self.gradients: SpilledGradients | None = None
        self.parked: ParkedTensors | None = None
        self.parked_bytes = 0

    def start_step(self) -> None:
        self.gradients, self.parked, self.parked_bytes = None, None, 0

    def park(self, optimizer: torch.optim.Optimizer) -> None:
        """AdamW's moments of ``optimizer`` into a file (they are two more copies of the
        parameters, needed again only at the update)."""
        state = getattr(optimizer, "state", {})
        moments = [
            (s, k) for s in state.values() for k, v in s.items()
            if k != "step" and type(v) is torch.Tensor and v.numel() > 1
        ]  # fmt: skip
        self.parked = ParkedTensors(moments) if moments else None

    def restore(self) -> None:
        """The parked moments back in the optimizer's state."""
        if self.parked is not None:
            self.parked_bytes = self.parked.nbytes
            self.parked.restore()
            self.parked = None

    def spill(self, grads: dict[str, torch.Tensor]) -> SpilledGradients:
        """The truth's gradients into a file (``grads`` is emptied as it is written)."""
        self.gradients = SpilledGradients(grads)
        return self.gradients

    def end_step(self, record: StepRecord) -> None:
        if self.gradients is not None:
            record.spilled = self.gradients.nbytes
            self.gradients.close()
            self.gradients = None
        record.parked = self.parked_bytes
