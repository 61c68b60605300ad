"""Hugging Face checkpoints in: checked before anything trains, read a slice at a time.

`validate_checkpoint` reads only what describes a checkpoint (``config.json``, the shard
index, each safetensors header) and refuses, naming the file, the tensor, and the expected
and found shape or dtype, anything that does not match the model: missing, unexpected or
mis-shaped tensors, a dtype that is no float (int32 weights), a file shorter than its own
header says (truncated), a quantisation we do not read. CLIs call it in the parent,
before any process group starts.

`CheckpointWeights` is the weight source (`models.network.weights`) of a checkpoint folder: a
rank fills each of its parameters with only the rows it holds, read from the file straight
into the parameter (`read_rows`: a row range of a safetensors tensor is one byte range),
one tensor -- for routed experts one expert -- at a time, so nothing is mapped or copied
whole. On-disk layouts are those of `models.hf.hf_layout`; GPT-OSS's MXFP4 experts are read
the same way, one expert's ``*_blocks`` and ``*_scales`` rows into small uint8 buffers,
and dequantised into the parameter's dtype, bit for bit as transformers does
(`models.hf.mxfp4`); so are DeepSeek-V3's FP8 weights, a few block rows of float8 values
and the scale rows that cover them at a time (`models.hf.fp8`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from models.hf.checkpoint_write import SAFETENSORS_DTYPES, save_pretrained
from models.hf.config_json import read_config_json
from models.hf.fp8 import FP8, block_size, dequantize_rows, grid_shape, scale_name
from models.hf.hf_config import config_from_hf
from models.hf.hf_layout import (
    FLOAT_DTYPES,
    FUSED_EXPERTS,
    INDEX_NAME,
    MXFP4,
    WEIGHTS_NAME,
    CheckpointError,
    check_tensors,
    expected_hf_shapes,
    experts_split_on_disk,
    skipped_on_disk,
    to_hf_state_dict,
)
from models.hf.mtp_copies import compare_copies, copy_names
from models.hf.mxfp4 import dequantize
from models.network import SINGLE, CausalLM, ExpertParallel, ModelConfig, Reporting, build_part
from models.runtime import BadInput, ProgressLine, read_json

__all__ = [
    "INDEX_NAME",
    "WEIGHTS_NAME",
    "CheckpointError",
    "CheckpointWeights",
    "check_hf_checkpoint",
    "checked_weights",
    "from_pretrained",
    "load_state_dict_hf",
    "save_pretrained",
    "to_hf_state_dict",
    "validate_checkpoint",
]


class StoredTensor(NamedTuple):
    """One tensor of a safetensors file, as its header describes it."""

    file: str
    dtype: str
    """safetensors dtype code: ``F32``, ``BF16``, ``U8``, ``I32``, ..."""
    shape: tuple[int, ...]
    end: int
    """Byte of the file where its data ends."""


INDEX_EXPECTED = "a safetensors index: a JSON object whose weight_map maps tensor names to files"
"""What ``model.safetensors.index.json`` must hold (said when it does not)."""


def read_header(file: str) -> dict[str, StoredTensor]:
    """The tensors a safetensors file holds, from its header alone; `CheckpointError` when
    the file is not safetensors or is shorter than its header says (truncated)."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else None
        if length is None or 8 + length > size:
            raise CheckpointError(
                f"{file} is truncated or not a safetensors file: it has {size} bytes, "
                f"less than its header needs ({'8' if length is None else 8 + length})"
            )
        try:
            header = json.loads(f.read(length))
        except ValueError as error:
            raise CheckpointError(f"{file}: unreadable safetensors header ({error})") from None
    stored = {
        name: StoredTensor(
            file, info["dtype"], tuple(info["shape"]), 8 + length + info["data_offsets"][1]
        )
        for name, info in header.items()
        if name != "__metadata__"
    }
    beyond = [(t.end, name) for name, t in stored.items() if t.end > size]
    if beyond:
        end, name = min(beyond)
        t = stored[name]
        raise CheckpointError(
            f"{file} is truncated: it has {size} bytes, but tensor {name} "
            f"({t.dtype} {list(t.shape)}) ends at byte {end}"
        )
    return stored


