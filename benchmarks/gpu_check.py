"""The project's GPU check: everything a GPU session measures, in one run of a few minutes.

Run it on a machine with a CUDA GPU, from the checkout::

    python -m benchmarks.gpu_check --out gpu-check            # every part
    python -m benchmarks.gpu_check --out gpu-check --first-contact

Parts, each a process group of its own with its own time limit (`benchmarks.gpu_check_runner`:
killed whole at its limit, SIGTERM then SIGKILL, and nothing of it left running after it):

1. ``probe``: the kernels' NaN and infinity through their bfloat16 stores, compiled
   (``tests/test_ops_nonfinite.py``): the check a GPU's own NaN bit patterns need;
2. ``tests``: the suite's CUDA tests (``-m gpu``), then the kernel tests compiled on the GPU;
   not the cross-compile tests (``-m cross_compile``: they build for GPUs without one);
3. ``compare``: `twinpipe compare` of mid-qwen3-moe at PP 1 in bfloat16 (the verdict, each
   stack's time per step, the estimate against the CUDA peak for both stacks);
4. ``train``: `twinpipe train` throughput on the mid presets at 4 x 4096 tokens (tokens/s,
   TFLOP/s and MFU from the trainer's own metrics file; steady-state steps only);
5. ``ops``: the op benchmarks at GPU shapes (`benchmarks/`), optimized against plain;
6. ``multi`` (two GPUs or more): `twinpipe compare` at PP 2, and at DP 2 / EP 2 with FSDP2,
   on NCCL: the p2p stream groups, the asynchronous all-to-all, the count exchange, the DP
   reductions;
7. ``pipeline``: DualPipeV at PP 4 under NCCL's rules (`benchmarks.gpu_check_pipeline`): the
   CPU model of them always, and with two GPUs or more a training run at PP min(4, GPUs) with
   the mid preset's activations on NCCL (with one GPU or none the NCCL half is unmeasured).

A pytest part is read from pytest's JUnit file and passes only when at least one test
passed: skipped and error counts, failures and skip reasons go in the table. On a machine
with a GPU every part runs with ``TRITON_INTERPRET=0`` (an inherited ``1`` would make the
CUDA tests skip). The budget of each part is printed at the start; ``--time-scale`` scales
them. After every part ``gpu_check.json`` (everything) and ``gpu_check.md`` (the table for a
closing note) are written again into ``--out``, so a run cut short keeps what it measured;
``--first-contact`` runs the cheapest parts first. Exit 0 when every part run passed.

On an offline GPU machine (`../shared/GPU.md`): unpack the wheels it lacks into a folder on
``PYTHONPATH`` first; nothing here needs the network.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_check_pipeline import check_pipeline
from benchmarks.gpu_check_runner import pytest_part, run_part
from benchmarks.gpu_check_table import markdown, result_word

ROOT = Path(__file__).resolve().parents[1]

PARTS = ("probe", "tests", "compare", "train", "ops", "multi", "pipeline")
BUDGET_S = {"probe": 20, "tests": 110, "compare": 80, "train": 110, "ops": 60, "multi": 60,
            "pipeline": 40}  # fmt: skip
"""Each part's limit on a warm machine (Triton's cache filled), 480 s in all: 8 minutes."""
TEST_SHARE = {"gpu": 0.4, "kernels": 0.6}
KERNEL_TESTS = "not multiprocess and not cross_compile"
"""The kernel tests the ``tests`` part selects: not the cross-compile ones (they build for
GPUs on a machine without one, each with a limit of its own)."""
"""How the ``tests`` part splits its budget between its two pytest runs."""
PROBE_TESTS = ("tests/test_ops_nonfinite.py",)
TRAIN_PRESETS = ("mid-deepseek-v2", "mid-qwen3-moe", "mid-gpt-oss")
TRAIN_STEPS = 6
STEADY_FROM = 3
"""Steps before this one (compilation, the allocator's warm-up) are left out of the rates."""
COMPARE_ARGS = (
    "--model mid-qwen3-moe --pp 1 --dp 1 --ep 1 --micro-batches 4 --micro-batch-size 1 "
    "--seq-len 1024 --steps 2 --dtype bfloat16 --device cuda"
).split()
MULTI_RUNS = {
    "pp2": "--pp 2 --dp 1 --ep 1",
    "dp2-ep2": "--pp 1 --dp 2 --ep 2 --candidate optimized-fsdp",
}
MULTI_ARGS = (
    "--model tiny-qwen3-moe --micro-batches 4 --micro-batch-size 2 --seq-len 128 --steps 2 "
    "--dtype bfloat16 --device cuda"
).split()
TRAIN_ARGS = (
    "--nproc 1 --pp 1 --dp 1 --ep 1 --micro-batches 4 --micro-batch-size 1 --seq-len 4096 "
    f"--dtype bfloat16 --device cuda --steps {TRAIN_STEPS}"
).split()


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


def part_env(gpus: int) -> dict[str, str]:
    """What every part's environment sets: on a machine with a GPU, kernels compiled
    (``TRITON_INTERPRET=0``), whatever the caller's shell exported."""
    return {"TRITON_INTERPRET": "0"} if gpus else {}


def plan_parts(only: list[str] | None, gpus: int) -> tuple[list[str], dict[str, str]]:
    """(the parts to run, the parts left out and why): every part by default, ``multi`` only
    with two GPUs or more; ``--only`` runs what it names (``multi`` then fails on one GPU)."""
    if only:
        return list(only), {}
    if gpus < 2:
        return [p for p in PARTS if p != "multi"], {
            "multi": f"needs 2 GPUs or more; {gpus} visible"
        }
    return list(PARTS), {}


def order(parts: list[str], first_contact: bool) -> list[str]:
    """The parts in the order asked, or with ``first_contact`` the cheapest first."""
    return sorted(parts, key=lambda part: BUDGET_S[part]) if first_contact else list(parts)


def budget_table(parts: list[str], scale: float) -> str:
    rows = [f"  {part:<8} {BUDGET_S[part] * scale:6.0f} s" for part in parts]
    total = sum(BUDGET_S[part] for part in parts) * scale
    return "\n".join(["gpu_check: budget per part (a warm machine):", *rows,
                      f"  {'total':<8} {total:6.0f} s ({total / 60:.1f} min)"])  # fmt: skip


# ----------------------------------------------------------------------------- parts
def check_probe(out: Path, scale: float, env: dict) -> dict:
    return pytest_part(["-rs", *PROBE_TESTS], BUDGET_S["probe"] * scale, out, "probe", env)


def gpu_test_files() -> list[str]:
    """The test files with a test marked ``gpu`` (collecting the whole suite costs time)."""
    return sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").glob("test_*.py")
        if "mark.gpu" in path.read_text()
    )


