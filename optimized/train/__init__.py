"""The training product around the engine: config, data, optimizer, checkpoints, export.

- `config` (dataclasses, fields, validation) and `config_io` (TOML, ``--set``, flags);
  `schedule`: the learning rate of each step (warmup, cosine, constant, WSD) and the rule
  for extending a WSD run on resume;
- the data each step reads is `optimized.data`'s (blends, splits, the loader);
  `evaluation`: the held-out loss and perplexity, forward only;
- `optimizer`: AdamW over sharded parameters with float32 state;
- `checkpointing`: DCP checkpoints, atomic, layout-free, each rank's own piece written
  as an explicit DCP chunk (`chunks`, which `export` reads too), the expert biases with
  them; `checkpoint_weights`: a checkpoint as the weight source a run builds from;
  `export`: Hugging Face out;
- `preflight`: everything ``twinpipe train`` checks before a process group starts, and
  the run it plans;
- `trainer`: the training loop on one rank; `faults`: the faults tests inject into it
  (crashes, signals, NaN mid-step); `objective`: z-loss and label smoothing
  (the optimized runner only), the z-loss for the log, and the ``[moe]`` and ``[mtp]``
  sections set on the model; `mtp_coef`: the MTP loss weight over a run; `metrics`: a
  step's figures, its log line with TFLOP/s and MFU, the
  JSON-lines and TensorBoard sink; `expert_load`: the tokens each expert got, per MoE
  layer and step, gathered in one collective; `phases`: the
  peak memory of each phase (load, warm-up, train, save); `profiling`: torch.profiler
  traces and top-op tables of chosen steps (``--profile``), reusable around any region;
  `startup`: what runs between loading and step 1 (connect, tune, tighten the timeout);
- `sizing`: a training config as the memory estimator's question (the defaults of
  ``twinpipe estimate`` and ``twinpipe plan``);
- `cli` (``twinpipe train``), `export` (``twinpipe export``).

May import `models`, `optimized.ops`, `optimized.estimator`, `optimized.pipeline` and
`optimized.data`;
never `reference` or `harness`.
"""

from optimized.data.indexed import token_dtype
from optimized.data.loader import Batch, ShardedSampler, TokenDataset, TokenLoader
from optimized.data.preparation import default_dataset, prepare_data, read_sidecar
from optimized.data.readers import resolve_inputs
from optimized.data.tokenizers import ByteTokenizer, HFTokenizer, load_tokenizer
from optimized.train.checkpointing import (
    list_checkpoints,
    load_checkpoint,
    load_model_state,
    newest_valid,
    save_checkpoint,
)
from optimized.train.config import FIELDS, TrainConfig, lr_at, validate_config
from optimized.train.config_io import (
    add_config_arguments,
    apply_overrides,
    config_from_args,
    config_from_dict,
    config_to_toml,
    load_config,
    print_config,
)
from optimized.train.expert_load import ExpertLoad
from optimized.train.export import export, export_checkpoint
from optimized.train.metrics import LoggedScalars
from optimized.train.optimizer import ParamShard, ShardedAdamW, gather_slices
from optimized.train.profiling import StepProfiler, profile_region, top_ops_table
from optimized.train.sizing import estimate_config, training_run
from optimized.train.trainer import runner_class, train

__all__ = [
    "FIELDS",
    "add_config_arguments",
    "print_config",
    "resolve_inputs",
    "token_dtype",
    "Batch",
    "ByteTokenizer",
    "ExpertLoad",
    "HFTokenizer",
    "LoggedScalars",
    "ParamShard",
    "ShardedAdamW",
    "ShardedSampler",
    "TokenDataset",
    "TokenLoader",
    "TrainConfig",
    "apply_overrides",
    "config_from_args",
    "config_from_dict",
    "config_to_toml",
    "default_dataset",
    "export",
    "export_checkpoint",
    "gather_slices",
    "list_checkpoints",
    "load_checkpoint",
    "load_config",
    "load_model_state",
    "load_tokenizer",
    "lr_at",
    "newest_valid",
    "prepare_data",
    "read_sidecar",
    "runner_class",
    "StepProfiler",
    "estimate_config",
    "profile_region",
    "top_ops_table",
    "training_run",
    "save_checkpoint",
    "train",
    "validate_config",
]
