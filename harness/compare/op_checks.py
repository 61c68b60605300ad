"""What the ops audit (`harness.compare.ops_audit`) checks of one op call: index ops exactly,
numeric ops by their error and bias against a float32 truth; and the host copies of an
op's inputs (the slice the audit checks of the larger ops) it checks them on.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def host() -> Iterator[None]:
    """Work the memory tracker does not see (its dispatch mode suspended), without autograd."""
    from torch.utils._python_dispatch import _disable_current_modes  # noqa: PLC0415

    with _disable_current_modes(), torch.no_grad():
        yield


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return value


def error_stats(out: torch.Tensor, truth: torch.Tensor) -> tuple[float, float, int]:
    """Relative L2 error of ``out`` against ``truth``; its bias: the mean of each element's
    error toward the truth's sign in units of the truth's bfloat16 spacing, over the RMS of
    the same (``-sqrt(3)/2`` for rounding toward zero, whatever the magnitudes); the count
    of elements the bias is taken over (nonzero, finite truth)."""
    out, truth = out.double(), truth.double()
    err = out - truth
    rel = float(err.norm()) / max(float(truth.norm()), 1e-30)
    keep = (truth != 0) & torch.isfinite(truth)
    t = truth[keep]
    spacing = torch.exp2(torch.floor(torch.log2(t.abs())) - 7)  # bfloat16: 8 significant bits
    units = err[keep] * t.sign() / spacing
    n = units.numel()
    rms = float(units.square().mean().sqrt()) if n else 0.0
    bias = float(units.mean()) / rms if rms else 0.0
    return rel, bias, n


def nonfinite_problem(out: torch.Tensor, truth: torch.Tensor) -> str | None:
    """What is wrong with the non-finite elements of ``out`` against ``truth``: made where
    the truth is finite, or lost (a NaN or an infinity stored as a number, as a rounding
    that turned NaN into zero did); None when both are non-finite in the same places."""
    out_bad, truth_bad = ~torch.isfinite(out), ~torch.isfinite(truth)
    made, lost = int((out_bad & ~truth_bad).sum()), int((truth_bad & ~out_bad).sum())
    problems = []
    if made:
        problems.append(f"non-finite output where the float32 truth is finite ({made} elements)")
    if lost:
        problems.append(f"finite output where the float32 truth is NaN or infinite ({lost} "
                        "elements: a NaN or infinity lost)")  # fmt: skip
    return "; ".join(problems) or None


def index_problem(name: str, inputs: dict, out: Any) -> str | None:
    """What is wrong with an index op's output (``gather_rows``, ``to_expert_order``,
    ``from_expert_order``), or None when it is exact."""
    return _INDEX_CHECKS[name](inputs, out)


def _gather_rows(inputs: dict, out: torch.Tensor) -> str | None:
    expected = inputs["x"][inputs["index"]]
    if tuple(out.shape) != tuple(expected.shape) or not torch.equal(out.cpu(), expected):
        return "rows differ from x[index]"
    return None


def _from_expert_order(inputs: dict, out: torch.Tensor) -> str | None:
    grouped, layout = inputs["grouped"], inputs["layout"]
    expected = grouped[layout.positions.long()]
    if tuple(out.shape) != tuple(expected.shape) or not torch.equal(out.cpu(), expected):
        return "rows differ from grouped[positions]"
    return None


def _to_expert_order(inputs: dict, out: tuple) -> str | None:
    tokens, expert_ids = inputs["tokens"], inputs["expert_ids"].long()
    grouped, layout = out[0].detach().cpu(), out[1]
    positions = layout.positions.detach().cpu().long()
    offsets = layout.offsets.detach().cpu().long()
    if positions.numel() != tokens.shape[0]:
        return f"{positions.numel()} positions for {tokens.shape[0]} rows"
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= grouped.shape[0]):
        return "a position outside the grouped buffer"
    if torch.unique(positions).numel() != positions.numel():
        return "two rows share a grouped row"
    if not torch.equal(grouped[positions], tokens):
        return "a grouped row differs from its token"
    groups = torch.searchsorted(offsets, positions, right=True)
    wrong = (groups != expert_ids).nonzero().flatten()
    if wrong.numel():
        i = int(wrong[0])
        return (
            f"{wrong.numel()} of {expert_ids.numel()} rows in another expert's group "
            f"(row {i}: expert {int(expert_ids[i])}, grouped with expert {int(groups[i])})"
        )
    return None


_INDEX_CHECKS = {
    "gather_rows": _gather_rows,
    "from_expert_order": _from_expert_order,
    "to_expert_order": _to_expert_order,
}


def numeric_outputs(reference: Any, name: str, inputs: dict, out: Any):
    """The op's output as checked (flat, float32 on the host), the truth's (`ReferenceOps`
    on float32 copies of the inputs) and plain PyTorch's (on the same inputs, in their dtype).
    """
    cut = inputs.pop("_cut", None)
    candidate = out.detach()
    if name == "attention":
        candidate = candidate[:1, :, :cut]
    elif name == "grouped_linear":
        candidate = candidate[cut.to(candidate.device)]
    candidate = candidate.cpu().float().reshape(-1)
    method = getattr(reference, name)
    dtype = next(v for v in inputs.values() if isinstance(v, torch.Tensor)).dtype

    def run(to):
        args = {k: (v.to(to) if isinstance(v, torch.Tensor) and v.is_floating_point()
                    else v) for k, v in inputs.items()}  # fmt: skip
        return method(**args).float().reshape(-1)

    return candidate, run(torch.float32), run(dtype)


def snapshot(name: str, inputs: dict) -> dict:
    """Host copies of what the audit needs of an op's inputs: the slice it checks of the
    larger ops (see `harness.compare.ops_audit`), with ``_cut`` saying which part of the output."""
    if name == "attention":
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        group = q.shape[1] // k.shape[1]
        sinks = inputs["sinks"]
        return {
            "q": _copy(q[:1, :group]), "k": _copy(k[:1, :1]), "v": _copy(v[:1, :1]),
            "scaling": inputs["scaling"], "window": inputs["window"],
            "sinks": None if sinks is None else _copy(sinks[:group]),
            "_cut": group * v.shape[-1],
        }  # fmt: skip
    if name == "grouped_linear":
        x, weight, bias = inputs["x"], inputs["weight"], inputs["bias"]
        ends = inputs["offsets"].detach().cpu().long()
        starts = torch.cat([ends.new_zeros(1), ends[:-1]])
        groups = [g for g in range(ends.numel()) if ends[g] > starts[g]][:2]
        rows = torch.cat([torch.arange(int(starts[g]), int(ends[g])) for g in groups]
                         or [torch.zeros(0, dtype=torch.long)])  # fmt: skip
        sizes = torch.tensor([int(ends[g] - starts[g]) for g in groups], dtype=torch.long)
        return {
            "x": _copy(x[rows.to(x.device)]), "weight": _copy(weight[groups]),
            "offsets": torch.cumsum(sizes, 0).to(torch.int32),
            "bias": None if bias is None else _copy(bias[groups]), "_cut": rows,
        }  # fmt: skip
    out = {k: _copy(v) for k, v in inputs.items()}
    if name == "from_expert_order":
        layout = out["layout"]
        out["layout"] = type(layout)(*(_copy(t) for t in layout))
    return out
