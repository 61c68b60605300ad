"""grouped_linear runs no aten op around its GEMMs that torch's own autograd of
`F.grouped_mm` does not run: no copy, no fill, no extra allocation.

On an H100 the op once took 1.96 ms where torch's autograd of ``torch._grouped_mm`` on
the same tensors took 1.05 ms (16 experts x 1024 rows, 2048 -> 2816, bf16), with the
same GEMM kernels: the difference was around them. A weight gradient computed in the
other layout than the weight's was copied by autograd into a fresh weight-sized tensor,
and a mask over the whole output (forward, and the input gradient in backward) zeroed
the rows past ``offsets[-1]``. Every aten op both sides dispatch is recorded here, so
such work cannot come back unnoticed.

The budget: the same data-moving ops (views and other metadata-only ops aside) as torch,
and where rows lie past ``offsets[-1]`` (which `F.grouped_mm` leaves unwritten) one
``zero_`` of those rows each for the output and the input gradient. That ``zero_`` is the
interpreter's way (the end read from host memory through numpy, only the tail sliced and
zeroed); compiled, a Triton kernel zeroes the tail and dispatches no aten op, so on CUDA
the budget is torch's own. The counts are held on a CPU rank (`tests._ranks.on_cpu_rank`)
on every machine, and on the GPU where there is one (``gpu``).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from optimized.ops import WeightGradStore, grouped_linear
from optimized.ops.grouped_linear import launch_zero_tail_rows
from tests._ranks import on_cpu_rank

METADATA_OPS = {"aten::_local_scalar_dense", "aten::lift_fresh"}
"""Ops that move no tensor data (besides views, which `OpOverload.is_view` names)."""
TAIL_ZEROS = Counter({"aten::zero_": 2})
"""What rows past ``offsets[-1]`` add: one ``zero_`` for the output, one for grad x."""


class DataOps(TorchDispatchMode):
    """Counts every dispatched aten op that moves tensor data (no views); keeps the
    strides of each tensor an op returns, to show copies by layout."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if not func.is_view and name not in METADATA_OPS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def make_inputs(rows, ends, transposed, device, dtype=torch.bfloat16, seed=0):
    """Drawn on the CPU (the same values on every device), then moved to ``device``."""
    generator = torch.Generator().manual_seed(seed)
    fan_in, fan_out = 32, 48
    x = torch.randn(rows, fan_in, generator=generator).to(dtype)
    shape = (len(ends), fan_out, fan_in) if transposed else (len(ends), fan_in, fan_out)
    parameter = torch.randn(shape, generator=generator).to(dtype)
    grad_out = torch.randn(rows, fan_out, generator=generator).to(dtype)
    offsets = torch.tensor(ends, dtype=torch.int32)
    return tuple(t.to(device) for t in (x, parameter, offsets, grad_out))


def count(fn, x, parameter, offsets, grad_out, transposed, existing_grad=False):
    """Data-moving ops of ``fn(x, weight, offsets)`` forward and backward, and the grads."""
    x = x.clone().requires_grad_()
    parameter = parameter.clone().requires_grad_()
    if existing_grad:
        parameter.grad = torch.ones_like(parameter)
    with DataOps() as recorder:
        weight = parameter.transpose(1, 2) if transposed else parameter
        fn(x, weight, offsets).backward(grad_out)
    return recorder.ops, x.grad, parameter.grad


def torch_autograd(x, weight, offsets):
    return F.grouped_mm(x, weight, offs=offsets)


def tail_zeros(device: torch.device) -> Counter:
    """What zeroing the rows past the groups dispatches on ``device``: two ``zero_`` on the
    CPU (interpreted, offsets in host memory), nothing on CUDA (a Triton kernel)."""
    return TAIL_ZEROS if device.type == "cpu" else Counter()


CASES = {
    "aligned groups": (256, [64, 64, 192, 256]),  # as the expert-order buffer gives them
    "rows past the groups": (256, [64, 128, 200]),
}


