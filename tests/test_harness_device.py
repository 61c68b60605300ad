"""The harness's device: ``--device`` on compare and bench resolved once before any rank
starts, what the ranks ran on and with (the report's ``device``: TF32 off, bfloat16
products), ``diff`` refusing to compare a CPU figure with a GPU one, bisect in a rank, the
CUDA tracker's workspaces, and ``bench --profile``.

Runs that must not see a GPU hide them (``CUDA_VISIBLE_DEVICES=""``), so each test means
the same on a machine with GPUs."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from harness.memory.cuda import with_workspaces, workspaces_at_peak
from harness.report import cpu_name
from tests._cli import ROOT, twinpipe, twinpipe_here

DATA = ROOT / "tests" / "data"
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}
TINY = ["--model", "tiny-qwen3-moe", "--micro-batch-size", "1", "--seq-len", "16", "--steps",
        "1"]  # fmt: skip


@pytest.mark.slow
def test_compare_device_cuda_without_a_gpu_exits_2_before_any_rank(tmp_path):
    out = tmp_path / "report.json"
    result = twinpipe("compare", "--device", "cuda", "--json", str(out), **NO_GPU)
    assert result.returncode == 2, result.stderr
    assert "--device cuda: this machine has no usable CUDA device" in result.stderr
    assert "--device cpu" in result.stderr  # the way out
    assert "launching" not in result.stderr and not out.exists()


@pytest.mark.slow
def test_bench_device_cuda_without_a_gpu_exits_2_before_running(tmp_path):
    history = tmp_path / "history"
    sample = str(DATA / "bench_sample")
    result = twinpipe("bench", "--device", "cuda", "--benchmarks", sample, "--history",
                      str(history), **NO_GPU)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "--device cuda: this machine has no usable CUDA device" in result.stderr
    assert "pytest" not in result.stdout and not history.exists()


def test_a_device_that_is_none_of_the_choices_exits_2_naming_them(tmp_path, capsys):
    from harness.cli import main

    message = "--device: 'gpu' is not a device; expected one of auto, cuda, cpu"
    assert main(["compare", "--device", "gpu", "--json", str(tmp_path / "r.json")]) == 2
    assert message in capsys.readouterr().err
    assert main(["bench", "--device", "gpu", "--history", str(tmp_path / "history")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "history").exists() and not (tmp_path / "r.json").exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_auto_runs_on_the_cpu_here_and_the_report_says_what_the_ranks_ran_with(tmp_path):
    """``auto`` without a GPU: CPU ranks; the report names the device, its versions, TF32
    off as each rank set it, and bfloat16 products as float32 products where asked."""
    out = tmp_path / "out"
    result = twinpipe(
        "compare", *TINY, "--pp", "1", "--dp", "2", "--ep", "2", "--micro-batches", "2",
        "--dtype", "bfloat16", "--noise-floor", "off", "--ops-audit", "off", "--out", str(out),
        TWINPIPE_CPU_BF16_GEMM="float32", **NO_GPU,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "launching 2 ranks on cpu" in result.stderr
    device = json.loads((out / "report.json").read_text())["device"]
    assert device["type"] == "cpu" and device["name"] == cpu_name()
    assert device["requested"] == "auto"
    assert device["torch"] == torch.__version__ and device["cuda"] == torch.version.cuda
    assert device["triton"]
    # The parent process keeps torch's defaults (cuDNN's TF32 is on); the ranks turned it off.
    assert torch.backends.cudnn.allow_tf32
    assert device["tf32"] is False and device["float32_matmul_precision"] == "highest"
    assert device["float32_products"] is True
    assert "TWINPIPE_CPU_BF16_GEMM=float32" in device["float32_products_why"]
    note = "note: bfloat16 products computed as float32 products rounded once"
    assert note in result.stdout
    markdown = (out / "report.md").read_text()
    assert f"- device: `cpu ({cpu_name()}), torch {torch.__version__}" in markdown
    assert f"- {note}" in markdown
    ranks = json.loads((out / "report.json").read_text())["memory"]["ranks"]
    assert all(rank[side]["workspaces"] == 0 for rank in ranks for side in ("baseline",
               "candidate"))  # fmt: skip


@pytest.mark.slow
@pytest.mark.multiprocess
def test_bisect_runs_in_a_rank_and_finds_a_bug_planted_there(tmp_path):
    """The planted bug lives in the ranks: bisected in the parent, every stage agreed."""
    out = tmp_path / "report.json"
    result = twinpipe(
        "compare", *TINY, "--pp", "2", "--dp", "1", "--ep", "1", "--micro-batches", "4",
        "--plant", "cross-entropy-grad-1.01", "--bisect", "--no-memory", "--json", str(out),
        "--device", "cpu",
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    found = json.loads(out.read_text())["bisect"]
    assert found is not None, result.stderr
    assert (found["layer"], found["stage"], found["direction"]) == ("loss", "loss", "backward")
    assert 0.009 < found["rel_error"] < 0.011  # the 1% planted in the gradient
    assert "first divergence: loss, stage loss, backward" in result.stderr


def _gpu_report(report: dict) -> dict:
    gpu = copy.deepcopy(report)
    gpu["device"] = {"type": "cuda", "name": "NVIDIA H100 80GB HBM3", "torch": "2.11.0",
                     "triton": "3.6.0", "cuda": "13.0"}  # fmt: skip
    return gpu


def test_diff_refuses_a_cpu_report_against_a_cuda_one(tmp_path):
    old = DATA / "compare_report.json"  # written before reports named their device: a CPU's
    new = tmp_path / "gpu.json"
    new.write_text(json.dumps(_gpu_report(json.loads(old.read_text()))))
    result = twinpipe_here("diff", str(old), str(new))
    assert result.returncode == 2, result.stderr
    assert "measured on cpu and the new one on cuda (NVIDIA H100 80GB HBM3)" in result.stderr
    assert "not comparable" in result.stderr


def test_diff_compares_reports_and_benchmarks_of_one_device(tmp_path, capsys):
    from harness.cli import main

    report = json.loads((DATA / "compare_report.json").read_text())
    cpu = {**report, "device": {"type": "cpu", "name": "AMD EPYC"}}
    (tmp_path / "cpu.json").write_text(json.dumps(cpu))
    assert main(["diff", str(DATA / "compare_report.json"), str(tmp_path / "cpu.json")]) == 0
    gpu = _gpu_report(report)
    (tmp_path / "a.json").write_text(json.dumps(gpu))
    (tmp_path / "b.json").write_text(json.dumps(gpu))
    assert main(["diff", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    capsys.readouterr()

    def benchmarks(device: str) -> dict:
        bench = {"name": "test_ce[optimized]", "group": "ce", "stats": {"median": 0.01},
                 "extra_info": {"device": device, "peak_memory_bytes": 1024}}  # fmt: skip
        return {"benchmarks": [bench]}

    for name, device in (("cpu", "cpu"), ("gpu", "cuda:0"), ("gpu2", "cuda")):
        (tmp_path / f"bench-{name}.json").write_text(json.dumps(benchmarks(device)))
    assert main(["diff", str(tmp_path / "bench-gpu.json"), str(tmp_path / "bench-gpu2.json")]) == 0
    assert main(["diff", str(tmp_path / "bench-cpu.json"), str(tmp_path / "bench-gpu.json")]) == 2
    assert "measured on cpu and the new one on cuda" in capsys.readouterr().err


def test_cuda_workspaces_are_named_apart_from_activations():
    """What the CUDA backend does with the cuBLAS workspaces it measured (the measuring needs
    a GPU; `tests/test_memory_tracker.py` runs the backend there)."""
    # Held at the end, allocated during the step: in the peak as far as the step rose.
    assert workspaces_at_peak(held=32 << 20, peak=100 << 20, start=10 << 20) == 32 << 20
    assert workspaces_at_peak(held=32 << 20, peak=(10 << 20) + 5, start=10 << 20) == 5
    assert workspaces_at_peak(held=32 << 20, peak=10 << 20, start=10 << 20) == 0
    breakdown = {"parameters": 10, "gradients": 0, "optimizer_state": 0, "activations": 50,
                 "total": 100}  # fmt: skip
    split = with_workspaces(breakdown, 32)
    assert split["workspaces"] == 32 and split["activations"] == 18 and split["total"] == 100
    assert with_workspaces(breakdown, 80)["activations"] == 0  # never below zero


@pytest.mark.slow
def test_bench_profile_writes_a_trace_and_a_top_ops_table(tmp_path):
    profile = tmp_path / "profile"
    sample, history = str(DATA / "bench_sample"), str(tmp_path / "history")
    result = twinpipe("bench", "--benchmarks", sample, "--history", history, "--profile",
                      str(profile), "--device", "cpu")  # fmt: skip
    assert result.returncode == 0, result.stderr
    trace = json.loads((profile / "bench.trace.json").read_text())
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert any(name.endswith("test_softmax[optimized]") for name in names)  # each benchmark
    assert any(name.startswith("aten::") for name in names)
    table = (profile / "bench.top_ops.md").read_text()
    assert "## Host ops by self CPU time" in table and "| `aten::" in table


def test_bench_profile_into_a_file_exits_2_before_any_work(tmp_path, capsys):
    from harness.cli import main

    taken = tmp_path / "file"
    taken.write_text("")
    history = tmp_path / "history"
    args = ["bench", "--benchmarks", str(DATA / "bench_sample"), "--history", str(history)]
    assert main([*args, "--profile", str(taken)]) == 2
    assert "--profile" in capsys.readouterr().err and not history.exists()
    assert main([*args, "--profile", str(tmp_path / "p"), "--add-report", "x.json"]) == 2
    assert "--add-report runs nothing" in capsys.readouterr().err


def test_every_stack_builds_on_the_ranks_device():
    """Each side's constructor takes ``device=``, so no stack is held to the CPU under
    ``--device cuda`` (`harness.compare.stacks.device_problem` names one that would be)."""
    from harness.compare.stacks import STACKS, device_problem, takes_device

    assert all(takes_device(name) for name in STACKS), STACKS
    assert device_problem(tuple(STACKS), "cuda") is None
