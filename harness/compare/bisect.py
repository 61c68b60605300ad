"""First-divergence bisection: which layer, stage and tensor makes two stacks disagree.

When `twinpipe compare` fails, the loss and gradients say *that* the stacks
differ, not *where*. This re-runs one micro-batch through the whole model on
one process, stage by stage (embedding, the five stages of every decoder
layer, the loss), with the baseline's and the candidate's ops. Every stage is
checked in isolation: both sides get the baseline's inputs, their outputs are
compared, then both backpropagate the same random output gradient and their
input and parameter gradients are compared. The first stage whose forward or
backward disagrees beyond tolerance is named, so a kernel author goes straight
to the op that broke. The loss stage is each stack's own: the reference's
cross-entropy of the head's logits, the optimized stack's fused output layer and
cross-entropy (`stack_loss`).

`bisect_rank` is the bisection as `twinpipe compare --bisect` runs it: in a rank process
of its own (a one-rank launch on the run's device, `harness.compare.cli`), with the run's
planted bug (`harness.compare.planted`) and arithmetic (`harness.compare.arithmetic`), so
that what the compare ranks ran is what is bisected.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from models.network import (
    IGNORE_INDEX,
    AttentionOut,
    CombineOut,
    DispatchOut,
    ExpertsOut,
    ModelConfig,
    WeightSource,
    build_part,
)


@dataclass(slots=True)
class Divergence:
    """Where two stacks first disagree."""

    layer: str
    """``embedding``, ``layer N`` or ``loss``."""
    stage: str
    """The stage: attention, dispatch, experts, combine, aggregate, embed, loss."""
    tensor: str
    """The record field, input gradient or parameter gradient that differs."""
    direction: str
    """``forward`` or ``backward``."""
    rel_error: float
    """Relative L2 error of the candidate's tensor against the baseline's."""
    tolerance: float

    def describe(self) -> str:
        return (
            f"first divergence: {self.layer}, stage {self.stage}, {self.direction} tensor "
            f"{self.tensor}: relative error {self.rel_error:.3e} > {self.tolerance:.0e}"
        )


LossStage = Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]
"""``loss(part, hidden, labels)``: the summed loss of a whole model's last hidden states."""


def stack_loss(name: str) -> LossStage:
    """The loss stage of stack ``name``: the part's own cross-entropy of its logits (oracle,
    reference), or the optimized stack's fused output layer and cross-entropy, the object
    its schedule calls (so a bug in it, planted or not, is bisected too)."""
    if name in ("optimized", "optimized-fsdp"):
        from optimized.pipeline.dualpipev import SummedLinearCrossEntropy  # noqa: PLC0415

        fused = SummedLinearCrossEntropy()

        def fused_loss(part, hidden, labels):
            return part.lm_head.fused_loss(part.model.norm(hidden), labels, fused)[0]

        return fused_loss
    stack_ops(name)  # a name check
    return lambda part, hidden, labels: part.loss_sum(hidden, labels)


def stack_ops(name: str):
    """The ops object of a stack by name (oracle and reference share the plain ops)."""
    if name in ("oracle", "reference"):
        from reference.ops import ReferenceOps  # noqa: PLC0415

        return ReferenceOps()
    if name in ("optimized", "optimized-fsdp"):
        from optimized.ops import OptimizedOps  # noqa: PLC0415

        return OptimizedOps()
    raise ValueError(
        f"unknown stack {name!r}; expected oracle, reference, optimized or optimized-fsdp"
    )


def _rel(candidate: torch.Tensor, baseline: torch.Tensor) -> float:
    if candidate.shape != baseline.shape:
        return math.inf
    c, b = candidate.double(), baseline.double()
    if not torch.isfinite(c).all():
        return math.inf
    denom = b.norm().item()
    diff = (c - b).norm().item()
    return diff / denom if denom else (0.0 if diff == 0 else math.inf)


def _tensors(value: Any, prefix: str) -> dict[str, torch.Tensor]:
    """Floating-point tensors of a stage record, by field name."""
    if isinstance(value, torch.Tensor):
        return {prefix: value} if value.is_floating_point() else {}
    if hasattr(value, "_fields"):
        out = {}
        for field in value._fields:
            out.update(_tensors(getattr(value, field), f"{prefix}.{field}"))
        return out
    if type(value) is tuple:
        out = {}
        for i, item in enumerate(value):
            out.update(_tensors(item, f"{prefix}[{i}]"))
        return out
    return {}


