"""Compare two stacks' tensors where they live: each rank reduces its pieces to scalars.

`twinpipe compare` used to clone every gradient and parameter of both stacks in float32,
every step, and assemble whole-model copies in the parent: at real widths that is several
times the model, on one process. Here nothing whole-model moves. For each parameter name
each rank reduces the rows it holds, in float64, to four sums and a maximum:

- ``a2 = sum(a^2)`` (candidate), ``b2 = sum(b^2)`` (baseline), ``d2 = sum((a - b)^2)``;
- ``max_abs = max |a - b|``, and whether anything was not finite;

and one all-reduce per comparison (sums added, maxima taken) gives every rank the figures
of the whole tensors: relative L2 error ``sqrt(d2 / b2)`` and ``1 - cos``. Only these
scalars travel to the parent.

Which rows a rank counts. Every parameter a rank holds is a range of rows (dim 0) of the
whole model's tensor of that name: the EP shard of a routed-expert tensor is its block of
experts (``Experts.first_expert``), an FSDP2 shard (a DTensor) a further row range. Two
sides compared on one rank cover nested ranges (the oracle's whole tensor contains a
pipeline's expert shard, which contains an FSDP2 shard of it); the narrower range is
compared, the wider side sliced to it. Rows held by several ranks (data-parallel copies)
count once: a plain non-expert tensor counts on dp-rank 0 only, a plain expert shard on
the first block of EP ranks only (as `models.runtime.reduce_gradients` reduces them);
an FSDP2 shard always counts (its rows are its own). Pipeline ranks hold different layers.

``1 - cos`` without cancellation: ``1 - a.b / (|a| |b|)`` loses everything below 1e-16 to
rounding (two correct float32 stacks differ by far less than that can resolve in some
parameters). It is computed as ``(d2 - (|a| - |b|)^2) / (2 |a| |b|)``, whose error is about
1e-16 times the relative size difference, not 1e-16 absolute; the same formula on whole
tensors or on pieces agrees far below 1e-12 relative.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from models.network import is_expert_parameter

CHUNK_ELEMENTS = 1 << 20
"""Elements converted to float64 at a time (8 MiB a side)."""


class Row(NamedTuple):
    """One parameter's comparison: ``name``, relative L2 error, ``1 - cos``."""

    name: str
    rel: float
    one_minus_cos: float


@dataclass(slots=True)
class Sums:
    """Reductions of one parameter's elements; add pieces with `merge`."""

    a2: float = 0.0
    """Sum of the candidate's squares."""
    b2: float = 0.0
    """Sum of the baseline's squares."""
    d2: float = 0.0
    """Sum of the squared differences."""
    max_abs: float = 0.0
    """Largest absolute difference."""
    finite: bool = True
    """Whether every element of both sides was finite."""
    count: int = 0
    """Elements summed."""

    def merge(self, other: Sums) -> None:
        self.a2 += other.a2
        self.b2 += other.b2
        self.d2 += other.d2
        self.count += other.count
        self.max_abs = max(self.max_abs, other.max_abs)
        self.finite = self.finite and other.finite

    @property
    def rel(self) -> float:
        """``|a - b| / |b|`` (0 when both are zero, infinite when only ``b`` is)."""
        if not self.finite:
            return math.inf
        if self.b2 == 0:
            return 0.0 if self.d2 == 0 else math.inf
        return math.sqrt(self.d2 / self.b2)

    @property
    def one_minus_cos(self) -> float:
        """``1 - cos(a, b)``: 0 for two zero tensors, 1 when only one is zero."""
        if not self.finite:
            return math.inf
        na, nb = math.sqrt(self.a2), math.sqrt(self.b2)
        if na == 0 and nb == 0:
            return 0.0
        if na == 0 or nb == 0:
            return 1.0
        return max(0.0, (self.d2 - (na - nb) ** 2) / (2.0 * na * nb))

    @property
    def radial(self) -> float:
        """``<a - b, b> / |b|^2``: the part of the error along ``b`` (a scale error), signed.

        Random rounding errors of relative size ``rel`` over ``count`` elements project onto
        ``b`` with a standard deviation of about ``rel / sqrt(count)``; a wrong scale (a
        gradient 1% too large, values biased toward zero) shows here in full."""
        if not self.finite:
            return math.inf
        if self.b2 == 0:
            return 0.0
        return (self.a2 - self.b2 - self.d2) / (2.0 * self.b2)

    def row(self, name: str) -> Row:
        return Row(name, self.rel, self.one_minus_cos)