def check_no_op_beyond_torch(case, transposed, existing_grad, device="cpu") -> None:
    device = torch.device(device)
    rows, ends = CASES[case]
    inputs = make_inputs(rows, ends, transposed, device)
    theirs, _, their_grad = count(torch_autograd, *inputs, transposed, existing_grad)
    ours, grad_x, grad_weight = count(grouped_linear, *inputs, transposed, existing_grad)
    budget = theirs + (tail_zeros(device) if ends[-1] < rows else Counter())
    assert ours == budget, f"ours {dict(ours)} vs torch's {dict(theirs)} + tail"
    assert theirs["aten::_grouped_mm"] == 3
    # the gradient autograd keeps is laid out as the parameter is (nothing was copied)
    assert grad_weight.stride() == inputs[1].stride()
    assert torch.equal(grad_weight, their_grad)
    assert torch.equal(grad_x[ends[-1] :], torch.zeros_like(grad_x[ends[-1] :]))


def check_deferred_weight_gradient(transposed, existing_grad, device="cpu") -> None:
    device = torch.device(device)
    x, parameter, offsets, grad_out = make_inputs(256, [64, 64, 192, 256], transposed, device)
    _, _, expected = count(torch_autograd, x, parameter, offsets, grad_out, transposed,
                           existing_grad)  # fmt: skip
    store = WeightGradStore()
    parameter = parameter.clone().requires_grad_()
    if existing_grad:
        parameter.grad = torch.ones_like(parameter)
    weight = parameter.transpose(1, 2) if transposed else parameter
    out = grouped_linear(x.clone().requires_grad_(), weight, offsets, None, store)
    with store.deferring():
        out.backward(grad_out)
    with DataOps() as recorder:
        store.pop()
    expected_ops = Counter({"aten::_grouped_mm": 1})
    if existing_grad:
        expected_ops["aten::add_"] = 1
    assert recorder.ops == expected_ops
    assert parameter.grad.stride() == parameter.stride()
    assert torch.equal(parameter.grad, expected)


TRANSPOSED = pytest.mark.parametrize("transposed", [True, False], ids=["param.transpose", "param"])
EXISTING_GRAD = pytest.mark.parametrize(
    "existing_grad", [False, True], ids=["fresh grad", "accumulated"]
)


@TRANSPOSED
@EXISTING_GRAD
@pytest.mark.parametrize("case", list(CASES))
def test_no_op_beyond_torch_autograd_of_grouped_mm(case, transposed, existing_grad):
    on_cpu_rank(check_no_op_beyond_torch, case, transposed, existing_grad)


@TRANSPOSED
@EXISTING_GRAD
def test_deferred_weight_gradient_adds_nothing(transposed, existing_grad):
    """The W step's closure runs the same GEMM and lands in ``.grad`` without a zeroed
    staging buffer or a copy: as the gradient itself, or added in place."""
    on_cpu_rank(check_deferred_weight_gradient, transposed, existing_grad)


@pytest.mark.gpu
@TRANSPOSED
@EXISTING_GRAD
@pytest.mark.parametrize("case", list(CASES))
def test_no_op_beyond_torch_autograd_of_grouped_mm_on_cuda(
    case, transposed, existing_grad, gpu_device
):
    """The path the H100 measurement was about: compiled, the tail costs no aten op."""
    check_no_op_beyond_torch(case, transposed, existing_grad, gpu_device)


@pytest.mark.gpu
@TRANSPOSED
@EXISTING_GRAD
def test_deferred_weight_gradient_adds_nothing_on_cuda(transposed, existing_grad, gpu_device):
    check_deferred_weight_gradient(transposed, existing_grad, gpu_device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tail_kernel_zeroes_only_the_rows_past_the_groups(dtype, compute_device):
    """The kernel the compiled path uses (compiled on a GPU, interpreted on the CPU): rows
    before ``offsets[-1]`` keep their values bit for bit, the rest become zero."""
    generator = torch.Generator().manual_seed(3)
    for ends, rows in (([5, 5, 17], 40), ([40], 40), ([0, 0], 9)):
        out = torch.randn(rows, 300, generator=generator).to(compute_device, dtype)
        before = out.clone()
        launch_zero_tail_rows(out, torch.tensor(ends, dtype=torch.int32, device=compute_device))
        end = ends[-1]
        assert torch.equal(out[:end], before[:end])
        assert torch.equal(out[end:], torch.zeros_like(out[end:]))
