"""`twinpipe export`: a training checkpoint as a Hugging Face checkpoint, streamed.

The checkpoint is layout-free (chunks of whole-model tensors, `optimized.train.checkpointing`),
so export runs in one process whatever layout trained it, and never builds the model:
tensor by tensor, in the order of the on-disk layout (`models.hf.hf_layout`: DeepSeek-V2 and
Qwen3-MoE experts one tensor per expert, GPT-OSS fused), each output tensor is read from
the DCP chunks that hold it and written to its shard file at once (the shards,
``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``, are planned up
front from the shapes, so each header is known before its tensors arrive). A stored
chunk often holds many on-disk tensors (one rank's experts: 16 of Qwen3-30B-A3B's 128 at
EP=8, all of them at EP=1), so the plan is ordered by stored chunk and each chunk is read
once, whole, and every tensor cut from it written before the next is read (reading it
per on-disk tensor read 8.9x the bytes written on tiny-qwen3-moe). The peak is one stored
chunk plus the tensor being written (a tensor made of several chunks, such as a dense
weight in FSDP2 rows, is assembled in its own buffer), never a shard and never the model.
Weights are written in the trained dtype (or ``--dtype``);
a GPT-OSS model imported from MXFP4 is exported unquantised, and the command says so.

A trained expert bias (``moe.expert_bias``: ``e_score_correction_bias`` per MoE layer) is
written where the family's Hugging Face layout has the tensor
(`models.hf.hf_stores_expert_bias`). Where it has none (DeepSeek-V2, GPT-OSS, Qwen3-MoE)
the export cannot carry it, and the exported model chooses experts without it, so
differently from the trained one: the export warns, naming the layers and the bias's
largest magnitude, and records them in its report (`ExportReport.dropped`).
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from models.hf import config_from_hf, config_to_hf
from models.network import ModelConfig
from models.runtime import DTYPES, respect_umask

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from optimized.train.chunks import CachedReader

DEFAULT_SHARD_BYTES = 2 * 1024**3
"""Shard size of the export (transformers reads any; the export holds none in memory)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint", required=True,
        help="a checkpoint folder (step-*) or a checkpoint dir (its newest complete one)",
    )  # fmt: skip
    parser.add_argument("--out", required=True, help="folder to write the HF checkpoint to")
    parser.add_argument(
        "--dtype", choices=tuple(DTYPES), default=None, help="cast (default: as trained)"
    )
    parser.add_argument(
        "--max-shard-bytes", type=int, default=DEFAULT_SHARD_BYTES,
        help=f"bytes per safetensors shard (default {DEFAULT_SHARD_BYTES})",
    )  # fmt: skip


def _pieces(name: str, shape: torch.Size, config: ModelConfig):
    """The on-disk tensors of our tensor ``name``: (disk name, shape, offsets in ours)."""
    from models.hf import hf_tensors  # noqa: PLC0415

    whole = torch.empty(shape, device="meta")
    for disk_name, view in hf_tensors(name, whole, config).items():
        if view.dim() == whole.dim():  # itself
            yield disk_name, view.shape, (0,) * whole.dim()
            continue
        expert = int(disk_name.split(".mlp.experts.")[1].split(".")[0])
        first_row = config.moe_intermediate_size if ".up_proj." in disk_name else 0
        yield disk_name, view.shape, (expert, first_row, 0)


Region = tuple[tuple[int, int], ...]
"""``[start, stop)`` per dimension of a whole-model tensor."""


def _region(shape: tuple[int, ...], offsets: tuple[int, ...]) -> Region:
    """Where a piece of ``shape`` (leading dimensions of size 1 dropped) starting at
    ``offsets`` lies in the whole tensor."""
    full = (1,) * (len(offsets) - len(shape)) + tuple(shape)
    return tuple((first, first + size) for first, size in zip(offsets, full))


def _overlap(a: Region, b: Region) -> Region | None:
    both = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return both if all(start < stop for start, stop in both) else None


def _volume(region: Region) -> int:
    return math.prod(stop - start for start, stop in region)


def _cut(tensor: torch.Tensor, region: Region, origin: tuple[int, ...]) -> torch.Tensor:
    """``region`` of a tensor whose first element sits at ``origin`` (a view)."""
    index = tuple(slice(start - o, stop - o) for (start, stop), o in zip(region, origin))
    return tensor[index]


