"""The trainer's configuration: slotted dataclasses, TOML, ``--set`` overrides and flags.

One `TrainConfig` holds everything `twinpipe train` needs. Values come from, in
increasing precedence:

1. the defaults written below,
2. a TOML file (``--config run.toml``; top-level keys, then ``[model]``, ``[data]``,
   ``[parallel]``, ``[optim]``, ``[checkpoint]``, ``[logging]`` tables),
3. ``--set key=value`` overrides, dotted for sections (``--set optim.lr=1e-3``),
4. one flag per field, generated from the fields (``--micro-batch-size 4``, ``--lr 1e-3``).

Every field carries a docstring; it becomes the flag's help and the comment above the
key in `config_to_toml`, so the three views cannot drift apart. An unknown key is a
`ValueError` naming the key and the valid ones; `validate_config` names the field, the
value and the valid range -- all before any process group starts.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import json
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NamedTuple

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DTYPES = ("float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
LR_SCHEDULES = ("cosine", "constant")


@dataclass(slots=True)
class ModelSection:
    """Which network to train and where its first weights come from."""

    name: str = field(default="tiny-deepseek-v2", metadata={"flag": "model"})
    """A preset name (see `models.presets.PRESET_NAMES`) or a Hugging Face config.json path."""
    init_from: str | None = None
    """Checkpoint to take the initial weights from (HF folder or twinpipe checkpoint); unset:
    random initialization from ``seed``."""


@dataclass(slots=True)
class DataSection:
    """What each step reads: the token folder and the batch shape per DP rank."""

    path: str | None = field(default=None, metadata={"flag": "data"})
    """Folder written by `twinpipe prepare-data`; unset: the standard library's source,
    byte-tokenized (`optimized.data.default_dataset`)."""
    seq_len: int = 128
    """Tokens per sequence (each sample reads ``seq_len + 1`` for the shifted labels)."""
    micro_batch_size: int = 2
    """Sequences per micro-batch."""
    micro_batches: int = 4
    """Micro-batches per step per DP rank (DualPipeV chunks); at least ``2 * pp``."""
    shuffle: bool = True
    """Shuffle the samples each epoch (deterministically from ``seed`` and the epoch)."""


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
    nproc: int | None = None
    """Processes launched on this machine; unset: the whole world (``pp * dp``)."""

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    @property
    def use_fsdp(self) -> bool:
        return self.dp > 1 if self.fsdp is None else self.fsdp


@dataclass(slots=True)
class OptimSection:
    """AdamW and its learning-rate schedule."""

    lr: float = 3e-4
    """Peak learning rate, reached at the end of warmup."""
    min_lr: float = 3e-5
    """Learning rate the cosine schedule ends at, at step ``steps``."""
    warmup_steps: int = 10
    """Steps of linear warmup from ``lr / warmup_steps`` to ``lr``."""
    lr_schedule: str = "cosine"
    """After warmup: ``cosine`` (decay to ``min_lr``) or ``constant`` (stay at ``lr``)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW ``(beta1, beta2)``."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 turns clipping off."""
    skip_nonfinite: bool = False
    """Skip the optimizer step (and log it) when the loss or gradient norm is NaN or inf;
    off: stop the run naming the step and ranks."""


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
    """Resume from the newest checkpoint in ``dir`` when there is one."""


@dataclass(slots=True)
class LoggingSection:
    """What is reported while training."""

    log_every: int = 1
    """Print (and record) metrics every this many steps."""
    metrics_file: str | None = None
    """JSON-lines file that gets one record per logged step; unset: none."""
    tensorboard_dir: str | None = None
    """TensorBoard event folder; unset: no TensorBoard."""


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
    model: ModelSection = field(default_factory=ModelSection)
    """The network."""
    data: DataSection = field(default_factory=DataSection)
    """The token data and batch shape."""
    parallel: ParallelSection = field(default_factory=ParallelSection)
    """The rank layout."""
    optim: OptimSection = field(default_factory=OptimSection)
    """Optimizer and learning-rate schedule."""
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
    """``(class name, field name) -> docstring`` read from this module's source."""
    tree = ast.parse(Path(__file__).read_text())
    docs = {}
    for node in tree.body:
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


