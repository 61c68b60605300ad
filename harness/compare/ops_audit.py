"""The ops audit: each of the candidate's ops, on the inputs the run gave it, against plain
PyTorch, beside the pipeline verdict.

Why. The pipeline verdict (`harness.compare.noise_floor`) judges a whole step against a
float32 truth, within ``k`` times the reference's own bfloat16 error. At real widths some
bugs are smaller than a step's bfloat16 noise and pass it (docs/results.json holds the
figures at mid width): a bfloat16 activation stored toward zero, and one token in a few thousand
computed by the wrong expert. At the op that produced them neither is small: truncation shifts
every element of the op's output by half a unit in the last place, always toward zero,
and a misrouted row is a wrong index, exactly. So the audit looks there.

What runs. While the candidate's forward runs in bfloat16, each audited op's inputs are
copied to the host and the op's output is checked against plain PyTorch (`ReferenceOps`):

- index ops, every call: ``gather_rows`` and ``from_expert_order`` must equal ``x[index]``
  bit for bit; ``to_expert_order`` must keep every row bit for bit, put each row in its
  own expert's group (``expert_ids``, as the op was given them), and use each grouped row
  once (the `ExpertLayout` contract in `models.network.ops`);
- numeric ops, the first call of each per step (``attention``, ``grouped_linear``,
  ``silu_and_mul``, ``clamped_swiglu``, ``scatter_add_rows``, ``cross_entropy``): the
  truth is `ReferenceOps` on float32 copies of the same inputs; the candidate's error
  ``e_c`` (relative L2 against the truth) and the reference's ``e_r`` (`ReferenceOps` on
  the same bfloat16 inputs) are measured, and so is each one's *bias*: each element's
  error toward the truth's sign in units of the truth's bfloat16 spacing,
  ``u = err * sign(t) / spacing(t)``, and ``beta = mean(u) / rms(u)``.

The op passes when ``e_c <= K * e_r + SLACK_REL`` (the noise floor's ``k``: as precise as
plain PyTorch up to that factor) and ``|beta_c| <= |beta_r| + Z / sqrt(N) + SLACK_BIAS``.
Rounding to nearest even has no bias: ``beta`` is then zero up to ``1 / sqrt(N)`` over
``N`` independent elements, and ``Z = 6`` standard deviations leave room for that at the
smallest op this suite audits (a few thousand elements). Rounding toward zero has
``beta = -sqrt(3) / 2 = -0.87`` whatever the width (``u`` is uniform on ``[-1, 0]``); its
RMS error is about twice rounding to nearest's, so ``e_c`` alone sits near the ``K = 2``
edge and the bias is what catches it. ``SLACK_BIAS = 0.05`` covers
reductions whose rounding errors are not quite independent. A dropped sink or window makes
``e_c`` of order one.

Bounded cost. The audit runs on the host with the memory tracker's dispatch mode
suspended: what it allocates is not in the measured peak (its transient RSS is, like the
spill's). Numeric ops are audited once per step; attention on its first batch element and
first key/value head's query group, ``grouped_linear`` on its first two non-empty groups.
It is off in float32 (DESIGN.md's float32 bounds are already at rounding level) and when
the candidate is plain PyTorch (`twinpipe compare --ops-audit off` turns it off).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from harness.compare.instruments import Instrument
from harness.compare.op_checks import (
    error_stats,
    host,
    index_problem,
    nonfinite_problem,
    numeric_outputs,
    snapshot,
)
from harness.compare.record import StepRecord

K = 2.0
"""The candidate's error may be this many times the reference's (as the noise floor's)."""
Z = 6.0
"""Standard deviations of the bias of ``N`` unbiased rounding errors allowed (``Z / sqrt(N)``)."""
SLACK_BIAS = 0.05
SLACK_REL = 1e-6
"""Relative L2 slack, for ops both sides compute exactly."""

INDEX_OPS = ("gather_rows", "to_expert_order", "from_expert_order")
NUMERIC_OPS = (
    "attention", "grouped_linear", "silu_and_mul", "clamped_swiglu", "scatter_add_rows",
    "cross_entropy",
)  # fmt: skip


class OpsAudit(Instrument):
    """Audits the ops of one class while `active` (the candidate's regions); results per
    step, as scalars, into the step's record."""

    def __init__(self, ops_class: type) -> None:
        from reference.ops import ReferenceOps  # noqa: PLC0415

        self.ops_class = ops_class
        self.reference = ReferenceOps()
        self.active = False
        self.results: list[dict[str, Any]] = []
        self._seen: set[str] = set()
        self._busy = False
        self._calls: dict[str, int] = {}

    # ----------------------------------------------------------------- plumbing
    @contextmanager
    def installed(self) -> Iterator[None]:
        """The audit wrapped around the class's ops (whatever is on the class now, a planted
        bug included) while the block runs."""
        saved = []
        try:
            for name in INDEX_OPS + NUMERIC_OPS:
                original = getattr(self.ops_class, name, None)
                if original is None:
                    continue
                saved.append((name, original))
                setattr(self.ops_class, name, self._wrap(name, original))
            yield
        finally:
            for name, original in reversed(saved):
                setattr(self.ops_class, name, original)

    def start_step(self) -> None:
        self.results, self._seen, self._calls = [], set(), {}

    @contextmanager
    def region(self, key: str, phase: str, held: int) -> Iterator[None]:
        """Active while the candidate runs."""
        self.active = key == "candidate"
        try:
            yield
        finally:
            self.active = False

    def end_step(self, record: StepRecord) -> None:
        record.ops_audit = self.results

    def _wants(self, name: str) -> bool:
        if not self.active or self._busy:
            return False
        return name in INDEX_OPS or name not in self._seen

    def _wrap(self, name: str, original):
        from models.network import Ops  # noqa: PLC0415

        # The interface's signature: a planted bug may wrap the method as (self, x, *args).
        signature = inspect.signature(getattr(Ops, name))
        audit = self

        def audited(ops, *args, **kwargs):
            if not audit._wants(name):
                return original(ops, *args, **kwargs)
            bound = signature.bind(ops, *args, **kwargs)
            bound.apply_defaults()
            inputs = dict(list(bound.arguments.items())[1:])  # without self
            tensors = [v for v in inputs.values() if isinstance(v, torch.Tensor)]
            if tensors[0].dtype != torch.bfloat16 or any(
                type(t).__name__ == "DTensor" for t in tensors
            ):
                return original(ops, *args, **kwargs)  # bfloat16 runs, plain tensors only
            with host():
                copies = snapshot(name, inputs)
            out = original(ops, *args, **kwargs)
            audit._busy = True
            try:
                with host():
                    audit._check(name, copies, out)
            finally:
                audit._busy = False
            return out

        audited.__wrapped__ = original
        return audited

    # ------------------------------------------------------------------ checks
    def _record(self, name: str, **figures: Any) -> None:
        call = self._calls.get(name, 0)
        self._calls[name] = call + 1
        self._seen.add(name)
        self.results.append({"op": name, "call": call, **figures})

    def _check(self, name: str, inputs: dict[str, Any], out: Any) -> None:
        if name in INDEX_OPS:
            problem = index_problem(name, inputs, out)
            self._record(name, kind="index", passed=problem is None, problem=problem)
            return
        candidate, truth, reference = numeric_outputs(self.reference, name, inputs, out)
        problem = nonfinite_problem(candidate, truth)
        if problem is not None:
            self._record(name, kind="numeric", passed=False, problem=problem,
                         elements=candidate.numel())  # fmt: skip
            return
        # Non-finite in the same places as the truth: the errors are the finite elements'.
        keep = torch.isfinite(truth) & torch.isfinite(reference)
        candidate, truth, reference = candidate[keep], truth[keep], reference[keep]
        e_c, beta_c, n = error_stats(candidate, truth)
        e_r, beta_r, _ = error_stats(reference, truth)
        rel_limit = K * e_r + SLACK_REL
        bias_limit = abs(beta_r) + Z / math.sqrt(n) + SLACK_BIAS
        problems = []
        if e_c > rel_limit:
            problems.append(
                f"error {e_c:.3g} against float32 is {e_c / max(e_r, 1e-30):.2f}x plain "
                f"PyTorch's {e_r:.3g} (limit {rel_limit:.3g})"
            )
        if n > 1 and abs(beta_c) > bias_limit:
            problems.append(
                f"biased: mean error toward the truth's sign {beta_c:+.3f} of its RMS, plain "
                f"PyTorch {beta_r:+.3f} (limit +-{bias_limit:.3f}; rounding toward zero "
                "gives -0.87)"
            )
        self._record(
            name, kind="numeric", passed=not problems, problem="; ".join(problems) or None,
            elements=n, rel_error=e_c, reference_rel_error=e_r, rel_limit=rel_limit,
            bias=beta_c, reference_bias=beta_r, bias_limit=bias_limit,
        )  # fmt: skip


def ops_class(stack: str) -> type | None:
    """The ops class a stack's ops are audited on; None for plain PyTorch (nothing to audit)."""
    if not stack.startswith("optimized"):
        return None
    from optimized.ops import OptimizedOps  # noqa: PLC0415

    return OptimizedOps


def summarize(per_rank: list[dict], steps: int) -> tuple[dict | None, list[str]]:
    """The report's ``ops_audit`` section and its problems, from each rank's step records
    (``None`` when no step was audited)."""
    ops: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    audited = False
    for rank, result in enumerate(per_rank):
        for step in range(steps):
            for row in result["steps"][step].ops_audit or []:
                audited = True
                entry = ops.setdefault(row["op"], {"kind": row["kind"], "calls": 0, "failed": 0})
                entry["calls"] += 1
                if row["kind"] == "numeric" and "rel_error" in row:
                    ratio = row["rel_error"] / max(row["reference_rel_error"], 1e-30)
                    entry["worst_error_ratio"] = max(entry.get("worst_error_ratio", 0.0), ratio)
                    worst = entry.get("worst_bias")
                    if worst is None or abs(row["bias"]) > abs(worst[0]):
                        entry["worst_bias"] = [row["bias"], row["bias_limit"]]
                if not row["passed"]:
                    entry["failed"] += 1
                    if entry["failed"] == 1:
                        problems.append(
                            f"step {step}: ops audit: rank {rank}: {row['op']} call "
                            f"{row['call']}: {row['problem']}"
                        )
    if not audited:
        return None, []
    settings = {"k": K, "z": Z, "slack_bias": SLACK_BIAS, "slack_rel": SLACK_REL}
    return {"passed": not problems, "settings": settings, "ops": ops}, problems
