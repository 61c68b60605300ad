"""Model math written once: configs, presets, layers as five stages, HF checkpoints."""

from models.checkpoint import from_pretrained, save_pretrained
from models.config import ModelConfig
from models.decoder import DecoderLayer, ExpertParallel
from models.model import (
    IGNORE_INDEX,
    CausalLM,
    build_model,
    build_part,
    is_expert_parameter,
    shift_labels,
)
from models.presets import PRESET_NAMES, preset, resolve_model

__all__ = [
    "IGNORE_INDEX",
    "PRESET_NAMES",
    "CausalLM",
    "DecoderLayer",
    "ExpertParallel",
    "ModelConfig",
    "build_model",
    "build_part",
    "from_pretrained",
    "is_expert_parameter",
    "preset",
    "resolve_model",
    "save_pretrained",
    "shift_labels",
]
