"""OptimizedOps is a drop-in for ReferenceOps: same values and gradients in float32, on
`compute_device` (compiled on a GPU, interpreted on the CPU); the all-to-all on gloo ranks."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

from models.network import Ops
from models.runtime import launch
from optimized.ops import OptimizedOps, WeightGradStore
from reference.ops import ReferenceOps

TOLERANCE = 1e-5
REFERENCE = ReferenceOps()


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    assert torch.isfinite(actual).all()
    return ((actual - expected).norm() / expected.norm().clamp(min=1e-30)).item()


def random(*shape, seed, device="cpu"):
    """Drawn on the CPU (the same values on every device), then moved to ``device``."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)


def leaves(*tensors):
    return [t.clone().requires_grad_() for t in tensors]


def assert_close(actual, expected):
    assert actual.shape == expected.shape
    assert rel_error(actual, expected) <= TOLERANCE


def test_implements_every_protocol_method_with_its_signature():
    protocol_methods = [
        name for name, value in vars(Ops).items() if callable(value) and not name.startswith("_")
    ]
    assert len(protocol_methods) == 10
    # Recomputation is the optimized default, per ops object (`--recompute off` turns it off).
    assert OptimizedOps().recompute_attention is True and REFERENCE.recompute_attention is False
    assert OptimizedOps(recompute_attention=False).recompute_attention is False
    for name in protocol_methods:
        expected = list(inspect.signature(getattr(Ops, name)).parameters)
        assert list(inspect.signature(getattr(OptimizedOps, name)).parameters) == expected, name


@pytest.mark.parametrize(
    "heads,kv_heads,qk_dim,v_dim,window,sinks",
    [
        (4, 4, 24, 16, None, False),  # MLA: values narrower than queries
        (4, 2, 16, 16, None, False),  # GQA
        (4, 2, 16, 16, 8, False),  # sliding window shorter than the sequence
        (4, 2, 16, 16, 8, True),  # GPT-OSS sinks: the virtual key, banded window
        (2, 2, 8, 12, None, False),  # values wider than queries
    ],
)
def test_attention_matches_plain_attention(
    heads, kv_heads, qk_dim, v_dim, window, sinks, compute_device
):
    batch, seq, device = 2, 24, compute_device
    q = random(batch, heads, seq, qk_dim, seed=1, device=device)
    k = random(batch, kv_heads, seq, qk_dim, seed=2, device=device)
    v = random(batch, kv_heads, seq, v_dim, seed=3, device=device)
    sink = random(heads, seed=4, device=device) if sinks else None
    grad = random(batch, seq, heads * v_dim, seed=5, device=device)
    results = []
    for ops in (REFERENCE, OptimizedOps()):
        inputs = leaves(q, k, v) + (leaves(sink) if sinks else [])
        out = ops.attention(*inputs[:3], 0.3, window, inputs[3] if sinks else None)
        out.backward(grad)
        results.append([out] + [t.grad for t in inputs])
    for actual, expected in zip(results[1], results[0]):
        assert_close(actual, expected)


def test_attention_saves_no_square_probabilities(compute_device):
    # 48 tokens: the output [B, S, heads * 16] is not square either.
    q, k, v = leaves(
        random(2, 4, 48, 24, seed=1, device=compute_device),
        random(2, 4, 48, 24, seed=2, device=compute_device),
        random(2, 4, 48, 16, seed=3, device=compute_device),
    )
    shapes = []

    def pack(tensor):
        shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        OptimizedOps().attention(q, k, v, 0.2)
    assert shapes and all(shape[-2:] != (48, 48) for shape in shapes), shapes


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_cross_entropy_on_lm_head_output(reduction, compute_device):
    hidden = random(24, 16, seed=1, device=compute_device)
    weight = random(500, 16, seed=2, device=compute_device)
    target = torch.randint(0, 500, (24,), generator=torch.Generator().manual_seed(3))
    target[::5] = -100
    target = target.to(compute_device)
    results = []
    for ops in (REFERENCE, OptimizedOps()):
        h, w = leaves(hidden, weight)
        loss = ops.cross_entropy(h @ w.t(), target, reduction=reduction)
        loss.backward()
        results.append((loss, h.grad, w.grad))
    assert results[1][0].dtype == torch.float32
    for actual, expected in zip(results[1], results[0]):
        assert_close(actual, expected)


def test_gather_rows_and_scatter_add_rows(compute_device):
    source = random(40, 12, seed=4, device=compute_device)
    index = torch.randint(0, 40, (90,), generator=torch.Generator().manual_seed(5))
    index = index.to(compute_device)
    weights = random(90, 12, seed=6, device=compute_device)
    results = []
    for ops in (REFERENCE, OptimizedOps()):
        (x,) = leaves(source)
        gathered = ops.gather_rows(x, index)
        scattered = ops.scatter_add_rows(gathered * weights, index, 40)
        (scattered * scattered).sum().backward()
        results.append((gathered, scattered, x.grad))
    for actual, expected in zip(results[1], results[0]):
        assert_close(actual, expected)


