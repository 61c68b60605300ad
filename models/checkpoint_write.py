"""Hugging Face checkpoints out: sharded safetensors written one shard buffer at a time.

`ShardWriter` takes tensors one by one in a planned order and writes each shard as soon
as its last tensor arrives, so a writer that produces tensors one at a time (the
training checkpoint's export reads them from DCP) never holds more than one shard's
buffer. The shards are ``model-0000k-of-0000n.safetensors`` with a
``model.safetensors.index.json``, as transformers writes them, or one
``model.safetensors`` when the plan asks for a single unsharded file.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable

import torch
from safetensors.torch import save_file

from models.hf_layout import (
    CONFIG_NAME,
    INDEX_NAME,
    SHARD_NAME,
    WEIGHTS_NAME,
    shard_file_name,
    to_hf_state_dict,
)

METADATA = {"format": "pt"}


def owned(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor that owns its storage (safetensors refuses views into a shared one)."""
    tensor = tensor.detach().cpu()
    whole = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    return tensor if whole and tensor.is_contiguous() else tensor.clone()


def plan_shards(sizes: Iterable[tuple[str, int]], max_shard_bytes: int | None) -> list[list[str]]:
    """Names per shard, in order; a new shard starts when the next tensor would overflow."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes:
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def remove_old_weights(path: str) -> None:
    for entry in os.listdir(path):
        if entry in (WEIGHTS_NAME, INDEX_NAME) or SHARD_NAME.match(entry):
            os.remove(os.path.join(path, entry))


def write_config(path: str, hf_config: dict) -> None:
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)
        f.write("\n")


class ShardWriter:
    """Writes planned tensors into safetensors shards, each as soon as it is complete."""

    def __init__(self, path: str | os.PathLike, shards: list[list[str]], single: bool) -> None:
        """``shards``: the names of each shard in order (`plan_shards`); ``single``: write
        one ``model.safetensors`` and no index (only with one shard)."""
        self.path = os.fspath(path)
        self.shards, self.single = shards, single and len(shards) == 1
        self.shard_of = {name: i for i, names in enumerate(shards) for name in names}
        self.buffer: dict[str, torch.Tensor] = {}
        self.current = 0
        self.total_bytes = 0
        self.peak_buffer_bytes = 0
        """The largest shard buffer held (bytes): what writing cost beyond one tensor."""
        os.makedirs(self.path, exist_ok=True)
        remove_old_weights(self.path)

    def file(self, shard: int) -> str:
        return WEIGHTS_NAME if self.single else shard_file_name(shard, len(self.shards))

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next tensor of the plan (names arrive in plan order)."""
        shard = self.shard_of.get(name)
        if shard != self.current:
            raise ValueError(f"{name} is not planned for shard {self.current + 1} (plan order)")
        self.buffer[name] = owned(tensor)
        held = sum(t.numel() * t.element_size() for t in self.buffer.values())
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, held)
        if len(self.buffer) == len(self.shards[shard]):
            self._flush()

    def _flush(self) -> None:
        names = self.shards[self.current]
        self.total_bytes += sum(t.numel() * t.element_size() for t in self.buffer.values())
        save_file(
            {n: self.buffer[n] for n in names},
            os.path.join(self.path, self.file(self.current)),
            METADATA,
        )
        self.buffer = {}
        self.current += 1

    def close(self) -> None:
        """Check every planned tensor was written; write the index (sharded)."""
        if self.current != len(self.shards):
            missing = [n for n in self.shards[self.current] if n not in self.buffer]
            raise ValueError(f"shard {self.current + 1} never received {missing[:4]}")
        if self.single:
            return
        weight_map = {name: self.file(i) for i, names in enumerate(self.shards) for name in names}
        with open(os.path.join(self.path, INDEX_NAME), "w") as f:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            json.dump(index, f, indent=2)
            f.write("\n")


def save_pretrained(model, path: str | os.PathLike, max_shard_bytes: int | None = None) -> None:
    """Write ``config.json`` and the weights of a whole `models.model.CausalLM` in the HF
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
    hf_config = config.to_hf()
    hf_config["dtype"] = str(model.lm_head.weight.dtype).removeprefix("torch.")
    sizes = [(n, t.numel() * t.element_size()) for n, t in state.items()]
    writer = ShardWriter(path, plan_shards(sizes, max_shard_bytes), single=True)
    write_config(path, hf_config)
    for name, tensor in state.items():
        writer.write(name, tensor)
    writer.close()


def write_mxfp4(
    source: str | os.PathLike, out: str | os.PathLike, max_shard_bytes: int | None
) -> None:
    """Re-write an unquantised GPT-OSS checkpoint folder as GPT-OSS is published: routed
    experts in MXFP4 (`models.mxfp4.quantize`, ``*_blocks``/``*_scales``), the rest as
    stored, ``quantization_config`` in config.json. One tensor at a time (tests and
    benchmarks build published-style checkpoints with it)."""
    from safetensors import safe_open  # noqa: PLC0415

    from models.hf_layout import FUSED_EXPERTS, MXFP4  # noqa: PLC0415
    from models.mxfp4 import quantize  # noqa: PLC0415

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
    entries = []  # (file, name, stored name, bytes)
    for file in files:
        with safe_open(file, "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - a safetensors handle is no mapping
                view = handle.get_slice(name)
                shape, item = view.get_shape(), 2 if view.get_dtype() in ("BF16", "F16") else 4
                if FUSED_EXPERTS.match(name):
                    experts, inner, outer = shape
                    values = experts * outer * inner
                    entries.append((file, name, f"{name}_blocks", values // 2))
                    entries.append((file, name, f"{name}_scales", values // 32))
                else:
                    entries.append((file, name, name, math.prod(shape) * item))
    writer = ShardWriter(out, plan_shards([(e[2], e[3]) for e in entries], max_shard_bytes), True)
    hf_config["quantization_config"] = {
        "quant_method": MXFP4,
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }  # fmt: skip
    write_config(os.fspath(out), hf_config)
    packed: dict[str, torch.Tensor] = {}
    for file, name, stored, _ in entries:
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