class StoredChunks:
    """The stored chunks of a training checkpoint, read for the export's pieces one chunk
    at a time: the chunk last read is kept until a piece needs another, so pieces taken
    in the order of `first_chunk` read each chunk once."""

    def __init__(self, reader: CachedReader, stored: dict[str, TensorStorageMetadata]) -> None:
        self.reader, self.stored = reader, stored
        self._held: tuple[str, tuple[int, ...]] | None = None
        self._tensor: torch.Tensor | None = None

    def chunks(self, key: str) -> list[Region]:
        """The regions of ``key``'s stored chunks, in offset order."""
        return sorted(_region(tuple(c.sizes), tuple(c.offsets)) for c in self.stored[key].chunks)

    def first_chunk(self, key: str, region: Region) -> int:
        """The index (offset order) of the first stored chunk ``region`` overlaps."""
        overlapping = (i for i, c in enumerate(self.chunks(key)) if _overlap(c, region) is not None)
        return next(overlapping, 0)

    def _chunk(self, key: str, chunk: Region) -> torch.Tensor:
        origin = tuple(start for start, _ in chunk)
        if self._held != (key, origin):
            self._held, self._tensor = None, None  # freed before the next is read
            md = next(c for c in self.stored[key].chunks if tuple(c.offsets) == origin)
            self._tensor, self._held = self.reader.read_stored(key, md), (key, origin)
        return self._tensor

    def piece(
        self, key: str, shape: torch.Size, region: Region, dtype: torch.dtype
    ) -> torch.Tensor:
        """``region`` of ``key`` as a tensor of ``shape`` in ``dtype``: a view of its
        stored chunk when one holds it all (cast: a copy of the piece), else assembled."""
        covering = [
            (c, part) for c in self.chunks(key) if (part := _overlap(c, region)) is not None
        ]
        if sum(_volume(part) for _, part in covering) != _volume(region):
            raise ValueError(
                f"{self.reader.path}: the stored chunks of {key} do not cover its rows "
                f"{[list(r) for r in region]} exactly (an incomplete or overlapping save)"
            )
        origin = tuple(start for start, _ in region)
        if len(covering) == 1 and covering[0][1] == region:
            chunk = covering[0][0]
            view = _cut(self._chunk(key, chunk), region, tuple(s for s, _ in chunk))
            return view.reshape(shape).to(dtype)
        out = torch.empty(shape, dtype=dtype)
        full = out.view(tuple(stop - start for start, stop in region))
        for chunk, part in covering:  # no view of a chunk outlives its copy: one at a time
            start = tuple(s for s, _ in chunk)
            _cut(full, part, origin).copy_(_cut(self._chunk(key, chunk), part, start))
        return out


class ExportReport(NamedTuple):
    """What `export_checkpoint` wrote."""

    folder: Path
    """The training checkpoint exported."""
    dtype: torch.dtype
    """The dtype of every weight written."""
    tensors: int
    shards: int
    total_bytes: int
    largest_tensor_bytes: int
    """The largest tensor written: with the stored chunk it came from, the export's memory."""
    dropped: tuple[str, ...] = ()
    """Trained tensors the family's HF layout has no place for, left out (expert biases)."""


