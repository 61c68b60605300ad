"""The on-disk layout of Hugging Face checkpoints (transformers 5) for the four families.

In memory, twinpipe's names are transformers 5's (``model.layers.3.mlp.experts.gate_up_proj``),
but the files differ from memory in three ways, and this module says how:

- DeepSeek and Qwen3-MoE store one ``gate_proj``/``up_proj``/``down_proj`` per expert
  (``model.layers.3.mlp.experts.7.up_proj.weight [I, H]``), the layout of the published
  checkpoints; transformers fuses them on load into ``gate_up_proj [E, 2I, H]`` (gate rows
  first) and ``down_proj [E, H, I]``, and so do we. GPT-OSS is fused on disk as in memory.
- GPT-OSS is published with its routed experts in MXFP4 (`models.hf.mxfp4`):
  ``gate_up_proj_blocks``/``_scales`` and ``down_proj_blocks``/``_scales``, transposed
  (``[E, 2I, H / 32, 16]`` for our ``gate_up_proj [E, H, 2I]``).
- DeepSeek-V3 is published in FP8 (`models.hf.fp8`): each linear weight as float8 e4m3 with
  a float32 ``weight_scale_inv`` per 128 x 128 block beside it.
- DeepSeek-V3's router holds its expert bias, ``model.layers.N.mlp.gate.e_score_correction_bias``
  (float32), under the same name on disk as in memory.
- With tied embeddings ``lm_head.weight`` is not written; it is the embedding.

The routers' expert bias (``...mlp.gate.e_score_correction_bias``, aux-loss-free balancing:
a training-state buffer, `models.network.state_buffers`) is written and read only where the
family's layout has it (`hf_stores_expert_bias`, the one place that decides it): elsewhere a
trained bias has no tensor to go to, so writing leaves it out (and `twinpipe export` warns)
and a read starts it at zero.

DeepSeek-V3's published checkpoint also holds its multi-token-prediction module as one more
layer (``model.layers.61.*``, `models.network.mtp`), which transformers skips. twinpipe
reads and writes its ``num_nextn_predict_layers`` layers under the same names as in memory;
each also holds copies of the embedding and the output layer (``embed_tokens.weight``,
``shared_head.head.weight``), which are written from the main model's and not loaded on
read (`skipped_on_disk`; `models.hf.mtp_copies` holds them equal to the main model's), and
layers past the MTP depth are skipped.

DeepSeek in transformers always builds shared experts, of width
``moe_intermediate_size * n_shared_experts``: with none, its files hold zero-width
``shared_experts`` tensors, which we write and accept (our model has no module for them).
"""

from __future__ import annotations

import re

import torch

from models.hf.mxfp4 import BLOCK
from models.network import SINGLE, CausalLM, ExpertParallel, ModelConfig, Router

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
MXFP4 = "mxfp4"
"""``quantization_config.quant_method`` of GPT-OSS's published checkpoints."""
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
"""safetensors dtypes a weight may be stored in (it is cast to the model's dtype on load)."""
_LIST_AT_MOST = 12


HF_EXPERT_BIAS_FAMILIES: frozenset[str] = frozenset({"deepseek_v3"})
"""Families whose Hugging Face layout stores each MoE router's ``e_score_correction_bias``
(DeepSeek-V3's does; DeepSeek-V2's, GPT-OSS's and Qwen3-MoE's have no such tensor)."""


def hf_stores_expert_bias(config: ModelConfig) -> bool:
    """Whether ``config``'s family stores the routers' expert bias in its HF layout: where
    not, a trained bias is not written (the export warns: the exported model routes
    without it) and a read leaves it at zero."""
    return config.model_type in HF_EXPERT_BIAS_FAMILIES


def is_state_buffer(name: str) -> bool:
    """Whether ``name`` (our naming) is a training-state buffer, not a parameter (the
    routers' expert bias, `models.network.state_buffers`): a checkpoint made before a run
    turned it on lacks it, and it then starts at zero."""
    return name.rsplit(".", 1)[-1] in Router.FLOAT32_BUFFERS


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: the message names the file, the tensor,
    and what was expected and found."""


_SHAPES_ONLY = object()  # ops of a meta-device model that is never run


def experts_split_on_disk(config: ModelConfig) -> bool:
    """Whether routed experts are stored one tensor per expert (DeepSeek-V2, Qwen3-MoE)."""
    return config.model_type != "gpt_oss"


MTP_COPIES = (".embed_tokens.weight", ".shared_head.head.weight")
"""An MTP layer's copies of the embedding and the output layer on disk (the model shares them)."""


def skipped_on_disk(name: str, config: ModelConfig) -> bool:
    """Whether a tensor on disk belongs to what twinpipe does not build: DeepSeek-V3's
    multi-token-prediction layers past the run's MTP depth (all of them at depth 0, as
    transformers skips them), and each MTP layer's copies of the embedding and the head."""
    layer = LAYER_INDEX.match(name)
    if layer is None or int(layer[1]) < config.num_hidden_layers:
        return False
    if int(layer[1]) < config.num_hidden_layers + config.num_mtp_layers:
        return name.endswith(MTP_COPIES)
    return config.model_type == "deepseek_v3"


