"""Every Triton kernel in `optimized.ops` compiles for sm_80 and sm_90, with no GPU here.

No GPU is lent to this project, so the compiled path of the kernels would otherwise never
be built: the CPU runs them through the interpreter, which accepts things the compiler
rejects (and the reverse). `tests/_kernel_compile.py` discovers the ``@triton.jit``
kernels from the source, records the launches the public ops make with their GPU launch
parameters, and compiles each distinct signature with ``triton.compile`` for both targets
(triton ships its own ptxas), all in one subprocess with the interpreter off. Compiled
kernels land in Triton's cache, so a second run only re-checks them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._kernel_compile import jit_function_names

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"sm_80", "sm_90"}

pytestmark = [pytest.mark.cross_compile, pytest.mark.slow]


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, without its warning
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_kernel_compile.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout)


def test_every_kernel_compiles_for_sm80_and_sm90(compiled):
    kernels = compiled["kernels"]
    for name in (
        "cross_entropy_kernels:_row_stats_kernel",
        "cross_entropy_kernels:_row_grad_kernel",
        "grouped_linear:_zero_tail_rows_kernel",
    ):
        assert f"optimized.ops.{name}" in kernels
    assert len(kernels) >= 11  # and the four activation and four attention kernels today
    failures = [entry for entry in compiled["compiled"] if "cubin_bytes" not in entry]
    assert not failures, "\n\n".join(f"{e['kernel']} {e['target']}: {e['error']}" for e in failures)
    for kernel in kernels:
        entries = [e for e in compiled["compiled"] if e["kernel"] == kernel]
        assert entries, f"{kernel} is never launched by the ops driven in _kernel_compile.py"
        assert {e["target"] for e in entries} == TARGETS
        assert all(e["cubin_bytes"] > 0 for e in entries)
        # every training dtype reaches every kernel
        pointer_types = {t for e in entries for t in e["signature"].values() if t.startswith("*")}
        assert {"*fp32", "*bf16"} <= pointer_types, (kernel, pointer_types)


SHARED_MEMORY_LIMIT = {"sm_80": 166_912, "sm_90": 232_448}
"""Bytes of shared memory one block may use: A100 (163 KiB), H100 (227 KiB)."""
ATTENTION_KERNELS = (
    "attention_forward_kernel", "attention_backward_preprocess_kernel",
    "attention_backward_kv_kernel", "attention_backward_q_kernel",
)  # fmt: skip


def _attention_launches(compiled: dict) -> set[tuple]:
    """(kernel, target, its first pointer's dtype, value width, HAS_SINKS or None)."""
    seen = set()
    for entry in compiled["compiled"]:
        name = entry["kernel"].split(":")[1]
        if name in ATTENTION_KERNELS:
            pointer = next(t for t in entry["signature"].values() if t.startswith("*"))
            constexprs = entry["constexprs"]
            seen.add((name, entry["target"], pointer, constexprs["V_DIM"],
                      constexprs.get("HAS_SINKS")))  # fmt: skip
    return seen


def test_attention_kernels_compile_at_head_widths_64_and_128(compiled):
    """Forward (with and without sinks), preprocess, dK/dV and dQ, at widths 64 and 128 in
    bfloat16 (and 64 in float32), for both targets, within each target's shared memory."""
    expected = set()
    driven = [("*bf16", "64", "True"), ("*bf16", "64", "False"), ("*bf16", "128", "False"),
              ("*fp32", "64", "True")]  # fmt: skip
    for target in TARGETS:
        for dtype, width, sinks in driven:
            expected.add((ATTENTION_KERNELS[0], target, dtype, width, sinks))
            expected |= {(name, target, dtype, width, None) for name in ATTENTION_KERNELS[1:]}
    seen = _attention_launches(compiled)
    assert expected <= seen, sorted(expected - seen)
    too_big = [
        (e["kernel"], e["target"], e["shared_bytes"]) for e in compiled["compiled"]
        if e.get("shared_bytes", 0) > SHARED_MEMORY_LIMIT[e["target"]]
    ]  # fmt: skip
    assert not too_big, too_big


def _combos(compiled, kernel: str, *names: str) -> set[tuple[str, ...]]:
    return {
        (e["signature"]["logits_ptr"], *(e["constexprs"][n] for n in names), e["target"])
        for e in compiled["compiled"]
        if e["kernel"].endswith(f":{kernel}")
    }


def test_cross_entropy_constexpr_combinations(compiled):
    """Whole rows (the cross-entropy) at both vocabulary blocks (tiny presets: 512, published
    32000 to 201088: 32768) in float32, bfloat16 and float16; vocabulary chunks (the linear
    cross-entropy: first, middle, last) in the training dtypes; the gradient with and
    without a per-row upstream."""
    dtypes, training = ("*fp32", "*bf16", "*fp16"), ("*fp32", "*bf16")
    whole = {
        (dtype, block, "True", "True", target)
        for dtype in dtypes for block in ("512", "32768") for target in TARGETS
    }  # fmt: skip
    chunked = {
        (dtype, "1024", first, last, target)
        for dtype in training for target in TARGETS
        for first, last in (("True", "False"), ("False", "False"), ("False", "True"))
    }  # fmt: skip
    stats = _combos(compiled, "_row_stats_kernel", "BLOCK", "FIRST", "LAST")
    assert whole | chunked <= stats, sorted((whole | chunked) - stats)
    grads = _combos(compiled, "_row_grad_kernel", "BLOCK", "UPSTREAM")
    expected = {(d, b, "True", t) for d in dtypes for b in ("512", "32768") for t in TARGETS}
    expected |= {(d, "1024", u, t) for d in training for u in ("True", "False") for t in TARGETS}
    assert expected <= grads, sorted(expected - grads)


def test_discovery_sees_every_decorator_form():
    source = """
import triton
from triton import jit

@triton.jit
def a(x): pass

@jit
def b(x): pass

@triton.jit(do_not_specialize=["n"])
def c(x, n): pass

def helper(x): pass

@staticmethod
def d(x): pass
"""
    assert jit_function_names(source) == ["a", "b", "c"]