def pair_sums(a: torch.Tensor, b: torch.Tensor, chunk: int = CHUNK_ELEMENTS) -> Sums:
    """`Sums` of two tensors with the same number of elements, in float64, chunk by chunk."""
    if a.numel() != b.numel():
        raise ValueError(f"pair_sums: {a.numel()} elements against {b.numel()}")
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    out = Sums()
    for start in range(0, a.numel(), chunk):
        x = a[start : start + chunk].double()
        y = b[start : start + chunk].double()
        out.count += x.numel()
        diff = x - y
        finite = (torch.isfinite(x).all() & torch.isfinite(y).all()).double()
        # Reduced where the tensors live; one read of five numbers per chunk.
        figures = torch.stack([x.dot(x), y.dot(y), diff.dot(diff), diff.abs().max(), finite])
        a2, b2, d2, max_abs, ok = figures.tolist()
        if not ok:
            out.finite = False
            continue
        out.a2 += a2
        out.b2 += b2
        out.d2 += d2
        out.max_abs = max(out.max_abs, max_abs)
    return out


def rows_worst_first(rows: Iterable[Row]) -> list[Row]:
    """Rows ordered worst first: largest ``1 - cos`` first, then largest relative error.

    Every reader that takes ``[0]`` of such a list takes the worst parameter.
    """
    return sorted(rows, key=lambda row: (row.one_minus_cos, row.rel), reverse=True)


def compare_sums(sums: Mapping[str, Sums]) -> list[Row]:
    """Rows of every parameter, worst first."""
    return rows_worst_first(s.row(name) for name, s in sums.items())


GROUP_PATTERN = re.compile(r"layers\.\d+\.")


def group_of(name: str) -> str:
    """A parameter's group: its name with the layer index replaced (``layers.*.``)."""
    return GROUP_PATTERN.sub("layers.*.", name)


def group_sums(sums: Mapping[str, Sums]) -> dict[str, Sums]:
    """Sums merged per parameter group (`group_of`): the group's tensors as one vector."""
    groups: dict[str, Sums] = {}
    for name, s in sums.items():
        groups.setdefault(group_of(name), Sums()).merge(s)
    return groups


# ----------------------------------------------------------------- pieces on a rank
@dataclass(slots=True)
class Piece:
    """What one side holds of one parameter on this rank."""

    tensor: torch.Tensor
    """The local rows (a DTensor's local shard), any dtype."""
    start: int
    """First row of the whole model's tensor the local rows are."""
    counts: bool
    """Whether these rows count here (False on data-parallel copies)."""

    @property
    def stop(self) -> int:
        return self.start + (self.tensor.shape[0] if self.tensor.dim() else 1)


@dataclass(slots=True)
class RankPlace:
    """Where this rank sits, as far as counting copies goes."""

    dp_rank: int = 0
    ep: int = 1
    whole: bool = False
    """A side that holds the whole model on every rank (the oracle): its rows always
    defer to the other side's rule."""


