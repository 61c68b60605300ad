"""Deterministic mode (`models.runtime.determinism`) and the device policy's reductions, on
the CPU: the sort-and-segment-sum path gives the default path's bits in float32 (both add
each index's rows in row order), twice the same bits, and the flag reaches every op that
sums over repeated indices (the optimized gather and scatter, the GPT-OSS bias gradient,
the reference's scatter). On a GPU the default path adds with atomics; what the mode costs
there is not yet measured (docs/gpus.md)."""

from __future__ import annotations

import argparse

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness.compare import cli
from harness.compare.arithmetic import device_section, exact_float32, float32_settings
from models.runtime import deterministic, deterministic_mode, index_add
from optimized.ops import grouped_linear, padded_index_gather, scatter_add_rows
from reference.ops import ReferenceOps


class _Ops(TorchDispatchMode):
    """The aten ops run inside, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _case(seed: int = 0, rows: int = 300, width: int = 24, targets: int = 37):
    generator = torch.Generator().manual_seed(seed)
    src = torch.randn(rows, width, generator=generator)
    index = torch.randint(0, targets, (rows,), generator=generator)
    return src, index, targets + 3  # some rows receive nothing


def test_sorted_sums_are_the_default_bits_in_float32_and_the_same_twice():
    src, index, rows = _case()
    out = torch.zeros(rows, src.shape[1])
    default = index_add(out, index, src)
    with deterministic_mode():
        assert deterministic() and torch.are_deterministic_algorithms_enabled()
        first, second = index_add(out, index, src), index_add(out, index, src)
    assert not deterministic() and not torch.are_deterministic_algorithms_enabled()
    assert torch.equal(first, default) and torch.equal(second, first)
    # bfloat16: both add in float32 and round once.
    bf16 = index_add(out.bfloat16(), index, src.bfloat16())
    with deterministic_mode():
        assert torch.equal(index_add(out.bfloat16(), index, src.bfloat16()), bf16)


@pytest.mark.parametrize("where", ["optimized gather and scatter", "gpt-oss bias", "reference"])
def test_the_flag_reaches_every_repeated_index_sum(where):
    src, index, rows = _case(seed=1)

    def run():
        x = src.clone().requires_grad_()
        if where == "optimized gather and scatter":
            table = torch.randn(rows, src.shape[1], generator=torch.Generator().manual_seed(2))
            table.requires_grad_()
            out = scatter_add_rows(x, index, rows) + padded_index_gather(table, index).sum()
            out.square().sum().backward()
            return out, x.grad, table.grad
        if where == "gpt-oss bias":
            ends = torch.tensor([100, 180, 300], dtype=torch.int32)
            weight = torch.randn(3, src.shape[1], 8, generator=torch.Generator().manual_seed(3))
            bias = torch.zeros(3, 8, requires_grad=True)
            out = grouped_linear(x, weight, ends, bias)
            out.square().sum().backward()
            return out, x.grad, bias.grad
        out = ReferenceOps().scatter_add_rows(x, index, rows)
        out.square().sum().backward()
        return out, x.grad

    with _Ops() as plain:
        default = run()
    with deterministic_mode(), _Ops() as sorted_:
        first = run()
        second = run()
    assert "segment_reduce" in sorted_.names and "segment_reduce" not in plain.names
    # No float sum over repeated indices is left to index_add_ (the counts it still adds
    # are integers: exact in any order).
    assert "index_add" in plain.names or "index_add_" in plain.names
    for a, b, c in zip(default, first, second, strict=True):
        assert torch.equal(a, b) and torch.equal(b, c), where


def test_the_policy_turns_bf16_reductions_off_with_tf32_and_reports_them():
    matmul = torch.backends.cuda.matmul
    before = (matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
              torch.get_float32_matmul_precision(),
              matmul.allow_bf16_reduced_precision_reduction,
              matmul.allow_fp16_reduced_precision_reduction)  # fmt: skip
    try:
        matmul.allow_bf16_reduced_precision_reduction = True  # torch's default
        settings = exact_float32()
        assert matmul.allow_bf16_reduced_precision_reduction is False
        assert settings == float32_settings()
        assert settings["bf16_reduced_precision_reduction"] is False
        assert settings["fp16_reduced_precision_reduction"] is False
        assert settings["cuda_matmul_tf32"] is False and settings["cudnn_tf32"] is False
        section = device_section(torch.device("cpu"), torch.bfloat16, settings)
        assert section["bf16_reduced_precision_reduction"] is False and section["tf32"] is False
    finally:
        matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before[0], before[1]
        torch.set_float32_matmul_precision(before[2])
        matmul.allow_bf16_reduced_precision_reduction = before[3]
        matmul.allow_fp16_reduced_precision_reduction = before[4]


@pytest.mark.parametrize("flag,expected", [("auto", False), ("on", True), ("off", False)])
def test_compare_is_deterministic_on_cuda_by_default_and_as_asked(flag, expected):
    """On this machine's CPU ranks ``auto`` leaves it off (CUDA turns it on)."""
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--deterministic", flag])
    plan, device = cli._plan(args)
    assert device.kind == "cpu" and plan.deterministic is expected