def _weight_files(path: str) -> list[str]:
    single = os.path.join(path, WEIGHTS_NAME)
    if os.path.exists(single):
        return [single]
    index_path = os.path.join(path, INDEX_NAME)
    if not os.path.exists(index_path):
        raise FileNotFoundError(
            f"no weights in {path}: expected {WEIGHTS_NAME} or {INDEX_NAME} (safetensors)"
        )
    index = read_json(index_path, INDEX_EXPECTED)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path} has no 'weight_map' of tensor name -> shard file")
    files = sorted(set(weight_map.values()))
    for shard in files:
        if not os.path.exists(os.path.join(path, shard)):
            raise FileNotFoundError(f"shard {shard} named in {index_path} does not exist")
    return [os.path.join(path, shard) for shard in files]


def quantization_of(raw_config: dict) -> str | None:
    """``quantization_config.quant_method`` of a ``config.json`` (None: not quantised)."""
    quantization = raw_config.get("quantization_config")
    if quantization is None:
        return None
    return str(quantization.get("quant_method")) if isinstance(quantization, dict) else "?"


TORCH_DTYPES = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}
"""safetensors dtype code -> torch dtype."""
READ_BUFFER_BYTES = 64 << 20
"""The most a read holds beside its destination, when it must convert the dtype."""