def kernel_test_files() -> list[str]:
    """The kernel tests (``test_ops_*.py``) the probe has not run."""
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_ops_*.py"))
    return [name for name in files if name not in PROBE_TESTS]


def check_tests(out: Path, scale: float, env: dict) -> dict:
    """The tests that need CUDA (``-m gpu``), then the kernel tests, compiled on the GPU; the
    cross-compile tests (no use on a GPU) are left out."""
    limit = BUDGET_S["tests"] * scale
    gpu = pytest_part(["-m", "gpu", *gpu_test_files()], limit * TEST_SHARE["gpu"], out,
                      "tests-gpu", env)  # fmt: skip
    kernels = pytest_part(
        ["-m", KERNEL_TESTS, *kernel_test_files()],
        limit * TEST_SHARE["kernels"], out, "tests-kernels", env,
    )  # fmt: skip
    return {
        "gpu": gpu,
        "kernels": kernels,
        "seconds": round(gpu["seconds"] + kernels["seconds"], 1),
        "timed_out": gpu["timed_out"] or kernels["timed_out"],
        "passed": gpu["passed"] and kernels["passed"],
    }


def _compare_report(run: dict, folder: Path) -> dict:
    """A compare run judged by its exit code and its report's verdict."""
    report_path = folder / "report.json"
    if not report_path.exists():
        run["passed"] = False
        return run
    report = json.loads(report_path.read_text())
    run["verdict"] = "pass" if report.get("passed") else "fail"
    run["problems"] = report.get("problems", [])[:5]
    run["passed"] = run["exit_code"] == 0 and bool(report.get("passed"))
    run["seconds_per_step"] = {
        side: report["time"][side] for side in ("baseline", "candidate") if side in report["time"]
    }
    run["stacks"] = {"baseline": report.get("baseline"), "candidate": report.get("candidate")}
    run["device"] = report.get("device")
    run["report"] = report
    return run


def check_compare(out: Path, scale: float, env: dict) -> dict:
    folder = out / "compare"
    command = twinpipe("compare", *COMPARE_ARGS, "--out", str(folder))
    run = _compare_report(run_part(command, BUDGET_S["compare"] * scale,
                                   out / "logs" / "compare.log", env), folder)  # fmt: skip
    report = run.pop("report", {})
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
    return run