@pytest.mark.parametrize("use_bias", [False, True])
def test_grouped_linear_with_transposed_parameter(use_bias, compute_device):
    device = compute_device
    x_source = random(50, 20, seed=7, device=device)
    parameter_source = random(3, 12, 20, seed=8, device=device)
    bias_source = random(3, 12, seed=9, device=device)
    grad_out = random(50, 12, seed=10, device=device)
    # an empty group, and rows past the end
    offsets = torch.tensor([17, 17, 45], dtype=torch.int32, device=device)
    results = []
    for ops in (REFERENCE, OptimizedOps()):
        x, parameter, bias = leaves(x_source, parameter_source, bias_source)
        out = ops.grouped_linear(x, parameter.transpose(1, 2), offsets, bias if use_bias else None)
        out.backward(grad_out)
        results.append((out, x.grad, parameter.grad) + ((bias.grad,) if use_bias else ()))
    for actual, expected in zip(results[1], results[0]):
        assert_close(actual, expected)


@pytest.mark.parametrize("activation", ["silu_and_mul", "clamped_swiglu"])
def test_activations(activation, compute_device):
    source = random(30, 2 * 24, seed=11, device=compute_device) * 4
    grad_out = random(30, 24, seed=12, device=compute_device)
    results = []
    for ops in (REFERENCE, OptimizedOps()):
        (x,) = leaves(source)
        if activation == "silu_and_mul":
            out = ops.silu_and_mul(x)
        else:
            out = ops.clamped_swiglu(x, 1.702, 7.0)
        out.backward(grad_out)
        results.append((out, x.grad))
    for actual, expected in zip(results[1], results[0]):
        assert_close(actual, expected)


def expert_mlp(ops, tokens, expert_ids, up, up_bias, down, num_experts, activation):
    """Dispatch-to-combine as a model layer does it, through the ops seam only."""
    grouped, layout = ops.to_expert_order(tokens, expert_ids, num_experts)
    hidden = ops.grouped_linear(grouped, up.transpose(1, 2), layout.offsets, up_bias)
    if activation == "silu_and_mul":
        hidden = ops.silu_and_mul(hidden)
    else:
        hidden = ops.clamped_swiglu(hidden, 1.702, 7.0)
    out = ops.grouped_linear(hidden, down, layout.offsets)
    return ops.from_expert_order(out, layout), layout


@pytest.mark.parametrize("activation", ["silu_and_mul", "clamped_swiglu"])
@pytest.mark.parametrize("with_store", [False, True])
def test_expert_order_and_grouped_mlp_chain(activation, with_store, compute_device):
    num_experts, rows, hidden_size, inner = 5, 70, 12, 10
    device = compute_device
    generator = torch.Generator().manual_seed(13)
    expert_ids = torch.randint(0, num_experts - 1, (rows,), generator=generator)  # last empty
    expert_ids = expert_ids.to(device)
    sources = [
        random(rows, hidden_size, seed=14, device=device),
        random(num_experts, 2 * inner, hidden_size, seed=15, device=device) * 0.4,  # [E, out, in]
        random(num_experts, 2 * inner, seed=16, device=device),
        random(num_experts, inner, hidden_size, seed=17, device=device) * 0.4,  # [E, in, out]
    ]
    grad_out = random(rows, hidden_size, seed=18, device=device)
    store = WeightGradStore() if with_store else None
    results, layouts = [], []
    for ops in (REFERENCE, OptimizedOps(weight_grad_store=store)):
        tokens, up, up_bias, down = leaves(*sources)
        if store is not None and isinstance(ops, OptimizedOps):
            with store.deferring():
                out, layout = expert_mlp(
                    ops, tokens, expert_ids, up, up_bias, down, num_experts, activation
                )
                out.backward(grad_out)
            assert up.grad is None and down.grad is None
            store.pop()
            store.assert_empty()
        else:
            out, layout = expert_mlp(
                ops, tokens, expert_ids, up, up_bias, down, num_experts, activation
            )
            out.backward(grad_out)
        layouts.append(layout)
        results.append((out, tokens.grad, up.grad, up_bias.grad, down.grad))
    for actual, expected in zip(results[1], results[0]):
        assert_close(actual, expected)
    reference_layout, optimized_layout = layouts
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    counts = torch.diff(reference_layout.offsets.to(device), prepend=zero)
    padded = torch.diff(optimized_layout.offsets.to(device), prepend=zero)
    assert torch.all(padded % 128 == 0) and torch.all((padded >= counts) & (padded - counts < 128))


def test_all_to_all_is_the_identity_without_a_group():
    x = random(6, 4, seed=19)
    assert OptimizedOps().all_to_all(x, [6], [6], None) is x


def _all_to_all_case() -> bool:
    """One rank of two (`models.runtime.launch` made the gloo group): both stacks' all-to-all
    of the same rows, forward and backward, equal bit for bit."""
    rank = dist.get_rank()
    input_splits = [[1, 3], [2, 0]][rank]  # uneven, with an empty split
    output_splits = [[1, 2], [3, 0]][rank]
    source = random(sum(input_splits), 5, seed=20 + rank)
    grad_out = random(sum(output_splits), 5, seed=30 + rank)
    outs = []
    for ops in (REFERENCE, OptimizedOps()):
        (x,) = leaves(source)
        out = ops.all_to_all(x, output_splits, input_splits, dist.group.WORLD)
        out.backward(grad_out)
        outs.append((out.detach(), x.grad))
    return all(torch.equal(actual, expected) for actual, expected in zip(outs[1], outs[0]))


@pytest.mark.multiprocess
def test_all_to_all_over_two_gloo_ranks():
    """Two ranks from the rank server (a fork of a process that has imported the stacks;
    `mp.spawn` imported torch afresh in each)."""
    assert launch(_all_to_all_case, 2) == [True, True]
