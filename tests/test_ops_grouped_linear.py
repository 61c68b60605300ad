"""Grouped linear over F.grouped_mm, and the weight-gradient store, on `compute_device`
(compiled on a GPU, interpreted on the CPU)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from optimized.ops import WeightGradStore, grouped_linear

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    assert torch.isfinite(actual).all()
    return ((actual - expected).norm() / expected.norm().clamp(min=1e-30)).item()


def plain_grouped_linear(x, weight, offsets, bias=None):
    """A loop of per-group matmuls; rows past the last group give zeros."""
    outputs, start = [], 0
    for expert, end in enumerate(offsets.tolist()):
        out = x[start:end] @ weight[expert]
        outputs.append(out if bias is None else out + bias[expert])
        start = end
    outputs.append(x.new_zeros((x.shape[0] - start, weight.shape[-1])))
    return torch.cat(outputs, 0)


def make_case(rows, fan_in, fan_out, ends, dtype, seed, device, transposed=True):
    """Inputs, a parameter [E, out, in] used through its transpose (or [E, in, out]), bias:
    drawn on the CPU (the same values on every device), then moved to ``device``."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, fan_in, generator=generator).to(dtype)
    shape = (len(ends), fan_out, fan_in) if transposed else (len(ends), fan_in, fan_out)
    parameter = (torch.randn(shape, generator=generator) * 0.5).to(dtype)
    bias = torch.randn(len(ends), fan_out, generator=generator).to(dtype)
    grad_out = torch.randn(rows, fan_out, generator=generator).to(dtype)
    offsets = torch.tensor(ends, dtype=torch.int32)
    return tuple(t.to(device) for t in (x, parameter, bias, offsets, grad_out))


def run(fn, x, parameter, bias, offsets, grad_out, transposed, dtype=None, use_bias=True):
    cast = (lambda t: t.to(dtype)) if dtype else (lambda t: t.clone())
    leaves = [cast(t).requires_grad_() for t in (x, parameter, bias)]
    weight = leaves[1].transpose(1, 2) if transposed else leaves[1]
    out = fn(leaves[0], weight, offsets, leaves[2] if use_bias else None)
    out.backward(cast(grad_out))
    return [out] + [leaf.grad for leaf in leaves]


CASES = [
    # rows, in, out, group ends
    (40, 16, 24, [10, 10, 33, 40]),  # an empty group
    (37, 5, 7, [3, 20, 37]),  # odd sizes: strides not 16-byte multiples
    (20, 8, 12, [6, 6, 15]),  # rows past the last group give zeros
    (0, 8, 4, [0, 0]),  # zero rows
    (256, 32, 16, [128, 256]),  # aligned groups as scatter_for_grouped_gemm makes them
]


FLAGS = [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 0)]
"""Pairwise (docs/testing.md, the case table): each case runs with one (bfloat16, transposed,
bias) triple and its complement, so each case meets both values of each, and every pair of
values of two of them meets in some case: 10 runs instead of the product's 40."""
MATRIX = [
    pytest.param(dtype, case, transposed, use_bias,
                 id=f"{case[0]}-{case[1]}-{case[2]}-{str(dtype)[6:]}-t{transposed:d}-b{use_bias:d}")
    for case, flags in zip(CASES, FLAGS, strict=True)
    for bf16, transposed_flag, bias_flag in (flags, tuple(1 - f for f in flags))
    for dtype, transposed, use_bias in [
        ((torch.float32, torch.bfloat16)[bf16], bool(transposed_flag), bool(bias_flag))
    ]
]  # fmt: skip


def test_the_grouped_linear_cases_are_pairwise():
    flags = [(p.values[0] == torch.bfloat16, p.values[2], p.values[3]) for p in MATRIX]
    for i, j in ((0, 1), (0, 2), (1, 2)):
        assert {(f[i], f[j]) for f in flags} == {(a, b) for a in (0, 1) for b in (0, 1)}
    for case in CASES:
        mine = [f for p, f in zip(MATRIX, flags) if p.values[1] == case]
        assert all({f[k] for f in mine} == {0, 1} for k in range(3)), case


@pytest.mark.parametrize(("dtype", "case", "transposed", "use_bias"), MATRIX)
def test_matches_plain_and_float64(dtype, case, transposed, use_bias, compute_device):
    rows, fan_in, fan_out, ends = case
    seed = rows + fan_in
    inputs = make_case(
        rows, fan_in, fan_out, ends, dtype, seed=seed, device=compute_device, transposed=transposed
    )
    got = run(grouped_linear, *inputs, transposed, use_bias=use_bias)
    expected = run(plain_grouped_linear, *inputs, transposed, torch.float64, use_bias)
    plain = run(plain_grouped_linear, *inputs, transposed, use_bias=use_bias)
    names = ["output", "grad x", "grad weight", "grad bias"]
    for name, actual, ref, same_dtype in zip(names, got, expected, plain):
        if actual is None or ref is None:
            assert actual is None and ref is None, name
            continue
        assert actual.shape == ref.shape, name
        if ref.numel() == 0 or ref.norm() == 0:
            assert torch.equal(actual, torch.zeros_like(actual)), name
            continue
        assert rel_error(actual, ref) <= TOLERANCE[dtype], name
        assert rel_error(actual, same_dtype) <= TOLERANCE[dtype], name


