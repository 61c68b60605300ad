"""The project's GPU check: everything a GPU session measures, in one run of a few minutes.

Run it on a machine with a CUDA GPU, from the checkout::

    python -m benchmarks.gpu_check --out gpu-check

It runs, each in its own process with its own time limit (so one hang costs one part):

1. ``tests``: the suite's CUDA tests (``-m gpu``) and the kernel tests, compiled on the GPU;
2. ``compare``: `twinpipe compare` of mid-qwen3-moe at PP1 in bfloat16 (the verdict, each
   stack's time per step, the estimate against the CUDA peak for both stacks);
3. ``train``: `twinpipe train` throughput on the mid presets at 4 x 4096 tokens (tokens/s,
   TFLOP/s and MFU from the trainer's own metrics file; steady-state steps only);
4. ``ops``: the op benchmarks at GPU shapes (`benchmarks/`), optimized against plain.

and writes ``gpu_check.json`` (everything, machine-readable) and ``gpu_check.md`` (the
table for a closing note) into ``--out``. ``--only`` picks parts; each part's limit can be
scaled with ``--time-scale``. A part that fails or runs out of time is recorded as such, with
the tail of its output, and the others still run. Exit 0 when every part ran and passed.

On an offline GPU machine (`../shared/GPU.md`): unpack the wheels it lacks into a folder on
``PYTHONPATH`` first; nothing here needs the network.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

PARTS = ("tests", "compare", "train", "ops")
LIMITS_S = {"tests": 100, "compare": 120, "train": 60, "ops": 110}
"""Each part's limit (train: each preset); 8 minutes in all on one H100."""
TRAIN_PRESETS = ("mid-deepseek-v2", "mid-qwen3-moe", "mid-gpt-oss")
TRAIN_STEPS = 6
STEADY_FROM = 3
"""Steps before this one (compilation, the allocator's warm-up) are left out of the rates."""
COMPARE_ARGS = (
    "--model mid-qwen3-moe --pp 1 --dp 1 --ep 1 --micro-batches 4 --micro-batch-size 1 "
    "--seq-len 1024 --steps 2 --dtype bfloat16 --device cuda"
).split()
TRAIN_ARGS = (
    "--nproc 1 --pp 1 --dp 1 --ep 1 --micro-batches 4 --micro-batch-size 1 --seq-len 4096 "
    f"--dtype bfloat16 --device cuda --steps {TRAIN_STEPS}"
).split()


def _run(command: list[str], limit_s: float, env: dict[str, str] | None = None) -> dict:
    """``command`` to completion or its limit: exit code, seconds, the output's tail."""
    start = time.monotonic()
    try:
        done = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=limit_s,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )  # fmt: skip
        code, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        code = None
        out = (expired.stdout or b"").decode(errors="replace") + (expired.stderr or b"").decode(
            errors="replace"
        )
    return {
        "command": " ".join(command),
        "exit_code": code,
        "timed_out": code is None,
        "seconds": round(time.monotonic() - start, 1),
        "tail": out[-3000:],
    }


def twinpipe(*args: str) -> list[str]:
    return [sys.executable, "-m", "harness.cli", *args]