def _leaf(value: Any) -> Any:
    """A detached copy of a record whose float tensors are fresh leaves needing grad."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            return value.detach().clone().requires_grad_()
        return value
    if hasattr(value, "_fields"):
        return type(value)(*(_leaf(getattr(value, f)) for f in value._fields))
    if type(value) is tuple:
        return tuple(_leaf(item) for item in value)
    return value


class _Checker:
    def __init__(self, tolerance: float, generator: torch.Generator) -> None:
        self.tolerance = tolerance
        self.generator = generator

    def stage(
        self,
        where: str,
        stage: str,
        run: Callable[[Any, Any], Any],
        inputs: Any,
        base_module: torch.nn.Module,
        cand_module: torch.nn.Module,
    ) -> tuple[Any, Divergence | None]:
        """Run ``run(inputs, side)`` for both sides on the same inputs; compare both ways."""
        base_in, cand_in = _leaf(inputs), _leaf(inputs)
        base_out = run(base_in, "baseline")
        cand_out = run(cand_in, "candidate")
        base_t, cand_t = _tensors(base_out, "out"), _tensors(cand_out, "out")
        for name, tensor in base_t.items():
            rel = _rel(cand_t[name], tensor)
            if rel > self.tolerance:
                return base_out, Divergence(where, stage, name, "forward", rel, self.tolerance)
        outputs = [t for t in base_t.values() if t.requires_grad]
        if not outputs:
            return base_out, None
        # Drawn on the CPU (the same on every device), then put where the outputs are.
        cotangents = [
            torch.randn(t.shape, generator=self.generator).to(t.device, t.dtype) for t in outputs
        ]
        cand_outputs = [cand_t[name] for name, t in base_t.items() if t.requires_grad]
        base_in_t, cand_in_t = _tensors(base_in, "in"), _tensors(cand_in, "in")
        base_params = dict(base_module.named_parameters())
        cand_params = dict(cand_module.named_parameters())
        base_grads = _grads(outputs, cotangents, base_in_t, base_params)
        cand_grads = _grads(cand_outputs, cotangents, cand_in_t, cand_params)
        for name, grad in base_grads.items():
            rel = _rel(cand_grads[name], grad)
            if rel > self.tolerance:
                label = name if name.startswith("in") else f"grad of {name}"
                return base_out, Divergence(where, stage, label, "backward", rel, self.tolerance)
        return base_out, None


def _grads(outputs, cotangents, inputs: dict, params: dict) -> dict[str, torch.Tensor]:
    wanted = {n: t for n, t in inputs.items() if t.requires_grad}
    wanted.update(params)
    names = list(wanted)
    grads = torch.autograd.grad(outputs, [wanted[n] for n in names], cotangents, allow_unused=True)
    return {
        name: (grad if grad is not None else torch.zeros_like(wanted[name]))
        for name, grad in zip(names, grads)
    }


def bisect(
    model: ModelConfig,
    source: WeightSource | dict[str, torch.Tensor],
    baseline_ops,
    candidate_ops,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    tolerance: float = 1e-5,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    losses: tuple[LossStage, LossStage] | None = None,
) -> Divergence | None:
    """Name the first stage where ``candidate_ops`` disagree with ``baseline_ops``, or None.

    The models are built on the device of ``input_ids``; ``losses``: the baseline's and
    the candidate's loss stage (`stack_loss`; default: each part's cross-entropy)."""
    device = input_ids.device
    base = build_part(model, source, ops=baseline_ops, dtype=dtype, device=device)
    cand = build_part(model, source, ops=candidate_ops, dtype=dtype, device=device)
    loss_of = dict(zip(("baseline", "candidate"), losses or (stack_loss("reference"),) * 2))
    checker = _Checker(tolerance, torch.Generator().manual_seed(seed))
    models = {"baseline": base, "candidate": cand}
    ops = {"baseline": baseline_ops, "candidate": candidate_ops}

    hidden, found = checker.stage(
        "embedding", "embed", lambda ids, who: models[who].embed(ids), input_ids,
        base.model.embed_tokens, cand.model.embed_tokens,
    )  # fmt: skip
    if found:
        return found
    for index in range(model.num_hidden_layers):
        where = f"layer {index}"
        layers = {name: models[name].layer(index) for name in models}

        def stage_fn(method: str, layers=layers):
            def run(inputs, who):
                return getattr(layers[who], method)(*inputs, ops[who])

            return run

        pair = (layers["baseline"], layers["candidate"])
        a, found = checker.stage(where, "attention", stage_fn("attention"), (hidden,), *pair)
        if found:
            return found
        d, found = checker.stage(where, "dispatch", stage_fn("dispatch"), (a,), *pair)
        if found:
            return found
        e, found = checker.stage(where, "experts", stage_fn("experts"), (d,), *pair)
        if found:
            return found
        c, found = checker.stage(where, "combine", stage_fn("combine"), (a, e, d), *pair)
        if found:
            return found
        hidden, found = checker.stage(where, "aggregate", stage_fn("aggregate"), (a, c), *pair)
        if found:
            return found

    count = max(int((labels != IGNORE_INDEX).sum()), 1)
    _, found = checker.stage(
        "loss", "loss", lambda h, who: loss_of[who](models[who], h, labels) / count, hidden,
        base, cand,
    )  # fmt: skip
    return found


def bisect_rank(plan: Any) -> dict[str, Any] | None:
    """Bisect micro-batch 0 of step 0 of a compare run (`harness.compare.rank.RankPlan`) in
    this rank process, on its device, with the plan's planted bug; the divergence's fields,
    or None when every stage agrees."""
    from harness.compare.arithmetic import rank_arithmetic  # noqa: PLC0415
    from harness.compare.planted import planted  # noqa: PLC0415
    from models.runtime import synthetic_batch  # noqa: PLC0415

    parallel = plan.parallel
    arithmetic = rank_arithmetic(parallel.torch_dtype, plan.deterministic)
    with arithmetic as arithmetic, planted(plan.plant):
        ids, labels = synthetic_batch(plan.model, parallel, 0, arithmetic.device)
        size = parallel.micro_batch_size
        found = bisect(
            plan.model, plan.weights, stack_ops(plan.baseline), stack_ops(plan.candidate),
            ids[:size], labels[:size], tolerance=1e-5 if parallel.dtype == "float32" else 1e-2,
            seed=parallel.seed, dtype=parallel.torch_dtype,
            losses=(stack_loss(plan.baseline), stack_loss(plan.candidate)),
        )  # fmt: skip
    return None if found is None else {f: getattr(found, f) for f in found.__slots__}


__all__ = [
    "AttentionOut",
    "CombineOut",
    "Divergence",
    "DispatchOut",
    "ExpertsOut",
    "bisect",
    "bisect_rank",
    "stack_loss",
    "stack_ops",
]
