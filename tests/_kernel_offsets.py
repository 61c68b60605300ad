"""Every Triton kernel of `optimized.ops` at shapes whose offsets pass 2^31, with nothing allocated.

Run as a script with ``TRITON_INTERPRET=0`` (``tests/test_ops_offsets.py`` does, in one
subprocess); prints one JSON object.

1. The public ops are driven on meta tensors (shapes and strides, no storage) at shapes where a
   row index times a row stride passes 2^31 (attention's rows at 262 144 tokens of 8192-wide
   rows, a transposed logits' columns, a tall expert buffer's rows), and at 2^20 batch x
   head pairs; each kernel launch is recorded, not run (``JITFunction.run`` replaced, as in
   `tests/_kernel_compile.py`), with its grid.
2. Each launch is bound as a GPU launch would be (Triton's binder: a stride below 2^31 is an
   ``i32``, the worst case) and lowered to Triton IR for sm_90 (the front end only, no
   compilation: seconds). In that IR, every multiply, add and pointer offset that a stride
   argument (a parameter named ``*stride*``, of the kernel or of a helper it calls) reaches is
   read for its integer width: ``i32`` is an offset that wraps.
3. A kernel written here with a 32-bit row offset is checked the same way: the check must
   find it, or it proves nothing.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton._C.libtriton import ir  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from tests._kernel_compile import discover_kernels  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
TOKENS = 262_144
"""Attention's sequence: 262 144 rows of 64 x 128 = 8192 values: row 262 143 starts past 2^31."""
PAIRS = 1 << 20
"""Batch x heads where a two-axis grid's second axis (65 535 at most) would overflow."""
LAUNCHES: list[tuple[JITFunction, tuple, dict, object, str]] = []
SHAPE = ["?"]
"""What the ops are being driven with (a label for each recorded launch)."""


def _record(self: JITFunction, *args, grid, warmup, **kwargs):
    LAUNCHES.append((self, args, kwargs, grid, SHAPE[0]))


def _record_first_config(self: Autotuner, *args, **kwargs):
    self.fn.run(*args, **kwargs, **self.configs[0].all_kwargs())