def machine() -> dict[str, Any]:
    import torch
    import triton

    from models.runtime import cuda_support

    support = cuda_support()
    return {
        "gpus": list(support.names),
        "why_no_gpu": support.why_none,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def check_tests(out: Path, scale: float) -> dict:
    """The tests that need CUDA (``-m gpu``), then the kernel tests, compiled on the GPU."""
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE"]
    kernels = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_ops_*.py"))
    gpu = _run([*pytest, "-m", "gpu", "tests"], LIMITS_S["tests"] * scale / 2)
    ops = _run([*pytest, "-m", "not multiprocess", *kernels], LIMITS_S["tests"] * scale / 2)
    summaries = []
    for run in (gpu, ops):
        last = [line for line in run["tail"].splitlines() if " passed" in line or " failed" in line]
        summaries.append(last[-1].strip() if last else "no summary")
    return {
        "gpu": gpu,
        "kernels": ops,
        "seconds": round(gpu["seconds"] + ops["seconds"], 1),
        "timed_out": gpu["timed_out"] or ops["timed_out"],
        "summary": f"-m gpu: {summaries[0]}; kernel tests: {summaries[1]}",
        "passed": gpu["exit_code"] == 0 and ops["exit_code"] == 0,
    }


def check_compare(out: Path, scale: float) -> dict:
    folder = out / "compare"
    run = _run(
        twinpipe("compare", *COMPARE_ARGS, "--out", str(folder)), LIMITS_S["compare"] * scale
    )
    report_path = folder / "report.json"
    if not report_path.exists():
        run["passed"] = False
        return run
    report = json.loads(report_path.read_text())
    run["verdict"] = "pass" if report.get("passed") else "fail"
    run["passed"] = run["exit_code"] == 0 and bool(report.get("passed"))
    run["seconds_per_step"] = {
        side: report["time"][side] for side in ("baseline", "candidate") if side in report["time"]
    }
    run["stacks"] = {"baseline": report.get("baseline"), "candidate": report.get("candidate")}
    estimates = {}
    for rank in report.get("memory", {}).get("ranks", []):
        for side in ("baseline", "candidate"):
            figures = rank.get(side) or {}
            estimate = figures.get("estimate") or {}
            estimates[f"rank {rank['rank']} {side}"] = {
                "measured_bytes": figures.get("total"),
                "estimated_bytes": estimate.get("peak_bytes"),
                "error": estimate.get("error"),
            }
    run["estimates"] = estimates
    run["device"] = report.get("device")
    return run


def train_rates(metrics: Path) -> dict:
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steady = [r for r in records if r.get("step", 0) >= STEADY_FROM] or records
    if not steady:
        return {}

    def mean(key: str) -> float | None:
        values = [r[key] for r in steady if r.get(key) is not None]
        return sum(values) / len(values) if values else None

    return {
        "steps_measured": [r.get("step") for r in steady],
        "tokens_per_second": mean("tokens_per_second"),
        "tflops": mean("tflops"),
        "mfu": mean("mfu"),
        "peak_memory_bytes": max(r.get("peak_memory_bytes", 0) for r in records),
    }


def check_train(out: Path, scale: float) -> dict:
    runs = {}
    for preset in TRAIN_PRESETS:
        metrics = out / f"train-{preset}.jsonl"
        metrics.unlink(missing_ok=True)
        command = twinpipe("train", "--model", preset, *TRAIN_ARGS, "--metrics-file", str(metrics))
        run = _run(command, LIMITS_S["train"] * scale)
        if metrics.exists():
            run.update(train_rates(metrics))
        run["passed"] = run["exit_code"] == 0
        runs[preset] = run
    return {"presets": runs, "passed": all(r["passed"] for r in runs.values())}


def check_ops(out: Path, scale: float) -> dict:
    result = out / "ops.json"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "benchmarks/"]
    command += ["--gpu-shapes", f"--benchmark-json={result}", "--benchmark-max-time=0.2"]
    run = _run(command, LIMITS_S["ops"] * scale)
    run["passed"] = run["exit_code"] == 0
    if result.exists():
        run["ops"] = summarize_benchmarks(json.loads(result.read_text()))
    return run


def summarize_benchmarks(document: dict) -> list[dict]:
    """One row per benchmark: op, implementation, median ms, TFLOP/s and peak memory."""
    rows = []
    for bench in document.get("benchmarks", []):
        info = bench.get("extra_info", {})
        rows.append({
            "op": info.get("op", bench.get("group")),
            "implementation": info.get("implementation", bench.get("name")),
            "shape": info.get("shape"),
            "median_ms": bench["stats"]["median"] * 1e3,
            "tflops": info.get("tflops_per_s"),
            "peak_bytes": info.get("peak_bytes"),
            "logits_multiple": info.get("logits_multiple"),
        })  # fmt: skip
    return rows


