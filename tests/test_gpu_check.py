"""The GPU check's plumbing, on a machine without a GPU (`benchmarks/gpu_check.py`,
`benchmarks/gpu_check_runner.py`): each part runs in a process group of its own and leaves
nothing running, at its limit or after it; a pytest part is judged from pytest's JUnit file
and fails when no test passed; the budget adds to at most 8 minutes and is printed first;
the results are written after every part, so a run cut short keeps them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check
from benchmarks.gpu_check_runner import group_members, pytest_part, run_part
from benchmarks.gpu_check_table import markdown

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = pytest.mark.skipif(torch.cuda.device_count() > 0, reason="checks a machine without a GPU")
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
"""A process that ignores SIGTERM: only SIGKILL stops it."""


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting to be reaped is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _spawner(then: str) -> list[str]:
    """A command that starts a stubborn grandchild, prints its pid, then runs ``then``."""
    code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"child = subprocess.Popen([sys.executable, '-c', {STUBBORN!r}])\n"
        "print(child.pid, flush=True)\n" + then
    )
    return [sys.executable, "-c", code]


def test_a_timed_out_part_leaves_no_process_behind(tmp_path):
    """The part and its grandchild both ignore SIGTERM: at the limit the group gets SIGTERM,
    then SIGKILL; nothing of it runs afterwards."""
    run = run_part(_spawner("time.sleep(600)"), 10, tmp_path / "part.log", grace_s=1)
    assert run["timed_out"] and run["exit_code"] is None
    grandchild = int(Path(run["log"]).read_text().split()[0])
    assert grandchild in run["killed"], run
    assert not _running(grandchild)


def test_a_part_that_ends_with_a_grandchild_running_has_it_stopped(tmp_path):
    run = run_part(_spawner("sys.exit(0)"), 60, tmp_path / "part.log", grace_s=1)
    assert run["exit_code"] == 0 and not run["timed_out"]
    grandchild = int(run["tail"].split()[0])
    assert run["left_running"] == [grandchild]
    assert not _running(grandchild)


def test_the_stop_finds_every_member_of_a_group():
    assert group_members(os.getpgrp())  # this very process, at least
    assert group_members(2**22 + 12345) == []  # no such group


def _pytest_file(folder: Path, body: str) -> Path:
    path = folder / "test_sample.py"
    path.write_text("import pytest\n\n" + body)
    return path


def test_a_pytest_part_is_read_from_its_junit_file(tmp_path):
    tests = _pytest_file(tmp_path, (
        "def test_one(): pass\n\ndef test_two(): pass\n\ndef test_breaks(): assert 1 == 2\n\n"
        "@pytest.mark.skip(reason='needs a CUDA GPU')\ndef test_a(): pass\n\n"
        "@pytest.mark.skip(reason='needs a CUDA GPU')\ndef test_b(): pass\n"
    ))  # fmt: skip
    run = pytest_part([str(tests)], 120, tmp_path, "sample")
    summary = run["junit"]
    assert (summary["passed"], summary["failed"], summary["skipped"]) == (2, 1, 2), summary
    assert summary["skip_reasons"] == [["needs a CUDA GPU", 2]]
    assert any(name.endswith("::test_breaks") for name in summary["failed_tests"])
    assert run["exit_code"] == 1 and not run["passed"]


def test_a_part_whose_tests_all_skip_fails_and_says_why(tmp_path):
    """pytest exits 0 when every test skips (as every CUDA test does when the kernels are
    interpreted): the part fails all the same, with the reasons in the table."""
    tests = _pytest_file(tmp_path, (
        "@pytest.mark.skip(reason='interpreted: CPU tensors only')\ndef test_a(): pass\n\n"
        "@pytest.mark.skip(reason='interpreted: CPU tensors only')\ndef test_b(): pass\n"
    ))  # fmt: skip
    run = pytest_part([str(tests)], 120, tmp_path, "probe")
    assert run["exit_code"] == 0 and not run["passed"]
    assert run["why"] == "no test passed (all 2 skipped)"
    summary = {"machine": gpu_check.machine(), "parts": {"probe": run}, "budget_s": {"probe": 20}}
    table = markdown(summary)
    assert "| probe | FAIL (no test passed (all 2 skipped)) |" in table, table
    assert "0 passed, 0 failed, 0 errors, 2 skipped" in table
    assert "- probe: skipped 2 x: interpreted: CPU tensors only" in table


def test_an_inherited_interpreter_is_switched_off_where_a_gpu_is(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert gpu_check.part_env(0) == {}
    show = [sys.executable, "-c", "import os; print(os.environ['TRITON_INTERPRET'])"]
    run = run_part(show, 60, tmp_path / "env.log", gpu_check.part_env(1))
    assert run["tail"].strip() == "0"


def test_the_budget_adds_to_at_most_8_minutes_and_is_printed_first(tmp_path, capsys):
    assert set(gpu_check.BUDGET_S) == set(gpu_check.PARTS)
    assert sum(gpu_check.BUDGET_S.values()) <= 8 * 60
    table = gpu_check.budget_table(list(gpu_check.PARTS), 1.0)
    assert table.splitlines()[-1].split() == ["total", "480", "s", "(8.0", "min)"]
    gpu_check.main(["--out", str(tmp_path), "--only", "multi"])
    printed = capsys.readouterr().out
    assert printed.startswith("gpu_check: budget per part")


def test_the_cheapest_parts_come_first_on_first_contact():
    first = gpu_check.order(list(gpu_check.PARTS), first_contact=True)
    budgets = [gpu_check.BUDGET_S[part] for part in first]
    assert first[0] == "probe" and budgets == sorted(budgets)
    assert gpu_check.order(["compare", "probe"], first_contact=False) == ["compare", "probe"]


def test_multi_runs_with_two_gpus_only():
    parts, not_run = gpu_check.plan_parts(None, 1)
    assert "multi" not in parts and "needs 2 GPUs or more; 1 visible" in not_run["multi"]
    assert gpu_check.plan_parts(None, 2) == (list(gpu_check.PARTS), {})
    layouts = list(gpu_check.MULTI_RUNS.values())
    assert any("--pp 2" in x for x in layouts) and any("--dp 2 --ep 2" in x for x in layouts)
    assert "--device" in gpu_check.MULTI_ARGS and "cuda" in gpu_check.MULTI_ARGS


@NO_GPU
def test_multi_asked_for_on_one_gpu_or_none_fails_saying_why(tmp_path):
    assert gpu_check.main(["--out", str(tmp_path), "--only", "multi"]) == 1
    multi = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]["multi"]
    assert not multi["passed"] and multi["why"] == "needs 2 GPUs or more; 0 visible"


@pytest.mark.slow
def test_the_tests_part_leaves_out_the_cross_compile_tests():
    """The compile-only tests are marked and the part's selection deselects every one of
    them (pytest's own collection says so)."""
    files = ["tests/test_ops_compile.py", "tests/test_ops_offsets.py"]
    assert set(files) <= set(gpu_check.kernel_test_files())
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-m", gpu_check.KERNEL_TESTS, *files],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert collected.returncode == 5, collected.stdout[-2000:]  # 5: nothing selected
    assert "deselected" in collected.stdout
    assert "tests/test_ops_nonfinite.py" not in gpu_check.kernel_test_files()  # the probe's


@NO_GPU
def test_a_part_that_cannot_run_is_recorded_and_the_table_is_written(tmp_path):
    code = gpu_check.main(["--out", str(tmp_path), "--only", "compare"])
    assert code == 1
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    compare = summary["parts"]["compare"]
    assert compare["exit_code"] == 2 and not compare["passed"] and not compare["timed_out"]
    assert "no usable CUDA device" in compare["tail"], compare["tail"]
    assert summary["machine"]["torch"] == torch.__version__
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| compare mid-qwen3-moe PP1 bf16 | FAIL |" in table, table
    assert "no GPU" in table


@NO_GPU
@pytest.mark.slow
def test_a_run_cut_short_keeps_what_it_measured(tmp_path):
    """SIGTERM while the second part runs: the first part's results are on disk, the second
    is recorded as stopped, and nothing of it runs on."""
    check = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.gpu_check", "--out", str(tmp_path), "--only",
         "compare", "probe"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    written = tmp_path / "gpu_check.json"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and check.poll() is None:
        if written.exists() and "compare" in json.loads(written.read_text())["parts"]:
            break
        time.sleep(0.2)
    assert check.poll() is None, "the check ended before it could be cut short"
    time.sleep(1)  # the probe's pytest is starting
    check.send_signal(signal.SIGTERM)
    assert check.wait(timeout=120) == 128 + signal.SIGTERM
    parts = json.loads(written.read_text())["parts"]
    assert parts["compare"]["exit_code"] == 2 and parts["probe"]["why"] == "stopped by a signal"
    assert "| compare mid-qwen3-moe PP1 bf16 | FAIL |" in (tmp_path / "gpu_check.md").read_text()
    junit = str(tmp_path / "probe.junit.xml")
    left = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
            if _running(pid) and junit in _cmdline(pid)]  # fmt: skip
    assert not left


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_an_unwritable_output_folder_is_bad_input(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert gpu_check.main(["--out", str(blocker / "sub"), "--only", "compare"]) == 2


def test_benchmark_rows_and_train_rates(tmp_path):
    document = {
        "benchmarks": [
            {
                "group": "attention",
                "name": "test_attention[optimized]",
                "stats": {"median": 0.0032},
                "extra_info": {"op": "attention", "implementation": "optimized",
                               "tflops_per_s": 152.0, "peak_bytes": 1024},
            }
        ]
    }  # fmt: skip
    rows = gpu_check.summarize_benchmarks(document)
    assert rows == [{"op": "attention", "implementation": "optimized", "shape": None,
                     "median_ms": 3.2, "tflops": 152.0, "peak_bytes": 1024,
                     "logits_multiple": None}]  # fmt: skip
    metrics = tmp_path / "m.jsonl"
    records = [
        {"step": s, "tokens_per_second": 1000.0 * s, "tflops": 100.0 + s, "mfu": None,
         "peak_memory_bytes": 10 * s}
        for s in range(1, 6)
    ]  # fmt: skip
    metrics.write_text("\n".join(json.dumps(r) for r in records))
    rates = gpu_check.train_rates(metrics)
    assert rates["steps_measured"] == [3, 4, 5]
    assert rates["tokens_per_second"] == 4000.0 and rates["tflops"] == 104.0
    assert rates["mfu"] is None and rates["peak_memory_bytes"] == 50


def test_the_pipeline_part_widens_the_mid_preset_to_two_layers_per_stage(tmp_path):
    from benchmarks.gpu_check_pipeline import pipeline_config  # noqa: PLC0415
    from models.hf import resolve_model  # noqa: PLC0415

    config = resolve_model(str(pipeline_config(tmp_path, 4)))
    assert (config.num_hidden_layers, config.hidden_size) == (16, 2048)
    assert all(config.is_moe_layer(i) for i in range(16))


@pytest.mark.slow
def test_the_pipeline_part_runs_the_cpu_model_at_pp4_without_a_gpu(tmp_path):
    """No GPU: the CPU model of NCCL's rules at PP 4 runs (and passes), the NCCL half is
    said to be unmeasured."""
    from benchmarks.gpu_check_pipeline import check_pipeline  # noqa: PLC0415

    result = check_pipeline(tmp_path, 300, {}, gpus=0)
    assert result["passed"] and result["model"]["junit"]["passed"] == 1, result
    assert result["nccl"] == {
        "measured": False,
        "why": "not measured: PP >= 2 on NCCL needs one GPU per rank; 0 visible",
    }
    table = markdown({"machine": gpu_check.machine(), "parts": {"pipeline": result}})
    assert "| pipeline on NCCL | not measured: PP >= 2 on NCCL" in table
    assert "| pipeline: CPU model of NCCL's rules, PP 4 | pass |" in table
