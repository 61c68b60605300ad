"""The causal language model: embedding, decoder layers, final norm, output layer, loss.

State-dict names are those of Hugging Face transformers 5's ``*ForCausalLM``
in memory (``model.layers.3.mlp.experts.gate_up_proj``, ``lm_head.weight``);
`models.checkpoint` maps them to and from the on-disk layout.
"""

from __future__ import annotations

import torch
from torch import nn

from models.config import ModelConfig
from models.decoder import SINGLE, DecoderLayer, ExpertParallel, Experts, MoE
from models.layers import OutputLayer, RMSNorm, Router

IGNORE_INDEX = -100


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
        if head:
            self.norm = RMSNorm(
                config.hidden_size, config.rms_norm_eps, config.model_type == "gpt_oss"
            )


class CausalLM(nn.Module):
    """A MoE causal LM of any of the three families, run with an `Ops` object.

    The whole model lives on one process unless ``ep`` shards the routed experts.
    A pipeline rank builds a *part*: only some ``layers``, and the embedding and
    the head (final norm, output layer) only where its stages need them. Parameter
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
            if config.tie_word_embeddings and embedding:
                self.lm_head.weight = self.model.embed_tokens.weight
        if embedding and head and len(layers) == config.num_hidden_layers:
            self.init_weights(torch.Generator().manual_seed(0))

    @property
    def ops(self):
        """The `models.ops.Ops` the layers run with; set by the caller."""
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
        return list(self.model.layers.values())

    def layer(self, index: int) -> DecoderLayer:
        return self.model.layers[str(index)]

    # -------------------------------------------------------------- init
    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Normal(0, initializer_range) for matrices, ones for norms, zeros for biases.

        Draws from ``generator`` in a fixed order over the full (unsharded) model,
        so an expert shard gets the same values as the same experts of the whole model.
        """
        std = self.config.initializer_range
        for module in self._init_order():
            if isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.copy_(_normal(module.weight.shape, std, generator))
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, Router):
                module.weight.copy_(_normal(module.weight.shape, std, generator))
                if hasattr(module, "bias"):
                    module.bias.zero_()
            elif isinstance(module, Experts):
                for name in ("gate_up_proj", "down_proj"):
                    param = getattr(module, name)
                    full = (module.num_experts,) + tuple(param.shape[1:])
                    values = _normal(full, std, generator)
                    start = module.first_expert
                    param.copy_(values[start : start + module.num_local])
                if module.transposed:
                    module.gate_up_proj_bias.zero_()
                    module.down_proj_bias.zero_()
        for layer in self.decoder_layers:
            if hasattr(layer.self_attn, "sinks"):
                layer.self_attn.sinks.zero_()

    def _init_order(self):
        yield self.model.embed_tokens
        for layer in self.decoder_layers:
            for module in layer.modules():
                if not isinstance(module, (MoE,)):
                    yield module
        yield self.model.norm
        if not self.config.tie_word_embeddings:
            yield self.lm_head

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


def _normal(shape, std: float, generator: torch.Generator) -> torch.Tensor:
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def build_model(
    config: ModelConfig,
    ops=None,
    ep: ExpertParallel = SINGLE,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> CausalLM:
    """A freshly initialised model; the same ``seed`` gives the same weights at any EP."""
    model = CausalLM(config, ops, ep)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model.to(dtype)


def build_part(
    config: ModelConfig,
    full_state: dict[str, torch.Tensor],
    layers,
    embedding: bool,
    head: bool,
    ops=None,
    ep: ExpertParallel = SINGLE,
    dtype: torch.dtype = torch.float32,
) -> CausalLM:
    """The part of the model one pipeline rank holds, with weights taken from ``full_state``
    (the whole model's state dict; routed experts are sliced to this EP rank's shard)."""
    part = CausalLM(config, ops, ep, layers, embedding, head).to(dtype)
    state = {}
    for name in part.state_dict():
        source = full_state[name]
        if ".mlp.experts." in name and source.shape[0] == config.num_experts:
            per_rank = config.num_experts // ep.size
            source = source[ep.rank * per_rank : (ep.rank + 1) * per_rank]
        state[name] = source
    part.load_state_dict(state, strict=True)
    return part


def is_expert_parameter(name: str) -> bool:
    """Routed-expert parameters: sharded over EP, gradients reduced over expert replicas."""
    return ".mlp.experts." in name
