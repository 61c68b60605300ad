"""When FSDP2 reduces gradients and reshards parameters within a DualPipeV step.

FSDP2's default reduce-scatters a module's gradients in every backward's post-backward
hook: with M micro-batches, M reductions of every unit per step where one would do, M
times the traffic. Here each FSDP unit (a `fully_shard`-ed module) belongs to one chunk
of this rank (its layer's, the embedding's: chunk 0, the final norm's and the output
layer's: chunk 1), and the static schedule says in advance which backward of a chunk is
its last and which W step completes its deferred expert weight gradients
(`optimized.estimator.sync_marks`). `GradientSync` is told of every backward and every W
by the schedule and sets, per unit, right before the chunk's backward:

- ``set_requires_gradient_sync(last)``: the post-backward hook reduce-scatters only in
  the chunk's last backward; before it the unsharded gradients accumulate in FSDP2's
  unsharded parameters' ``.grad`` (autograd sums into them, W closures too). This is
  FSDP2's own switch for gradient accumulation without communication. The units are
  the modules' own roots (nothing forwards the part as a whole), so
  ``set_is_last_backward`` would only say when to wait for pending reductions and
  clear prefetch state at the end of each autograd call, which the default already does;
  it cannot say *whether* to reduce, so it is not the switch here;
- for the routed experts of a chunk whose last weight gradients arrive in a W step
  after its last backward, no sync at that backward; once that W has run, the unit's
  post-backward is run again with syncing on (`reduce_unit`): one reduce-scatter of all
  the micro-batches' expert weight gradients, the W steps' included;
- with ``reshard_after_forward`` off, ``set_reshard_after_backward(last)``: parameters
  are all-gathered at a unit's first forward and stay gathered until its last backward,
  one all-gather per unit per step instead of one per forward and one per backward;
- a unit of one chunk that the other chunk's backward also runs (``ChunkUnits.shared``:
  the embedding, which the MTP module runs in pp-rank 0's loss stage) neither syncs nor
  reshards there: its own chunk's last backward, which comes later, does both;
- a unit that one micro-batch's pass runs more than once (``ChunkUnits.repeated``: with
  the MTP module, the loss stage's final norm and output layer) would have its hooks
  reduce-scatter at each use's post-backward, and, once resharded by the first, gather
  again for the next: it neither syncs nor reshards inside the backward, and `flush`
  reduces it once after (`reduce_unit`), resharding it after the chunk's last backward.

``grad_sync="micro-batch"`` keeps FSDP2's default (a reduction after every backward) and
reduces the W steps' leftovers at the end (`reduce_pending_gradients`),
for jobs that cannot hold the unsharded gradients of a whole chunk across the step.

Cost of ``step``: every unit's unsharded gradient lives from the chunk's first backward to
its last (the estimator counts it, ``EstimateConfig.grad_sync``).
"""

from __future__ import annotations

from typing import NamedTuple

from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from models.runtime import GRAD_SYNC
from optimized.estimator.sync_marks import SyncMarks


class ChunkUnits(NamedTuple):
    """The FSDP units of one chunk of this rank."""

    dense: list[FSDPModule]
    """Everything whose gradients are complete at the chunk's backward."""
    experts: list[FSDPModule]
    """The routed experts, whose weight gradients a zero-bubble backward defers to W."""
    shared: list[FSDPModule] = []
    """Units of the other chunk that this chunk also runs, and whose gradients the other
    chunk's last backward reduces (the embedding, run by the MTP module in pp-rank 0's loss
    stage, chunk 1: its chunk 0's last backward comes after every backward of chunk 1)."""
    repeated: list[FSDPModule] = []
    """Units of this chunk (among ``dense``) that one micro-batch's pass runs more than once
    (with the MTP module, the loss stage's final norm and output layer: the main loss's and
    each depth's): their hooks would reduce and reshard at each use, so the sync does both
    once, after the backward."""


def chunk_units(part: nn.Module, chunks: tuple[list[int], list[int]], pp_rank: int) -> tuple:
    """The FSDP units of each of this rank's two chunks (stage ``pp_rank`` is chunk 0,
    with the embedding on rank 0; chunk 1 holds the loss stage's final norm and output
    layer on rank 0)."""
    out = []
    for chunk, layers in enumerate(chunks):
        dense: list[nn.Module] = []
        experts: list[nn.Module] = []
        if pp_rank == 0 and chunk == 0:
            dense.append(getattr(part.model, "embed_tokens", None))
        for index in layers:
            layer = part.layer(index)
            for name, module in layer.named_modules():
                (experts if name == "mlp.experts" else dense).append(module)
        shared: list[nn.Module] = []
        repeated: list[nn.Module] = []
        if pp_rank == 0 and chunk == 1:
            head = [getattr(part.model, "norm", None), getattr(part, "lm_head", None)]
            dense += head
            # The MTP layers: complete at the backward (their experts run on the part's
            # ops, which defer nothing to W); they run the head again, and chunk 0's
            # embedding.
            mtp = getattr(part, "mtp_layers", [])
            for layer in mtp:
                dense += list(layer.modules())
            if mtp:
                shared.append(getattr(part.model, "embed_tokens", None))
                repeated += head

        def units(modules: list) -> list[FSDPModule]:
            return [m for m in modules if isinstance(m, FSDPModule)]

        out.append(ChunkUnits(units(dense), units(experts), units(shared), units(repeated)))
    return tuple(out)


def _has_unsharded_grads(unit: FSDPModule) -> bool:
    state = fully_shard.state(unit)
    return any(
        getattr(param, "_unsharded_param", None) is not None
        and param._unsharded_param.grad is not None
        for group in state._fsdp_param_groups
        for param in group.fsdp_params
    )