def pieces(
    part: nn.Module,
    place: RankPlace,
    take: Callable[[str, nn.Parameter], torch.Tensor | None],
) -> dict[str, Piece]:
    """``take(name, parameter)`` (its gradient, itself, or any tensor shaped like it) of
    every parameter of ``part``, as pieces with their rows and copy rule."""
    owners = {
        f"{prefix}.{pname}" if prefix else pname: module
        for prefix, module in part.named_modules()
        for pname, _ in module.named_parameters(recurse=False)
    }
    out: dict[str, Piece] = {}
    for name, param in part.named_parameters():
        tensor = take(name, param)
        if tensor is None:
            continue
        start = getattr(owners[name], "first_expert", 0) if is_expert_parameter(name) else 0
        sharded = isinstance(param, DTensor)
        if sharded:  # FSDP2: this rank's rows, cut as torch.chunk cuts them
            mesh = param.device_mesh
            chunk = -(-param.shape[0] // mesh.size())
            start += min(param.shape[0], mesh.get_local_rank() * chunk)
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        if place.whole or sharded:
            counts = True
        elif is_expert_parameter(name):
            counts = place.dp_rank < place.ep
        else:
            counts = place.dp_rank == 0
        out[name] = Piece(tensor.detach(), start, counts)
    return out


def _local_pair(name: str, a: Piece, b: Piece) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The rows both pieces hold: the narrower one whole, the wider sliced to it."""
    if (a.start, a.stop) == (b.start, b.stop):
        return a.tensor, b.tensor, a.counts and b.counts
    narrow, wide = (a, b) if a.start >= b.start and a.stop <= b.stop else (b, a)
    if not (narrow.start >= wide.start and narrow.stop <= wide.stop):
        raise RuntimeError(
            f"{name}: the two sides hold rows [{a.start}, {a.stop}) and [{b.start}, {b.stop}) "
            "on this rank; one must contain the other (same layers and experts per rank)"
        )
    sliced = wide.tensor[narrow.start - wide.start : narrow.stop - wide.start]
    if narrow is a:
        return a.tensor, sliced, narrow.counts
    return sliced, b.tensor, narrow.counts


class Comparer:
    """Reduces pairs of pieces to whole-tensor `Sums` on every rank (collective: every
    rank calls `compare` the same number of times, in the same order).

    The pieces are reduced on their device; the sums and the parameter names are host
    values, exchanged over ``group``: a group with gloo (`models.runtime.Layout.host_group`:
    NCCL carries no CPU tensors and no objects)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self._names: dict[frozenset[str], list[str]] = {}

    def _all_names(self, local: list[str]) -> list[str]:
        key = frozenset(local)
        if key not in self._names:
            if dist.is_initialized() and dist.get_world_size(self.group) > 1:
                gathered: list[list[str] | None] = [None] * dist.get_world_size(self.group)
                dist.all_gather_object(gathered, sorted(local), group=self.group)
                everything = sorted({n for names in gathered for n in names or ()})
            else:
                everything = sorted(local)
            self._names[key] = everything
        return self._names[key]

    def compare(
        self, candidate: Mapping[str, Piece], baseline: Mapping[str, Piece]
    ) -> dict[str, Sums]:
        """Whole-tensor sums for every parameter either side holds on any rank."""
        if set(candidate) != set(baseline):
            missing = sorted(set(candidate) ^ set(baseline))
            raise RuntimeError(f"the two stacks hold different parameters here: {missing[:5]}")
        names = self._all_names(list(candidate))
        index = {name: i for i, name in enumerate(names)}
        added = torch.zeros(len(names), 4, dtype=torch.float64)
        maxima = torch.zeros(len(names), 2, dtype=torch.float64)
        for name in candidate:
            a, b, counts = _local_pair(name, candidate[name], baseline[name])
            if not counts:
                continue
            s = pair_sums(a, b)
            added[index[name]] = torch.tensor(
                [s.a2, s.b2, s.d2, float(s.count)], dtype=torch.float64
            )
            maxima[index[name]] = torch.tensor(
                [s.max_abs, 0.0 if s.finite else 1.0], dtype=torch.float64
            )
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(added, group=self.group)
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self.group)
        return {
            name: Sums(
                float(added[i, 0]),
                float(added[i, 1]),
                float(added[i, 2]),
                float(maxima[i, 0]),
                bool(maxima[i, 1] == 0),
                int(added[i, 3]),
            )  # fmt: skip
            for name, i in index.items()
        }