def check_multi(out: Path, scale: float, env: dict) -> dict:
    """Two compares on NCCL: PP 2 (the p2p stream groups), DP 2 / EP 2 with FSDP2 (the
    asynchronous all-to-all, the count exchange, the DP reductions)."""
    runs = {}
    for name, layout in MULTI_RUNS.items():
        folder = out / f"multi-{name}"
        command = twinpipe("compare", *layout.split(), *MULTI_ARGS, "--out", str(folder))
        run = run_part(command, BUDGET_S["multi"] * scale / len(MULTI_RUNS),
                       out / "logs" / f"multi-{name}.log", env)  # fmt: skip
        runs[name] = _compare_report(run, folder)
        runs[name].pop("report", None)
    return {
        "runs": runs,
        "seconds": round(sum(r["seconds"] for r in runs.values()), 1),
        "timed_out": any(r["timed_out"] for r in runs.values()),
        "passed": all(r["passed"] for r in runs.values()),
    }


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


def check_train(out: Path, scale: float, env: dict) -> dict:
    runs = {}
    for preset in TRAIN_PRESETS:
        metrics = out / f"train-{preset}.jsonl"
        metrics.unlink(missing_ok=True)
        command = twinpipe("train", "--model", preset, *TRAIN_ARGS, "--metrics-file", str(metrics))
        run = run_part(command, BUDGET_S["train"] * scale / len(TRAIN_PRESETS),
                       out / "logs" / f"train-{preset}.log", env)  # fmt: skip
        if metrics.exists():
            run.update(train_rates(metrics))
        run["passed"] = run["exit_code"] == 0
        runs[preset] = run
    return {
        "presets": runs,
        "seconds": round(sum(r["seconds"] for r in runs.values()), 1),
        "timed_out": any(r["timed_out"] for r in runs.values()),
        "passed": all(r["passed"] for r in runs.values()),
    }


def check_ops(out: Path, scale: float, env: dict) -> dict:
    result = out / "ops.json"
    result.unlink(missing_ok=True)
    args = ["benchmarks/", "--gpu-shapes", f"--benchmark-json={result}",
            "--benchmark-max-time=0.2"]  # fmt: skip
    run = pytest_part(args, BUDGET_S["ops"] * scale, out, "ops", env)
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


CHECKS = {
    "probe": check_probe, "tests": check_tests, "compare": check_compare, "train": check_train,
    "ops": check_ops, "multi": check_multi,
    "pipeline": lambda out, scale, env: check_pipeline(
        out, BUDGET_S["pipeline"] * scale, env, len(machine()["gpus"])
    ),
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu-check", help="folder for the JSON and the table")
    parser.add_argument("--only", nargs="+", choices=PARTS, help="these parts, in this order")
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiply every limit")
    parser.add_argument(
        "--first-contact",
        action="store_true",
        help="the cheapest parts first (results are written after each part)",
    )
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
    gpus = len(summary["machine"]["gpus"])
    parts, summary["not_run"] = plan_parts(args.only, gpus)
    parts = order(parts, args.first_contact)
    env = part_env(gpus)
    if gpus and os.environ.get("TRITON_INTERPRET", "0") != "0":
        print("gpu_check: TRITON_INTERPRET=1 in the environment: the parts run with 0 (a GPU "
              "is here; interpreted kernels would skip every CUDA test)", flush=True)  # fmt: skip
    summary.update(order=parts, budget_s={p: BUDGET_S[p] * args.time_scale for p in parts})
    print(budget_table(parts, args.time_scale), flush=True)
    for part in parts:
        print(f"gpu_check: {part} ...", flush=True)
        began = time.monotonic()
        try:
            if part == "multi" and gpus < 2:
                why = f"needs 2 GPUs or more; {gpus} visible"
                summary["parts"][part] = {"passed": False, "seconds": 0, "why": why}
            else:
                summary["parts"][part] = CHECKS[part](out, args.time_scale, env)
        except SystemExit:  # a signal (`cli`): the part's processes are stopped; say so
            summary["parts"][part] = {"passed": False, "why": "stopped by a signal",
                                      "seconds": round(time.monotonic() - began, 1)}  # fmt: skip
            _write(out, summary)
            raise
        _write(out, summary)
        print(f"gpu_check: {part}: {result_word(summary['parts'][part])}", flush=True)
    print(markdown(summary))
    return 0 if all(p.get("passed") for p in summary["parts"].values()) else 1


def _write(out: Path, summary: dict) -> None:
    """Both files, each written whole and then moved into place: a reader (or a run cut
    short) sees the last complete version."""
    for name, text in (("gpu_check.json", json.dumps(summary, indent=1)),
                       ("gpu_check.md", markdown(summary))):  # fmt: skip
        partial = out / f".{name}.partial"
        partial.write_text(text)
        partial.replace(out / name)


def cli() -> int:
    """`main`, stopped cleanly by SIGTERM or SIGINT: the running part's processes are stopped,
    the results so far written, and the exit code is 128 + the signal."""

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)
    return main()


if __name__ == "__main__":
    sys.exit(cli())