def _meta(*shape, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def _heads(batch: int, seq: int, heads: int, width: int, dtype) -> torch.Tensor:
    """``[B, heads, S, width]`` as the projections give it: a view of ``[B, S, heads * width]``."""
    flat = _meta(batch, seq, heads * width, dtype=dtype)
    return flat.view(batch, seq, heads, width).transpose(1, 2).requires_grad_()


def drive_attention() -> None:
    from optimized.ops import flash_attention

    for label, batch, heads, kv_heads, seq, width, dtype, sinks, window in (
        ("attention bf16, 262144 x 8192-wide rows, sinks, window", 1, 64, 8, TOKENS, 128,
         torch.bfloat16, True, 128),
        ("attention fp32, 262144 x 8192-wide rows", 1, 64, 8, TOKENS, 128, torch.float32,
         False, None),
        ("attention bf16, 2^20 batch x head pairs", PAIRS // 64, 64, 8, 128, 64,
         torch.bfloat16, False, None),
    ):  # fmt: skip
        SHAPE[0] = label
        q = _heads(batch, seq, heads, width, dtype)
        k, v = (_heads(batch, seq, kv_heads, width, dtype) for _ in "kv")
        sink_logits = _meta(heads, dtype=torch.float32).requires_grad_() if sinks else None
        out = flash_attention(q, k, v, width**-0.5, window, sink_logits)
        out.backward(torch.empty_like(out))


def drive_losses() -> None:
    """The loss kernels on transposed logits ``[tokens, vocab]`` (a column stride of
    ``tokens``): column 16 383 starts past 2^31."""
    from optimized.ops.cross_entropy_kernels import (
        STATS,
        LossOptions,
        launch_row_grad,
        launch_row_stats,
    )

    vocab = 16_384
    logits = _meta(vocab, TOKENS).t()
    target = _meta(TOKENS, dtype=torch.int64)
    stats = _meta(STATS, TOKENS, dtype=torch.float32)
    losses = _meta(TOKENS, dtype=torch.float32)
    scale = _meta((), dtype=torch.float32)
    options = LossOptions(label_smoothing=0.1, lse_square_scale=1e-4)
    SHAPE[0] = "cross-entropy, 262144 x 16384 logits stored column by column"
    for chunk in ((0, vocab, vocab), (0, vocab, 2 * vocab), (vocab, vocab, 2 * vocab)):
        start, _, total = chunk
        launch_row_stats(logits, target, stats, losses, losses, options, start, total)
        launch_row_grad(logits, target, stats, scale, options, losses, start, total)


def drive_elementwise() -> None:
    """Activations and the grouped linear's tail on tall buffers (rows x width past 2^31)."""
    from optimized.ops import clamped_swiglu, silu_and_mul
    from optimized.ops.grouped_linear import launch_zero_tail_rows

    SHAPE[0] = "activations, 2^21 x 2048 inputs"
    for dtype in (torch.bfloat16, torch.float32):
        x = _meta(1 << 21, 2048, dtype=dtype).requires_grad_()
        silu_and_mul(x).backward(_meta(1 << 21, 1024, dtype=dtype))
        clamped_swiglu(x).backward(_meta(1 << 21, 1024, dtype=dtype))
    SHAPE[0] = "grouped linear's tail, 2^22 x 1024 rows"
    launch_zero_tail_rows(_meta(1 << 22, 1024), _meta(4, dtype=torch.int32))


# ------------------------------------------------------------------------------ the IR
NAME = r"%[\w.#]+"
OP = re.compile(rf"^\s*(?:({NAME}(?::\d+)?)\s*=\s*)?([\w.]+)\s+(.*?)\s*loc\(")
FUNC = re.compile(r"tt\.func\s+\w*\s*@([\w.]+)\((.*)\)\s*(?:->|attributes)")
ARG = re.compile(r"(%\w+):\s*([^\s{,]+)")
SHAPE_OPS = {"tt.splat", "tt.broadcast", "tt.expand_dims", "tt.reshape", "arith.extsi",
             "arith.extui", "tt.trans"}  # fmt: skip
ARITH = {"arith.muli", "arith.addi", "arith.subi"}


def _result_type(rest: str) -> str:
    """The result type of an op's text after its name (the last type after ``:`` or ``->``)."""
    types = rest.rsplit(":", 1)[-1]
    return types.rsplit("->", 1)[-1].strip().split(" to ")[-1].strip()


def narrow_offsets(text: str) -> list[str]:
    """Every 32-bit integer operation a stride reaches, in the IR ``text``: ``func: op type``.

    Per function, its parameters named ``*stride*`` are strides; what a shape op or an
    integer multiply, add or subtract makes of a stride is an offset too. A multiply, add
    or subtract taking an offset, or a pointer offset (``tt.addptr``), must be 64-bit."""
    found, function, tainted = [], "?", set()
    for line in text.splitlines():
        header = FUNC.search(line)
        if header:
            function = header.group(1)
            tainted = {name for name, _ in ARG.findall(header.group(2)) if "stride" in name}
            continue
        match = OP.match(line)
        if not match:
            continue
        result, op, rest = match.groups()
        operands = set(re.findall(NAME, rest))
        hit = operands & tainted
        if not hit:
            continue
        kind = _result_type(rest)
        if op in ARITH or op == "tt.addptr":
            width = kind if op in ARITH else rest.rsplit(",", 1)[-1].strip()
            if re.search(r"\bi32\b|xi32>", width):
                found.append(f"{function}: {op} of {sorted(hit)} as {width}")
        if result and (op in ARITH or op in SHAPE_OPS):
            tainted.add(result.split(":")[0])
    return found


def lower(fn: JITFunction, args: tuple, kwargs: dict) -> tuple[dict, str]:
    """(signature, Triton IR text) of a GPU launch of ``fn`` with these arguments."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, kwargs, bound, specialization, options
    )
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = ASTSource(fn, signature, constexprs, attrs).make_ir(
        TARGET, options, backend.get_codegen_implementation(options),
        backend.get_module_map(), context,
    )  # fmt: skip
    return signature, str(module)


def grid_of(grid, kwargs: dict) -> list[int]:
    return list(grid(kwargs) if callable(grid) else grid)


@triton.jit
def narrow_row_kernel(x_ptr, out_ptr, stride_row, n_cols, BLOCK: tl.constexpr):
    """A row copy whose row offset is 32-bit: what the check must find."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    value = tl.load(x_ptr + row * stride_row + cols, mask=cols < n_cols)
    tl.store(out_ptr + row * stride_row + cols, value, mask=cols < n_cols)


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "0":
        raise SystemExit("run with TRITON_INTERPRET=0: the interpreter must be off to lower")
    kernels = discover_kernels()
    names = {id(fn): name for name, fn in kernels.items()}
    JITFunction.run = _record
    Autotuner.run = _record_first_config
    drive_attention()
    drive_losses()
    drive_elementwise()
    SHAPE[0] = "a 32-bit row offset, 65536 rows of stride 65536"
    x = _meta(1 << 16, 1 << 16)
    narrow_row_kernel[(1 << 16,)](x, x, x.stride(0), x.shape[1], BLOCK=1024)
    results, seen = [], set()
    for fn, args, kwargs, grid, label in LAUNCHES:
        signature, text = lower(fn, args, kwargs)
        name = names.get(id(fn), fn.__name__)
        key = (name, label, repr(signature), repr(sorted((k, repr(v)) for k, v in kwargs.items())))
        if key in seen:
            continue
        seen.add(key)
        results.append({
            "kernel": name, "shape": label, "grid": grid_of(grid, kwargs),
            "strides": {k: v for k, v in signature.items() if "stride" in k},
            "narrow": narrow_offsets(text),
        })  # fmt: skip
    json.dump({"kernels": sorted(kernels), "launches": results}, sys.stdout)


if __name__ == "__main__":
    main()
