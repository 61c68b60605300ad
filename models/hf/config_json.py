"""A Hugging Face ``config.json`` read with errors a user can act on, and refused when it
asks for math twinpipe does not implement.

Why a module of its own: a config file comes from outside, and every way it can be
wrong used to surface somewhere else -- a truncated file as a bare ``JSONDecodeError``
without a file name, a list as ``AttributeError: 'list' object has no attribute 'get'``,
a missing width as ``KeyError`` from inside a rank after the process group started. Here
each becomes one `ModelConfigError` (a ``ValueError``) naming the file, the field, the
value and what would be valid, raised where the config is read, before any work.

Worse than a crash is a config that runs and means something else. Hugging Face configs
carry fields that change the network's math; a field twinpipe does not read would be
silently ignored, and the run would train another model than the one named (a DeepSeek-V2
config asking for ``scoring_func: sigmoid`` would run as softmax routing). `UNSUPPORTED` lists every
such field with the values that mean what twinpipe computes; any other value is refused
by name. Fields that only describe a run (``use_cache``, ``dtype``, token ids) or that the
the run's balancing controls read (``output_router_logits``, ``router_aux_loss_coef``,
DeepSeek-V2's ``aux_loss_alpha`` and ``seq_aux``: `models.network.balancing`) pass.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from typing import Any

from models.runtime import BadInput, read_text

CONFIG_NAME = "config.json"


class ModelConfigError(ValueError):
    """A model config that cannot be read, or asks for what twinpipe does not compute.
    (A config that does not exist is a ``FileNotFoundError`` with the same kind of
    message.)"""


def config_path(path: str | os.PathLike) -> str:
    """The ``config.json`` a path names: the file itself, or the one inside a folder;
    ``FileNotFoundError`` naming the path when there is none."""
    path = os.fspath(path)
    if os.path.isdir(path):
        inside = os.path.join(path, CONFIG_NAME)
        if not os.path.isfile(inside):
            raise FileNotFoundError(
                f"{path} is a folder without a {CONFIG_NAME}: a model is a preset name, a "
                f"Hugging Face {CONFIG_NAME}, or a folder holding one"
            )
        return inside
    if not os.path.exists(path):
        raise FileNotFoundError(f"no Hugging Face config at {path}: no such file")
    return path


def read_config_json(path: str | os.PathLike) -> tuple[str, dict[str, Any]]:
    """``(file, raw dict)`` of a ``config.json`` (or a folder holding one)."""
    file = config_path(path)
    try:
        text = read_text(file, "a JSON object (a Hugging Face config.json)")
    except BadInput as error:  # binary: an image, an archive, a weights file
        raise ModelConfigError(str(error)) from None
    except OSError as error:
        raise ModelConfigError(f"{file}: cannot read: {error.strerror or error}") from None
    if not text.strip():
        raise ModelConfigError(f"{file} is empty: expected a JSON object (a HF config.json)")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as error:
        raise ModelConfigError(
            f"{file} is not valid JSON ({error.msg} at line {error.lineno} column "
            f"{error.colno}); is it truncated?"
        ) from None
    if not isinstance(raw, dict):
        raise ModelConfigError(
            f"{file} holds a JSON {type(raw).__name__}, not an object: a HF config.json is "
            '{"model_type": ..., "hidden_size": ..., ...}'
        )
    return file, raw


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda value: value in values


def _zero(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and value == 0)


def _one(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and math.isclose(value, 1.0))


_ALL = ("deepseek_v2", "deepseek_v3", "gpt_oss", "qwen3_moe")
_DEEPSEEK = ("deepseek_v2", "deepseek_v3")
UNSUPPORTED: tuple[tuple[tuple[str, ...], str, Callable[[Any], bool], str], ...] = (
    # (families, field, accepted(value), what twinpipe computes)
    (("deepseek_v2",), "scoring_func", _is(None, "softmax"),
     "'softmax' (router scores are a softmax over the experts)"),
    (("deepseek_v2",), "topk_method", _is(None, "greedy", "group_limited_greedy"),
     "'greedy' or 'group_limited_greedy' (no noaux_tc bias-corrected selection)"),
    (("deepseek_v2",), "e_score_correction_bias", _zero,
     "absent (no noaux_tc score-correction bias)"),
    (("deepseek_v3",), "scoring_func", _is(None, "sigmoid"),
     "'sigmoid' (transformers' DeepSeek-V3 router scores with a sigmoid, whatever the field)"),
    (("deepseek_v3",), "topk_method", _is(None, "noaux_tc"),
     "'noaux_tc' (transformers' DeepSeek-V3 router chooses so, whatever the field)"),
    (_DEEPSEEK, "moe_layer_freq", _is(None, 1),
     "1 (every layer from first_k_dense_replace on is MoE)"),
    (_DEEPSEEK, "mlp_bias", _is(None, False), "false (MLPs without biases)"),
    (("deepseek_v2", "deepseek_v3", "qwen3_moe"), "hidden_act", _is(None, "silu"),
     "'silu' (SwiGLU experts)"),
    (_ALL, "attention_dropout", _zero, "0 (no dropout)"),
    (_ALL, "hidden_dropout", _zero, "0 (no dropout)"),
    (("qwen3_moe",), "use_sliding_window", _is(None, False), "false (full attention)"),
    (("deepseek_v2", "deepseek_v3", "qwen3_moe"), "layer_types",
     lambda v: v is None or (isinstance(v, list) and set(v) <= {"full_attention"}),
     "absent or every entry 'full_attention'"),
    (_ALL, "partial_rotary_factor", _one, "1 (rotary over the whole rotary width)"),
)  # fmt: skip


INTEGER_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "intermediate_size", "moe_intermediate_size", "n_routed_experts",
    "num_local_experts", "num_experts", "num_experts_per_tok", "max_position_embeddings",
    "n_group", "topk_group", "n_shared_experts", "first_k_dense_replace", "q_lora_rank",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "head_dim",
    "sliding_window", "decoder_sparse_step", "num_nextn_predict_layers",
    "rope_parameters.original_max_position_embeddings",
)  # fmt: skip
"""Fields read as whole numbers (null allowed: a field that must be set is refused by name
later, as missing or out of range)."""
FLOAT_FIELDS = (
    "rms_norm_eps", "rope_theta", "initializer_range", "routed_scaling_factor",
    "router_aux_loss_coef", "aux_loss_alpha", "swiglu_alpha", "swiglu_limit",
    "rope_parameters.rope_theta", "rope_parameters.factor", "rope_parameters.beta_fast",
    "rope_parameters.beta_slow", "rope_parameters.mscale", "rope_parameters.mscale_all_dim",
    "rope_parameters.attention_factor",
)  # fmt: skip
"""Fields read as real numbers (an integer is one too)."""
NON_NEGATIVE = ("num_nextn_predict_layers",)
"""Counts that may be 0 but not negative (the others' ranges are `ModelConfig`'s)."""


def numeric_problems(raw: dict[str, Any]) -> list[str]:
    """One line per numeric field of ``raw`` holding what is not a number of its kind: a
    string, a list, a boolean, a float where a count is meant, NaN or an infinity. So the
    error names the field instead of Python's ``could not convert string to float``.
    ``rope_parameters.*`` are looked for in ``rope_parameters`` and ``rope_scaling``."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    problems = []
    for names, integer in ((INTEGER_FIELDS, True), (FLOAT_FIELDS, False)):
        for name in names:
            holder, key = raw, name
            if name.startswith("rope_parameters."):
                holder, key = rope, name.split(".", 1)[1]
            if not isinstance(holder, dict) or holder.get(key) is None:
                continue
            value = holder[key]
            if integer:
                ok = isinstance(value, int) and not isinstance(value, bool)
                valid = "an integer"
                if ok and name in NON_NEGATIVE and value < 0:
                    ok, valid = False, "an integer >= 0"
            else:
                ok = (isinstance(value, int | float) and not isinstance(value, bool)
                      and math.isfinite(value))  # fmt: skip
                valid = "a finite number"
            if not ok:
                problems.append(f"{name} = {value!r} is invalid: expected {valid}")
    return problems


def unsupported_fields(raw: dict[str, Any]) -> list[str]:
    """One line per field of ``raw`` that asks for math twinpipe does not implement."""
    family = raw.get("model_type")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    problems = []
    for families, name, accepted, valid in UNSUPPORTED:
        if family not in families:
            continue
        for where, holder in ((name, raw), (f"rope_parameters.{name}", rope)):
            if isinstance(holder, dict) and name in holder and not accepted(holder[name]):
                problems.append(f"{where} = {holder[name]!r} is not implemented: valid is {valid}")
    return problems


def check_supported(raw: dict[str, Any], where: str) -> None:
    """Raise `ModelConfigError` naming every math-changing field of ``raw`` that twinpipe
    would otherwise ignore."""
    numbers = numeric_problems(raw)
    if numbers:
        raise ModelConfigError(f"{where}: " + "; ".join(numbers))
    problems = unsupported_fields(raw)
    if problems:
        raise ModelConfigError(
            f"{where} asks for what twinpipe does not compute, so it would train another "
            "model than the one named:\n  " + "\n  ".join(problems)
        )
