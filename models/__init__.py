"""Model math written once: configs, presets, layers as five stages, weight sources, HF
checkpoints."""

# ruff: noqa: E402  (the Triton mode is chosen before the imports below)

from models.device import choose_triton_mode as _choose_triton_mode

# A process that computes on the CPU runs Triton kernels through Triton's interpreter,
# which must be chosen before anything imports `triton` -- and torch imports it lazily on
# its own (the first AdamW step does). Every twinpipe process imports `models` first, so
# choose here (a rank's launcher has chosen already: `models.device`).
_choose_triton_mode()

from models.checkpoint import (
    CheckpointError,
    CheckpointWeights,
    from_pretrained,
    save_pretrained,
    validate_checkpoint,
)
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
from models.weights import SeededWeights, StateDictWeights, WeightSource

__all__ = [
    "IGNORE_INDEX",
    "PRESET_NAMES",
    "CausalLM",
    "CheckpointError",
    "CheckpointWeights",
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
    "SeededWeights",
    "shift_labels",
    "StateDictWeights",
    "validate_checkpoint",
    "WeightSource",
]
