"""Grouped expert linear over `F.grouped_mm`, with deferrable weight gradients.

Forward and the input gradient are one grouped GEMM each. The weight gradient
is the one a zero-bubble schedule (DualPipeV's W steps) wants to run later: when
a `WeightGradStore` is given and enabled, backward puts a closure computing it
into the store instead, returns no weight gradient, and the closure adds the
gradient into the parameter's ``.grad`` when the store pops its group. Expert
biases (GPT-OSS) always get their gradient at once: it is a cheap column sum.

Nothing runs around the GEMMs that torch's own autograd of `torch._grouped_mm` does not
run (held by ``tests/test_ops_grouped_linear_overhead.py``):

- the weight gradient is computed in the weight's own layout, as torch's backward does:
  for a weight used through a transpose (``param.transpose(1, 2)``, DeepSeek-V2 and
  Qwen3) it is ``grouped_mm(grad_out.T, x).T``, whose transpose back is the parameter's
  contiguous layout, so autograd's accumulation takes the buffer as ``.grad`` instead of
  copying a transposed weight-sized tensor into a fresh one (and a deferred gradient is
  added in place, with no zeroed staging buffer);
- `F.grouped_mm` leaves the rows past ``offsets[-1]`` unwritten; only those rows are
  zeroed (`zero_rows_past_groups_`), not the whole output through a mask. In the
  pipeline there are none: the expert-order buffer ends at ``offsets[-1]``.

`F.grouped_mm` wants int32 offsets, float32/bfloat16/float16 operands whose
non-unit strides are multiples of 16 bytes. Operands that break the stride rule (odd
sizes) are copied into padded buffers, other dtypes fall back to a loop of matmuls, so
every shape gives the plain per-group result.

float32 has no grouped kernel: torch's `F.grouped_mm` runs a loop of matmuls whose bounds
it reads from the offsets on the host, one device synchronisation per call on a GPU (six
per MoE layer and micro-batch: three GEMMs forward, two backward and the weight gradient).
Given the group ends on the host (``ends``: `models.network.ExpertLayout.ends`, from the
MoE layer's split sizes) the same loop runs on them and reads nothing; without them the
read remains (a caller that knows no host row counts).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F

from models.network import host_side
from models.runtime import index_add_
from optimized.ops._triton import INTERPRETED, launch, tl, triton
from optimized.ops.expert_order import GROUPED_GEMM_STRIDE_BYTES
from optimized.ops.gather import round_up

GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class WeightGradStore:
    """Weight-gradient work deferred from backward, run group by group.

    Owned by whoever runs the schedule and passed to the ops that use it (no
    global state). While ``enabled``, grouped linears `put` their weight-gradient
    closures here; `flush` closes the current group (one deferred backward);
    `pop` runs the oldest closed group (one W step); `assert_empty` at the end
    of a step raises if any work is left, which would otherwise be lost.
    """

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self._open_group: list[Callable[[], None]] = []
        self._closed_groups: deque[list[Callable[[], None]]] = deque()

    def put(self, work: Callable[[], None]) -> None:
        """Add one weight-gradient closure to the open group."""
        self._open_group.append(work)

    def flush(self) -> None:
        """Close the open group (even an empty one: one group per deferred backward)."""
        self._closed_groups.append(self._open_group)
        self._open_group = []

    def pop(self) -> None:
        """Run the oldest closed group."""
        if not self._closed_groups:
            raise RuntimeError(
                "WeightGradStore.pop: no closed group to run "
                f"({len(self._open_group)} closure(s) are in the open group; flush first)"
            )
        for work in self._closed_groups.popleft():
            work()

    def __len__(self) -> int:
        """The number of closed groups waiting to be popped."""
        return len(self._closed_groups)

    def assert_empty(self) -> None:
        """Raise RuntimeError if any weight-gradient work is still waiting."""
        if self._closed_groups or self._open_group:
            pending = sum(len(group) for group in self._closed_groups) + len(self._open_group)
            raise RuntimeError(
                f"WeightGradStore is not empty at the end of the step: {len(self._closed_groups)} "
                f"closed group(s) not popped and {len(self._open_group)} closure(s) not flushed "
                f"({pending} weight gradient(s) would be lost)"
            )

    @contextmanager
    def deferring(self) -> Iterator[WeightGradStore]:
        """Enable deferral for one backward, then close its group."""
        previous, self.enabled = self.enabled, True
        try:
            yield self
        finally:
            self.enabled = previous
        self.flush()


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself if `F.grouped_mm` accepts its layout, else a padded copy."""
    size = tensor.element_size()
    strides_ok = all(
        stride == 1 or (stride * size) % GROUPED_GEMM_STRIDE_BYTES == 0
        for stride in tensor.stride()
    )
    if (
        strides_ok
        and 1 in tensor.stride()[-2:]
        and tensor.data_ptr() % GROUPED_GEMM_STRIDE_BYTES == 0
    ):
        return tensor
    cols = tensor.shape[-1]
    per_row = max(1, GROUPED_GEMM_STRIDE_BYTES // size)
    buffer = tensor.new_empty(tuple(tensor.shape[:-1]) + (round_up(cols, per_row),))
    buffer[..., :cols].copy_(tensor)
    return buffer[..., :cols]


def _row_groups(rows: int, offsets: torch.Tensor) -> torch.Tensor:
    """The group of every row; rows past ``offsets[-1]`` get ``len(offsets)``."""
    row_index = torch.arange(rows, device=offsets.device)
    return torch.bucketize(row_index, offsets.long(), right=True)


TAIL_BLOCK_ROWS, TAIL_BLOCK_COLS = 16, 256
"""Rows and columns of one tile of `_zero_tail_rows_kernel` (compiled)."""


@triton.jit
def _zero_tail_rows_kernel(
    out_ptr, stride_row, offsets_ptr, last_group, n_rows, n_cols,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):  # fmt: skip
    """Zero rows ``offsets[last_group]`` onwards; a program whose rows all lie before
    that end (every program, when the groups fill the tensor) stores nothing."""
    first_row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS
    end = tl.load(offsets_ptr + last_group).to(tl.int64)
    if first_row + BLOCK_ROWS > end:
        rows = first_row + tl.arange(0, BLOCK_ROWS)
        row_mask = (rows >= end) & (rows < n_rows)
        zeros = tl.zeros([BLOCK_ROWS, BLOCK_COLS], out_ptr.dtype.element_ty)
        for start in range(0, n_cols, BLOCK_COLS):
            cols = start + tl.arange(0, BLOCK_COLS)
            mask = row_mask[:, None] & (cols[None, :] < n_cols)
            tl.store(out_ptr + rows[:, None] * stride_row + cols[None, :], zeros, mask=mask)


def launch_zero_tail_rows(out: torch.Tensor, offsets: torch.Tensor) -> None:
    """Zero ``out``'s rows from ``offsets[-1]`` on with one kernel that reads the end where
    it lives (no host sync). ``out`` must have unit column stride."""
    rows, cols = out.shape
    if rows == 0 or cols == 0 or offsets.numel() == 0:
        return
    if out.stride(1) != 1:
        raise ValueError(f"out must have unit column stride; got strides {out.stride()}")
    launch(
        _zero_tail_rows_kernel,
        (triton.cdiv(rows, TAIL_BLOCK_ROWS),),
        out, out.stride(0), offsets, offsets.numel() - 1, rows, cols,
        BLOCK_ROWS=TAIL_BLOCK_ROWS, BLOCK_COLS=TAIL_BLOCK_COLS,
    )  # fmt: skip


def zero_rows_past_groups_(out: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Zero the rows of ``out`` past ``offsets[-1]``, which `F.grouped_mm` leaves unwritten.

    Compiled (GPU), `launch_zero_tail_rows` reads the end on the device. Under the Triton
    interpreter with the offsets in host memory, the end is read from that memory as it
    is (through numpy: no aten op, nothing to synchronise; a host-side read for
    `models.runtime.host_sync`) and only the tail is sliced and zeroed (an interpreted launch costs
    milliseconds of Python).
    """
    if out.shape[0] == 0 or offsets.numel() == 0:
        return out
    if not INTERPRETED or offsets.device.type != "cpu":
        launch_zero_tail_rows(out, offsets)
        return out
    with host_side():
        end = int(offsets.numpy()[-1])
    if end < out.shape[0]:
        out[end:].zero_()
    return out


def _looped(dtype: torch.dtype, ends: Sequence[int] | None) -> bool:
    """Whether a grouped product runs as a loop of matmuls here: dtypes `F.grouped_mm`
    does not take, and float32 whose group ends the host knows (torch's float32 path is
    such a loop too, with the ends read back from the device)."""
    return dtype not in GROUPED_MM_DTYPES or (dtype == torch.float32 and ends is not None)


def grouped_mm(
    a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, ends: Sequence[int] | None = None
) -> torch.Tensor:
    """``out[rows of group g] = a[rows of group g] @ b[g]``; rows past the groups are zero.
    ``ends``: ``offsets`` on the host, when known."""
    if a.shape[0] == 0:
        return a.new_zeros((0, b.shape[-1]))
    if _looped(a.dtype, ends):
        out = a.new_zeros((a.shape[0], b.shape[-1]))
        for group, (start, end) in enumerate(_group_bounds(offsets, ends)):
            torch.mm(a[start:end], b[group], out=out[start:end])  # in place: no staging copy
        return out
    out = F.grouped_mm(_aligned(a), _aligned(b), offs=offsets)
    return zero_rows_past_groups_(out, offsets)


def is_column_major(matrix: torch.Tensor) -> bool:
    """Whether each ``[rows, cols]`` matrix of ``matrix`` is stored column by column (a
    transposed view of a contiguous parameter), as torch's `_grouped_mm` backward asks."""
    return matrix.stride(-2) == 1 and matrix.stride(-1) >= max(1, matrix.shape[-2])


def grouped_weight_grad(
    x: torch.Tensor,
    grad_out: torch.Tensor,
    offsets: torch.Tensor,
    column_major: bool = False,
    ends: Sequence[int] | None = None,
) -> torch.Tensor:
    """``grad_weight[g] = x[rows of g].T @ grad_out[rows of g]``, shape ``[E, in, out]``.

    With ``column_major`` (the weight is a transposed view) it is computed as
    ``(grad_out[rows of g].T @ x[rows of g]).T``: stored like the weight, so its transpose
    back is a contiguous parameter-shaped gradient (torch's own backward does the same).
    """
    num_groups = offsets.shape[0]
    if x.shape[0] == 0 or _looped(x.dtype, ends):
        shape = (num_groups, x.shape[1], grad_out.shape[1])
        if column_major:  # allocated in that layout: one buffer, never a second for a copy
            grad = x.new_zeros((shape[0], shape[2], shape[1])).transpose(1, 2)
        else:
            grad = x.new_zeros(shape)
        for group, (start, end) in enumerate(_group_bounds(offsets, ends)):
            grad[group].addmm_(x[start:end].t(), grad_out[start:end])  # into the zeros in place
        return grad
    if column_major:
        return F.grouped_mm(_aligned(grad_out).t(), _aligned(x), offs=offsets).transpose(1, 2)
    return F.grouped_mm(_aligned(x).t(), _aligned(grad_out), offs=offsets)


def _group_bounds(
    offsets: torch.Tensor, ends: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    """Each group's ``(start, end)`` rows: from the host's ``ends`` when given, else read
    from ``offsets`` (one host synchronisation on a GPU)."""
    ends = list(ends) if ends is not None else offsets.tolist()
    return list(zip([0] + ends[:-1], ends))


class _GradDestination(NamedTuple):
    """Where a deferred weight gradient lands: a leaf, and the view of it used."""

    leaf: torch.Tensor
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int


def _grad_destination(weight: torch.Tensor) -> _GradDestination | None:
    """The parameter behind ``weight`` (itself, or the base of a view of it); None when
    ``weight`` is computed (`_no_destination` names the problem)."""
    leaf = weight if weight.is_leaf else weight._base
    if leaf is None or not leaf.is_leaf or not leaf.requires_grad:
        return None
    return _GradDestination(
        leaf,
        tuple(weight.shape),
        tuple(weight.stride()),
        weight.storage_offset() - leaf.storage_offset(),
    )


def _no_destination(weight_grad_fn: str) -> ValueError:
    return ValueError(
        "grouped_linear with an enabled WeightGradStore needs weight to be a parameter "
        "or a view of one (e.g. param.transpose(1, 2)); got a tensor computed by "
        f"{weight_grad_fn}"
    )


def _leaf_shaped(destination: _GradDestination, grad_view: torch.Tensor) -> torch.Tensor | None:
    """``grad_view`` re-viewed as the whole leaf's gradient when the weight view covers the
    leaf and ``grad_view`` is laid out exactly like it (no copy); None otherwise."""
    leaf = destination.leaf
    if (
        grad_view.dtype != leaf.dtype
        or tuple(grad_view.stride()) != destination.stride
        or grad_view.numel() != leaf.numel()
        or destination.storage_offset != 0
        or not leaf.is_contiguous()
    ):
        return None
    return grad_view.as_strided(leaf.shape, leaf.stride(), grad_view.storage_offset())


def _accumulate_into(destination: _GradDestination, grad_view: torch.Tensor) -> None:
    """Add ``grad_view`` (laid out like the weight view) into ``leaf.grad``: in place when a
    gradient of the leaf's layout exists, as the gradient itself when it can be re-viewed as
    one, through a zeroed leaf-shaped buffer only otherwise."""
    leaf = destination.leaf
    existing = leaf.grad
    if existing is not None and tuple(existing.stride()) == tuple(leaf.stride()):
        offset = existing.storage_offset() + destination.storage_offset
        existing.as_strided(destination.size, destination.stride, offset).add_(grad_view)
        return
    grad = _leaf_shaped(destination, grad_view)
    if grad is None:
        grad = torch.zeros_like(leaf, memory_format=torch.preserve_format)
        grad.as_strided(destination.size, destination.stride, destination.storage_offset).copy_(
            grad_view
        )
    if existing is None:
        leaf.grad = grad
    else:
        existing.add_(grad)


class GroupedLinear(torch.autograd.Function):
    """``x_g @ weight[g] (+ bias[g])`` per group; the weight gradient may be deferred."""

    @staticmethod
    def forward(ctx, x, weight, offsets, bias, store, ends):
        ctx.ends = ends
        out = grouped_mm(x, weight, offsets, ends)
        row_groups = None
        if bias is not None:
            row_groups = _row_groups(x.shape[0], offsets)
            padded_bias = torch.cat([bias, bias.new_zeros((1, bias.shape[1]))])
            out.add_(padded_bias.index_select(0, row_groups))
        ctx.save_for_backward(x, weight, offsets, row_groups)
        ctx.column_major = is_column_major(weight)
        # Whether to defer is the backward's choice (a schedule enables the store around
        # a zero-bubble backward, long after the forward): keep where the gradient goes.
        ctx.store = store if ctx.needs_input_grad[1] else None
        ctx.destination = None
        if ctx.store is not None:
            ctx.destination = _grad_destination(weight)
            ctx.weight_grad_fn = type(weight.grad_fn).__name__
            if store.enabled and ctx.destination is None:
                raise _no_destination(ctx.weight_grad_fn)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x, weight, offsets, row_groups = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grouped_mm(grad_out, weight.transpose(1, 2), offsets, ctx.ends)
        if ctx.needs_input_grad[3]:
            num_groups = offsets.shape[0]
            accumulate = torch.promote_types(grad_out.dtype, torch.float32)
            sums = grad_out.new_zeros((num_groups + 1, grad_out.shape[1]), dtype=accumulate)
            index_add_(sums, row_groups, grad_out.to(accumulate))  # deterministic mode
            grad_bias = sums[:num_groups].to(grad_out.dtype)
        defer = ctx.store is not None and ctx.store.enabled
        if defer:
            destination = ctx.destination
            if destination is None:
                raise _no_destination(ctx.weight_grad_fn)
            del ctx.destination
            # Only the values wait for the W step: a saved input's autograd history (its
            # grad_fn, and through it the stage's leaves and their gradients) must not.
            x = x.detach()

            column_major, ends = ctx.column_major, ctx.ends

            def weight_grad_work() -> None:
                grad = grouped_weight_grad(x, grad_out, offsets, column_major, ends)
                _accumulate_into(destination, grad)

            ctx.store.put(weight_grad_work)
        elif ctx.needs_input_grad[1]:
            grad_weight = grouped_weight_grad(x, grad_out, offsets, ctx.column_major, ctx.ends)
        return grad_x, grad_weight, None, grad_bias, None, None


def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    bias: torch.Tensor | None = None,
    weight_grad_store: WeightGradStore | None = None,
    ends: Sequence[int] | None = None,
) -> torch.Tensor:
    """Per-group ``x_g @ weight[g] (+ bias[g])``, ``weight [E, in, out]``, int32 ``offsets``.

    ``offsets[g]`` is the exclusive end row of group ``g``; rows past
    ``offsets[-1]`` give zeros. With an enabled ``weight_grad_store`` the weight
    gradient is deferred to the store (see `WeightGradStore`). ``ends``: ``offsets`` on
    the host, when the caller knows them (float32 then reads nothing back).
    """
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"x must be [rows, in] and weight [experts, in, out]; got x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if offsets.dim() != 1 or offsets.shape[0] != weight.shape[0]:
        raise ValueError(
            f"offsets must be [{weight.shape[0]}] (one end per expert); got {tuple(offsets.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0], weight.shape[2]):
        raise ValueError(
            f"bias must be [{weight.shape[0]}, {weight.shape[2]}]; got {tuple(bias.shape)}"
        )
    if ends is not None:
        ends = tuple(int(end) for end in ends)
        if len(ends) != weight.shape[0]:
            raise ValueError(f"ends must give {weight.shape[0]} group ends; got {len(ends)}")
    return GroupedLinear.apply(x, weight, offsets.to(torch.int32), bias, weight_grad_store, ends)
