"""Hugging Face checkpoints: read and write the on-disk layout of transformers 5.

In memory, twinpipe's names are transformers 5's (``model.layers.3.mlp.experts.gate_up_proj``),
but the files differ from memory in two ways, and this module is where that is handled:

- DeepSeek-V2 and Qwen3-MoE store one ``gate_proj``/``up_proj``/``down_proj`` per expert
  (``model.layers.3.mlp.experts.7.up_proj.weight [I, H]``), the layout of the published
  checkpoints; transformers fuses them on load into ``gate_up_proj [E, 2I, H]`` (gate rows
  first) and ``down_proj [E, H, I]``, and so do we. GPT-OSS is fused on disk as in memory.
- With tied embeddings ``lm_head.weight`` is not written; it is the embedding.

DeepSeek-V2 in transformers always builds shared experts, of width
``moe_intermediate_size * n_shared_experts``: with none, its files hold zero-width
``shared_experts`` tensors, which we write and accept (our model has no module for them).

Loading opens safetensors files lazily, so an expert-parallel rank reads only the experts
it keeps (rank ``r`` of ``EP`` holds experts ``[r * E / EP, (r + 1) * E / EP)``). Every
tensor name and shape is checked against the config before a byte of weights is read, and
one error lists everything that is missing, unexpected or mis-shaped.
"""

from __future__ import annotations

import contextlib
import json
import os
import re

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.config import ModelConfig
from models.decoder import SINGLE, ExpertParallel
from models.model import CausalLM

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_LIST_AT_MOST = 12
_SHAPES_ONLY = object()  # ops of a meta-device model that is never run


# ------------------------------------------------------------------ layouts
def _experts_split_on_disk(config: ModelConfig) -> bool:
    return config.model_type != "gpt_oss"


def expected_state_shapes(
    config: ModelConfig, ep: ExpertParallel = SINGLE
) -> dict[str, torch.Size]:
    """Names and shapes of `CausalLM`'s state dict (our naming) for ``config`` at ``ep``.

    Built on the meta device, so it costs no memory at any model size.
    """
    with torch.device("meta"):
        model = CausalLM(config, ops=_SHAPES_ONLY, ep=ep)
    return {name: t.shape for name, t in model.state_dict().items()}


def _meta_state(config: ModelConfig) -> dict[str, torch.Tensor]:
    return {
        name: torch.empty(shape, device="meta")
        for name, shape in expected_state_shapes(config).items()
    }


def expected_hf_shapes(config: ModelConfig) -> dict[str, torch.Size]:
    """Names and shapes of the tensors a full Hugging Face checkpoint of ``config`` holds."""
    return {name: t.shape for name, t in to_hf_state_dict(_meta_state(config), config).items()}


