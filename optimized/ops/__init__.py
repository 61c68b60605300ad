"""Optimized ops: each a unit of kernel, autograd Function and public function.

- `activations`: SiLU-and-multiply and GPT-OSS's clamped SwiGLU, fused (Triton);
- `attention`: fused causal attention (FlashAttention-2) keeping O(S) statistics, with
  GPT-OSS's sinks and their exact gradient, sliding windows banded (`flash_attention`,
  `FlashAttention`); its Triton kernels are `attention_kernels`, their launch parameters
  (blocks, packing, autotuning) `attention_blocks`;
- `cross_entropy`: one kernel pass in forward, the gradient written over the logits in backward;
- `cross_entropy_kernels`: the two row kernels both losses run (softmax statistics, gradient);
- `linear_cross_entropy`: the output layer and the cross-entropy fused over vocabulary chunks;
- `gather`: row gather and scatter-add that save only the index;
- `expert_order`: token rows grouped by expert, each group padded for the grouped GEMM;
- `grouped_linear`: the grouped expert linear, its weight gradient deferrable to a W step;
- `optimized_ops`: `OptimizedOps`, the stack's `models.network.Ops`;
- `tuning`: every autotuned kernel tuned before the first step (`pretune`), its choices kept
  in a JSON file (`TuningCache`).
- `precompile`: every other Triton kernel of a rank's step launched once before it, on dummy
  tensors of the step's shapes (`precompile`);
- `launches`: every Triton launch counted by kernel and Triton's specialisation key, and the
  keys first met inside a scheduled step (`first_seen_in_step`).

`_triton` is imported first so that, without CUDA, the Triton interpreter is
switched on before any kernel module imports `triton`.

May import `models` only; never another `optimized` subpackage, `reference` or `harness`.
"""

from models.runtime import all_to_all
from optimized.ops import _triton  # noqa: F401  (must precede every kernel import)
from optimized.ops.activations import clamped_swiglu, silu_and_mul
from optimized.ops.attention import FlashAttention, flash_attention
from optimized.ops.cross_entropy import cross_entropy
from optimized.ops.expert_order import (
    GROUPED_GEMM_ROW_ALIGNMENT,
    gather_from_grouped,
    scatter_for_grouped_gemm,
)
from optimized.ops.gather import GATHER_ROW_ALIGNMENT, padded_index_gather, scatter_add_rows
from optimized.ops.grouped_linear import WeightGradStore, grouped_linear
from optimized.ops.launches import first_step_kernels
from optimized.ops.launches import watch as watch_launches
from optimized.ops.linear_cross_entropy import linear_cross_entropy
from optimized.ops.optimized_ops import OptimizedOps

__all__ = [
    "FlashAttention",
    "GATHER_ROW_ALIGNMENT",
    "GROUPED_GEMM_ROW_ALIGNMENT",
    "OptimizedOps",
    "WeightGradStore",
    "all_to_all",
    "clamped_swiglu",
    "cross_entropy",
    "first_step_kernels",
    "flash_attention",
    "gather_from_grouped",
    "grouped_linear",
    "linear_cross_entropy",
    "padded_index_gather",
    "scatter_add_rows",
    "scatter_for_grouped_gemm",
    "silu_and_mul",
    "watch_launches",
]
