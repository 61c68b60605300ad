"""Hugging Face checkpoints and configs, in and out, at real scale: no rank reads more than
its own slices, nothing whole-model is gathered to write.

Modules:

- `config_json`: a ``config.json`` read with errors a user can act on, and refused where
  it asks for math twinpipe does not compute;
- `hf_config`: that dict turned into a `models.network.ModelConfig` and back, and a model
  named by preset or path (`resolve_model`);
- `hf_layout`: our parameter names and layouts against transformers' (fused experts,
  MXFP4 blocks and scales), shapes a checkpoint must have;
- `checkpoint`: safetensors read as memory-mapped row slices into a rank's parameters
  (`CheckpointWeights`), ``from_pretrained``, checks of a folder before any work;
- `mtp_copies`: DeepSeek-V3's MTP layers' copies of the embedding and the head, held
  equal to the main model's on read;
- `checkpoint_write`: sharded safetensors written tensor by tensor (``save_pretrained``),
  MXFP4 written;
- `mxfp4`: GPT-OSS's MXFP4 expert weights, dequantised per slice (and quantised for tests);
- `fp8`: DeepSeek-V3's block-quantised FP8 weights, dequantised per row slice (and
  quantised, a checkpoint re-written as published, for tests and benchmarks).

May import `models.network` and `models.runtime`; never `reference`, `optimized` or
`harness`.
"""

from models.hf.checkpoint import (
    CheckpointWeights,
    check_hf_checkpoint,
    checked_weights,
    from_pretrained,
    load_state_dict_hf,
    read_exactly,
    read_header,
    read_rows,
    validate_checkpoint,
)
from models.hf.checkpoint_write import (
    Planned,
    ShardWriter,
    plan_shards,
    safetensors_header,
    save_pretrained,
    write_config,
    write_mxfp4,
)
from models.hf.fp8 import FP8, PUBLISHED_FP8, write_fp8
from models.hf.fp8 import dequantize as fp8_dequantize
from models.hf.fp8 import grid_shape as fp8_grid_shape
from models.hf.fp8 import quantize as fp8_quantize
from models.hf.hf_config import config_from_hf, config_to_hf, resolve_model
from models.hf.hf_layout import (
    FUSED_EXPERTS,
    HF_EXPERT_BIAS_FAMILIES,
    INDEX_NAME,
    MXFP4,
    WEIGHTS_NAME,
    CheckpointError,
    expected_hf_shapes,
    expected_state_shapes,
    hf_stores_expert_bias,
    hf_tensors,
    is_state_buffer,
    mxfp4_shapes,
    shard_file_name,
    to_hf_state_dict,
)
from models.hf.mtp_copies import copy_names as mtp_copy_names
from models.hf.mxfp4 import dequantize, quantize

__all__ = [
    "CheckpointError",
    "CheckpointWeights",
    "FP8",
    "FUSED_EXPERTS",
    "HF_EXPERT_BIAS_FAMILIES",
    "INDEX_NAME",
    "MXFP4",
    "PUBLISHED_FP8",
    "Planned",
    "ShardWriter",
    "WEIGHTS_NAME",
    "check_hf_checkpoint",
    "checked_weights",
    "config_from_hf",
    "config_to_hf",
    "dequantize",
    "expected_hf_shapes",
    "expected_state_shapes",
    "fp8_dequantize",
    "fp8_grid_shape",
    "fp8_quantize",
    "from_pretrained",
    "hf_stores_expert_bias",
    "hf_tensors",
    "is_state_buffer",
    "load_state_dict_hf",
    "mtp_copy_names",
    "mxfp4_shapes",
    "plan_shards",
    "quantize",
    "read_exactly",
    "read_header",
    "read_rows",
    "resolve_model",
    "safetensors_header",
    "save_pretrained",
    "shard_file_name",
    "to_hf_state_dict",
    "validate_checkpoint",
    "write_config",
    "write_fp8",
    "write_mxfp4",
]
