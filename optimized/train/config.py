"""The trainer's configuration: slotted dataclasses, their fields as keys, valid values.

One `TrainConfig` holds everything `twinpipe train` needs. Every field carries a
docstring; `FIELDS` reads them from this module's source, and they become the flag's
help and the comment above the key in `optimized.train.config_io.config_to_toml`, so
the three views cannot drift apart. `validate_config` names the field, the value and
the valid range -- all before any process group starts. Where the values come from
(TOML, ``--set``, flags) lives in `optimized.train.config_io`.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from optimized.train.mtp_coef import MtpSection, check_mtp
from optimized.train.schedule import (  # noqa: F401 - lr_at and warmup_of re-exported
    DEFAULT_WARMUP_STEPS,
    check_schedule,
    lr_at,
    warmup_of,
)

SECTION_FILES = (Path(__file__), Path(__file__).with_name("mtp_coef.py"))

DTYPES = ("float32", "bfloat16")
OPTIMIZER_STATE_DTYPES = ("float32", "bfloat16")
"""``optim.state_dtype`` values (`optimized.train.optimizer.STATE_DTYPES`)."""
DEVICES = ("auto", "cpu", "cuda")
MOE_AUX_LOSSES = ("auto", "none", "pooled", "layer", "sequence")
"""``moe.aux_loss`` values (`models.network.balancing.AUX_FORMS` and ``auto``)."""


@dataclass(slots=True)
class ModelSection:
    """Which network to train and where its first weights come from."""

    name: str | None = field(default=None, metadata={"flag": "model"})
    """A preset name (see `models.network.PRESET_NAMES`) or a Hugging Face config.json path;
    unset: the model of ``init_from`` (its config.json), else tiny-deepseek-v2."""
    init_from: str | None = None
    """Checkpoint to take the initial weights from (HF folder or twinpipe checkpoint); unset:
    random initialization from ``seed``."""


@dataclass(slots=True)
class DataSection:
    """What each step reads: the token folder and the batch shape per DP rank."""

    path: str | None = field(default=None, metadata={"flag": "data"})
    """A folder written by `twinpipe prepare-data`, a Megatron ``.bin``/``.idx`` prefix, or a
    blend of them, Megatron's syntax: ``"0.7 web/ 0.3 code/"``, or paths alone (weighted by
    their tokens); unset: the standard library's source, byte-tokenized
    (`optimized.data.blend`)."""
    seq_len: int = 128
    """Tokens per sequence (each sample reads ``seq_len + 1`` for the shifted labels)."""
    micro_batch_size: int = 2
    """Sequences per micro-batch."""
    micro_batches: int = 4
    """Micro-batches per step per DP rank (DualPipeV chunks); at least ``2 * pp``."""
    shuffle: bool = True
    """Shuffle the samples each epoch (deterministically from ``seed`` and the epoch)."""
    eval_path: str | None = field(default=None, metadata={"flag": "eval-data"})
    """Held-out data, a blend in ``data.path``'s syntax; unset: ``split``'s held-out part,
    else no evaluation."""
    split: str | None = None
    """``TRAIN,EVAL`` weights (``99,1``): each source's documents, in order, cut into a
    training part and a held-out part by whole documents; unset: train on everything."""
    eval_every: int = 0
    """Evaluate the held-out loss every this many steps and at the end; 0: at the end only
    (when there is held-out data)."""
    eval_batches: int = 10
    """Global batches per evaluation: the same ones each time."""


@dataclass(slots=True)
class ParallelSection:
    """How ranks are laid out: world = pp x dp; experts sharded over ep inside dp."""

    pp: int = 1
    """Pipeline-parallel ranks; DualPipeV gives each two stages."""
    dp: int = 1
    """Data-parallel ranks."""
    ep: int = 1
    """Expert-parallel ranks inside each DP group; must divide ``dp``."""
    fsdp: bool | None = None
    """Shard parameters and optimizer state over DP; unset (auto): on when ``dp > 1``."""
    grad_sync: str = "step"
    """With FSDP: ``step`` reduce-scatters each unit's gradients once per step, at the last
    backward (or W) the schedule gives its chunk, holding them unsharded across the
    micro-batches; ``micro-batch`` after every backward (M times the traffic, less memory)."""
    reshard_after_forward: bool = False
    """With FSDP: free gathered parameters after each forward and gather them again for the
    backward (2 M all-gathers per step, less memory); off (default): gather once per step and
    hold the part's parameters unsharded until each unit's last backward."""
    recompute: bool = True
    """Recompute each attention block in backward (selective recomputation); off keeps its
    activations: more memory (`twinpipe estimate --recompute off`), one attention forward
    less per backward."""
    nproc: int | None = None
    """Processes launched on this machine; unset: the whole world (``pp * dp``)."""

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    @property
    def use_fsdp(self) -> bool:
        return self.dp > 1 if self.fsdp is None else self.fsdp

    @property
    def sharded(self) -> bool:
        """Whether the run shards parameters, gradients and optimizer state (FSDP2 and
        `ShardedAdamW`): ``use_fsdp`` where there is more than one DP rank to shard over."""
        return self.use_fsdp and self.dp > 1


@dataclass(slots=True)
class OptimSection:
    """AdamW and its learning-rate schedule."""

    lr: float = 3e-4
    """Peak learning rate, reached at the end of warmup."""
    min_lr: float = 3e-5
    """Learning rate the cosine schedule ends at, at step ``steps``."""
    warmup_steps: int | None = None
    """Steps of linear warmup from ``lr / warmup_steps`` to ``lr``; unset: 10, or ``steps``
    when the run is shorter (`warmup_of`)."""
    lr_schedule: str = "cosine"
    """After warmup: ``cosine`` (decay to ``min_lr``), ``constant`` (stay at ``lr``) or
    ``wsd`` (stay at ``lr``, then decay to ``min_lr`` over the last ``decay_fraction``;
    `optimized.train.schedule`)."""
    decay_fraction: float = 0.2
    """WSD: the fraction of ``steps`` its decay takes, at the end of the run."""
    decay_style: str = "linear"
    """WSD's decay shape: ``linear``, ``cosine``, ``1-sqrt`` or ``exponential``
    (Megatron-Core's definitions, `optimized.train.schedule`)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (``p *= 1 - lr * weight_decay``), on every parameter:
    norm weights, biases and embeddings decay too, as `torch.optim.AdamW` over all."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW ``(beta1, beta2)``."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 turns clipping off."""
    state_dtype: str = field(default="float32", metadata={"flag": "optimizer-state-dtype"})
    """AdamW's ``exp_avg``/``exp_avg_sq`` dtype, kept, saved and resumed in it: ``float32``
    or ``bfloat16`` (4 bytes less per parameter; the update is computed in float32). A
    resume with another value converts the checkpoint's moments and says so."""
    master_weights: bool = True
    """Keep a float32 master copy of each 16-bit parameter and step it (4 bytes per
    parameter); off: step the parameters in their own dtype. A resume with another value
    drops the checkpoint's masters, or starts them from the parameters, and says so."""
    skip_nonfinite: bool = False
    """Skip the optimizer step (and log it) when the loss or gradient norm is NaN or inf;
    off: stop the run naming the step and ranks."""


@dataclass(slots=True)
class LossSection:
    """The training objective beyond plain token cross-entropy (optimized stack only: the
    reference stack and `twinpipe compare` compute the plain loss)."""

    z_loss: float = 0.0
    """z-loss weight ``s``: ``s * logsumexp(logits)**2`` is added per token (PaLM's 1e-4
    keeps the logits from drifting); 0 turns it off. Logged on its own when on."""
    label_smoothing: float = 0.0
    """Label smoothing ``eps`` in [0, 1): the target is ``(1 - eps) * onehot + eps / V``."""


@dataclass(slots=True)
class MoeSection:
    """How tokens are steered to experts (`models.network.balancing`); applied to the model's
    config before anything is built (`optimized.train.objective.with_moe`)."""

    aux_loss: str = "auto"
    """Load-balancing loss: ``auto`` (what the model's config.json asks: Qwen3-MoE and GPT-OSS
    with output_router_logits pool every layer, DeepSeek-V2 and V3 with aux_loss_alpha per
    sequence), ``none``, ``pooled`` (transformers' loss over all layers), ``layer`` or
    ``sequence`` (DeepSeek-V2's, per layer)."""
    aux_loss_coef: float | None = None
    """The load-balancing loss's coefficient; unset: the model's own (router_aux_loss_coef,
    or DeepSeek's aux_loss_alpha)."""
    z_loss_coef: float = 0.0
    """Router z-loss coefficient (ST-MoE: ``coef * mean(logsumexp(router logits)**2)`` per
    MoE layer); 0 turns it off. Not ``loss.z_loss``, which acts on the output logits."""
    expert_bias: bool | None = None
    """Aux-loss-free balancing (DeepSeek-V3): a float32 bias per MoE layer, added to the
    router's scores to choose experts only, moved once per optimizer step by
    ``expert_bias_rate * sign(mean load - load)``; checkpointed. Unset: the model's own
    (on for DeepSeek-V3, whose routing includes it; off for the other families)."""
    expert_bias_rate: float | None = None
    """How far one optimizer step moves each expert's bias (0 keeps it fixed); unset: the
    model's own (0.001)."""


@dataclass(slots=True)
class CheckpointSection:
    """Where and how often training state is saved."""

    dir: str | None = field(default=None, metadata={"flag": "checkpoint-dir"})
    """Folder for checkpoints; unset: nothing is saved."""
    save_every: int = 0
    """Save every this many steps; 0: only at the end of training."""
    keep_last: int = 2
    """Checkpoints kept on disk, newest first; 0 keeps all."""
    resume: bool = True
    """Resume from the newest checkpoint in ``dir`` when there is one; off: ``dir`` must
    hold no checkpoints (or pass ``overwrite``)."""
    overwrite: bool = False
    """Delete every checkpoint in ``dir`` (and its run record) before training, and start a
    new run there; off: never start a new run in a folder that holds one."""


@dataclass(slots=True)
class LoggingSection:
    """What is reported while training."""

    log_every: int = 1
    """Print (and record) metrics every this many steps."""
    metrics_file: str | None = None
    """JSON-lines file that gets one record per logged step; unset: none."""
    tensorboard_dir: str | None = None
    """TensorBoard event folder; unset: no TensorBoard."""
    peak_tflops: float | None = None
    """Peak TFLOP/s of one device, the denominator of the logged MFU; unset: the GPU's dense
    bf16 (or float32/TF32) peak from `optimized.estimator.flops.GPU_PEAKS`, and on a CPU or
    an unknown GPU no MFU (TFLOP/s only)."""
    profile_dir: str | None = field(default=None, metadata={"flag": "profile"})
    """Folder for a torch.profiler trace of ``profile_steps`` on every rank
    (``rank{r}.trace.json``, for Perfetto or chrome://tracing) and a table of its top
    kernels and host ops (``rank{r}.top_ops.md``); unset: no profiling."""
    profile_steps: str | None = None
    """Steps to profile, 1-based: ``N`` or ``A-B``; unset: two steady-state steps (the
    second and third this run does, or its last two when it does fewer)."""


@dataclass(slots=True)
class TrainConfig:
    """Everything one `twinpipe train` run needs."""

    steps: int = 100
    """Optimizer steps to train for."""
    seed: int = 0
    """Seed of weight initialization and data order."""
    dtype: str = "float32"
    """Compute dtype of parameters and activations: ``float32`` or ``bfloat16``."""
    device: str = "auto"
    """``cuda`` when available (``auto``), else ``cpu``; or name one."""
    timeout: float = 120.0
    """Collective timeout of a training step, seconds, set once the warm-up is done (NCCL's
    watchdog ends a step that waits longer on a peer)."""
    setup_timeout: float = 900.0
    """Limit of each phase before the first step, seconds: loading, tuning and compiling the
    kernels, connecting (the collective timeout until then)."""
    model: ModelSection = field(default_factory=ModelSection)
    """The network."""
    data: DataSection = field(default_factory=DataSection)
    """The token data and batch shape."""
    parallel: ParallelSection = field(default_factory=ParallelSection)
    """The rank layout."""
    optim: OptimSection = field(default_factory=OptimSection)
    """Optimizer and learning-rate schedule."""
    loss: LossSection = field(default_factory=LossSection)
    """The objective: z-loss and label smoothing."""
    moe: MoeSection = field(default_factory=MoeSection)
    """Expert balancing: load-balancing loss, router z-loss, expert bias."""
    mtp: MtpSection = field(default_factory=MtpSection)
    """Multi-token prediction: depth and loss weight."""
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    """Saving and resuming."""
    logging: LoggingSection = field(default_factory=LoggingSection)
    """Metrics output."""


class ConfigField(NamedTuple):
    """One leaf of `TrainConfig`, as TOML key, ``--set`` key and flag."""

    key: str
    """Dotted key: ``steps``, ``optim.lr``."""
    section: str | None
    """Section name, or None for a top-level field."""
    name: str
    """Field name inside its section."""
    type: Any
    """Resolved type annotation."""
    flag: str
    """Command-line flag without dashes: ``micro-batch-size``."""
    doc: str
    """The field's docstring, whitespace-collapsed."""


def _field_docs() -> dict[tuple[str, str], str]:
    """``(class name, field name) -> docstring`` read from this module's source (and the
    ``[mtp]`` section's, `optimized.train.mtp_coef`)."""
    docs = {}
    for node in [n for f in SECTION_FILES for n in ast.parse(f.read_text()).body]:
        if not isinstance(node, ast.ClassDef):
            continue
        for before, after in zip(node.body, node.body[1:]):
            if (
                isinstance(before, ast.AnnAssign)
                and isinstance(before.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[(node.name, before.target.id)] = " ".join(after.value.value.split())
    return docs


def _build_fields() -> tuple[dict[str, type], list[ConfigField]]:
    docs = _field_docs()
    sections: dict[str, type] = {}
    leaves: list[ConfigField] = []

    def add(cls: type, section: str | None) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                sections[f.name] = hints[f.name]
                continue
            key = f.name if section is None else f"{section}.{f.name}"
            flag = f.metadata.get("flag", f.name.replace("_", "-"))
            doc = docs.get((cls.__name__, f.name), "")
            leaves.append(ConfigField(key, section, f.name, hints[f.name], flag, doc))

    add(TrainConfig, None)
    for name, cls in list(sections.items()):
        add(cls, name)
    return sections, leaves


SECTIONS, FIELDS = _build_fields()
FIELDS_BY_KEY: dict[str, ConfigField] = {f.key: f for f in FIELDS}


# --------------------------------------------------------------------------- validation


def validate_config(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` if every value is in range; else `ValueError` listing each bad field,
    its value and what would be valid."""
    problems: list[str] = []

    def check(ok: bool, key: str, valid: str) -> None:
        if not ok:
            spec = FIELDS_BY_KEY[key]
            target = cfg if spec.section is None else getattr(cfg, spec.section)
            problems.append(f"{key} = {getattr(target, spec.name)!r} is invalid: {valid}")

    def finite(x: float) -> bool:
        return math.isfinite(x)

    check(cfg.steps >= 1, "steps", "must be >= 1")
    check(cfg.seed >= 0, "seed", "must be >= 0")
    check(cfg.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}")
    check(cfg.device in DEVICES, "device", f"must be one of {', '.join(DEVICES)}")
    for key in ("timeout", "setup_timeout"):
        value = getattr(cfg, key)
        check(finite(value) and value > 0, key, "must be a finite number of seconds > 0")

    from models.network import PRESET_NAMES

    name = cfg.model.name
    check(
        name is None or name in PRESET_NAMES or Path(name).exists(),
        "model.name",
        f"must be a preset ({', '.join(PRESET_NAMES)}) or an existing config.json path",
    )
    init_from = cfg.model.init_from
    check(init_from is None or Path(init_from).exists(), "model.init_from", "path must exist")

    data, par, opt = cfg.data, cfg.parallel, cfg.optim
    check(data.seq_len >= 1, "data.seq_len", "must be >= 1")
    check(data.micro_batch_size >= 1, "data.micro_batch_size", "must be >= 1")
    check(
        data.micro_batches >= max(1, 2 * par.pp),
        "data.micro_batches",
        f"must be >= 2 * parallel.pp = {2 * par.pp} (DualPipeV needs two per pipeline rank)",
    )
    check(par.pp >= 1, "parallel.pp", "must be >= 1")
    check(par.dp >= 1, "parallel.dp", "must be >= 1")
    check(
        par.ep >= 1 and par.dp % par.ep == 0,
        "parallel.ep",
        f"must be >= 1 and divide parallel.dp = {par.dp}",
    )
    from models.runtime import GRAD_SYNC

    check(
        par.grad_sync in GRAD_SYNC, "parallel.grad_sync", f"must be one of {', '.join(GRAD_SYNC)}"
    )
    world = max(par.pp, 1) * max(par.dp, 1)
    check(
        par.nproc is None or (par.nproc >= 1 and world % par.nproc == 0),
        "parallel.nproc",
        f"must be >= 1 and divide the world size pp * dp = {world}, or unset",
    )

    check(finite(opt.lr) and opt.lr >= 0, "optim.lr", "must be a finite number >= 0")
    check(
        finite(opt.min_lr) and 0 <= opt.min_lr <= max(opt.lr, 0),
        "optim.min_lr",
        f"must be in [0, optim.lr = {opt.lr}]",
    )
    check(
        opt.warmup_steps is None or 0 <= opt.warmup_steps <= max(cfg.steps, 0),
        "optim.warmup_steps",
        f"must be in [0, steps = {cfg.steps}], or unset for min({DEFAULT_WARMUP_STEPS}, steps)",
    )
    check_schedule(cfg, check, bool(problems))
    check(finite(opt.weight_decay) and opt.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
    check(all(0 <= b < 1 for b in opt.betas), "optim.betas", "each must be in [0, 1)")
    check(
        opt.state_dtype in OPTIMIZER_STATE_DTYPES,
        "optim.state_dtype",
        f"must be one of {', '.join(OPTIMIZER_STATE_DTYPES)}",
    )
    check(
        finite(opt.grad_clip) and opt.grad_clip >= 0,
        "optim.grad_clip",
        "must be >= 0 (0 turns clipping off)",
    )

    loss = cfg.loss
    check(
        finite(loss.z_loss) and loss.z_loss >= 0,
        "loss.z_loss",
        "must be a finite number >= 0 (0 turns the z-loss off)",
    )
    check(
        finite(loss.label_smoothing) and 0 <= loss.label_smoothing < 1,
        "loss.label_smoothing",
        "must be in [0, 1) (0 turns smoothing off)",
    )

    moe = cfg.moe
    check(moe.aux_loss in MOE_AUX_LOSSES, "moe.aux_loss",
          f"must be one of {', '.join(MOE_AUX_LOSSES)}")  # fmt: skip
    check(
        moe.aux_loss_coef is None or (finite(moe.aux_loss_coef) and moe.aux_loss_coef >= 0),
        "moe.aux_loss_coef",
        "must be a finite number >= 0, or unset for the model's own coefficient",
    )
    check(finite(moe.z_loss_coef) and moe.z_loss_coef >= 0, "moe.z_loss_coef",
          "must be a finite number >= 0 (0 turns the router z-loss off)")  # fmt: skip
    rate = moe.expert_bias_rate
    check(rate is None or (finite(rate) and rate >= 0), "moe.expert_bias_rate",
          "must be a finite number >= 0 (0 keeps the bias fixed; moe.expert_bias = off "
          "turns it off), or unset for the model's own")  # fmt: skip
    check_mtp(cfg.mtp, check)

    check(data.eval_every >= 0, "data.eval_every", "must be >= 0 (0: at the end only)")
    check(data.eval_batches >= 1, "data.eval_batches", "must be >= 1")
    check(
        data.eval_every == 0 or data.eval_path is not None or data.split is not None,
        "data.eval_every",
        "needs held-out data: --eval-data, or --split TRAIN,EVAL",
    )
    from optimized.data.corpus import config_problems  # noqa: PLC0415

    problems += config_problems(data.path, data.eval_path, data.split)
    check(cfg.checkpoint.save_every >= 0, "checkpoint.save_every", "must be >= 0 (0: at the end)")
    check(cfg.checkpoint.keep_last >= 0, "checkpoint.keep_last", "must be >= 0 (0: keep all)")
    check(cfg.logging.log_every >= 1, "logging.log_every", "must be >= 1")
    peak = cfg.logging.peak_tflops
    check(
        peak is None or (finite(peak) and peak > 0),
        "logging.peak_tflops",
        "must be a number > 0 (TFLOP/s of one device), or unset for the GPU table's",
    )
    if cfg.logging.profile_steps is not None:
        from optimized.train.profiling import parse_steps

        try:
            parse_steps(cfg.logging.profile_steps, 0, cfg.steps)
        except ValueError as error:
            problems.append(str(error))
    if problems:
        raise ValueError("invalid training config:\n  " + "\n  ".join(problems))
    return cfg
