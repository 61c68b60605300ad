"""Weight sources: where a rank's parameters come from, one slice at a time.

A published MoE model does not fit in one process, and no rank needs all of it: a
pipeline rank holds its stages (the V layout: the embedding and the head on pp-rank 0),
an expert-parallel rank its experts, an FSDP2 rank its rows. So nothing whole-model is
built in a parent and pickled to the ranks. A rank gets a *weight source*, a small
picklable object, builds its part on the meta device (no memory, no random init) and asks
the source for exactly the rows it holds, straight into the parameter's storage
(`materialise`). Every parameter a rank holds is a range of rows (dim 0) of the whole
model's tensor of that name: the EP shard of an expert tensor is the block of experts
``[first, first + local)``, and an FSDP2 shard is a further row range of that.

Sources:

- `SeededWeights` (``config``, ``seed``): a random initialisation that can produce any
  rows of any tensor without producing the rest. Each tensor is cut into fixed blocks of
  rows -- one expert for a routed-expert tensor, about a million elements otherwise --
  and each block is drawn from its own generator, seeded from ``(seed, name, block)``.
  The blocks do not depend on the layout, so the same seed gives the same weights at any
  PP, DP, EP or FSDP layout, and a rank draws only the blocks its rows touch;
- `models.hf.CheckpointWeights`: slices of a Hugging Face checkpoint;
- `optimized.train.checkpointing.TrainingCheckpointWeights`: slices of a training
  checkpoint (DCP);
- `StateDictWeights`: a state dict already in this process (tests, one-process tools).

`Reporting` wraps any source to report progress (tensors and bytes read) on a terminal.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from typing import Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from models.network.config import ModelConfig

EXPERT_MARKER = ".mlp.experts."
"""Routed-expert parameters (``model.layers.3.mlp.experts.gate_up_proj``): dim 0 is experts."""

SEED_BLOCK_ELEMENTS = 1 << 20
"""Elements per seeded block of a non-expert tensor (whole rows; at least one row)."""

Progress = Callable[[str, int], None]
"""``progress(name, nbytes)``: one more tensor of ``nbytes`` done (`models.runtime.progress`)."""


@runtime_checkable
class WeightSource(Protocol):
    """Fills a parameter's rows from wherever the weights live.

    A source may also have ``holds(name) -> bool``: whether it has a training-state buffer
    (`state_buffers`: an expert bias); one it lacks starts at zero. Without ``holds``, every
    buffer is asked for."""

    def fill(self, name: str, out: torch.Tensor, start: int = 0) -> None:
        """Write rows ``[start, start + out.shape[0])`` of the whole model's tensor ``name``
        (our naming and layout, `models.network.CausalLM`) into ``out``, in ``out``'s dtype."""
        ...


