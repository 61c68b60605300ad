"""Per-layer saved-tensor profile: what each stage keeps for its backward.

A stage's activation memory between its forward and its backward is what
autograd saves (plus the stage's boundary tensors, which the optimized schedule
frees early). `profile_layer` runs one decoder layer stage by stage under
`torch.autograd.graph.saved_tensors_hooks` and sorts every saved tensor into
*parameters* (a parameter of the layer, or a view of one: the layer holds it
anyway) or *activations*, deduplicated by storage (a tensor saved by two nodes
counts once, at its storage's full size: that is what stays allocated).

The harness reports this next to the measured peak, and the estimator can read
``LayerProfile.activation_bytes`` per stage instead of deriving it from shapes.
The expert stage runs with EP = 1 semantics on whatever rows it is given, so the
profile needs no process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from models.network import DecoderLayer

STAGES = ("attention", "dispatch", "experts", "combine", "aggregate")


@dataclass(slots=True)
class StageProfile:
    """Saved-tensor bytes of one stage of one layer."""

    parameter_bytes: int = 0
    """Bytes of saved tensors that are (views of) the layer's parameters."""
    activation_bytes: int = 0
    """Bytes of every other saved storage: what a micro-batch in flight costs."""
    tensors: list[tuple[str, tuple[int, ...], int]] = field(default_factory=list)
    """``(kind, shape, storage bytes)`` of each distinct saved storage."""


@dataclass(slots=True)
class LayerProfile:
    """Saved-tensor bytes of a layer, by stage."""

    layer: int
    stages: dict[str, StageProfile]

    @property
    def activation_bytes(self) -> int:
        return sum(stage.activation_bytes for stage in self.stages.values())

    @property
    def parameter_bytes(self) -> int:
        return sum(stage.parameter_bytes for stage in self.stages.values())

    def as_dict(self) -> dict:
        """Plain data for reports: ``{stage: {"parameters": b, "activations": b}}``."""
        return {
            name: {"parameters": s.parameter_bytes, "activations": s.activation_bytes}
            for name, s in self.stages.items()
        }


class _SavedTensorCollector:
    """Collects distinct saved storages while active, split by parameter or not."""

    def __init__(self, parameter_storages: set[int], profile: StageProfile) -> None:
        self.parameter_storages = parameter_storages
        self.profile = profile
        self.seen: set[int] = set()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self.seen and storage.nbytes():
            self.seen.add(key)
            kind = "parameter" if key in self.parameter_storages else "activation"
            if kind == "parameter":
                self.profile.parameter_bytes += storage.nbytes()
            else:
                self.profile.activation_bytes += storage.nbytes()
            self.profile.tensors.append((kind, tuple(tensor.shape), storage.nbytes()))
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def _leaf(tensor: torch.Tensor | None) -> torch.Tensor | None:
    if tensor is None or not tensor.is_floating_point():
        return tensor
    return tensor.detach().requires_grad_()


def profile_layer(layer: DecoderLayer, hidden: torch.Tensor, ops) -> LayerProfile:
    """Run ``layer`` on ``hidden [B, S, H]`` stage by stage and profile what each stage saves.

    Each stage's inputs are detached leaves, as in the optimized schedule, so a
    stage is charged only for what its own backward keeps.
    """
    parameter_storages = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    stages = {name: StageProfile() for name in STAGES}

    def run(name: str, fn, *args):
        collector = _SavedTensorCollector(parameter_storages, stages[name])
        with torch.autograd.graph.saved_tensors_hooks(collector.pack, collector.unpack):
            return fn(*args)

    with torch.enable_grad():
        a = run("attention", layer.attention, _leaf(hidden), ops)
        a = a._replace(
            residual=_leaf(a.residual),
            sorted_tokens=_leaf(a.sorted_tokens),
            sorted_weights=_leaf(a.sorted_weights),
        )
        d = run("dispatch", layer.dispatch, a, ops)
        d = d._replace(tokens=_leaf(d.tokens))
        e = run("experts", layer.experts, d, ops)
        e = e._replace(tokens=_leaf(e.tokens))
        c = run("combine", layer.combine, a, e, d, ops)
        c = c._replace(tokens=_leaf(c.tokens))
        run("aggregate", layer.aggregate, a, c, ops)
    return LayerProfile(layer.layer, stages)


def profile_part(part, hidden: torch.Tensor, ops) -> list[LayerProfile]:
    """`profile_layer` for every layer of a model part, feeding each layer's output on."""
    profiles = []
    for layer in part.decoder_layers:
        profiles.append(profile_layer(layer, hidden, ops))
        with torch.no_grad():
            hidden = layer(hidden, ops)
    return profiles