def read_rows(stored: StoredTensor, out: torch.Tensor, start: int = 0) -> None:
    """Rows ``[start, start + len(out))`` of ``stored`` (all of it for a 0-d tensor) read
    from its file straight into ``out``: with the same dtype into ``out``'s own memory,
    else through a buffer of at most `READ_BUFFER_BYTES`, converted a block at a time. The
    file is neither mapped nor copied whole, so loading holds the model and nothing else
    (the pages read stay in the page cache, which is not the process's memory)."""
    dtype = TORCH_DTYPES[stored.dtype]
    item = dtype.itemsize
    row = math.prod(stored.shape[1:])
    count = out.numel()
    rows = out.shape[0] if out.dim() and stored.shape else 1
    if math.prod(stored.shape[1:] if out.dim() else stored.shape) * rows != count:
        raise ValueError(
            f"{stored.file}: rows of {list(stored.shape)} do not fill {list(out.shape)}"
        )
    begin = stored.end - math.prod(stored.shape) * item + start * row * item
    direct = dtype == out.dtype and out.is_contiguous() and out.device.type == "cpu"
    with open(stored.file, "rb", buffering=0) as f:
        f.seek(begin)
        if direct:
            read_exactly(f, out.reshape(-1), stored.file)
            return
        flat = out.view(-1) if out.is_contiguous() else None
        per = max(1, READ_BUFFER_BYTES // item)
        if flat is None:  # a strided destination: one buffer of its size
            per = count
        for first in range(0, count, per):
            buffer = torch.empty(min(per, count - first), dtype=dtype)
            read_exactly(f, buffer, stored.file)
            if flat is None:
                out.copy_(buffer.view(out.shape))
            else:
                flat[first : first + buffer.numel()].copy_(buffer)


def read_exactly(f, tensor: torch.Tensor, file: str) -> None:
    """Fill a contiguous 1-d CPU ``tensor`` with the next bytes of ``f`` (a file opened
    ``rb``); `CheckpointError` naming ``file`` when it ends first."""
    view = memoryview(tensor.view(torch.uint8).numpy()).cast("B")
    done = 0
    while done < len(view):
        got = f.readinto(view[done:])
        if not got:
            raise CheckpointError(f"{file} ended while reading a tensor: is it truncated?")
        done += got


class CheckpointLayout(NamedTuple):
    """What a checked checkpoint folder holds."""

    path: str
    config: ModelConfig
    """The model of its ``config.json``."""
    quantization: str | None
    """None, ``mxfp4`` (GPT-OSS's routed experts) or ``fp8`` (block-quantised weights)."""
    tensors: dict[str, StoredTensor]
    """Every tensor on disk, by name (DeepSeek-V3's MTP layers left out)."""
    block: tuple[int, int] | None = None
    """FP8: the block of rows and columns that shares one scale (None: one per tensor)."""
    copies: dict[str, StoredTensor] | None = None
    """The MTP layers' copies of the embedding and the head on disk (`mtp_copies`), by name."""


def validate_checkpoint(
    path: str | os.PathLike, config: ModelConfig | None = None
) -> CheckpointLayout:
    """Check a Hugging Face checkpoint folder against ``config`` (default: its own
    ``config.json``) from its headers alone; raise `CheckpointError` (a ``ValueError``)
    naming the file, the tensor, and the expected and found shape or dtype."""
    path = os.fspath(path)
    config_file, raw = read_config_json(path)
    own = config_from_hf(path)
    config = config or own
    quantization = quantization_of(raw)
    readable = {None, MXFP4 if config.model_type == "gpt_oss" else FP8}
    if quantization not in readable:
        raise CheckpointError(
            f"{config_file}: quantization_config.quant_method={quantization!r} is not read "
            f"here; twinpipe reads unquantised checkpoints, GPT-OSS's {MXFP4!r} experts and "
            f"the other families' block-quantised {FP8!r} weights (DeepSeek-V3's)"
        )
    block = _fp8_block(raw, config_file) if quantization == FP8 else None
    if own.model_type != config.model_type:
        raise CheckpointError(
            f"{config_file} holds a {own.model_type} model, not the {config.model_type} model "
            "being run: pass --model for this checkpoint, or another checkpoint"
        )
    tensors: dict[str, StoredTensor] = {}
    index: dict[str, str] = {}
    if not os.path.exists(os.path.join(path, WEIGHTS_NAME)) and os.path.exists(
        os.path.join(path, INDEX_NAME)
    ):
        stored = read_json(os.path.join(path, INDEX_NAME), INDEX_EXPECTED)
        weight_map = stored.get("weight_map") if isinstance(stored, dict) else None
        index = {n: os.path.join(path, s) for n, s in (weight_map or {}).items()}
    for file in _weight_files(path):
        tensors.update(read_header(file))
    for name, file in index.items():
        if name not in tensors or tensors[name].file != file:
            raise CheckpointError(f"tensor {name} is listed for {file} but that file lacks it")
    if index:
        tensors = {name: t for name, t in tensors.items() if name in index}
    copies = {name: tensors[name] for name in copy_names(config) if name in tensors}
    copies |= {scale_name(n): tensors[scale_name(n)] for n in copies if scale_name(n) in tensors}
    tensors = {n: t for n, t in tensors.items() if not (skipped_on_disk(n, config) or n in copies)}
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    wrong_dtype = [p for n, t in tensors.items() if (p := _dtype_problem(n, t, quantization))]
    if quantization == FP8:
        scales = {n for n in tensors if n.endswith("_scale_inv")}
        optional |= scales
        wrong_dtype += _fp8_problems(tensors, scales, block)
    check_tensors(
        f"checkpoint {path}",
        _read_shapes(config, quantization),
        {name: torch.Size(t.shape) for name, t in tensors.items()},
        config,
        frozenset(optional),
        {name: t.file for name, t in tensors.items()},
        wrong_dtype,
    )
    return CheckpointLayout(path, config, quantization, tensors, block, copies)


def _read_shapes(config, quantization: str | None) -> dict[str, torch.Size]:
    """The tensors a checkpoint of ``config`` must hold for a read: the MTP layers' copies of
    the embedding and the head are written, not read (`skipped_on_disk`)."""
    shapes = expected_hf_shapes(config, quantization if quantization == MXFP4 else None)
    return {name: shape for name, shape in shapes.items() if not skipped_on_disk(name, config)}


def _fp8_block(raw: dict, config_file: str) -> tuple[int, int] | None:
    quantization = raw["quantization_config"]
    fmt = quantization.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(
            f"{config_file}: quantization_config.fmt={fmt!r} is not read here: FP8 weights "
            "are read as float8 e4m3 ('e4m3')"
        )
    try:
        return block_size(quantization)
    except ValueError as error:
        raise CheckpointError(f"{config_file}: {error}") from None


def _fp8_problems(
    tensors: dict[str, StoredTensor], scales: set[str], block: tuple[int, int] | None
) -> list[str]:
    """Each FP8 weight needs its float scale grid (one entry per block), and each scale grid
    an FP8 weight."""
    problems = []
    for name, stored in tensors.items():
        if stored.dtype != "F8_E4M3":
            continue
        scale = tensors.get(scale_name(name))
        if len(stored.shape) != 2:
            problems.append(f"{name}: FP8 {list(stored.shape)}, expected a 2-d weight")
        elif scale is None:
            problems.append(f"{name}: FP8 without its {scale_name(name)} (in {stored.file})")
        elif scale.shape != grid_shape(stored.shape, block) or scale.dtype not in ("F32", "BF16"):
            problems.append(
                f"{scale_name(name)}: expected F32 {list(grid_shape(stored.shape, block))} "
                f"(the grid of {list(stored.shape)} in {block} blocks), found {scale.dtype} "
                f"{list(scale.shape)} (in {scale.file})"
            )
    for name in scales:
        weight = tensors.get(name.removesuffix("_scale_inv"))
        if weight is None or weight.dtype != "F8_E4M3":
            problems.append(f"{name}: scales of no FP8 weight (in {tensors[name].file})")
    return problems


def check_hf_checkpoint(path: str | os.PathLike, config, flag: str) -> None:
    """A Hugging Face checkpoint folder that holds ``config``'s model: its ``config.json``
    is of the same family, every tensor is there with its shape, no file is truncated,
    every weight is a float (or GPT-OSS's MXFP4 experts), no quantisation we do not read.
    Reads only ``config.json``, the index and the headers (`validate_checkpoint`), and
    the MTP layers' copies of the embedding and the head with what they copy
    (`CheckpointWeights.check_mtp_copies`)."""
    folder = Path(path)
    if not folder.is_dir():
        raise BadInput(f"{flag} {str(path)!r}: expected a Hugging Face checkpoint folder")
    try:
        checked_weights(folder, config)
    except (ValueError, OSError) as error:
        raise BadInput(f"{flag} {str(path)!r}: {error}") from None


def _dtype_problem(name: str, stored: StoredTensor, quantization: str | None) -> str | None:
    packed = quantization == MXFP4 and name.endswith(("_blocks", "_scales"))
    allowed = ("U8",) if packed else FLOAT_DTYPES
    if quantization == FP8 and name.endswith(".weight"):
        allowed = (*FLOAT_DTYPES, "F8_E4M3")
    if stored.dtype in allowed:
        return None
    expected = " or ".join(allowed)
    return f"{name}: expected {expected}, found {stored.dtype} (in {stored.file})"


class CheckpointWeights:
    """A Hugging Face checkpoint folder as a weight source; checked when built (in the
    parent), then picklable to every rank."""

    def __init__(self, path: str | os.PathLike, config: ModelConfig | None = None) -> None:
        self.layout = validate_checkpoint(path, config)
        """The checked folder: its model, quantisation and tensors."""

    @property
    def config(self) -> ModelConfig:
        return self.layout.config

    def __repr__(self) -> str:
        return f"CheckpointWeights({self.layout.path!r})"

    def holds(self, name: str) -> bool:
        """Whether the folder has the training-state buffer ``name`` (an expert bias; where the
        family's layout has none, `models.hf.hf_layout.hf_stores_expert_bias`, never): one it
        lacks starts at zero (`models.network.materialise`)."""
        return name in self.layout.tensors

    def check_mtp_copies(self) -> None:
        """Each MTP layer's copy of the embedding and the head on disk equal to the main
        model's, which the layer shares: read once, a block of rows of both at a time
        (`models.hf.mtp_copies`); `CheckpointError` naming the tensors where they differ."""
        compare_copies(self.layout.copies or {}, self.config, self._into, self.layout.path)

    def _into(self, name: str, out: torch.Tensor, start: int = 0) -> None:
        """Rows ``[start, start + len(out))`` of a tensor on disk, read into ``out`` (an FP8
        one dequantised, with the rows of its scale grid that cover them)."""
        tensors = {**self.layout.tensors, **(self.layout.copies or {})}
        stored = tensors[name]
        if stored.dtype == "F8_E4M3":
            scales = tensors[scale_name(name)]
            dequantize_rows(stored, scales, self.layout.block, out, start, read_rows)
        else:
            read_rows(stored, out, start)

    def _packed(self, name: str, expert: int) -> torch.Tensor:
        """One expert's rows of an MXFP4 ``*_blocks`` or ``*_scales`` tensor (uint8), read
        by byte range into a buffer of their size."""
        stored = self.layout.tensors[name]
        out = torch.empty((1, *stored.shape[1:]), dtype=TORCH_DTYPES[stored.dtype])
        read_rows(stored, out, expert)
        return out

    def fill(self, name: str, out: torch.Tensor, start: int = 0) -> None:
        config = self.config
        if name == "lm_head.weight" and config.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        fused = FUSED_EXPERTS.match(name)
        if fused and experts_split_on_disk(config):
            prefix, kind = fused.groups()
            inner = config.moe_intermediate_size
            for i in range(out.shape[0]):
                expert = f"{prefix}.{start + i}"
                if kind == "down_proj":
                    self._into(f"{expert}.down_proj.weight", out[i])
                else:
                    self._into(f"{expert}.gate_proj.weight", out[i, :inner])
                    self._into(f"{expert}.up_proj.weight", out[i, inner:])
        elif fused and self.layout.quantization == MXFP4:
            for i in range(out.shape[0]):  # one expert at a time: [N, K / 32, 16] -> [K, N]
                blocks = self._packed(f"{name}_blocks", start + i)
                scales = self._packed(f"{name}_scales", start + i)
                out[i].copy_(dequantize(blocks, scales, out.dtype)[0].transpose(0, 1))
        else:
            self._into(name, out, start)


def checked_weights(
    path: str | os.PathLike, config: ModelConfig | None = None
) -> CheckpointWeights:
    """`CheckpointWeights` of a folder whose MTP copies were also held equal to the main
    model's (`CheckpointWeights.check_mtp_copies`): what a parent builds before any rank."""
    source = CheckpointWeights(path, config)
    source.check_mtp_copies()
    return source


def from_pretrained(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    ops=None,
    ep: ExpertParallel = SINGLE,
    progress: bool | None = None,
) -> CausalLM:
    """A `CausalLM` with the weights of an HF checkpoint folder (``ep``'s experts only).

    Built on the meta device and filled in ``dtype`` a tensor at a time: the peak is the
    model in ``dtype`` plus one tensor. ``progress`` (default: on a terminal) prints
    tensors and GB read.
    """
    source = CheckpointWeights(path)
    source.check_mtp_copies()
    line = ProgressLine(f"loading {os.fspath(path)}", enabled=progress)
    model = build_part(source.config, Reporting(source, line), ops=ops, ep=ep, dtype=dtype)
    line.close()
    return model


def load_state_dict_hf(
    path: str | os.PathLike,
    config: ModelConfig | None = None,
    ep: ExpertParallel = SINGLE,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """The state dict (our naming) of an HF checkpoint folder, only ``ep``'s expert shard.

    ``config`` defaults to the folder's ``config.json``; ``dtype`` casts (default: the
    embedding's stored dtype). With tied embeddings ``lm_head.weight`` is the embedding.
    """
    source = CheckpointWeights(path, config)
    source.check_mtp_copies()
    if dtype is None:
        with safe_open(source.layout.tensors["model.embed_tokens.weight"].file, "pt") as f:
            dtype = f.get_slice("model.embed_tokens.weight").get_dtype()
            dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[dtype]
    return build_part(source.config, source, ep=ep, dtype=dtype).state_dict()
