"""The GPU check's ``pipeline`` part: DualPipeV at PP 4 under NCCL's rules.

On NCCL a device-wide sync inside a step hangs a pipeline of three or more ranks
(`models.runtime.device_sync`); PP 2, all the other parts run, cannot show it. This part:

- always runs the CPU model of NCCL's rules over the project's own schedules at PP 4
  (``tests/test_nccl_model.py``: passes without a sync, deadlocks on a planted one);
- with two GPUs or more, trains at PP = min(4, GPUs) on NCCL, one GPU per rank, with the mid
  preset's real activations (mid-qwen3-moe, hidden 2048, widened to 2 layers per stage,
  one micro-batch of 4096 tokens: 16 MiB a message in bfloat16), 2 PP + 1 micro-batches and
  a tight collective timeout: a hang is a failure, not a wait;
- with fewer, says that the NCCL half is not measured.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.gpu_check_runner import pytest_part, run_part

PIPELINE_PRESET = "mid-qwen3-moe"
PIPELINE_PP = 4
PIPELINE_STEPS = 2
PIPELINE_TIMEOUT_S = 60
"""The steps' collective timeout: a hung pipeline ends within it (exit 3)."""


def pipeline_config(out: Path, pp: int) -> Path:
    """The mid preset with two layers per stage (``2 * 2 * pp``), as a ``config.json``."""
    from models.hf import config_to_hf
    from models.network import preset

    config = preset(PIPELINE_PRESET)
    layers = 4 * pp
    config = config.replace(num_hidden_layers=layers, mlp_only_layers=[])
    path = out / "pipeline" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config_to_hf(config), indent=1))
    return path


def check_pipeline(out: Path, limit_s: float, env: dict, gpus: int) -> dict:
    """The CPU model at PP 4, then PP = min(4, GPUs) on NCCL where two GPUs or more are."""
    share = limit_s / 2 if gpus >= 2 else limit_s
    model = pytest_part(
        ["tests/test_nccl_model.py", "-k", f"pp{PIPELINE_PP}"], share, out, "pipeline-model",
        env,
    )  # fmt: skip
    result = {"model": model, "seconds": model["seconds"], "timed_out": model["timed_out"]}
    if gpus < 2:
        result["nccl"] = {"measured": False, "why": f"not measured: PP >= 2 on NCCL needs one "
                          f"GPU per rank; {gpus} visible"}  # fmt: skip
        result["passed"] = model["passed"]
        return result
    pp = min(PIPELINE_PP, gpus)
    metrics = out / "pipeline" / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    command = [
        sys.executable, "-m", "harness.cli", "train", "--model", str(pipeline_config(out, pp)),
        "--nproc", str(pp), "--pp", str(pp), "--dp", "1", "--ep", "1",
        "--micro-batches", str(2 * pp + 1), "--micro-batch-size", "1", "--seq-len", "4096",
        "--dtype", "bfloat16", "--device", "cuda", "--steps", str(PIPELINE_STEPS),
        "--timeout", str(PIPELINE_TIMEOUT_S), "--metrics-file", str(metrics),
    ]  # fmt: skip
    run = run_part(command, limit_s - share, out / "logs" / "pipeline-nccl.log", env)
    run.update(pp=pp, measured=True, passed=run["exit_code"] == 0)
    if metrics.exists():
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line]
        run["step_seconds"] = [r.get("step_time_s") for r in records]
    result.update(nccl=run, seconds=round(result["seconds"] + run["seconds"], 1))
    result["timed_out"] = result["timed_out"] or run["timed_out"]
    result["passed"] = model["passed"] and run["passed"]
    return result
