"""Faults injected into a training run, for tests: ``TWINPIPE_FAULT=KIND@STEP:RANK``.

At 0-based step STEP on global rank RANK (0 when left out):

- before the step's forward: ``crash`` (raise), ``sigterm`` or ``sigkill`` (signal this
  process), ``ckpt-dir-gone`` (replace ``checkpoint.dir`` by a file, as a disk that went away
  would);
- after the backward, the gradients reduced: ``nan-grad`` (fill this rank's gradients with
  NaN);
- mid-step, a NaN in the first element of every output of one kind on this rank during the
  step: ``nan-attention`` (each attention call's output; every call, so that the optimized
  stack's recomputation in backward meets the same NaN as its forward did), ``nan-mlp`` (each
  routed-expert call's output, in expert order, before the combine all-to-all sends it back
  to its tokens' ranks) or ``nan-loss-grad`` (the gradient the loss sends back into the final
  norm's output, each micro-batch's; on a rank that holds the loss).

A mid-step NaN has to travel as a GPU's would: through the pipeline's sends, the all-to-all,
the gradient reductions. Nothing stops it on the way, so the step's end (`optimized.train.
trainer`) must see it on every rank, skip the step there or stop the run naming the step. A
fault that finds nothing to hit on its rank (no attention, no routed experts, no loss) is an
error, not a quiet pass.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

BEFORE_STEP = ("crash", "sigterm", "sigkill", "ckpt-dir-gone")
MID_STEP = ("nan-attention", "nan-mlp", "nan-loss-grad")
KINDS = (*BEFORE_STEP, "nan-grad", *MID_STEP)
ENV = "TWINPIPE_FAULT"


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    step: int
    """0-based."""
    rank: int

    def at(self, step: int, rank: int, *kinds: str) -> bool:
        """Whether this fault strikes ``rank`` at ``step`` (and is one of ``kinds``, if given)."""
        return self.step == step and self.rank == rank and (not kinds or self.kind in kinds)


def fault_from_env() -> Fault | None:
    """The fault ``TWINPIPE_FAULT`` asks for, or None; a ValueError naming a malformed one."""
    spec = os.environ.get(ENV)
    if not spec:
        return None
    kind, _, where = spec.partition("@")
    step, _, rank = where.partition(":")
    if kind not in KINDS or not step.isdigit() or not (rank or "0").isdigit():
        raise ValueError(f"{ENV}={spec!r} is invalid: KIND@STEP[:RANK] with KIND one of {KINDS}")
    return Fault(kind, int(step), int(rank or 0))


def before_step(fault: Fault, step: int, rank: int, checkpoint_dir: str | None) -> None:
    if not fault.at(step, rank, *BEFORE_STEP):
        return
    if fault.kind == "crash":
        raise RuntimeError(f"injected fault: rank {rank} crashed at step {step + 1}")
    if fault.kind in ("sigterm", "sigkill"):
        os.kill(os.getpid(), signal.SIGTERM if fault.kind == "sigterm" else signal.SIGKILL)
    if fault.kind == "ckpt-dir-gone" and checkpoint_dir:
        shutil.rmtree(checkpoint_dir, ignore_errors=True)
        Path(checkpoint_dir).write_text("the disk went away\n")


def after_backward(fault: Fault, step: int, rank: int, part: torch.nn.Module) -> None:
    if fault.at(step, rank, "nan-grad"):
        for p in part.parameters():
            if p.grad is not None:
                p.grad.fill_(float("nan"))


def with_nan(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its first element NaN (out of place, so autograd's saved tensors stay)."""
    first = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    first.view(-1)[0] = True
    return torch.where(first, torch.full((), float("nan"), dtype=x.dtype, device=x.device), x)


@contextmanager
def mid_step(fault: Fault, step: int, rank: int, part: torch.nn.Module) -> Iterator[None]:
    """Around the step's forward and backward: plant the fault's NaN on this rank (nothing
    for any other fault, step or rank); raise if it found nothing to land in."""
    if not fault.at(step, rank, *MID_STEP):
        yield
        return
    hits = [0]

    def nan_in(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.numel() == 0:
            return tensor
        hits[0] += 1
        return with_nan(tensor)

    undo = []
    if fault.kind in ("nan-attention", "nan-mlp"):
        # The stack's ops class, in this rank's process only: a stack may make a fresh ops
        # object each step (the optimized one does), so an instance would be missed.
        ops_class = type(part.ops)
        name = "attention" if fault.kind == "nan-attention" else "from_expert_order"
        own = ops_class.__dict__.get(name)
        original = getattr(ops_class, name)

        def planted(self, *args, **kwargs):
            return nan_in(original(self, *args, **kwargs))

        setattr(ops_class, name, planted)
        undo.append(lambda: setattr(ops_class, name, own) if own else delattr(ops_class, name))
    elif getattr(part, "has_head", False):

        def on_gradient(module, inputs, output) -> None:
            if output.requires_grad:
                output.register_hook(nan_in)  # the loss's gradient, on its way back

        undo.append(part.model.norm.register_forward_hook(on_gradient).remove)
    try:
        yield
    finally:
        for step_back in undo:
            step_back()
    if not hits[0]:
        what = {"nan-attention": "attention", "nan-mlp": "routed experts",
                "nan-loss-grad": "loss"}[fault.kind]  # fmt: skip
        raise RuntimeError(
            f"{ENV}={fault.kind}@{fault.step}:{fault.rank}: rank {rank} ran no {what} in step "
            f"{step + 1}; choose a rank that holds one"
        )
