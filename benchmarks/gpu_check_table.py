"""The GPU check's table (`benchmarks.gpu_check`): one row per part run, then what pytest
skipped and why, what failed, and the op benchmarks; written again after every part."""

from __future__ import annotations

from benchmarks.gpu_check_runner import pytest_figures


def result_word(part: dict) -> str:
    if part.get("timed_out"):
        return "timed out"
    return "pass" if part.get("passed") else "FAIL"


def _row(name: str, part: dict, figures: str, budget: float | None) -> str:
    seconds = f"{part.get('seconds', '')}" + (f" / {budget:.0f}" if budget else "")
    why = f" ({part['why']})" if part.get("why") else ""
    return f"| {name} | {result_word(part)}{why} | {seconds} | {figures} |"


def _figure(record: dict, key: str, form: str) -> str:
    return form.format(record[key]) if record.get(key) is not None else ""


def _pytest_notes(name: str, run: dict) -> list[str]:
    """Skip reasons and failed tests of one pytest run, as bullet lines."""
    summary = run.get("junit") or {}
    notes = [f"- {name}: skipped {n} x: {reason}" for reason, n in summary.get("skip_reasons", [])]
    notes += [f"- {name}: failed {test}" for test in summary.get("failed_tests", [])]
    return notes


def _compare_figures(run: dict) -> str:
    per_step = ", ".join(
        f"{side} {', '.join(f'{s:.2f}' for s in times)} s"
        for side, times in run.get("seconds_per_step", {}).items()
    )
    errors = ", ".join(
        f"{name} {e['error'] * 100:+.2f}%"
        for name, e in run.get("estimates", {}).items()
        if e.get("error") is not None
    )
    text = f"verdict {run.get('verdict', '-')}; per step: {per_step}"
    return text + (f"; estimate: {errors}" if errors else "")


def markdown(summary: dict) -> str:
    """The table a closing note quotes (seconds: taken / budget)."""
    m, budget = summary["machine"], summary.get("budget_s", {})
    lines = [
        f"# twinpipe GPU check ({m['date']})",
        "",
        f"{', '.join(m['gpus']) or 'no GPU: ' + m['why_no_gpu']}; torch {m['torch']}, CUDA "
        f"{m['cuda']}, Triton {m['triton']}, Python {m['python']}, {m['cpus']} CPUs",
        "",
        "| part | result | seconds | figures |",
        "|---|---|---|---|",
    ]
    notes: list[str] = []
    parts = summary["parts"]
    for part, run in parts.items():
        if part in ("probe", "ops") and "junit" in run:
            figures = pytest_figures(run["junit"])
            if part == "ops":
                figures += f"; {len(run.get('ops', []))} benchmarks"
            lines.append(_row(part, run, figures, budget.get(part)))
            notes += _pytest_notes(part, run)
        elif part == "tests" and "gpu" in run:
            runs = (("-m gpu", run["gpu"]), ("kernel tests", run["kernels"]))
            text = "; ".join(f"{name}: {pytest_figures(one.get('junit'))}" for name, one in runs)
            lines.append(_row("tests", run, text, budget.get(part)))
            notes += _pytest_notes("-m gpu", run["gpu"]) + _pytest_notes("kernels", run["kernels"])
        elif part == "compare":
            lines.append(_row("compare mid-qwen3-moe PP1 bf16", run, _compare_figures(run),
                              budget.get(part)))  # fmt: skip
        elif part == "multi" and "runs" in run:
            for name, one in run["runs"].items():
                lines.append(_row(f"multi {name} tiny-qwen3-moe bf16 NCCL", one,
                                  _compare_figures(one), None))  # fmt: skip
        elif part == "train" and "presets" in run:
            for preset, r in run["presets"].items():
                figures = "; ".join(text for text in (
                    _figure(r, "tokens_per_second", "{:,.0f} tokens/s"),
                    _figure(r, "tflops", "{:.0f} TFLOP/s"),
                    _figure(r, "mfu", "MFU {:.1%}"),
                    _figure(r, "peak_memory_bytes", "peak {:.2e} B"),
                ) if text)  # fmt: skip
                lines.append(_row(f"train {preset} 4x4096 bf16", r, figures, None))
        elif part == "pipeline" and "model" in run:
            lines.append(_row("pipeline: CPU model of NCCL's rules, PP 4", run["model"],
                              pytest_figures(run["model"].get("junit")), None))  # fmt: skip
            notes += _pytest_notes("pipeline model", run["model"])
            nccl = run.get("nccl", {})
            if nccl.get("measured"):
                lines.append(_row(f"pipeline: train PP {nccl.get('pp')} NCCL mid activations",
                                  nccl, "", None))  # fmt: skip
            else:
                lines.append(f"| pipeline on NCCL | {nccl.get('why', 'not measured')} | | |")
        else:
            lines.append(_row(part, run, "", budget.get(part)))
    for part, why in summary.get("not_run", {}).items():
        lines.append(f"| {part} | not run ({why}) | | |")
    if notes:
        lines += ["", *notes]
    ops = parts.get("ops", {}).get("ops", [])
    if ops:
        lines += ["", "| op | implementation | median ms | TFLOP/s | peak bytes |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for row in ops:
            tflops = f"{row['tflops']:.0f}" if row.get("tflops") else ""
            lines.append(f"| {row['op']} | {row['implementation']} | {row['median_ms']:.3f} | "
                         f"{tflops} | {row.get('peak_bytes') or ''} |")  # fmt: skip
    return "\n".join(lines) + "\n"


__all__ = ["markdown", "result_word"]
