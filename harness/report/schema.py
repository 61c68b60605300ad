"""The compare report's schema, and the checks its readers rely on.

A compare report is one JSON object. Only ``passed`` is required; every other
section is optional (an oracle side has no memory figures, a run may skip
timing) and every reader here copes with its absence.

.. code-block:: text

    {
      "passed": true,                       # every check within tolerance, nothing NaN
      "config": {...},                      # preset, pp, dp, ep, micro-batches, dtype, steps,
                                            # grad_sync, reshard_after_forward (optimized-fsdp)
      "baseline": "reference",              # name of the stack compared against
      "candidate": "optimized",             # name of the stack under test
      "loss": {
        "baseline":  [float, ...],          # loss per step
        "candidate": [float, ...],
        "rel_error": [float, ...]           # |candidate - baseline| / |baseline| per step
      },
      "grads": {
        "max_rel_error":     [float, ...],  # per step, worst parameter's ||dg|| / ||g||
        "max_one_minus_cos": [float, ...],  # per step, worst parameter's 1 - cos(g_c, g_b)
        "worst": [[name, rel, one_minus_cos], ...]   # worst parameters over the run
      },
      "params": {"max_rel_error": [float, ...]},      # after each optimizer step
      "memory": {
        "ranks": [
          {
            "rank": 0,
            "baseline":  {"parameters": int, "gradients": int, "optimizer_state": int,
                          "activations": int, "total": int,            # bytes at the peak
                          "peak_moment": {"phase": str, "micro_batch": int | null}},
            "candidate": {...same keys...},
            "ratio": float,                 # candidate total / baseline total
            "activation_ratio": float       # candidate activations / baseline activations
          }, ...
        ]
      },
      "time": {"baseline": [float, ...], "candidate": [float, ...]},   # seconds per step
      "communication": {...},               # per rank and kind: calls, bytes, predicted
                                            # (schema: harness.compare.communication)
      "balancing": {                        # the routing controls (harness.compare.balancing;
                                            # absent in reports written before them)
        "controls": {"aux_loss": str, "aux_loss_coef": float, "z_loss_coef": float,
                     "expert_bias": bool, "expert_bias_rate": float},
        "layers": [int, ...],               # the MoE layers, one row of load/bias each
        "experts": int,
        "judged": {"values": [step, ...],   # steps whose aux/z were judged (the loss bound)
                   "load": bool, "bias": bool},   # equal required (pinned routing)
        "aux": {"baseline": [float, ...], "candidate": [...], "rel_error": [...]},
        "z":   {...same keys...},           # per step, the step's value (summed over ranks)
        "load": {"baseline": [[[int, ...], ...], ...],   # [steps][layers][experts] copies
                 "candidate": [...],
                 "max_abs_diff": [int, ...]},            # per step, over ranks and layers
        "max_over_mean": {"baseline": [float, ...], "candidate": [...]},  # worst layer
        "bias": {"max_abs_diff": [[float, ...], ...],    # [steps][layers], over ranks
                 "range": [[[min, max], ...], ...],      # [steps][layers], the baseline's
                 "eval_change": {"baseline": float, "candidate": float}}  # by the evaluation
      },
      "mtp": {                              # multi-token prediction (harness.compare.mtp;
                                            # absent without it)
        "depths": int, "loss_coef": float,
        "baseline": {"loss": [[float, ...], ...],       # [steps][depths]: each L_k
                     "accuracy": [[float, ...], ...]},  # top-1 on each depth's target
        "candidate": {...same keys...},
        "rel_error": [[float, ...], ...]    # [steps][depths], judged at the loss bound
      },
      "tolerance": {"loss_rel": float, "grad_one_minus_cos": float, "grad_rel": float | None},
      "git_commit": str,
      "machine": str,
      "device": {"type": "cpu" | "cuda",   # where the ranks computed (absent before it was
                 "name": str,              # recorded: such reports ran on CPUs), the GPU
                 "torch": str, "triton": str | null, "cuda": str | null,   # or CPU model
                 "float32_products": bool, # bf16 products computed as float32 products
                 "float32_products_why": str,   # (models.runtime.cpu_gemm), and why
                 "tf32": bool,             # whether float32 matmuls could use TF32 (never)
                 "bf16_reduced_precision_reduction": bool,  # cuBLAS bf16 sums in bf16 (never)
                 "deterministic": bool,    # models.runtime.determinism (--deterministic)
                 "requested": str}         # what --device asked for: auto, cuda or cpu
    }

Memory figures on CUDA also carry ``workspaces``: the bytes of the library workspaces
(cuBLAS) the allocator held at the peak, counted in ``total`` but in no category; the
estimate is compared with ``total - workspaces``. On CPU it is 0.

Files written by `harness.report.write.write_report`: ``report.json``, ``report.md``,
``loss.png`` (when losses are present), ``memory.png`` (when memory is) and ``load.png``
(when the balancing section holds a load).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations")
"""The memory categories of a peak, as ``memory.ranks[i].baseline`` holds them."""


class ReportError(ValueError):
    """A file or object is not a compare report."""


def read_json(path: str | os.PathLike[str], error: type[Exception] = ValueError) -> Any:
    """The JSON in ``path``; ``error`` names the file when it cannot be read or parsed."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as cause:
        raise error(f"{path}: cannot read: {cause.strerror or cause}") from cause
    except UnicodeDecodeError as cause:  # a binary file: an image, an archive, a tensor
        raise error(
            f"{path}: not a text file (byte {cause.start} is not UTF-8: {cause.reason}); "
            "expected a JSON file"
        ) from cause
    try:
        return json.loads(text)
    except json.JSONDecodeError as cause:
        raise error(f"{path}: not JSON ({cause.msg} at line {cause.lineno}); expected a JSON "
                    "file") from cause  # fmt: skip
    except RecursionError as cause:
        raise error(f"{path}: not JSON this reader takes (nested too deeply)") from cause