# --------------------------------------------------------------------------- values


def _optional_inner(tp: Any) -> Any | None:
    """``X`` for ``X | None``, else None."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


def _type_name(tp: Any) -> str:
    inner = _optional_inner(tp)
    if inner is not None:
        return f"{_type_name(inner)} or unset (auto/none)"
    if typing.get_origin(tp) is tuple:
        return "a pair of " + " and ".join(_type_name(a) for a in typing.get_args(tp))
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}[tp]


def _invalid(key: str, value: Any, tp: Any) -> ValueError:
    return ValueError(f"config {key} = {value!r} is invalid: expected {_type_name(tp)}")


def coerce_value(key: str, value: Any, tp: Any) -> Any:
    """A TOML (or Python) value checked against, and converted to, the field type."""
    inner = _optional_inner(tp)
    if inner is not None:
        if value is None or (inner is not str and value in ("auto", "none")):
            return None
        return coerce_value(key, value, inner)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if isinstance(value, (list, tuple)) and len(value) == len(args):
            try:
                return tuple(coerce_value(key, v, a) for v, a in zip(value, args))
            except ValueError:
                pass
    raise _invalid(key, value, tp)


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def parse_text(key: str, text: str, tp: Any) -> Any:
    """A command-line string (``--set`` value or flag argument) as the field type."""
    stripped = text.strip()
    inner = _optional_inner(tp)
    if inner is not None:
        if stripped.lower() in ("auto", "none", "") and not (inner is str and stripped):
            return None
        try:
            return parse_text(key, text, inner)
        except ValueError:
            raise _invalid(key, text, tp) from None
    try:
        if tp is bool:
            if stripped.lower() in _TRUE + _FALSE:
                return stripped.lower() in _TRUE
        elif tp is int:
            return int(stripped)
        elif tp is float:
            return float(stripped)
        elif tp is str:
            return text
        elif typing.get_origin(tp) is tuple:
            parts = [p for p in stripped.strip("[]()").split(",") if p.strip()]
            args = typing.get_args(tp)
            if len(parts) == len(args):
                return tuple(parse_text(key, p, a) for p, a in zip(parts, args))
    except ValueError:
        pass
    raise _invalid(key, text, tp)


def _unknown_key(key: str, valid: list[str], where: str) -> ValueError:
    hint = difflib.get_close_matches(key, valid, n=1)
    suffix = [f"; did you mean {hint[0]!r}?"] if hint else []
    # A bare field name that lives in one section: point at the dotted key.
    dotted = [k for k in FIELDS_BY_KEY if k.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]]
    if not hint and dotted:
        suffix = [f"; did you mean {dotted[0]!r}?"]
    return ValueError(
        f"unknown config key {key!r}{where}; valid keys: {', '.join(valid)}" + "".join(suffix)
    )


def _lookup(key: str) -> ConfigField:
    if key in FIELDS_BY_KEY:
        return FIELDS_BY_KEY[key]
    section = key.split(".", 1)[0]
    if section in SECTIONS and "." in key:
        valid = [f.key for f in FIELDS if f.section == section]
        raise _unknown_key(key, valid, f" in [{section}]")
    if key in SECTIONS:
        valid = [f.key for f in FIELDS if f.section == key]
        raise ValueError(
            f"config key {key!r} is a section, not a value; set one of: {', '.join(valid)}"
        )
    raise _unknown_key(key, list(FIELDS_BY_KEY), "")


def set_value(cfg: TrainConfig, key: str, value: Any, from_text: bool = False) -> None:
    """Set the dotted ``key`` of ``cfg`` in place, converting ``value`` to the field type."""
    spec = _lookup(key)
    value = parse_text(key, value, spec.type) if from_text else coerce_value(key, value, spec.type)
    target = cfg if spec.section is None else getattr(cfg, spec.section)
    setattr(target, spec.name, value)


# --------------------------------------------------------------------------- sources


def config_from_dict(data: dict, base: TrainConfig | None = None) -> TrainConfig:
    """``base`` (default: the defaults) updated by a nested dict as TOML gives it."""
    cfg = copy_config(base) if base is not None else TrainConfig()
    for name, value in data.items():
        if isinstance(value, dict) and name not in SECTIONS:
            hint = difflib.get_close_matches(name, list(SECTIONS), n=1)
            raise ValueError(
                f"unknown config section [{name}]; valid sections: {', '.join(SECTIONS)}"
                + (f"; did you mean [{hint[0]}]?" if hint else "")
            )
        if name in SECTIONS:
            if not isinstance(value, dict):
                valid = [f.name for f in FIELDS if f.section == name]
                raise ValueError(
                    f"config {name} = {value!r} is invalid: {name} is a section; write "
                    f"[{name}] with keys {', '.join(valid)}"
                )
            for inner, inner_value in value.items():
                set_value(cfg, f"{name}.{inner}", inner_value)
        else:
            set_value(cfg, name, value)
    return cfg


def load_config(path: str | Path, base: TrainConfig | None = None) -> TrainConfig:
    """``base`` (default: the defaults) updated by a TOML file; not yet validated."""
    text = Path(path).read_text()
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"config file {str(path)!r} is not valid TOML: {error}") from error
    return config_from_dict(data, base)


def apply_overrides(cfg: TrainConfig, overrides: list[str]) -> TrainConfig:
    """A copy of ``cfg`` with ``key=value`` strings applied in order."""
    cfg = copy_config(cfg)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(
                f"override {item!r} is invalid: expected key=value, e.g. optim.lr=1e-3"
            )
        set_value(cfg, key.strip(), text, from_text=True)
    return cfg


def copy_config(cfg: TrainConfig) -> TrainConfig:
    """A deep copy (sections included)."""
    return dataclasses.replace(
        cfg, **{name: dataclasses.replace(getattr(cfg, name)) for name in SECTIONS}
    )


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

    from models.presets import PRESET_NAMES

    name = cfg.model.name
    check(
        name in PRESET_NAMES or Path(name).exists(),
        "model.name",
        f"must be a preset ({', '.join(PRESET_NAMES)}) or an existing config.json path",
    )
    init_from = cfg.model.init_from
    check(init_from is None or Path(init_from).exists(), "model.init_from", "path must exist")
    data_path = cfg.data.path
    check(
        data_path is None or Path(data_path).is_dir(),
        "data.path",
        "must be a folder written by `twinpipe prepare-data`, or unset for the default data",
    )

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
        0 <= opt.warmup_steps <= max(cfg.steps, 0),
        "optim.warmup_steps",
        f"must be in [0, steps = {cfg.steps}]",
    )
    check(
        opt.lr_schedule in LR_SCHEDULES,
        "optim.lr_schedule",
        f"must be one of {', '.join(LR_SCHEDULES)}",
    )
    check(finite(opt.weight_decay) and opt.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
    check(all(0 <= b < 1 for b in opt.betas), "optim.betas", "each must be in [0, 1)")
    check(
        finite(opt.grad_clip) and opt.grad_clip >= 0,
        "optim.grad_clip",
        "must be >= 0 (0 turns clipping off)",
    )

    check(cfg.checkpoint.save_every >= 0, "checkpoint.save_every", "must be >= 0 (0: at the end)")
    check(cfg.checkpoint.keep_last >= 0, "checkpoint.keep_last", "must be >= 0 (0: keep all)")
    check(cfg.logging.log_every >= 1, "logging.log_every", "must be >= 1")
    if problems:
        raise ValueError("invalid training config:\n  " + "\n  ".join(problems))
    return cfg


# --------------------------------------------------------------------------- TOML out


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def config_to_toml(cfg: TrainConfig) -> str:
    """``cfg`` as a TOML document `load_config` reads back to an equal config; each key
    is preceded by its docstring as a comment, and unset keys are commented out."""
    lines: list[str] = []
    for section in [None, *SECTIONS]:
        if section is not None:
            lines += ["", f"[{section}]"]
        target = cfg if section is None else getattr(cfg, section)
        for spec in (f for f in FIELDS if f.section == section):
            value = getattr(target, spec.name)
            lines.append(f"# {spec.doc}")
            if value is None:
                lines.append(f"# {spec.name} = (unset)")
            else:
                lines.append(f"{spec.name} = {_toml_value(value)}")
    return "\n".join(lines).lstrip("\n") + "\n"


def print_config(cfg: TrainConfig, file: IO[str] | None = None) -> None:
    """Write `config_to_toml` of ``cfg`` to ``file`` (default stdout)."""
    (file or sys.stdout).write(config_to_toml(cfg))


# --------------------------------------------------------------------------- flags

_DEST_PREFIX = "config__"


def _dest(spec: ConfigField) -> str:
    return _DEST_PREFIX + spec.key.replace(".", "__")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config``, ``--set`` and one flag per field (``--lr``, ``--micro-batch-size``...).

    Flags not given leave no attribute, so `config_from_args` knows which were given.
    """
    group = parser.add_argument_group("training config")
    group.add_argument("--config", metavar="TOML", help="TOML file of config values")
    group.add_argument(
        "--set",
        dest=_DEST_PREFIX + "set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one value, dotted for sections (optim.lr=1e-3); an empty value unsets an "
        "optional path; repeatable",
    )
    for spec in FIELDS:
        text = f"{spec.doc} [{spec.key}]"
        if spec.type is bool:
            group.add_argument(
                f"--{spec.flag}",
                dest=_dest(spec),
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=text,
            )
            continue

        def convert(value: str, spec: ConfigField = spec) -> Any:
            try:
                return parse_text(spec.key, value, spec.type)
            except ValueError as error:
                raise argparse.ArgumentTypeError(str(error)) from error

        convert.__name__ = _type_name(spec.type)  # argparse names it in its error
        group.add_argument(
            f"--{spec.flag}",
            dest=_dest(spec),
            type=convert,
            default=argparse.SUPPRESS,
            metavar="on|off|auto" if spec.type == bool | None else spec.name.upper(),
            help=text,
        )


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The validated config: defaults, then ``--config``, then ``--set``, then flags."""
    cfg = TrainConfig()
    if getattr(args, "config", None):
        cfg = load_config(args.config, cfg)
    cfg = apply_overrides(cfg, getattr(args, _DEST_PREFIX + "set", []))
    for spec in FIELDS:
        if hasattr(args, _dest(spec)):
            set_value(cfg, spec.key, getattr(args, _dest(spec)))
    return validate_config(cfg)


# --------------------------------------------------------------------------- schedule


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based).

    Warmup: ``lr * (step + 1) / warmup_steps`` for the first ``warmup_steps`` steps,
    so step 0 already moves and step ``warmup_steps - 1`` uses the full ``lr``. Then
    ``constant`` stays at ``lr``; ``cosine`` follows
    ``min_lr + (lr - min_lr) * (1 + cos(pi * t)) / 2`` with
    ``t = (step - warmup_steps) / (steps - warmup_steps)``, reaching ``min_lr`` at
    ``step == steps`` and staying there after.
    """
    opt = cfg.optim
    if step < 0:
        raise ValueError(f"step = {step} is invalid: must be >= 0")
    if step < opt.warmup_steps:
        return opt.lr * (step + 1) / opt.warmup_steps
    if opt.lr_schedule == "constant":
        return opt.lr
    if opt.lr_schedule != "cosine":
        raise ValueError(
            f"optim.lr_schedule = {opt.lr_schedule!r} is invalid: "
            f"must be one of {', '.join(LR_SCHEDULES)}"
        )
    decay_steps = cfg.steps - opt.warmup_steps
    if decay_steps <= 0:
        return opt.min_lr
    progress = min(1.0, (step - opt.warmup_steps) / decay_steps)
    return opt.min_lr + (opt.lr - opt.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
