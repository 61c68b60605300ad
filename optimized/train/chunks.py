"""Explicit DCP chunks: each rank saves and loads exactly its own piece of a global tensor.

`torch.distributed.checkpoint` records, for every key, the global shape and the list of
chunks (offsets and sizes) the ranks wrote; a load at any layout asks for the regions it
needs and DCP reads the overlapping pieces. DTensors carry that geometry themselves, but
a rank's piece of a twinpipe parameter is a row range of the whole model's tensor that no
one device mesh describes: routed experts are cut by expert parallelism (a plain tensor
holding experts ``[first, first + local)``) and then, over the expert replicas, by FSDP2
rows; the sharded AdamW keeps flat slices of parameters that FSDP2 does not shard.

A `Chunk` names that geometry explicitly (the local tensor, its offsets and the global
shape), and `ChunkSavePlanner` / `ChunkLoadPlanner` hand it to DCP as a shard write or
read. Nothing is gathered: a save writes each rank's bytes as they are, and a load reads
only the regions a rank holds, straight into the tensors it passes (a parameter's
storage, an optimizer slice). Pieces two ranks both hold (replicas) have the same
offsets, and DCP's plan deduplication writes them once.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.futures import Future

from models.hf import read_exactly
from models.network import Progress


@dataclass(slots=True)
class Chunk:
    """A rank's piece of a global tensor, for DCP: ``tensor`` is the region of the global
    tensor that starts at ``offsets`` (one per dimension)."""

    tensor: torch.Tensor
    """This rank's piece (saved from, or loaded into, in place)."""
    offsets: tuple[int, ...]
    """Where the piece starts in the global tensor, per dimension."""
    global_shape: tuple[int, ...]
    """The whole tensor's shape, the same on every rank and at every layout."""

    def size(self) -> torch.Size:
        """The global shape (DCP checks it against the checkpoint's on load)."""
        return torch.Size(self.global_shape)

    def _metadata(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(torch.Size(self.offsets), self.tensor.size())

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        offsets = torch.Size(self.offsets)
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=self._metadata(),
                    properties=TensorProperties.create_from_tensor(self.tensor),
                    size=self.size(),
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._metadata()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.tensor


def rows(tensor: torch.Tensor, start: int, global_shape: tuple[int, ...]) -> Chunk:
    """``tensor`` as rows ``[start, start + len)`` of a global tensor (dim 0 offset)."""
    return Chunk(tensor, (start,) + (0,) * (len(global_shape) - 1), tuple(global_shape))


class ChunkSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, with `Chunk` values written as shards; ``progress``
    hears of each piece as the writer takes it (one at a time)."""

    def __init__(self, progress: Progress | None = None) -> None:
        super().__init__(flatten_state_dict=False)
        self.progress = progress

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict[index.fqn]
        if not isinstance(value, Chunk):
            return super().lookup_object(index)
        if self.progress is not None:
            self.progress(index.fqn, value.tensor.numel() * value.tensor.element_size())
        return value.tensor


class ChunkLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with `Chunk` values read in place from the regions of
    the saved chunks they overlap."""

    def __init__(self, progress: Progress | None = None) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.progress = progress

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:  # fmt: skip
        # The default planner first runs `_init_state_dict`, which turns values it does
        # not know (a Chunk) into None; nothing here is on the meta device.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict[index.fqn]
        return value.tensor if isinstance(value, Chunk) else super().lookup_tensor(index)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        if self.progress is not None:
            self.progress(read_item.dest_index.fqn, tensor.numel() * tensor.element_size())


def save(
    state: dict[str, Any], folder: str | os.PathLike, progress: Progress | None = None
) -> None:
    """Every rank's `Chunk` (and plain) values to ``folder`` (collective when initialised)."""
    dcp.save(state, checkpoint_id=str(folder), planner=ChunkSavePlanner(progress))


class CachedReader(dcp.FileSystemReader):
    """A DCP file reader that parses the checkpoint's metadata once, however many loads."""

    def __init__(self, folder: str | os.PathLike) -> None:
        super().__init__(str(folder))
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata

    def read_stored(self, key: str, stored: ChunkStorageMetadata) -> torch.Tensor:
        """The stored chunk ``stored`` of ``key``, whole, as the rank that saved it wrote it:
        its bytes read once, straight into the tensor returned. (`load` reads a stored
        chunk the same way, then copies out the region asked for, so a caller that needs
        several regions of one chunk reads it once here and cuts them itself.)"""
        info = self.read_metadata().storage_data[MetadataIndex(key, stored.offsets)]
        if info.transform_descriptors:
            raise ValueError(
                f"{self.path}: {key} at {list(stored.offsets)} is stored through "
                f"{list(info.transform_descriptors)}; twinpipe saves plain chunks only"
            )
        path = self.fs.concat_path(self.path, info.relative_path)
        with self.fs.create_stream(path, "rb") as stream:
            piece = self._slice_file(stream, info)
            return torch.load(piece, map_location="cpu", weights_only=True)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's read, but a region of a stored chunk is read as its own byte range.

        DCP's reader `torch.load`s each stored chunk a request overlaps, whole, then
        narrows it: a resume at another layout that needs 8 of 64 experts stored as one
        chunk read 8x its bytes. A stored chunk is a `torch.save` archive whose tensor is
        one contiguous record, so a range of its rows (dimension 0: every twinpipe chunk
        and every region asked of one) is one byte range of the file, read straight into
        the tensor it fills. Anything else goes DCP's way."""
        rest = []
        for request in plan.items:
            if request.type != LoadItemType.TENSOR or not self._read_rows(request, planner):
                rest.append(request)
        if rest:
            return super().read_data(dataclasses.replace(plan, items=rest), planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_rows(self, request: ReadItem, planner: LoadPlanner) -> bool:
        info = self.read_metadata().storage_data[request.storage_index]
        if info.transform_descriptors:
            return False
        path = self.fs.concat_path(self.path, info.relative_path)
        with open(path, "rb", buffering=0) as stream:
            piece = self._slice_file(stream, info)
            record = torch._C.PyTorchFileReader(piece).get_record_offset("data/0")
            piece.seek(0)
            with torch.serialization.skip_data():
                stored = torch.load(piece, map_location="meta", weights_only=True)
            start, lengths = request.storage_offsets, request.lengths
            row = stored[0].numel() * stored.element_size() if stored.dim() else 0
            if (
                stored.dim() == 0 or not stored.is_contiguous() or stored.storage_offset()
                or stored.untyped_storage().nbytes() != stored.numel() * stored.element_size()
                or any(start[d] or lengths[d] != stored.shape[d] for d in range(1, stored.dim()))
            ):  # fmt: skip
                return False
            target = planner.resolve_tensor(request).detach()
            if tuple(target.shape) != tuple(lengths):
                return False
            direct = target.is_contiguous() and target.dtype == stored.dtype
            out = (
                target
                if direct and target.device.type == "cpu"
                else torch.empty(tuple(lengths), dtype=stored.dtype)
            )
            stream.seek(info.offset + record + start[0] * row)
            read_exactly(stream, out.reshape(-1), f"{path} ({request.dest_index.fqn})")
            if out is not target:
                target.copy_(out)
        planner.commit_tensor(request, target)
        return True


def load(
    state: dict[str, Any],
    folder: str | os.PathLike | None = None,
    reader: dcp.FileSystemReader | None = None,
    collective: bool = True,
    progress: Progress | None = None,
) -> None:
    """Fill ``state``'s `Chunk` values from the checkpoint in ``folder`` (or ``reader``).
    ``collective=False`` loads in this process alone (no process group needed)."""
    reader = reader or CachedReader(folder)
    planner = ChunkLoadPlanner(progress)
    dcp.load(state, storage_reader=reader, planner=planner, no_dist=not collective)


def tensor_metadata(metadata: Metadata) -> dict[str, TensorStorageMetadata]:
    """Key -> global shape, dtype and saved chunks, for the tensors of a checkpoint."""
    return {
        key: md
        for key, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