def load_report(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a compare report, with an error that names the file when it is not one, or
    when a section has the wrong shape (`report_problems`)."""
    report = read_json(path, ReportError)
    if not is_compare_report(report):
        raise ReportError(f"{path}: not a compare report (an object with a boolean 'passed')")
    problems = report_problems(report)
    if problems:
        raise ReportError(f"{path}: malformed compare report:\n  " + "\n  ".join(problems))
    return report


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _series_problem(where: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(v is None or _is_number(v) for v in value):
        return f"{where} = {value!r:.60}: expected a list of numbers (one per step)"
    return None


def report_problems(report: dict[str, Any]) -> list[str]:
    """Every section of a compare report whose shape its readers (`twinpipe diff`, the
    dashboard) would choke on; empty when the report is well formed. Sections are
    optional; a present one must have the documented shape."""
    problems: list[str] = []

    def section(name: str) -> dict[str, Any]:
        value = report.get(name)
        if value is not None and not isinstance(value, dict):
            problems.append(f"{name} = {value!r:.60}: expected an object")
            return {}
        return value or {}

    for name, keys in (
        ("loss", ("baseline", "candidate", "rel_error")),
        ("grads", ("max_rel_error", "max_one_minus_cos")),
        ("params", ("max_rel_error",)),
        ("time", ("baseline", "candidate")),
    ):
        values = section(name)
        problems += [p for k in keys if (p := _series_problem(f"{name}.{k}", values.get(k)))]
    balancing = section("balancing")
    parts = {name: balancing.get(name) for name in ("aux", "z", "load")}
    for name, value in parts.items():
        if value is not None and not isinstance(value, dict):
            problems.append(f"balancing.{name} = {value!r:.60}: expected an object")
            parts[name] = None
    for name in ("aux", "z"):
        values = parts[name] or {}
        problems += [
            p
            for k in ("baseline", "candidate", "rel_error")
            if (p := _series_problem(f"balancing.{name}.{k}", values.get(k)))
        ]
    for side in ("baseline", "candidate"):
        load = (parts["load"] or {}).get(side)
        if load is not None and not (
            isinstance(load, list) and all(isinstance(s, list) for s in load)
        ):
            problems.append(
                f"balancing.load.{side} = {load!r:.60}: expected [steps][layers][experts] counts"
            )
    tolerance = section("tolerance")
    problems += [
        f"tolerance.{k} = {v!r:.60}: expected a number"
        for k, v in tolerance.items()
        if not (_is_number(v) or isinstance(v, (str, bool)) or v is None)
    ]
    section("config")
    device = section("device")
    if device and not (isinstance(device.get("type"), str) and device["type"]):
        problems.append(f"device.type = {device.get('type')!r:.60}: expected 'cpu' or 'cuda'")
    ranks = section("memory").get("ranks")
    if ranks is not None and not isinstance(ranks, list):
        problems.append(f"memory.ranks = {ranks!r:.60}: expected a list, one entry per rank")
        ranks = []
    for i, entry in enumerate(ranks or []):
        if not isinstance(entry, dict):
            problems.append(f"memory.ranks[{i}] = {entry!r:.60}: expected an object")
            continue
        if not (entry.get("rank") is None or isinstance(entry.get("rank"), int)):
            problems.append(f"memory.ranks[{i}].rank = {entry['rank']!r:.60}: expected an int")
        for side in ("baseline", "candidate"):
            figures = entry.get(side)
            if figures is None:
                continue
            if not isinstance(figures, dict):
                problems.append(f"memory.ranks[{i}].{side} = {figures!r:.60}: expected an object")
                continue
            problems += [
                f"memory.ranks[{i}].{side}.{k} = {figures[k]!r:.60}: expected a number of bytes"
                for k in ("total", *CATEGORIES)
                if figures.get(k) is not None and not _is_number(figures[k])
            ]
        for k in ("ratio", "activation_ratio"):
            if entry.get(k) is not None and not _is_number(entry[k]):
                problems.append(f"memory.ranks[{i}].{k} = {entry[k]!r:.60}: expected a number")
    return problems


def report_device(report: dict[str, Any]) -> tuple[str, str]:
    """``(type, name)`` of the device a report's ranks computed on. A report without a
    ``device`` section was written before it was recorded, when `twinpipe compare` ran on
    CPUs only: ``("cpu", "")``."""
    device = report.get("device")
    if not isinstance(device, dict) or not device.get("type"):
        return "cpu", ""
    return str(device["type"]), str(device.get("name") or "")


def is_compare_report(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("passed"), bool)
