"""What one rank sends back for one step: `StepRecord`, written by the step order
(`harness.compare.lockstep`) and the rank's instruments (`harness.compare.instruments`),
read by the verdict (`harness.compare.verdict`), the noise floor and the ops audit's
summary.

Every field is a scalar or a small mapping of scalars: the record travels from each rank
to the parent. The comparisons (``grads``, ``grads_truth``, ``params``) are the same on
every rank after their all-reduce, so only rank 0 keeps them (`drop_shared`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.compare.inplace import Sums


@dataclass(slots=True)
class StepRecord:
    """One training step on one rank."""

    loss: dict[str, float] = field(default_factory=dict)
    """The step's loss per stack: ``baseline``, ``candidate`` and, with the noise floor,
    ``truth`` (the float32 reference)."""
    time: dict[str, float] = field(default_factory=dict)
    """Seconds of each stack's own work in the step (a shared update counts for both)."""
    held: int = 0
    """The most bytes the harness held beside a running stack (`harness.compare.meter`)."""
    grads: dict[str, Sums] | None = None
    """Per parameter: the candidate's gradient against the baseline's (rank 0 only)."""
    grads_truth: dict[str, dict[str, Sums]] | None = None
    """Per stack (``baseline``, ``candidate``), per parameter: its gradient against the
    float32 truth's (the noise floor; rank 0 only)."""
    params: dict[str, Sums] | None = None
    """Per parameter after the update: the candidate's against the baseline's (rank 0)."""
    spilled: int = 0
    """Bytes of the truth's gradients written to a file (`harness.compare.spill`)."""
    parked: int = 0
    """Bytes of AdamW's moments parked in a file while the truth ran."""
    ops_audit: list[dict[str, Any]] | None = None
    """The candidate's ops against plain PyTorch (`harness.compare.ops_audit`), one row
    per audited call; None when not audited."""
    routing: dict[str, Any] = field(default_factory=dict)
    """Per replaying stack, its `models.network.routing.ReplayResult` (pinned routing)."""
    balancing: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per stack (``baseline``, ``candidate``), its routing controls after the step
    (`harness.compare.balancing.stack_balance`): losses, load and expert biases."""
    memory: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    """Per stack (and ``truth``), the step's peak: the largest of its regions
    (`harness.compare.meter.Meter.finish_step`); None when not measured."""

    def drop_shared(self) -> None:
        """Forget the comparisons, which rank 0 sends for every rank."""
        self.grads = self.grads_truth = self.params = None
