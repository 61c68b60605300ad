"""The device policy: `models.runtime.resolve_device` chooses once, in the parent; the
launcher hands each rank its device and its Triton mode at spawn."""

from __future__ import annotations

import os

import pytest
import torch

from models.runtime import CudaSupport, DeviceError, DevicePlan, launch, resolve_device

NO_GPU = CudaSupport(0, (), "torch 2.13.0+cpu is a build without CUDA")
ONE_H100 = CudaSupport(1, ("NVIDIA H100 80GB HBM3",))
FOUR_H100 = CudaSupport(4, ("NVIDIA H100 80GB HBM3",) * 4)


def test_cpu_is_always_the_cpu():
    for support in (NO_GPU, ONE_H100, FOUR_H100):
        plan = resolve_device("cpu", 4, support=support)
        assert (plan.kind, plan.note, plan.interpreted) == ("cpu", "", True)
        assert plan.rank_environment() == {"TWINPIPE_DEVICE": "cpu", "TRITON_INTERPRET": "1"}


def test_auto_takes_one_gpu_per_local_rank_when_there_are_enough():
    plan = resolve_device("auto", 4, support=FOUR_H100)
    assert (plan.kind, plan.note, plan.interpreted) == ("cuda", "", False)
    assert plan.rank_environment() == {"TWINPIPE_DEVICE": "cuda", "TRITON_INTERPRET": "0"}
    assert plan.describe() == "cuda (4 x NVIDIA H100 80GB HBM3)"
    assert resolve_device("auto", 1, support=FOUR_H100).gpu_names == ONE_H100.names


def test_auto_runs_on_the_cpu_and_says_so_in_one_line_when_gpus_are_too_few():
    plan = resolve_device("auto", 4, layout="PP 2 x DP 2", support=ONE_H100)
    assert plan.kind == "cpu" and plan.interpreted
    assert "\n" not in plan.note
    for words in ("CPU", "PP 2 x DP 2", "4 local ranks", "1 GPU", "--device cuda"):
        assert words in plan.note, plan.note
    # Without any GPU there is nothing to explain: the CPU is the only choice.
    assert resolve_device("auto", 4, support=NO_GPU) == DevicePlan("cpu", "auto", 4)


def test_cuda_without_a_gpu_is_bad_input_that_says_why_and_what_works():
    with pytest.raises(DeviceError) as error:
        resolve_device("cuda", 1, support=NO_GPU)
    text = str(error.value)
    for words in ("--device cuda", "no usable CUDA device", "without CUDA", "--device cpu"):
        assert words in text, text


def test_cuda_with_fewer_gpus_than_local_ranks_names_ranks_gpus_and_ways_out():
    with pytest.raises(DeviceError) as error:
        resolve_device("cuda", 4, layout="PP 2 x DP 2", support=ONE_H100)
    text = str(error.value)
    for words in ("PP 2 x DP 2", "4 local ranks", "1 GPU", "at most 1 rank", "--device cpu"):
        assert words in text, text


def test_cuda_visible_but_unusable_is_reported_with_torchs_reason():
    broken = CudaSupport(0, (), "CUDA is visible but unusable: CUDA driver version too old")
    with pytest.raises(DeviceError, match="driver version too old"):
        resolve_device("cuda", 1, support=broken)


def test_an_unknown_device_names_the_choices():
    with pytest.raises(DeviceError, match=r"'gpu' is not a device; expected one of auto"):
        resolve_device("gpu", 1, support=ONE_H100)


def test_this_machine_is_described_truthfully():
    """Whatever this machine has: ``auto`` for one rank runs where a GPU is usable."""
    from models.runtime import cuda_support

    support = cuda_support()
    plan = resolve_device("auto", 1, support=support)
    assert plan.kind == ("cuda" if support.gpus else "cpu")
    assert support.gpus == 0 or support.names, support
    assert support.gpus > 0 or support.why_none, support


def _rank_environment():
    import triton  # noqa: F401  (imported in the rank, after the launcher chose its mode)

    from models.runtime import rank_device
    from optimized.ops._triton import INTERPRETED

    return os.environ["TRITON_INTERPRET"], INTERPRETED, str(rank_device())


@pytest.mark.multiprocess
def test_a_cpu_rank_interprets_triton_whatever_the_parent_chose(monkeypatch):
    """The launcher sets each rank's Triton mode at spawn: a parent that compiles (as on a
    GPU machine) still starts CPU ranks with the interpreter, and its own setting is back
    afterwards."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    results = launch(_rank_environment, 2, device="cpu")
    assert results == [("1", True, "cpu")] * 2
    assert os.environ["TRITON_INTERPRET"] == "0"


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="checks a machine without a GPU")
def test_launch_refuses_cuda_on_a_machine_without_one_before_any_rank_starts():
    with pytest.raises(DeviceError, match="--device cuda"):
        launch(_rank_environment, 1, device="cuda")


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="checks a machine without a GPU")
def test_train_with_cuda_on_a_machine_without_one_exits_2_before_any_rank_starts():
    from tests._cli import twinpipe_here

    done = twinpipe_here("train", "--model", "tiny-qwen3-moe", "--steps", "1", "--device", "cuda")
    assert done.returncode == 2, done.stderr
    assert "--device cuda" in done.stderr and "--device cpu" in done.stderr, done.stderr
    assert "rank" not in done.stdout, done.stdout  # no rank ran a step


def test_train_names_the_device_choices():
    from tests._cli import twinpipe_here

    done = twinpipe_here("train", "--model", "tiny-qwen3-moe", "--steps", "1", "--device", "gpu")
    assert done.returncode == 2, done.stderr
    assert "device" in done.stderr and "auto, cpu, cuda" in done.stderr, done.stderr