def deferred_backward(store, device, transposed=True):
    x, parameter, bias, offsets, grad_out = make_case(
        30, 8, 12, [7, 7, 30], torch.float32, seed=50, device=device, transposed=transposed
    )
    x = x.requires_grad_()
    parameter = parameter.requires_grad_()
    bias = bias.requires_grad_()
    weight = parameter.transpose(1, 2) if transposed else parameter
    with store.deferring():
        grouped_linear(x, weight, offsets, bias, store).backward(grad_out)
    ref = run(
        plain_grouped_linear,
        x.detach(),
        parameter.detach(),
        bias.detach(),
        offsets,
        grad_out,
        transposed,
        torch.float64,
    )
    return x, parameter, bias, ref


@pytest.mark.parametrize("transposed", [True, False])
def test_store_defers_the_weight_gradient_until_pop(transposed, compute_device):
    store = WeightGradStore()
    x, parameter, bias, ref = deferred_backward(store, compute_device, transposed)
    assert parameter.grad is None  # absent after backward
    assert rel_error(x.grad, ref[1]) <= 1e-5  # the input gradient came at once
    assert rel_error(bias.grad, ref[3]) <= 1e-5  # and so did the bias gradient
    assert len(store) == 1
    store.pop()
    assert rel_error(parameter.grad, ref[2]) <= 1e-5  # exact after pop
    store.assert_empty()


def test_the_backward_decides_whether_to_defer(compute_device):
    """A schedule enables the store around a zero-bubble backward, not around the forward
    (which ran long before): the weight gradient waits for the pop all the same."""
    store = WeightGradStore()
    x, parameter, bias, offsets, grad_out = make_case(
        30, 8, 12, [7, 7, 30], torch.float32, seed=50, device=compute_device, transposed=True
    )
    parameter.requires_grad_()
    out = grouped_linear(x, parameter.transpose(1, 2), offsets, None, store)
    with store.deferring():
        out.backward(grad_out)
    assert parameter.grad is None and len(store) == 1
    store.pop()
    whole = parameter.detach().clone().requires_grad_()
    grouped_linear(x, whole.transpose(1, 2), offsets).backward(grad_out)
    assert torch.equal(parameter.grad, whole.grad)


def test_deferred_work_keeps_no_autograd_history(compute_device):
    """The W closure holds the input's values only. Holding the saved input itself would
    keep its grad_fn, and through it the stage's leaves and their gradients, alive until
    the W step (in the pipeline: ~0.6 MB per deferred layer on the tiny presets, seen by
    the memory tracker before this was fixed)."""
    store = WeightGradStore()
    x, parameter, _, offsets, grad_out = make_case(
        30, 8, 12, [7, 7, 30], torch.float32, seed=52, device=compute_device, transposed=True
    )
    parameter.requires_grad_()
    source = x.clone().requires_grad_()
    out = grouped_linear(source * 1.0, parameter.transpose(1, 2), offsets, None, store)
    with store.deferring():
        out.backward(grad_out)
    assert source.grad is not None and len(store) == 1
    grad_of_source = weakref.ref(source.grad)
    del out, source
    gc.collect()
    assert grad_of_source() is None, "the deferred work keeps the stage's graph alive"
    store.pop()
    assert parameter.grad is not None


def test_deferred_gradient_accumulates_into_an_existing_grad(compute_device):
    store = WeightGradStore()
    _, parameter, _, ref = deferred_backward(store, compute_device)
    parameter.grad = torch.ones_like(parameter)
    store.pop()
    assert rel_error(parameter.grad - 1, ref[2]) <= 1e-5


def test_disabled_store_computes_at_once(compute_device):
    store = WeightGradStore(enabled=False)
    x, parameter, _, offsets, grad_out = make_case(
        20, 8, 4, [5, 20], torch.float32, seed=51, device=compute_device
    )
    parameter.requires_grad_()
    grouped_linear(x, parameter.transpose(1, 2), offsets, None, store).backward(grad_out)
    assert parameter.grad is not None
    store.assert_empty()


def test_unpopped_store_is_an_error_at_step_end(compute_device):
    store = WeightGradStore()
    deferred_backward(store, compute_device)
    deferred_backward(store, compute_device)
    store.pop()
    with pytest.raises(RuntimeError, match="1 closed group"):
        store.assert_empty()
    store.pop()
    store.put(lambda: None)  # put but never flushed
    with pytest.raises(RuntimeError, match="1 closure"):
        store.assert_empty()


def test_pop_without_a_group_is_an_error():
    with pytest.raises(RuntimeError, match="no closed group"):
        WeightGradStore().pop()


def test_groups_pop_oldest_first_and_empty_groups_count():
    store = WeightGradStore()
    order = []
    store.put(lambda: order.append("first"))
    store.flush()
    store.flush()  # a deferred backward with no grouped linear still makes a group
    store.put(lambda: order.append("third"))
    store.flush()
    assert len(store) == 3
    for _ in range(3):
        store.pop()
    assert order == ["first", "third"]
    store.assert_empty()


def test_store_needs_a_parameter_behind_the_weight(compute_device):
    store = WeightGradStore(enabled=True)
    parameter = torch.randn(2, 4, 4, device=compute_device, requires_grad=True)
    x = torch.randn(8, 4, device=compute_device)
    offsets = torch.tensor([4, 8], device=compute_device)
    with pytest.raises(ValueError, match="parameter or a view of one"):
        grouped_linear(x, parameter * 2, offsets, None, store)


def test_bad_shapes_are_named(compute_device):
    x = torch.randn(8, 4, device=compute_device)
    weight = torch.randn(2, 4, 4, device=compute_device)
    with pytest.raises(ValueError, match="offsets must be"):
        grouped_linear(x, weight, torch.tensor([8], device=compute_device))
    with pytest.raises(ValueError, match="bias must be"):
        grouped_linear(
            x, weight, torch.tensor([4, 8], device=compute_device),
            torch.randn(2, 3, device=compute_device),
        )  # fmt: skip
