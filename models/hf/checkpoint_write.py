"""Hugging Face checkpoints out: sharded safetensors written one tensor at a time.

`ShardWriter` takes tensors one by one in a planned order (names, shapes and dtypes known
up front) and writes each to its shard file as it arrives, so a writer that produces
tensors one at a time (the training checkpoint's export reads them from DCP) holds one
tensor, never a shard. The shards are ``model-0000k-of-0000n.safetensors`` with a
``model.safetensors.index.json``, as transformers writes them, or one
``model.safetensors`` when the plan asks for a single unsharded file.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable
from typing import NamedTuple

import torch

from models.hf.hf_config import config_to_hf
from models.hf.hf_layout import (
    CONFIG_NAME,
    INDEX_NAME,
    SHARD_NAME,
    WEIGHTS_NAME,
    shard_file_name,
    to_hf_state_dict,
)

METADATA = {"format": "pt"}


class Planned(NamedTuple):
    """One tensor of a write plan: its name, shape and dtype on disk."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def plan_shards(tensors: Iterable[Planned], max_shard_bytes: int | None) -> list[list[Planned]]:
    """Tensors per shard, in order; a new shard starts when the next tensor would overflow."""
    shards: list[list[Planned]] = [[]]
    size = 0
    for tensor in tensors:
        if max_shard_bytes is not None and shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


def remove_old_weights(path: str) -> None:
    for entry in os.listdir(path):
        if entry in (WEIGHTS_NAME, INDEX_NAME) or SHARD_NAME.match(entry):
            os.remove(os.path.join(path, entry))


def write_config(path: str, hf_config: dict) -> None:
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)
        f.write("\n")


SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}  # fmt: skip
"""The safetensors format's name of each dtype it stores."""


