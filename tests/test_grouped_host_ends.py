"""float32 grouped GEMM without host reads: torch's `F.grouped_mm` has no float32 kernel and
loops over the groups with bounds it reads from the device offsets on the host (on a GPU,
one synchronisation per call, six per MoE layer and micro-batch). The MoE layer knows each
group's rows on the host (its split sizes), so the optimized experts run that loop on them
(`models.network.ExpertLayout.ends`): on the CPU that shows as no ``_grouped_mm`` at all in
float32, no host read however many calls, and the same bits as `F.grouped_mm`."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from models.network import SeededWeights, build_part, preset
from models.runtime import HostSyncCounter
from optimized.ops import OptimizedOps, scatter_for_grouped_gemm


class _GroupedCalls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func._overloadpacket.__name__ == "_grouped_mm"
        return func(*args, **(kwargs or {}))


def _experts_and_inputs(dtype: torch.dtype):
    """A tiny GPT-OSS layer's experts (biases: the bias gradient too) and grouped rows."""
    config = preset("tiny-gpt-oss")
    part = build_part(config, SeededWeights(config), layers=[0], embedding=False, head=False,
                      ops=OptimizedOps(), dtype=dtype)  # fmt: skip
    experts = next(m for m in part.modules() if hasattr(m, "gate_up_proj"))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, experts.num_local, (24,), generator=generator)
    tokens = torch.randn(24, config.hidden_size, generator=generator).to(dtype)
    rows = torch.bincount(ids, minlength=experts.num_local).tolist()
    return experts, ids, tokens, rows


def _calls(experts, ids, tokens, rows, host_ends: bool, count: int):
    """``count`` forward and backward calls of the experts on rows grouped as a MoE layer
    groups them, with or without the host's group ends; outputs, gradients, the host reads
    and the ``_grouped_mm`` calls."""
    ops = OptimizedOps()
    outputs = []
    with HostSyncCounter() as counter, _GroupedCalls() as grouped:
        for _ in range(count):
            x = tokens.clone().requires_grad_()
            with counter.counting():
                buffer, layout = scatter_for_grouped_gemm(x, ids, experts.num_local,
                                                          group_rows=rows)  # fmt: skip
                ends = layout.ends if host_ends else None
                out = experts(buffer, layout.offsets, ops, ends)
                out.square().sum().backward()
            grads = [p.grad.clone() for p in experts.parameters()]
            experts.zero_grad(set_to_none=True)
            outputs.append((out.detach(), x.grad, *grads))
    return outputs, counter.events, grouped.calls


@pytest.mark.slow
def test_float32_experts_read_nothing_back_however_many_calls():
    experts, ids, tokens, rows = _experts_and_inputs(torch.float32)
    with_ends, reads, grouped = _calls(experts, ids, tokens, rows, True, 2)
    assert reads == [] and grouped == 0  # the loop ran on the host's ends, every call
    torch_path, _, torch_grouped = _calls(experts, ids, tokens, rows, False, 1)
    assert torch_grouped == 6  # what a GPU would read back from: 3 GEMMs forward, 3 back
    for ours, theirs in zip(with_ends[-1], torch_path[0], strict=True):
        assert torch.equal(ours, theirs)
    # bfloat16 keeps torch's grouped kernel (it reads nothing back).
    experts.to(torch.bfloat16)
    _, reads, grouped = _calls(experts, ids, tokens.bfloat16(), rows, True, 1)
    assert reads == [] and grouped == 6