def markdown(summary: dict) -> str:
    """The table a closing note quotes."""
    m = summary["machine"]
    lines = [
        f"# twinpipe GPU check ({m['date']})",
        "",
        f"{', '.join(m['gpus']) or 'no GPU: ' + m['why_no_gpu']}; torch {m['torch']}, CUDA "
        f"{m['cuda']}, Triton {m['triton']}, Python {m['python']}, {m['cpus']} CPUs",
        "",
        "| part | result | seconds | figures |",
        "|---|---|---|---|",
    ]
    parts = summary["parts"]
    if "tests" in parts:
        t = parts["tests"]
        lines.append(_row("tests", t, t.get("summary", "")))
    if "compare" in parts:
        c = parts["compare"]
        per_step = ", ".join(
            f"{side} {', '.join(f'{s:.2f}' for s in times)} s"
            for side, times in c.get("seconds_per_step", {}).items()
        )
        errors = ", ".join(
            f"{name} {e['error'] * 100:+.2f}%"
            for name, e in c.get("estimates", {}).items()
            if e.get("error") is not None
        )
        figures = f"verdict {c.get('verdict', '-')}; per step: {per_step}; estimate: {errors}"
        lines.append(_row("compare mid-qwen3-moe PP1 bf16", c, figures))
    if "train" in parts:
        for preset, r in parts["train"]["presets"].items():
            figures = "; ".join(
                text
                for text in (
                    _figure(r, "tokens_per_second", "{:,.0f} tokens/s"),
                    _figure(r, "tflops", "{:.0f} TFLOP/s"),
                    _figure(r, "mfu", "MFU {:.1%}"),
                    _figure(r, "peak_memory_bytes", "peak {:.2e} B"),
                )
                if text
            )
            lines.append(_row(f"train {preset} 4x4096 bf16", r, figures))
    if "ops" in parts:
        o = parts["ops"]
        lines.append(_row("ops", o, f"{len(o.get('ops', []))} benchmarks"))
        lines += [
            "",
            "| op | implementation | median ms | TFLOP/s | peak bytes |",
            "|---|---|---|---|---|",
        ]
        for row in o.get("ops", []):
            tflops = f"{row['tflops']:.0f}" if row.get("tflops") else ""
            lines.append(
                f"| {row['op']} | {row['implementation']} | {row['median_ms']:.3f} | {tflops} "
                f"| {row.get('peak_bytes') or ''} |"
            )
    return "\n".join(lines) + "\n"


def _row(name: str, part: dict, figures: str) -> str:
    return f"| {name} | {_result(part)} | {part.get('seconds', '')} | {figures} |"


def _result(part: dict) -> str:
    if part.get("timed_out"):
        return "timed out"
    return "pass" if part.get("passed") else "FAIL"


def _figure(record: dict, key: str, form: str) -> str:
    return form.format(record[key]) if record.get(key) is not None else ""


CHECKS = {"tests": check_tests, "compare": check_compare, "train": check_train, "ops": check_ops}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu-check", help="folder for the JSON and the table")
    parser.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiply every limit")
    args = parser.parse_args(argv)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / ".write-check").write_text("")
        (out / ".write-check").unlink()
    except OSError as error:
        print(f"gpu_check: --out {out}: cannot write there ({error})", file=sys.stderr)
        return 2
    summary: dict[str, Any] = {"machine": machine(), "parts": {}}
    for part in args.only:
        print(f"gpu_check: {part} ...", flush=True)
        summary["parts"][part] = CHECKS[part](out, args.time_scale)
        (out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
        print(f"gpu_check: {part}: {_result(summary['parts'][part])}", flush=True)
    table = markdown(summary)
    (out / "gpu_check.md").write_text(table)
    print(table)
    return 0 if all(p.get("passed") for p in summary["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