def init_value(name: str) -> str:
    """How the random initialisation sets ``name``: ``ones`` (norms), ``zeros`` (biases,
    attention sinks) or ``normal`` (matrices: N(0, initializer_range))."""
    if name.endswith("norm.weight"):
        return "ones"
    if name.endswith("bias") or name.endswith("sinks"):
        return "zeros"
    return "normal"


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class SeededWeights:
    """Random weights that any rank can draw in part; see the module docstring."""

    __slots__ = ("config", "seed")

    def __init__(self, config: ModelConfig, seed: int = 0) -> None:
        self.config = config
        """The model: initializer_range and whether the output layer is the embedding."""
        self.seed = seed
        """The seed every block's generator is derived from."""

    def __repr__(self) -> str:
        return f"SeededWeights({self.config.model_type}, seed={self.seed})"

    def fill(self, name: str, out: torch.Tensor, start: int = 0) -> None:
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        kind = init_value(name)
        if kind != "normal" or out.numel() == 0:
            out.fill_(1.0 if kind == "ones" else 0.0)
            return
        row_shape = tuple(out.shape[1:])
        per_block = (
            1 if EXPERT_MARKER in name else max(1, SEED_BLOCK_ELEMENTS // math.prod(row_shape))
        )
        stop = start + out.shape[0]
        for block in range(start // per_block, -(-stop // per_block)):
            first = block * per_block
            generator = torch.Generator().manual_seed(_block_seed(self.seed, name, block))
            values = torch.empty((per_block,) + row_shape).normal_(
                0.0, self.config.initializer_range, generator=generator
            )
            lo, hi = max(start, first), min(stop, first + per_block)
            out[lo - start : hi - start].copy_(values[lo - first : hi - first])


class StateDictWeights:
    """A whole-model state dict (our naming) held in this process, as a source."""

    __slots__ = ("state",)

    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        self.state = state
        """Whole tensors by name (routed experts as ``[E, ...]``)."""

    def fill(self, name: str, out: torch.Tensor, start: int = 0) -> None:
        if name not in self.state:
            raise KeyError(f"the state dict has no tensor {name}")
        out.copy_(self.state[name][start : start + out.shape[0]])

    def holds(self, name: str) -> bool:
        return name in self.state


class Reporting:
    """A source that reports each tensor it fills to ``progress`` (a `ProgressLine`)."""

    __slots__ = ("inner", "progress")

    def __init__(self, inner: WeightSource, progress: Progress) -> None:
        self.inner, self.progress = inner, progress

    def fill(self, name: str, out: torch.Tensor, start: int = 0) -> None:
        self.inner.fill(name, out, start)
        self.progress(name, out.numel() * out.element_size())

    def holds(self, name: str) -> bool:
        holds = getattr(self.inner, "holds", None)
        return holds is None or holds(name)


def as_source(weights: WeightSource | Mapping[str, torch.Tensor]) -> WeightSource:
    """``weights`` as a source: a state dict is wrapped in `StateDictWeights`."""
    if isinstance(weights, Mapping):
        return StateDictWeights(weights)
    if not isinstance(weights, WeightSource):
        raise TypeError(f"expected a weight source or a state dict, got {type(weights).__name__}")
    return weights


# ------------------------------------------------------------------ materialise
def chunk_rows(rows: int, size: int, index: int) -> tuple[int, int]:
    """``(start, count)`` of shard ``index`` of ``size`` over ``rows`` rows, cut as
    `torch.chunk` (and FSDP2) cuts dim 0: ``ceil(rows / size)`` each, the last ones short
    or empty."""
    chunk = -(-rows // size)
    start = min(rows, index * chunk)
    return start, min(rows, start + chunk) - start


def _row_offset(module: nn.Module, param: torch.Tensor) -> int:
    """First row of the whole model's tensor this rank's ``param`` holds."""
    start = getattr(
        module, "first_expert", 0
    )  # models.network.layers.Experts: this EP rank's block
    if isinstance(param, DTensor):
        if tuple(param.placements) != (Shard(0),):
            raise ValueError(f"cannot place rows of a DTensor with placements {param.placements}")
        mesh = param.device_mesh
        start += chunk_rows(param.shape[0], mesh.size(), mesh.get_local_rank())[0]
    return start


@torch.no_grad()
def materialise(part: nn.Module, source: WeightSource, device: torch.device | str = "cpu") -> None:
    """Give a meta-device part real storage on ``device`` and fill it from ``source``.

    Parameters keep the dtype they have on the meta device. A part whose parameters
    already have storage (sharded and allocated by `fully_shard`'s caller) is filled in
    place. Buffers (rotary tables) are recomputed; a tied output layer is re-tied.
    Each parameter reads only its rows; nothing else is allocated but one source slice.
    """
    if any(p.is_meta for p in part.parameters()):
        part.to_empty(device=device)
    tie = getattr(part, "tie_weights", None)
    if tie is not None:
        tie()
    for module in part.modules():
        init_buffers = getattr(module, "init_buffers", None)
        if init_buffers is not None:
            init_buffers()
    owners = {
        f"{prefix}.{pname}" if prefix else pname: module
        for prefix, module in part.named_modules()
        for pname, _ in module.named_parameters(recurse=False)
    }
    for name, param in part.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param.data
        if local.numel():
            source.fill(name, local, _row_offset(owners[name], param))
    for name, buffer in state_buffers(part):
        holds = getattr(source, "holds", None)
        if holds is None or holds(name):
            source.fill(name, buffer)
        else:  # a checkpoint made before the run turned the expert bias on: it starts at 0
            buffer.zero_()


def state_buffers(part: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Buffers that are training state, not derived from the config (the routers' expert
    biases): read from a weight source and written to checkpoints like parameters, in
    float32 whatever the model's dtype (``FLOAT32_BUFFERS`` of their module)."""
    found = []
    for prefix, module in part.named_modules():
        for attribute in getattr(module, "FLOAT32_BUFFERS", ()):
            buffer = module._buffers.get(attribute)
            if buffer is not None:
                found.append((f"{prefix}.{attribute}" if prefix else attribute, buffer))
    return found


def keep_float32(part: nn.Module) -> None:
    """Put `state_buffers` back in float32 after ``part.to(dtype)`` cast them."""
    for module in part.modules():
        for attribute in getattr(module, "FLOAT32_BUFFERS", ()):
            buffer = module._buffers.get(attribute)
            if buffer is not None and buffer.dtype != torch.float32:
                module._buffers[attribute] = buffer.float()