def to_hf_state_dict(
    state_dict: dict[str, torch.Tensor], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """Our state dict (whole model, our naming) as the tensors of an HF checkpoint on disk.

    Per-expert tensors are views of the fused ones (no copy); `save_pretrained` writes them.
    Raises ``ValueError`` naming any tensor that is missing, unexpected or mis-shaped.
    """
    _check_tensors(
        "state dict",
        expected_state_shapes(config),
        {name: t.shape for name, t in state_dict.items()},
        config,
    )
    split = _experts_split_on_disk(config)
    inner = config.moe_intermediate_size
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        fused = _FUSED_EXPERTS.match(name)
        if not (fused and split):
            out[name] = tensor
            continue
        prefix, kind = fused.groups()
        for expert in range(tensor.shape[0]):
            if kind == "gate_up_proj":
                out[f"{prefix}.{expert}.gate_proj.weight"] = tensor[expert, :inner]
                out[f"{prefix}.{expert}.up_proj.weight"] = tensor[expert, inner:]
            else:
                out[f"{prefix}.{expert}.down_proj.weight"] = tensor[expert]
    if config.model_type == "deepseek_v2" and not config.n_shared_experts:
        reference = state_dict["model.embed_tokens.weight"]
        for layer in range(config.num_hidden_layers):
            if config.is_moe_layer(layer):
                out.update(_zero_width_shared_experts(layer, config.hidden_size, reference))
    return out


def _zero_width_shared_experts(
    layer: int, hidden: int, like: torch.Tensor
) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{layer}.mlp.shared_experts"
    empty = {"dtype": like.dtype, "device": like.device}
    return {
        f"{prefix}.gate_proj.weight": torch.empty(0, hidden, **empty),
        f"{prefix}.up_proj.weight": torch.empty(0, hidden, **empty),
        f"{prefix}.down_proj.weight": torch.empty(hidden, 0, **empty),
    }


def _check_tensors(
    where: str,
    expected: dict[str, torch.Size],
    found: dict[str, torch.Size],
    config: ModelConfig,
    optional: frozenset[str] = frozenset(),
) -> None:
    """One ``ValueError`` listing every missing, unexpected and mis-shaped tensor."""
    missing = [name for name in expected if name not in found]
    unexpected = [name for name in found if name not in expected and name not in optional]
    wrong = [
        f"{name}: expected {list(expected[name])}, found {list(found[name])}"
        for name in expected
        if name in found and tuple(found[name]) != tuple(expected[name])
    ]
    if not (missing or unexpected or wrong):
        return
    lines = [f"{where} does not match the {config.model_type} config:"]
    for title, items in (
        ("missing", [f"{name} {list(expected[name])}" for name in missing]),
        ("unexpected", [f"{name} {list(found[name])}" for name in unexpected]),
        ("wrong shape", wrong),
    ):
        if items:
            lines.append(f"  {len(items)} {title}:")
            lines.extend(f"    {item}" for item in items[:_LIST_AT_MOST])
            if len(items) > _LIST_AT_MOST:
                lines.append(f"    ... and {len(items) - _LIST_AT_MOST} more")
    raise ValueError("\n".join(lines))


# ------------------------------------------------------------------ reading
def _weight_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file, from ``model.safetensors`` or the shard index."""
    single = os.path.join(path, WEIGHTS_NAME)
    if os.path.exists(single):
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(_names_in(f), single)
    index_path = os.path.join(path, INDEX_NAME)
    if not os.path.exists(index_path):
        raise FileNotFoundError(
            f"no weights in {path}: expected {WEIGHTS_NAME} or {INDEX_NAME} (safetensors)"
        )
    with open(index_path) as f:
        weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict):
        raise TypeError(f"{index_path} has no 'weight_map' of tensor name -> shard file")
    files = {name: os.path.join(path, shard) for name, shard in weight_map.items()}
    for shard in sorted(set(files.values())):
        if not os.path.exists(shard):
            raise FileNotFoundError(f"shard {shard} named in {index_path} does not exist")
    return files


def _names_in(handle) -> list[str]:
    return list(handle.keys())  # a safetensors handle is no mapping: no `in`, no iteration


class _Reader:
    """Lazily opened safetensors files; reads whole tensors or a range of their first dim."""

    def __init__(self, files: dict[str, str], stack: contextlib.ExitStack) -> None:
        self.files, self.stack = files, stack
        self.handles: dict[str, object] = {}

    def _handle(self, name: str):
        file = self.files[name]
        if file not in self.handles:
            self.handles[file] = self.stack.enter_context(safe_open(file, framework="pt"))
        return self.handles[file]

    def shapes(self) -> dict[str, torch.Size]:
        shapes = {}
        first_name = {file: name for name, file in self.files.items()}
        names = {file: set(_names_in(self._handle(name))) for file, name in first_name.items()}
        for name, file in self.files.items():
            handle = self._handle(name)
            if name not in names[file]:
                raise ValueError(f"tensor {name} is listed for {file} but that file lacks it")
            shapes[name] = torch.Size(handle.get_slice(name).get_shape())
        return shapes

    def tensor(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def fused_expert(self, prefix: str, kind: str, expert: int) -> torch.Tensor:
        """One expert's slice of our fused tensor from its per-expert tensors on disk."""
        if kind == "down_proj":
            return self.tensor(f"{prefix}.{expert}.down_proj.weight")
        gate = self.tensor(f"{prefix}.{expert}.gate_proj.weight")
        return torch.cat([gate, self.tensor(f"{prefix}.{expert}.up_proj.weight")])

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._handle(name).get_slice(name)[start:stop]


def load_state_dict_hf(
    path: str | os.PathLike,
    config: ModelConfig | None = None,
    ep: ExpertParallel = SINGLE,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """The state dict (our naming) of an HF checkpoint folder, only ``ep``'s expert shard.

    ``config`` defaults to the folder's ``config.json``; ``dtype`` casts (default: as stored).
    With tied embeddings ``lm_head.weight`` is the embedding tensor (and ignored on disk).
    """
    path = os.fspath(path)
    if config is None:
        config = ModelConfig.from_hf(path)
    tied = frozenset({"lm_head.weight"}) if config.tie_word_embeddings else frozenset()
    files = _weight_files(path)
    local = expected_state_shapes(config, ep)  # validates ep against num_experts
    num_local = config.num_experts // ep.size
    first = ep.rank * num_local
    split = _experts_split_on_disk(config)
    out: dict[str, torch.Tensor] = {}
    with contextlib.ExitStack() as stack:
        reader = _Reader(files, stack)
        _check_tensors(
            f"checkpoint {path}", expected_hf_shapes(config), reader.shapes(), config, tied
        )
        for name in local:
            fused = _FUSED_EXPERTS.match(name)
            if name == "lm_head.weight" and config.tie_word_embeddings:
                tensor = out["model.embed_tokens.weight"]
            elif fused and split:
                prefix, kind = fused.groups()
                experts = range(first, first + num_local)
                tensor = torch.stack([reader.fused_expert(prefix, kind, e) for e in experts])
            elif name.startswith("model.layers.") and ".mlp.experts." in name:
                tensor = reader.rows(name, first, first + num_local)  # fused on disk
            else:
                tensor = reader.tensor(name)
            if dtype is not None:
                tensor = tensor.to(dtype)
            out[name] = tensor
    return out


def from_pretrained(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    ops=None,
    ep: ExpertParallel = SINGLE,
) -> CausalLM:
    """A `CausalLM` with the weights of an HF checkpoint folder (``ep``'s experts only)."""
    config = ModelConfig.from_hf(path)
    state = load_state_dict_hf(path, config, ep)
    model = CausalLM(config, ops, ep)
    model.load_state_dict(state, strict=True)
    return model.to(dtype)


# ------------------------------------------------------------------ writing
def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor that owns its storage (safetensors refuses views into a shared one)."""
    tensor = tensor.detach().cpu()
    whole = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    return tensor if whole and tensor.is_contiguous() else tensor.clone()


def _plan_shards(state: dict[str, torch.Tensor], max_shard_bytes: int | None) -> list[list[str]]:
    """Names per shard, in order; a new shard starts when the next tensor would overflow."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _remove_old_weights(path: str) -> None:
    for entry in os.listdir(path):
        if entry in (WEIGHTS_NAME, INDEX_NAME) or _SHARD_NAME.match(entry):
            os.remove(os.path.join(path, entry))


def save_pretrained(
    model: CausalLM, path: str | os.PathLike, max_shard_bytes: int | None = None
) -> None:
    """Write ``config.json`` and the weights in the HF on-disk layout, in the model's dtype.

    Over ``max_shard_bytes`` the weights go to ``model-0000i-of-0000n.safetensors`` shards with
    a ``model.safetensors.index.json``, as transformers writes them. The model must hold every
    layer and every expert (gather an expert-parallel model first).
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
    _remove_old_weights(path)
    hf_config = config.to_hf()
    hf_config["dtype"] = str(model.lm_head.weight.dtype).removeprefix("torch.")
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)
        f.write("\n")
    shards = _plan_shards(state, max_shard_bytes)
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(
            {n: _owned(t) for n, t in state.items()},
            os.path.join(path, WEIGHTS_NAME),
            metadata=metadata,
        )
        return
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: _owned(state[n]) for n in names}, os.path.join(path, file), metadata)
        weight_map.update({n: file for n in names})
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(path, INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        f.write("\n")
