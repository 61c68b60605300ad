"""A tiny benchmark suite shaped like benchmarks/: an op and its plain counterpart per group.

Used by tests/test_bench_dashboard.py through `twinpipe bench --benchmarks`.
"""

import pytest
import torch


def _softmax_fused(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=-1)


def _softmax_plain(x: torch.Tensor) -> torch.Tensor:
    shifted = x - x.max(dim=-1, keepdim=True).values
    exp = shifted.exp()
    return exp / exp.sum(dim=-1, keepdim=True)


@pytest.mark.benchmark(group="softmax")
@pytest.mark.parametrize("impl", ["optimized", "plain"])
def test_softmax(benchmark, impl):
    x = torch.randn(64, 128)
    fn = _softmax_fused if impl == "optimized" else _softmax_plain
    out = benchmark.pedantic(fn, args=(x,), rounds=3, iterations=1, warmup_rounds=0)
    benchmark.extra_info["impl"] = impl
    benchmark.extra_info["peak_bytes"] = (
        out.numel() * out.element_size() * (1 if impl == "optimized" else 3)
    )
    assert torch.allclose(out.sum(-1), torch.ones(64))
