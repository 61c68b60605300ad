"""A `twinpipe train` run as the memory estimator sees it: one `EstimateConfig` per
`TrainConfig`.

`twinpipe estimate` and `twinpipe plan` size training jobs, so their defaults are the
trainer's: they build a `TrainConfig` from the flags given (`training_run`: a flag left out
keeps the field's default, read from `optimized.train.config`, never copied) and ask
`estimate_config` what that run holds. Without this, ``twinpipe estimate`` said 8.40 GiB for
a mid-deepseek-v2 run the trainer's defaults make 13.77 GiB (measured 13.83 on an H100):
its own defaults were torch's AdamW (moments in the parameters' dtype, no masters).

The mapping is the trainer's own reading of its config (`optimized.train.trainer`):

- FSDP2 and `ShardedAdamW`'s sharding where ``parallel.sharded`` (``parallel.fsdp``, on by
  default where DP > 1): parameters, gradients and optimizer state divided over DP, the
  routed experts' over their expert replicas. Without it nothing is sharded: the trainer
  has no optimizer sharding of its own (ZeRO-1) outside FSDP2;
- AdamW's moments in ``optim.state_dtype``, float32 masters with ``optim.master_weights``;
- the batch (``data.micro_batch_size``, ``data.micro_batches``, ``data.seq_len``), the
  ``dtype``, ``parallel.grad_sync``, ``parallel.reshard_after_forward`` and
  ``parallel.recompute``;
- the optimized stack, which the trainer runs.
"""

from __future__ import annotations

from typing import Any

from models.network import ModelConfig
from optimized.estimator.config import EstimateConfig
from optimized.train.config import FIELDS_BY_KEY, TrainConfig


def training_run(values: dict[str, Any]) -> TrainConfig:
    """The trainer's default config with ``values`` set, by dotted key (``parallel.dp``,
    ``optim.state_dtype``); a value of None keeps the field's default."""
    cfg = TrainConfig()
    for key, value in values.items():
        if key not in FIELDS_BY_KEY:
            raise KeyError(f"{key!r} is not a training config key")
        if value is None:
            continue
        spec = FIELDS_BY_KEY[key]
        setattr(cfg if spec.section is None else getattr(cfg, spec.section), spec.name, value)
    return cfg


def estimate_config(
    cfg: TrainConfig, model: ModelConfig, stack: str = "optimized", **planning: Any
) -> EstimateConfig:
    """What a run of ``cfg`` on ``model`` holds, as the estimator's question: the trainer
    runs the optimized ``stack`` (``reference`` counts the plain stack's activations at the
    same layout). ``planning`` adds the estimator's own fields the trainer has none of
    (``tp``, ``etp``, ``layers_per_stage``, ``first_step``, ...)."""
    par, data, optim = cfg.parallel, cfg.data, cfg.optim
    return EstimateConfig(
        model,
        pp=par.pp, dp=par.dp, ep=par.ep,
        micro_batch_size=data.micro_batch_size, seq_len=data.seq_len,
        num_microbatches=data.micro_batches, dtype=cfg.dtype, stack=stack,
        fsdp=par.sharded, shard_optimizer=par.sharded,
        optimizer_state_dtype=optim.state_dtype, master_weights=optim.master_weights,
        grad_sync=par.grad_sync, reshard_after_forward=par.reshard_after_forward,
        recompute=par.recompute, **planning,
    )  # fmt: skip


def trainer_default(key: str) -> Any:
    """The default of one training config field (``data.seq_len``)."""
    spec = FIELDS_BY_KEY[key]
    section = TrainConfig() if spec.section is None else getattr(TrainConfig(), spec.section)
    return getattr(section, spec.name)


__all__ = ["estimate_config", "trainer_default", "training_run"]