def shard_file_name(index: int, count: int) -> str:
    """``model-0000k-of-0000n.safetensors`` (``index`` from 0)."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


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


def mxfp4_shapes(name: str, shape: torch.Size) -> dict[str, torch.Size]:
    """The ``_blocks`` and ``_scales`` tensors that store our GPT-OSS expert ``name``
    (``[E, K, N]``, applied as ``x @ W``) in MXFP4: ``[E, N, K / 32, 16]``, ``[E, N, K / 32]``."""
    experts, inner, outer = shape
    if inner % BLOCK:
        raise ValueError(f"{name} {list(shape)}: MXFP4 needs dim 1 to be a multiple of {BLOCK}")
    groups = inner // BLOCK
    return {
        f"{name}_blocks": torch.Size([experts, outer, groups, BLOCK // 2]),
        f"{name}_scales": torch.Size([experts, outer, groups]),
    }


def expected_hf_shapes(
    config: ModelConfig, quantization: str | None = None
) -> dict[str, torch.Size]:
    """Names and shapes of the tensors a full Hugging Face checkpoint of ``config`` holds
    (``quantization="mxfp4"``: GPT-OSS's routed experts as MXFP4 blocks and scales)."""
    shapes = {name: t.shape for name, t in to_hf_state_dict(_meta_state(config), config).items()}
    if quantization != MXFP4:
        return shapes
    out: dict[str, torch.Size] = {}
    for name, shape in shapes.items():
        out.update(mxfp4_shapes(name, shape) if FUSED_EXPERTS.match(name) else {name: shape})
    return out


def to_hf_state_dict(
    state_dict: dict[str, torch.Tensor], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """Our state dict (whole model, our naming) as the tensors of an HF checkpoint on disk.

    Per-expert tensors are views of the fused ones (no copy); `save_pretrained` writes them.
    Raises ``ValueError`` naming any tensor that is missing, unexpected or mis-shaped.
    """
    check_tensors(
        "state dict",
        expected_state_shapes(config),
        {name: t.shape for name, t in state_dict.items()},
        config,
    )
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if is_state_buffer(name) and not hf_stores_expert_bias(config):
            continue  # no such tensor in the family's layout
        out.update(hf_tensors(name, tensor, config))
    if config.is_deepseek and not config.n_shared_experts:
        reference = state_dict["model.embed_tokens.weight"]
        for layer in range(config.num_hidden_layers):
            if config.is_moe_layer(layer):
                out.update(_zero_width_shared_experts(layer, config.hidden_size, reference))
    return out


def hf_tensors(name: str, tensor: torch.Tensor, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our whole tensor ``name`` as the tensors that store it on disk (views, no copy):
    itself, or one per expert (gate and up rows of ``gate_up_proj`` apart); the embedding
    and the output layer also as each MTP layer's copy (`MTP_COPIES`)."""
    copy = {"model.embed_tokens.weight": MTP_COPIES[0], "lm_head.weight": MTP_COPIES[1]}
    if name in copy and config.num_mtp_layers:
        first = config.num_hidden_layers
        layers = range(first, first + config.num_mtp_layers)
        return {name: tensor, **{f"model.layers.{i}{copy[name]}": tensor for i in layers}}
    fused = FUSED_EXPERTS.match(name)
    if not (fused and experts_split_on_disk(config)):
        return {name: tensor}
    prefix, kind = fused.groups()
    inner = config.moe_intermediate_size
    out = {}
    for expert in range(tensor.shape[0]):
        if kind == "gate_up_proj":
            out[f"{prefix}.{expert}.gate_proj.weight"] = tensor[expert, :inner]
            out[f"{prefix}.{expert}.up_proj.weight"] = tensor[expert, inner:]
        else:
            out[f"{prefix}.{expert}.down_proj.weight"] = tensor[expert]
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


def check_tensors(
    where: str,
    expected: dict[str, torch.Size],
    found: dict[str, torch.Size],
    config: ModelConfig,
    optional: frozenset[str] = frozenset(),
    files: dict[str, str] | None = None,
    wrong_dtype: list[str] | None = None,
) -> None:
    """One `CheckpointError` listing every missing, unexpected and mis-shaped tensor (with the
    file that holds it, given ``files``), and the ``wrong_dtype`` ones found elsewhere."""

    def at(name: str) -> str:
        return f" (in {files[name]})" if files and name in files else ""

    missing = [name for name in expected if name not in found]
    unexpected = [name for name in found if name not in expected and name not in optional]
    wrong = [
        f"{name}: expected {list(expected[name])}, found {list(found[name])}{at(name)}"
        for name in expected
        if name in found and tuple(found[name]) != tuple(expected[name])
    ]
    wrong_dtype = wrong_dtype or []
    if not (missing or unexpected or wrong or wrong_dtype):
        return
    lines = [f"{where} does not hold the {config.model_type} model being run:"]
    for title, items in (
        ("missing", [f"{name} {list(expected[name])}" for name in missing]),
        ("unexpected", [f"{name} {list(found[name])}{at(name)}" for name in unexpected]),
        ("wrong shape", wrong),
        ("wrong dtype", wrong_dtype),
    ):
        if items:
            lines.append(f"  {len(items)} {title}:")
            lines.extend(f"    {item}" for item in items[:_LIST_AT_MOST])
            if len(items) > _LIST_AT_MOST:
                lines.append(f"    ... and {len(items) - _LIST_AT_MOST} more")
    raise CheckpointError("\n".join(lines))