def safetensors_header(tensors: list[Planned]) -> bytes:
    """The 8-byte length and JSON header of a safetensors file holding ``tensors`` in
    order, padded with spaces to 8 bytes as the safetensors library writes it."""
    header: dict = {"__metadata__": METADATA}
    offset = 0
    for tensor in tensors:
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{tensor.name}: safetensors cannot store dtype {tensor.dtype}")
        end = offset + tensor.nbytes
        header[tensor.name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class ShardWriter:
    """Writes planned tensors into safetensors shards as they arrive, holding none of them.

    A shard's header is known from the plan (names, shapes, dtypes), so it is written when
    the shard's first tensor arrives, and every tensor's bytes go to the file at once: the
    writer's memory is the one tensor it is handed. A shard is written as
    ``NAME.partial`` and renamed when its last tensor is in, so a crash leaves no shard
    that looks whole.
    """

    def __init__(self, path: str | os.PathLike, shards: list[list[Planned]], single: bool) -> None:
        """``shards``: the tensors of each shard in order (`plan_shards`); ``single``:
        write one ``model.safetensors`` and no index (only with one shard)."""
        self.path = os.fspath(path)
        self.shards, self.single = shards, single and len(shards) == 1
        self.current, self.written = 0, 0
        """The shard being written and how many of its tensors are in."""
        self.handle = None
        self.total_bytes = 0
        self.largest_tensor_bytes = 0
        """The largest tensor written (bytes): all the memory writing needs."""
        os.makedirs(self.path, exist_ok=True)
        remove_old_weights(self.path)

    def file(self, shard: int) -> str:
        return WEIGHTS_NAME if self.single else shard_file_name(shard, len(self.shards))

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next tensor of the plan (tensors arrive in plan order)."""
        if self.current == len(self.shards):
            raise ValueError(f"{name} is not planned: every planned tensor is written")
        planned = self.shards[self.current][self.written]
        if name != planned.name:
            raise ValueError(f"{name} arrived where the plan writes {planned.name} next")
        if tuple(tensor.shape) != tuple(planned.shape) or tensor.dtype != planned.dtype:
            raise ValueError(
                f"{name}: planned {tuple(planned.shape)} {planned.dtype}, "
                f"got {tuple(tensor.shape)} {tensor.dtype}"
            )
        if self.handle is None:
            target = os.path.join(self.path, self.file(self.current) + ".partial")
            self.handle = open(target, "wb")  # noqa: SIM115 (closed at the shard's end)
            self.handle.write(safetensors_header(self.shards[self.current]))
        data = tensor.detach().cpu().contiguous().reshape(-1)
        self.handle.write(data.view(torch.uint8).numpy().data)
        self.largest_tensor_bytes = max(self.largest_tensor_bytes, planned.nbytes)
        self.total_bytes += planned.nbytes
        self.written += 1
        if self.written == len(self.shards[self.current]):
            self._finish_shard()

    def _finish_shard(self) -> None:
        self.handle.close()
        self.handle = None
        final = os.path.join(self.path, self.file(self.current))
        os.replace(final + ".partial", final)
        self.current, self.written = self.current + 1, 0

    def close(self) -> None:
        """Check every planned tensor was written; write the index (sharded)."""
        if self.current != len(self.shards):
            missing = [t.name for t in self.shards[self.current][self.written :]]
            raise ValueError(f"shard {self.current + 1} never received {missing[:4]}")
        if self.single:
            return
        weight_map = {t.name: self.file(i) for i, shard in enumerate(self.shards) for t in shard}
        with open(os.path.join(self.path, INDEX_NAME), "w") as f:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            json.dump(index, f, indent=2)
            f.write("\n")


def save_pretrained(model, path: str | os.PathLike, max_shard_bytes: int | None = None) -> None:
    """Write ``config.json`` and the weights of a whole `models.network.CausalLM` in the HF
    on-disk layout, in the model's dtype.

    Over ``max_shard_bytes`` the weights go to ``model-0000i-of-0000n.safetensors`` shards with
    a ``model.safetensors.index.json``, as transformers writes them. The model must hold every
    layer and every expert (a training checkpoint is exported with ``twinpipe export``).
    """
    config = model.config
    if model.ep.size > 1:
        raise ValueError(
            f"save_pretrained needs every expert, but this model holds expert shard "
            f"{model.ep.rank} of {model.ep.size}; gather the experts first"
        )
    state = to_hf_state_dict(model.state_dict(), config)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    hf_config = config_to_hf(config)
    hf_config["dtype"] = str(model.lm_head.weight.dtype).removeprefix("torch.")
    planned = [Planned(n, tuple(t.shape), t.dtype) for n, t in state.items()]
    writer = ShardWriter(path, plan_shards(planned, max_shard_bytes), single=True)
    write_config(path, hf_config)
    for name, tensor in state.items():
        writer.write(name, tensor)
    writer.close()


def write_mxfp4(
    source: str | os.PathLike, out: str | os.PathLike, max_shard_bytes: int | None
) -> None:
    """Re-write an unquantised GPT-OSS checkpoint folder as GPT-OSS is published: routed
    experts in MXFP4 (`models.hf.quantize`, ``*_blocks``/``*_scales``), the rest as
    stored, ``quantization_config`` in config.json. One tensor at a time (tests and
    benchmarks build published-style checkpoints with it)."""
    from safetensors import safe_open  # noqa: PLC0415

    from models.hf.hf_layout import FUSED_EXPERTS, MXFP4  # noqa: PLC0415
    from models.hf.mxfp4 import quantize

    source = os.fspath(source)
    with open(os.path.join(source, CONFIG_NAME)) as f:
        hf_config = json.load(f)
    if hf_config.get("model_type") != "gpt_oss":
        raise ValueError(
            f"{source} holds a {hf_config.get('model_type')} model; MXFP4 is GPT-OSS's"
        )
    files = [os.path.join(source, WEIGHTS_NAME)]
    if not os.path.exists(files[0]):
        with open(os.path.join(source, INDEX_NAME)) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(source, name) for name in names]
    entries = []  # (file, name, the tensor as stored)
    dtypes = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}
    for file in files:
        with safe_open(file, "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - a safetensors handle is no mapping
                view = handle.get_slice(name)
                shape, dtype = tuple(view.get_shape()), dtypes[view.get_dtype()]
                if FUSED_EXPERTS.match(name):
                    experts, inner, outer = shape
                    blocks = (experts, outer, inner // 32, 16)
                    entries.append((file, name, Planned(f"{name}_blocks", blocks, torch.uint8)))
                    entries.append((file, name, Planned(f"{name}_scales", blocks[:3], torch.uint8)))
                else:
                    entries.append((file, name, Planned(name, shape, dtype)))
    writer = ShardWriter(out, plan_shards([e[2] for e in entries], max_shard_bytes), True)
    hf_config["quantization_config"] = {
        "quant_method": MXFP4,
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }  # fmt: skip
    write_config(os.fspath(out), hf_config)
    packed: dict[str, torch.Tensor] = {}
    for file, name, planned in entries:
        stored = planned.name
        if stored.endswith("_scales"):
            writer.write(stored, packed.pop(stored))
            continue
        with safe_open(file, "pt") as handle:
            tensor = handle.get_tensor(name)
        if stored.endswith("_blocks"):  # ours [E, K, N] is stored transposed: [E, N, K / 32, 16]
            pairs = [quantize(expert.transpose(0, 1)) for expert in tensor]  # one at a time
            packed[f"{name}_scales"] = torch.stack([scales for _, scales in pairs])
            tensor = torch.stack([blocks for blocks, _ in pairs])
        writer.write(stored, tensor)
    writer.close()
