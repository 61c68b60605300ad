"""Where a `TrainConfig`'s values come from and go: TOML, ``--set`` overrides and flags.

Values come from, in increasing precedence:

1. the defaults written in `optimized.train.config`,
2. a TOML file (``--config run.toml``; top-level keys, then ``[model]``, ``[data]``,
   ``[parallel]``, ``[optim]``, ``[checkpoint]``, ``[logging]`` tables),
3. ``--set key=value`` overrides, dotted for sections (``--set optim.lr=1e-3``),
4. one flag per field, generated from the fields (``--micro-batch-size 4``, ``--lr 1e-3``).

An unknown key is a `ValueError` naming the key and the valid ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import sys
import types
import typing
from pathlib import Path
from typing import IO, Any

from models.runtime import BadInput, read_text

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from optimized.train.config import (
    FIELDS,
    FIELDS_BY_KEY,
    SECTIONS,
    ConfigField,
    TrainConfig,
    validate_config,
)

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
    return {
        bool: "a boolean (true or false)",
        int: "an integer",
        float: "a number",
        str: "a string",
    }[tp]


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
    if Path(path).is_dir():
        raise ValueError(f"--config {str(path)!r}: is a folder; expected a TOML file")
    try:
        text = read_text(path, "a TOML file of config values")
    except OSError as error:
        why = error.strerror or error
        raise ValueError(f"--config {str(path)!r}: cannot read ({why})") from None
    except BadInput as error:  # binary
        raise ValueError(f"--config {error}") from None
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


def _default_text(defaults: TrainConfig, spec: ConfigField) -> str:
    """A field's default as its flag takes it (``unset`` for None, ``on``/``off``)."""
    holder = defaults if spec.section is None else getattr(defaults, spec.section)
    value = getattr(holder, spec.name)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value).replace("%", "%%")


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
        "optional path; repeatable (default: none)",
    )
    defaults = TrainConfig()
    for spec in FIELDS:
        text = f"{spec.doc} [{spec.key}; default: {_default_text(defaults, spec)}]"
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
