"""Wide offsets and CUDA's grid limits, proved without a GPU and without allocating a tensor.

Past 2^31 elements, 32-bit address arithmetic wraps to a wrong address: attention's
``rows * row_stride`` at 262 144 tokens of 8192-wide rows, the loss's ``cols * stride_col``
on logits stored column by column. `tests/_kernel_offsets.py` drives every op on meta tensors
at such shapes, binds each launch as a GPU launch would (strides below 2^31 as ``i32``, the
worst case), lowers it to Triton's IR for sm_90 and reads the integer width of every
operation a stride reaches; it also records each launch's grid. A kernel written there with a
32-bit row offset shows the check finds one. A shape no grid can hold is refused, before
anything is allocated, with an error naming it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from optimized.ops import flash_attention
from optimized.ops.attention_blocks import MAX_PROGRAMS, attention_grid, check_shape

ROOT = Path(__file__).resolve().parents[1]
CUDA_AXIS_LIMITS = (2**31 - 1, 65_535, 65_535)
"""The most programs a CUDA grid holds on its x, y and z axes."""

pytestmark = [pytest.mark.cross_compile, pytest.mark.slow]


@pytest.fixture(scope="module")
def lowered() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_kernel_offsets.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout)


def _ours(lowered: dict) -> list[dict]:
    return [launch for launch in lowered["launches"] if launch["kernel"] in lowered["kernels"]]


@pytest.mark.slow
def test_every_kernel_forms_its_addresses_in_64_bits(lowered):
    launches = _ours(lowered)
    assert {launch["kernel"] for launch in launches} == set(lowered["kernels"])
    assert len(lowered["kernels"]) >= 11
    # The shapes are wide, and their row strides arrive as 32-bit integers: only the kernels'
    # own arithmetic keeps the offsets whole.
    wide = {launch["shape"] for launch in launches}
    assert any("262144 x 8192-wide rows" in shape for shape in wide), wide
    strides = {(launch["kernel"].split(":")[1], name): kind for launch in launches
               for name, kind in launch["strides"].items()}  # fmt: skip
    assert strides[("attention_forward_kernel", "stride_qs")] == "i32"
    assert strides[("_row_grad_kernel", "stride_col")] == "i32"
    narrow = {f"{launch['kernel']} ({launch['shape']})": launch["narrow"]
              for launch in launches if launch["narrow"]}  # fmt: skip
    assert not narrow, json.dumps(narrow, indent=1)


@pytest.mark.slow
def test_the_check_finds_a_32_bit_row_offset(lowered):
    (launch,) = [x for x in lowered["launches"] if x["kernel"] == "narrow_row_kernel"]
    assert "narrow_row_kernel: arith.muli of ['%stride_row'] as i32" in launch["narrow"]


@pytest.mark.slow
def test_no_launch_passes_a_cuda_grid_limit(lowered):
    """Every grid, at 2^20 batch x head pairs too (a two-axis attention grid put them on an
    axis of 65 535 at most), within CUDA's limits on every axis."""
    launches = _ours(lowered)
    many = [x for x in launches if "2^20 batch x head pairs" in x["shape"]]
    assert {x["kernel"].split(":")[1] for x in many} >= {
        "attention_forward_kernel", "attention_backward_kv_kernel", "attention_backward_q_kernel"
    }  # fmt: skip
    assert max(x["grid"][0] for x in many) >= 2**20
    for launch in launches:
        grid = launch["grid"]
        assert 1 <= len(grid) <= 3, launch
        assert all(n <= limit for n, limit in zip(grid, CUDA_AXIS_LIMITS)), launch


def test_the_attention_grid_holds_any_batch_x_heads_up_to_its_one_axis():
    assert attention_grid(4096, 128, 2**20) == (32 * 2**20,)
    assert attention_grid(1, 16, MAX_PROGRAMS) == (MAX_PROGRAMS,)
    with pytest.raises(
        ValueError,
        match=r"1024 tokens in blocks of 16 rows for 2147483647 "
        r"programs .* at most 2147483647 \(2\^31 - 1\)",
    ):
        attention_grid(1024, 16, MAX_PROGRAMS)


def test_a_shape_out_of_reach_is_refused_before_anything_is_allocated():
    """Meta tensors (no storage): the refusal comes from the argument checks, naming the
    shape and the limit."""
    batch, heads, seq, width = 2**16, 64, 2**16, 64
    q = torch.empty(batch, heads, seq, width, dtype=torch.bfloat16, device="meta")
    k = torch.empty(batch, 8, seq, width, dtype=torch.bfloat16, device="meta")
    with pytest.raises(
        ValueError,
        match=r"batch 65536 x 64 heads x 65536 tokens is out of "
        r"reach: .* 2147483647 programs \(2\^31 - 1\)",
    ):
        flash_attention(q, k, k, width**-0.5)
    check_shape(2**13, 64, 2**15)  # 2^30 programs of 16 rows: within reach, no error