def export(
    checkpoint: str | Path,
    out: str | Path,
    dtype: str | None = None,
    max_shard_bytes: int | None = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write the newest complete checkpoint under ``checkpoint`` to ``out``; return it."""
    return export_checkpoint(checkpoint, out, dtype, max_shard_bytes).folder


def export_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    dtype: str | None = None,
    max_shard_bytes: int | None = DEFAULT_SHARD_BYTES,
    progress: bool | None = None,
) -> ExportReport:
    """Write the newest complete checkpoint under ``checkpoint`` to ``out``, one tensor at a
    time (see the module docstring); ``progress`` (default: on a terminal) prints tensors
    and GB written."""
    from models.hf import (  # noqa: PLC0415
        Planned,
        ShardWriter,
        expected_state_shapes,
        hf_stores_expert_bias,
        is_state_buffer,
        plan_shards,
        to_hf_state_dict,
        write_config,
    )
    from models.runtime import ProgressLine
    from optimized.train import chunks  # noqa: PLC0415
    from optimized.train.checkpointing import (  # noqa: PLC0415
        newest_valid,
        validate_training_checkpoint,
    )

    folder = newest_valid(checkpoint)
    if folder is None:
        raise ValueError(f"no complete checkpoint in {checkpoint}")
    config = config_from_hf(str(folder / "config.json"))
    validate_training_checkpoint(folder, config)
    reader = chunks.CachedReader(folder)
    stored = chunks.tensor_metadata(reader.read_metadata())
    source = StoredChunks(reader, stored)
    biases = sorted(k.removeprefix("model.") for k in stored if is_state_buffer(k))
    dropped: tuple[str, ...] = ()
    if biases and hf_stores_expert_bias(config):
        config = config.replace(expert_bias=True)  # written under the family's HF name
    elif biases:
        dropped = tuple(biases)
        warnings.warn(_dropped_bias(config, dropped, source), stacklevel=2)
    trained = stored["model.model.embed_tokens.weight"].properties.dtype
    target = DTYPES[dtype] if dtype else trained
    plan = []  # (our name or None: zero-width, disk name, shape, region in ours)
    shapes = expected_state_shapes(config)
    for name, shape in shapes.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        pieces = [(name, d, s, _region(s, o)) for d, s, o in _pieces(name, shape, config)]
        plan += sorted(pieces, key=lambda p: source.first_chunk(f"model.{name}", p[3]))
    meta = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    on_disk = {disk for _, disk, _, _ in plan}
    for disk, tensor in to_hf_state_dict(meta, config).items():
        if disk not in on_disk:  # DeepSeek-V2's zero-width shared experts, as transformers
            plan.append((None, disk, tensor.shape, ()))
    # An expert bias stays float32 (the published layout's dtype, and the training state's).
    dtypes = [
        torch.float32 if name is not None and is_state_buffer(name) else target
        for name, _, _, _ in plan
    ]
    planned = [Planned(p[1], tuple(p[2]), dt) for p, dt in zip(plan, dtypes, strict=True)]
    writer = ShardWriter(out, plan_shards(planned, max_shard_bytes), single=False)
    hf_config = config_to_hf(config)
    hf_config["dtype"] = str(target).removeprefix("torch.")
    write_config(str(out), hf_config)
    line = ProgressLine(
        f"exporting {folder}", len(plan), sum(p.nbytes for p in planned), enabled=progress
    )
    for (name, disk, shape, region), dt in zip(plan, dtypes, strict=True):
        if name is None:
            tensor = torch.empty(shape, dtype=dt)
        else:
            tensor = source.piece(f"model.{name}", shape, region, dt)
        writer.write(disk, tensor)
        line(disk, tensor.numel() * tensor.element_size())
        del tensor  # a copy when cast or assembled: gone before the next is made
    writer.close()
    line.close()
    # safetensors creates its files 0600; an export is meant to be shared like any file.
    respect_umask(p for p in Path(out).iterdir() if p.name.endswith((".safetensors", ".json")))
    return ExportReport(
        folder, target, len(plan), len(writer.shards), writer.total_bytes,
        writer.largest_tensor_bytes, dropped,
    )  # fmt: skip


def _dropped_bias(config: ModelConfig, names: tuple[str, ...], source: StoredChunks) -> str:
    """The warning of an export that leaves a trained expert bias out."""
    largest = 0.0
    for name in names:
        shape = tuple(source.stored[f"model.{name}"].size)
        region = tuple((0, size) for size in shape)
        bias = source.piece(f"model.{name}", torch.Size(shape), region, torch.float32)
        largest = max(largest, float(bias.abs().max()))
    layers = ", ".join(name.split(".")[2] for name in names)
    return (
        f"the checkpoint holds a trained expert bias (e_score_correction_bias, moe.expert_bias) "
        f"of MoE layers {layers}, largest |bias| {largest:.4g}; {config.model_type}'s Hugging "
        "Face layout has no such tensor, so it is left out of the export, and the exported "
        "model chooses its experts without it: differently from the trained model"
    )


def _check(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, found before any tensor is read."""
    from models.runtime import BadInput, check_output_dir  # noqa: PLC0415
    from optimized.train.checkpointing import list_checkpoints, newest_valid  # noqa: PLC0415

    source = Path(args.checkpoint)
    if not source.is_dir():
        return f"--checkpoint {args.checkpoint!r}: no such checkpoint folder"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        folder = newest_valid(source)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    if folder is None:
        what = (
            "every checkpoint in it is incomplete or corrupt"
            if list_checkpoints(source)
            else "it holds no twinpipe checkpoint (step-* folders with a manifest.json)"
        )
        return f"--checkpoint {args.checkpoint!r}: {what}"
    try:
        config_from_hf(folder / "config.json")
    except (ValueError, OSError) as error:
        return f"--checkpoint {args.checkpoint!r}: {error}"
    if args.max_shard_bytes is not None and args.max_shard_bytes < 1:
        return f"--max-shard-bytes={args.max_shard_bytes} is invalid: expected >= 1 or unset"
    if Path(args.out).resolve().is_relative_to(source.resolve()):
        return (
            f"--out {args.out!r} lies in --checkpoint {args.checkpoint!r}: the export would write "
            "into the checkpoints; choose a folder outside it"
        )
    try:
        check_output_dir(args.out, "--out")
    except BadInput as error:
        return str(error)
    return None


def run(args: argparse.Namespace) -> int:
    problem = _check(args)
    if problem:
        print(f"twinpipe export: error: {problem}", file=sys.stderr)
        return 2
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = export_checkpoint(args.checkpoint, args.out, args.dtype, args.max_shard_bytes)
    except ValueError as error:  # a checkpoint that does not match its own config.json
        print(f"twinpipe export: error: {error}", file=sys.stderr)
        return 2
    for w in caught:
        print(f"twinpipe export: warning: {w.message}", file=sys.stderr)
    dtype = str(report.dtype).removeprefix("torch.")
    print(
        f"exported {report.folder} to {args.out}: {report.tensors} tensors in {report.shards} "
        f"shard(s), {report.total_bytes / 1e9:.2f} GB, every weight in {dtype} (unquantised: "
        f"GPT-OSS's MXFP4 experts and DeepSeek-V3's FP8 weights are written in {dtype}; expert "
        f"biases in float32); largest tensor "
        f"{report.largest_tensor_bytes / 1e9:.2f} GB"
        + (f"; left out: {len(report.dropped)} expert biases (see the warning)"
           if report.dropped else "")
    )  # fmt: skip
    return 0