def reduce_unit(unit: FSDPModule) -> bool:
    """Reduce-scatter what ``unit``'s unsharded parameters' ``.grad`` holds now, outside
    any backward; False when it holds nothing (no collective then).

    FSDP2 has no public call for "reduce what has accumulated": this runs the unit's
    post-backward again and then its root's end-of-backward callback, as
    `torch.distributed.pipelining` does for its zero-bubble schedules
    (``_PipelineStageBase.perform_reduce_grad``, torch 2.13): private API, kept to here
    and `reduce_pending_gradients` (torch is pinned).
    """
    if not _has_unsharded_grads(unit):
        return False
    unit.set_requires_gradient_sync(True)
    state = fully_shard.state(unit)
    for group in state._fsdp_param_groups:
        group.post_backward()
    state._root_post_backward_final_callback()
    return True


def reduce_pending_gradients(part: nn.Module) -> int:
    """Reduce-scatter the gradients still waiting in FSDP2's unsharded parameters: those
    the W steps added after a module's last post-backward hook of the step (see the
    module docstring; ``grad_sync="micro-batch"``). Collective over each module's mesh; a
    module with none does nothing. Returns how many units it reduced (`reduce_unit`)."""
    return sum(reduce_unit(m) for m in part.modules() if isinstance(m, FSDPModule))


class GradientSync:
    """Syncs each FSDP unit's gradients at the marks of `sync_marks` (see the module
    docstring). The schedule calls `before_backward` and `after_weight`; the runner calls
    `begin` and `finish` around each step."""

    def __init__(
        self,
        units: tuple[ChunkUnits, ChunkUnits],
        marks: SyncMarks,
        mode: str = "step",
        reshard_after_forward: bool = False,
    ) -> None:
        if mode not in GRAD_SYNC:
            raise ValueError(f"grad_sync={mode!r} is invalid: expected one of {GRAD_SYNC}")
        self.units, self.marks, self.mode = units, marks, mode
        self.reshard_after_forward = reshard_after_forward
        self.backwards = [0, 0]
        self.weights = 0
        self.reductions = 0
        """Explicit reductions after W steps in the last step (tests)."""
        self.pending: list[tuple[FSDPModule, bool]] = []
        """``(unit, reshard)``: repeated or shared units the last backward left to reduce
        (`flush`)."""

    def all_units(self) -> list[FSDPModule]:
        return [u for chunk in self.units for u in chunk.dense + chunk.experts]

    def begin(self) -> None:
        """Every unit sharded and not syncing until its mark (``micro-batch``: syncing)."""
        self.backwards, self.weights, self.reductions = [0, 0], 0, 0
        for unit in self.all_units():
            unit.reshard()  # a forward-only pass with reshard-after-forward off left it gathered
            unit.set_requires_gradient_sync(self.mode == "micro-batch")

    def flush(self) -> None:
        """Reduce (and, after their chunk's last backward, reshard) the units the last
        backward ran more than once, or ran for the other chunk (``micro-batch``): at the
        rank's next backward or W, or the step's end, whichever comes first."""
        for unit, reshard in self.pending:
            if reshard:
                unit.set_reshard_after_backward(True)
            if not reduce_unit(unit) and reshard:
                unit.reshard()
        self.pending = []

    def before_backward(self, chunk: int) -> None:
        """The schedule is about to run a backward of ``chunk``."""
        self.flush()
        ordinal = self.backwards[chunk]
        self.backwards[chunk] += 1
        last = ordinal == self.marks.last_backward[chunk]
        units = self.units[chunk]
        if self.mode == "step":
            for unit in units.dense:
                unit.set_requires_gradient_sync(last)
            experts_done = last and self.marks.last_weight[chunk] is None
            for unit in units.experts:
                unit.set_requires_gradient_sync(experts_done)
        if not self.reshard_after_forward:
            for unit in units.dense + units.experts:
                unit.set_reshard_after_backward(last)
        # Neither reduced nor resharded inside this backward: a repeated unit once after it
        # (`flush`), a shared one by its own chunk's last backward (``micro-batch``: also
        # reduced once after this one).
        for unit in units.repeated + units.shared:
            unit.set_requires_gradient_sync(False)
            if not self.reshard_after_forward:
                unit.set_reshard_after_backward(False)
        if self.mode == "micro-batch" or last:
            reshard = last and not self.reshard_after_forward
            self.pending = [(unit, reshard) for unit in units.repeated]
        if self.mode == "micro-batch":
            self.pending += [(unit, False) for unit in units.shared]

    def after_weight(self) -> None:
        """The schedule has just run a W step."""
        self.flush()
        ordinal = self.weights
        self.weights += 1
        if self.mode != "step":
            return
        for chunk in (0, 1):
            if self.marks.last_weight[chunk] == ordinal:
                for unit in self.units[chunk].experts:
                    self.reductions += reduce_unit(unit)

    def finish(self, part: nn.Module) -> None:
        """After the step's last action: micro-batch mode reduces the W steps' leftovers;
        either mode then checks that no unit holds an unreduced gradient (a wrong mark
        would leave one, to be lost or added into the next step)."""
        self.flush()
        if self.mode == "micro-batch":
            reduce_pending_gradients(part)
        left = [type(u).__name__ for u in self.all_units() if _has_unsharded_grads(u)]
        if left:
            raise RuntimeError(
                f"gradient sync: {len(left)} FSDP unit(s) ({', '.join(sorted(set(left)))}) "
                f"hold gradients never reduced this step; the sync marks {self.marks} do not "
                f"match the schedule (backwards run per chunk: {self.backwards}, W steps: "
                f"{self.weights})"
            )
