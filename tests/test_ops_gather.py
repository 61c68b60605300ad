"""Padded index gather and scatter-add rows against index_select / index_add."""

from __future__ import annotations

import pytest
import torch

from optimized.ops import GATHER_ROW_ALIGNMENT, padded_index_gather, scatter_add_rows

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    assert torch.isfinite(actual).all()
    return ((actual - expected).norm() / expected.norm().clamp(min=1e-30)).item()


def saved_tensors_of(fn):
    """Run ``fn`` and return every tensor autograd saved for backward while it ran."""
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn()
    return out, saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 300, 1024, 1500])
def test_gather_matches_index_select_forward_and_backward(dtype, rows):
    generator = torch.Generator().manual_seed(rows)
    source = torch.randn(200, 13, generator=generator).to(dtype)
    index = torch.randint(0, 200, (rows,), generator=generator)  # with repeats
    grad_out = torch.randn(rows, 13, generator=generator).to(dtype)

    x = source.clone().requires_grad_()
    out, saved = saved_tensors_of(lambda: padded_index_gather(x, index))
    out.backward(grad_out)

    plain_x = source.clone().requires_grad_()
    plain_x.index_select(0, index).backward(grad_out)
    x64 = source.double().requires_grad_()
    x64.index_select(0, index).backward(grad_out.double())

    assert torch.equal(out, source.index_select(0, index))
    assert rel_error(x.grad, x64.grad) <= TOLERANCE[dtype]
    assert rel_error(x.grad, plain_x.grad) <= TOLERANCE[dtype]
    # Only the index is saved, never the input.
    assert len(saved) == 1 and saved[0] is index
    # The storage behind the view is the padded buffer, with zero tail rows.
    padded_rows = -(-rows // GATHER_ROW_ALIGNMENT) * GATHER_ROW_ALIGNMENT
    assert out.untyped_storage().nbytes() == padded_rows * 13 * out.element_size()
    buffer = torch.empty(0, dtype=dtype).set_(out.untyped_storage()).view(padded_rows, 13)
    assert torch.equal(buffer[:rows], out)
    assert torch.equal(buffer[rows:], torch.zeros_like(buffer[rows:]))


def test_same_buffer_size_across_micro_batches():
    x = torch.randn(50, 4)
    sizes = {
        padded_index_gather(x, torch.randint(0, 50, (n,))).untyped_storage().nbytes()
        for n in (100, 517, 1000, 1024)
    }
    assert sizes == {GATHER_ROW_ALIGNMENT * 4 * 4}


def test_custom_alignment_and_empty_index():
    x = torch.randn(10, 3, requires_grad=True)
    out = padded_index_gather(x, torch.tensor([4, 4, 9]), alignment=8)
    assert out.untyped_storage().nbytes() == 8 * 3 * 4
    empty = padded_index_gather(x, torch.zeros(0, dtype=torch.long))
    assert empty.shape == (0, 3)
    (out.sum() + empty.sum()).backward()
    expected = torch.zeros(10, 3)
    expected[4] = 2
    expected[9] = 1
    assert torch.equal(x.grad, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_add_rows_matches_index_add(dtype):
    generator = torch.Generator().manual_seed(30)
    source = torch.randn(77, 9, generator=generator).to(dtype)
    index = torch.randint(0, 20, (77,), generator=generator)
    grad_out = torch.randn(20, 9, generator=generator).to(dtype)

    src = source.clone().requires_grad_()
    out, saved = saved_tensors_of(lambda: scatter_add_rows(src, index, 20))
    out.backward(grad_out)
    src64 = source.double().requires_grad_()
    ref = src64.new_zeros(20, 9).index_add(0, index, src64)
    ref.backward(grad_out.double())

    assert rel_error(out, ref) <= TOLERANCE[dtype]
    assert rel_error(src.grad, src64.grad) <= TOLERANCE[dtype]
    assert len(saved) == 1 and saved[0] is index


def test_bad_index_is_named():
    with pytest.raises(ValueError, match="index must be"):
        padded_index_gather(torch.randn(3, 2), torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="index has"):
        scatter_add_rows(torch.randn(3, 2), torch.tensor([0, 1]), 4)
