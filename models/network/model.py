"""The causal language model: embedding, decoder layers, final norm, output layer, loss.

State-dict names are those of Hugging Face transformers 5's ``*ForCausalLM``
in memory (``model.layers.3.mlp.experts.gate_up_proj``, ``lm_head.weight``);
`models.hf.checkpoint` maps them to and from the on-disk layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from models.network.config import ModelConfig
from models.network.decoder import SINGLE, DecoderLayer, ExpertParallel
from models.network.layers import OutputLayer, RMSNorm
from models.network.mtp import IGNORE_INDEX, MTPLayer
from models.network.weights import (
    SeededWeights,
    WeightSource,
    as_source,
    keep_float32,
    materialise,
)


def shift_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """Labels aligned to positions as transformers does: next token, -100 on the last one."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = input_ids[:, 1:]
    return labels


class Backbone(nn.Module):
    """``model.*`` of the HF checkpoint: embedding, layers, final norm."""

    def __init__(
        self, config: ModelConfig, ep: ExpertParallel, layers, embedding: bool, head: bool
    ) -> None:
        super().__init__()
        if embedding:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, i, ep) for i in layers})
        if head:  # the MTP module lives with the head (and the embedding): the loss stage
            for depth in range(1, config.num_mtp_layers + 1):
                mtp = MTPLayer(config, depth, ep)
                self.layers[str(mtp.layer)] = mtp
        if head:
            self.norm = RMSNorm(
                config.hidden_size, config.rms_norm_eps, config.model_type == "gpt_oss"
            )


class CausalLM(nn.Module):
    """A MoE causal LM of any of the three families, run with an `Ops` object.

    The whole model lives on one process unless ``ep`` shards the routed experts.
    A pipeline rank builds a *part*: only some ``layers``, and the embedding and
    the head (final norm, output layer) only where its stages need them. The MTP module
    (`models.network.mtp`, ``config.num_mtp_layers`` layers) is built with the head. Parameter
    names stay those of the whole model, so parts and the whole compare by name.

    ``ops`` comes from the caller (`reference.ops.ReferenceOps` or
    `optimized.ops.OptimizedOps`): `models` imports neither stack. A model built
    without ops holds and loads weights, and refuses to run.
    """

    def __init__(
        self,
        config: ModelConfig,
        ops=None,
        ep: ExpertParallel = SINGLE,
        layers=None,
        embedding: bool = True,
        head: bool = True,
    ) -> None:
        super().__init__()
        self.config = config
        self._ops = ops
        self.ep = ep
        self.has_embedding, self.has_head = embedding, head
        if layers is None:
            layers = range(config.num_hidden_layers)
        self.model = Backbone(config, ep, layers, embedding, head)
        if head:
            self.lm_head = OutputLayer(config.hidden_size, config.vocab_size)
        self.tie_weights()

    @property
    def ops(self):
        """The `models.network.Ops` the layers run with; set by the caller."""
        if self._ops is None:
            raise RuntimeError(
                "this CausalLM was built without ops: pass ops=ReferenceOps() (reference.ops) "
                "or ops=OptimizedOps() (optimized.ops) to build it, or set model.ops"
            )
        return self._ops

    @ops.setter
    def ops(self, ops) -> None:
        self._ops = ops

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        """The main model's layers this part holds (not the MTP module's)."""
        return [layer for layer in self.model.layers.values() if not isinstance(layer, MTPLayer)]

    @property
    def mtp_layers(self) -> list[MTPLayer]:
        """The MTP module's layers, depth 1 first (on a part with the head; else none)."""
        return [layer for layer in self.model.layers.values() if isinstance(layer, MTPLayer)]

    @property
    def moe_layers_with_mtp(self) -> list[DecoderLayer]:
        """The MoE layers this part holds, the MTP module's included (each has a router and
        routed experts)."""
        return [layer for layer in self.decoder_layers + self.mtp_layers if layer.is_moe]

    def layer(self, index: int) -> DecoderLayer:
        return self.model.layers[str(index)]

    def tie_weights(self) -> None:
        """With tied embeddings, make the output layer's weight the embedding's (again)."""
        if self.config.tie_word_embeddings and self.has_embedding and self.has_head:
            self.lm_head.weight = self.model.embed_tokens.weight

    # ----------------------------------------------------------- forward
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and output layer: logits ``[B, S, V]``."""
        return self.lm_head(self.model.norm(hidden))

    def loss_sum(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed token cross-entropy (float32) of the head's logits against ``labels``."""
        logits = self.head(hidden)
        return self.ops.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            labels.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids)
        for layer in self.decoder_layers:
            hidden = layer(hidden, self.ops)
        return self.head(hidden)

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Mean token cross-entropy (labels default to transformers' shift of the inputs)."""
        if labels is None:
            labels = shift_labels(input_ids)
        hidden = self.embed(input_ids)
        for layer in self.decoder_layers:
            hidden = layer(hidden, self.ops)
        count = (labels != IGNORE_INDEX).sum().clamp(min=1)
        return self.loss_sum(hidden, labels) / count


def build_part(
    config: ModelConfig,
    source: WeightSource | Mapping[str, torch.Tensor],
    layers: Iterable[int] | None = None,
    embedding: bool = True,
    head: bool = True,
    ops=None,
    ep: ExpertParallel = SINGLE,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    shard: Callable[[CausalLM], object] | None = None,
) -> CausalLM:
    """The part of the model one rank holds, its weights read from ``source``.

    Built on the meta device, cast to ``dtype`` there, optionally sharded there
    (``shard(part)``, e.g. FSDP2's `fully_shard` of its modules, which then allocates only
    this rank's rows), and materialised: each parameter reads only the rows this rank
    holds (its EP experts, its FSDP2 rows) from the source, in ``dtype``, on ``device``.
    No random initialisation runs for a tensor that is loaded.
    """
    with torch.device("meta"):
        part = CausalLM(config, ops, ep, layers, embedding, head)
    part.to(dtype)
    keep_float32(part)
    if shard is not None:
        shard(part)
    materialise(part, as_source(source), device)
    return part


def build_model(
    config: ModelConfig,
    ops=None,
    ep: ExpertParallel = SINGLE,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> CausalLM:
    """A whole model (``ep``'s experts) with `SeededWeights`: the same ``seed`` gives the
    same weights at any layout."""
    return build_part(config, SeededWeights(config, seed), ops=ops, ep=ep, dtype=dtype)


def is_expert_parameter(name: str) -> bool:
    """Routed-expert parameters: sharded over EP, gradients reduced over expert replicas."""
    return ".mlp.experts." in name
