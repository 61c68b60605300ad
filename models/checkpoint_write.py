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
