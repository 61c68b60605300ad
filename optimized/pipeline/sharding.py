"""Data-parallel sharding of `twinpipe train` with FSDP2 (`fully_shard`), module by module.

The DualPipeV stages call a decoder layer's stage methods, never ``layer.forward``
(the optimized stack) or run a layer's stages one after another (the reference), but
every *leaf* module inside them is called through its own ``forward`` (or, for the
output layer, a registered forward method): the norms, the attention block, the dense
MLP, the router, the shared experts, the routed experts, the embedding, the final norm
and the output layer. Each is `fully_shard`-ed on
its own, so each is its own FSDP2 parameter group and its own FSDP2 root (nothing forwards
the pipeline part as a whole):

- parameters, gradients and AdamW state are sharded along dim 0; the pre-forward hook
  all-gathers a module's parameters; with ``reshard_after_forward`` the post-forward hook
  frees them and the pre-backward hook gathers them again, by default (off) they stay
  gathered until the module's last backward of the step (`gradient_sync`: one all-gather
  per step instead of 2 M); the post-backward hook reduce-scatters the gradients (a *sum*:
  divide factor 1, the loss is already the mean over the global batch) into the sharded
  ``.grad``, at the chunk's last backward;
- every module but the routed experts is sharded over this rank's DP group; the routed
  experts (``layer.mlp.experts``, this EP rank's shard of them) over their
  *expert-replica* group, the DP ranks holding the same experts (size DP / EP). Where
  that group is one rank (EP = DP) FSDP2 would shard nothing and only add an all-gather
  copy of the experts, so they stay whole and unreduced (`ShardedAdamW`'s plain path);
- the output layer: the optimized loss stage fuses it with the cross-entropy and never
  calls ``lm_head.forward``; it calls ``lm_head.fused_loss`` (`models.network.layers.OutputLayer`),
  registered with `register_fsdp_forward_method` so the same hooks gather the weight
  around it. The fused loss finishes ``grad_weight`` in its forward and hands it to
  autograd in the backward, where it lands in the unsharded ``.grad`` as a plain linear's
  would. With tied embeddings the output layer and the embedding share one weight and
  stay off FSDP2 (below);
- the MTP layers (`models.network.mtp`, on pp-rank 0 with the head, run by the loss stage
  of both stacks): units like a main layer's (`models.network.MTPLayer.fsdp_modules`: its
  ``enorm``, ``hnorm``, ``eh_proj``, its decoder layer's modules and ``shared_head.norm``),
  their routed experts over the expert replicas like the main layers'. The embedding and
  the output layer they run are the main model's own units, registered once; the loss
  stage's MTP also runs the embedding, a unit of chunk 0 (`gradient_sync.GradientSync`
  keeps it gathered and unreduced through chunk 1's backwards: chunk 0's last backward
  comes after them).

Deferred expert weight gradients. A zero-bubble backward (`WeightGradStore`) leaves the
routed experts' weight gradients to a later W step, whose closure adds them into the
``.grad`` of the parameter the forward used: FSDP2's *unsharded* parameter, one
`nn.Parameter` FSDP2 keeps for the module's lifetime (reshard frees its storage, not the
object), so the closure may run after the module was resharded. FSDP2's post-backward
hook reduce-scatters whatever that ``.grad`` holds and sets it to None, so a W gradient
that lands between two backwards of a module is reduced by the next one, together with
that micro-batch's gradient (``grad_sync="micro-batch"``), or all of them once after the
chunk's last W (``step``). Each deferred gradient is thus reduce-scattered exactly once
(tests/test_sharding.py compares every gradient with an unsharded run's). Replicas of an
expert shard run the same schedule, so they reach the same collectives in the same order.

Gradient accumulation: each unit's gradients are reduce-scattered once per step, at the
last backward (or the last W step) the static schedule gives its chunk, and accumulate
unsharded until then (`optimized.pipeline.gradient_sync`, ``ParallelConfig.grad_sync``);
``grad_sync="micro-batch"`` reduces after every backward as FSDP2 does by default, and the
W gradients left after a module's last backward are reduced by
`gradient_sync.reduce_pending_gradients`
once the schedule's last W has run.

What stays off FSDP2, on `ShardedAdamW`'s ZeRO-1 path (whole parameters and gradients,
gradients all-reduced by `reduce_unsharded_gradients`, optimizer state sharded as flat
slices): the routed experts where EP = DP (nothing to reduce), and an embedding tied to
the output layer (with that layer). The tied weight is used by two modules at different
moments of the schedule (the embedding in stage 0's forwards, the head in the loss
stage's); FSDP2 can group them (``fully_shard([embed, lm_head])``) but its group hooks
assume the group's modules run together in one forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

from models.network import CausalLM, is_expert_parameter
from models.runtime import Layout, PipelineRunner, micro_batches_of, shared_loss, token_count
from optimized.estimator.sync_marks import sync_marks
from optimized.pipeline.gradient_sync import GradientSync, chunk_units


def fsdp_modules(part: CausalLM) -> list[nn.Module]:
    """The modules FSDP2 shards over the DP group: each is called through its ``forward``
    (the output layer through its registered ``fused_loss``) by both stacks. The MTP
    layers' (pp-rank 0, with the head) are units like a main layer's; the embedding and the
    output layer they share are the main model's, registered once."""
    modules: list[nn.Module] = []
    backbone = part.model
    tied = part.config.tie_word_embeddings
    if getattr(backbone, "embed_tokens", None) is not None and not tied:
        modules.append(backbone.embed_tokens)
    for layer in part.decoder_layers + part.mtp_layers:
        modules += layer.fsdp_modules()
    if getattr(backbone, "norm", None) is not None:
        modules.append(backbone.norm)
    if getattr(part, "lm_head", None) is not None and not tied:
        modules.append(part.lm_head)
    return modules


def expert_modules(part: CausalLM, layout: Layout) -> list[nn.Module]:
    """The routed experts of each MoE layer (the MTP layers' too), sharded over the expert
    replicas; none when there is one replica (EP = DP)."""
    if layout.dp // layout.ep == 1:
        return []
    return [layer.mlp.experts for layer in part.moe_layers_with_mtp]


def held_rows(part: CausalLM, dp: int, ep: int, dp_rank: int) -> dict[str, tuple[int, int]]:
    """``name -> (start, count)``: the rows of the whole model's tensor each parameter of a
    (meta-device) part holds on dp-rank ``dp_rank`` once `apply_fsdp` has sharded it (DP > 1)
    -- its EP block, then its FSDP2 rows -- with no process group. What that rank reads
    from a checkpoint (`models.network.weights.materialise` places the same rows); the dry run of
    a published-size layout lists it."""
    from models.network import chunk_rows  # noqa: PLC0415

    over: dict[int, tuple[int, int]] = {}
    if dp > 1:
        for module in fsdp_modules(part):
            over.update({id(p): (dp, dp_rank) for p in module.parameters()})
        if dp // ep > 1:
            for layer in part.moe_layers_with_mtp:
                experts = layer.mlp.experts.parameters()
                over.update({id(p): (dp // ep, dp_rank // ep) for p in experts})
    out = {}
    for prefix, module in part.named_modules():
        for name, param in module.named_parameters(recurse=False):
            full = f"{prefix}.{name}" if prefix else name
            size, index = over.get(id(param), (1, 0))
            start, count = chunk_rows(param.shape[0], size, index)
            out[full] = (getattr(module, "first_expert", 0) + start, count)
    return {name: out[name] for name, _ in part.named_parameters()}


def _shard(module: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool) -> None:
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
    module.set_gradient_divide_factor(1.0)  # a sum: the loss is already the global mean
    module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def apply_fsdp(
    part: CausalLM, layout: Layout, device: torch.device, reshard_after_forward: bool = False
) -> set[str]:
    """`fully_shard` each of `fsdp_modules` over the DP group and each of `expert_modules`
    over the expert replicas; the names of the parameters FSDP2 now manages (DTensors
    sharded on dim 0).

    On a meta-device part (`models.network.build_part`'s ``shard``) this also allocates the
    part on ``device``: FSDP2 parameters get storage for this rank's rows only, in FSDP2's
    own padded shard buffer, so the values filled in next are the ones it trains.
    """
    dp_mesh = DeviceMesh.from_group(layout.dp_group, device.type, mesh_dim_names=("dp",))
    experts = expert_modules(part, layout)
    ids = {id(p) for m in fsdp_modules(part) + experts for p in m.parameters()}
    names = {n for n, p in part.named_parameters() if id(p) in ids}
    for module in fsdp_modules(part):
        _shard(module, dp_mesh, reshard_after_forward)
    if getattr(part, "lm_head", None) is not None:
        register_fsdp_forward_method(part.lm_head, "fused_loss")  # no-op when not sharded
    if experts:
        replica_mesh = DeviceMesh.from_group(
            layout.expert_replica_group, device.type, mesh_dim_names=("expert_replica",)
        )
        for module in experts:
            _shard(module, replica_mesh, reshard_after_forward)
    if any(p.is_meta for p in part.parameters()):
        _allocate(part, device)
    return names


def _allocate(part: nn.Module, device: torch.device) -> None:
    """Storage on ``device`` for a meta-device part after `fully_shard`: whole parameters
    for unsharded modules, this rank's rows for FSDP2's.

    `to_empty` gives an FSDP2 parameter a fresh local tensor of its rows; FSDP2 would move
    it into its padded shard buffer at its lazy initialisation (the first forward), after
    `ShardedAdamW` took views of it. Re-padding now (FSDP2's own `reset_sharded_param`, what
    its lazy init calls; private API, torch is pinned) makes the parameter a view of that
    buffer from the start, and the lazy init then finds nothing to move.
    """
    part.to_empty(device=device)
    for module in part.modules():
        if isinstance(module, FSDPModule):
            for group in fully_shard.state(module)._fsdp_param_groups:
                for param in group.fsdp_params:
                    param.reset_sharded_param()


def reduce_unsharded_gradients(part: nn.Module, layout: Layout, sharded: set[str]) -> None:
    """All-reduce the gradients FSDP2 does not reduce: experts over their replicas, the
    rest over DP (as `models.runtime.reduce_gradients`)."""
    for name, param in part.named_parameters():
        if name in sharded:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        if is_expert_parameter(name):
            if layout.dp // layout.ep > 1:
                dist.all_reduce(param.grad, group=layout.expert_replica_group)
        elif layout.dp > 1:
            dist.all_reduce(param.grad, group=layout.dp_group)


def install_gradient_sync(runner, mode: str | None = None, reshard_after_forward=None):
    """Tell ``runner``'s schedule where to sync each FSDP unit (`GradientSync` at the
    schedule's `sync_marks`); ``mode`` and ``reshard_after_forward`` default to the
    runner's `ParallelConfig`. Returns the `GradientSync`."""
    parallel, layout, schedule = runner.parallel, runner.layout, runner.schedule
    marks = sync_marks(
        layout.pp_rank, layout.pp, parallel.micro_batches, schedule.defers_weight_gradients
    )
    sync = GradientSync(
        chunk_units(runner.part, schedule.chunks, layout.pp_rank),
        marks,
        parallel.grad_sync if mode is None else mode,
        parallel.reshard_after_forward if reshard_after_forward is None else reshard_after_forward,
    )
    schedule.gradient_sync = sync
    return sync


def forward_backward(runner, optimizer, sharded: set[str], ids, labels) -> float:
    """The runner's ``forward_backward`` with FSDP2 reducing the sharded gradients at the
    schedule's marks (`install_gradient_sync`, done here on first use), then only the
    unsharded gradients all-reduced."""
    return float(forward_backward_on_device(runner, optimizer, sharded, ids, labels))


def forward_backward_on_device(runner, optimizer, sharded: set[str], ids, labels):
    """`forward_backward` with the loss left on the device, unread (`shared_loss`)."""
    optimizer.zero_grad()
    layout = runner.layout
    sync = runner.schedule.gradient_sync or install_gradient_sync(runner)
    batches = micro_batches_of(ids, labels, runner.parallel, layout.dp_rank)
    runner.set_mtp_step(labels)
    sync.begin()
    loss = runner.schedule.step(batches, token_count(labels))
    sync.finish(runner.part)
    reduce_unsharded_gradients(runner.part, layout, sharded)
    return shared_loss(loss, layout)


class ShardedOptimizedPipeline(PipelineRunner):
    """The optimized stack as `twinpipe train` runs it with DP > 1: FSDP2 on every leaf
    module (`apply_fsdp`) and `ShardedAdamW`, behind the runner interface the harness
    drives, so that ``twinpipe compare --baseline optimized --candidate optimized-fsdp``
    shows that sharding changes nothing beyond rounding.

    ``optimizer_class`` is that optimizer, `optimized.train.ShardedAdamW`, given by the
    caller (`harness.compare.stacks`): the engine never imports the training product. It is called
    as ``optimizer_class(part, layout, lr, betas, eps, weight_decay, fsdp, sharded)``.

    The harness reads ``.grad`` after the optimizer step (torch's AdamW leaves it);
    `ShardedAdamW.step` clears it, so the step puts the reduced gradients back.
    """

    name = "optimized-fsdp"

    def __init__(
        self,
        model,
        parallel,
        layout,
        source,
        optimizer,
        stages=None,
        *,
        optimizer_class: type,
        device: torch.device | str = "cpu",
    ) -> None:
        from optimized.pipeline.runner import OptimizedPipeline  # noqa: PLC0415

        self.sharded: set[str] = set()
        device = torch.device(device)
        self.runner = OptimizedPipeline(
            model, parallel, layout, source, optimizer, stages, device=device,
            shard=lambda part: self.sharded.update(
                apply_fsdp(part, layout, device, parallel.reshard_after_forward)
            ),
        )  # fmt: skip
        self.part, self.layout, self.parallel = self.runner.part, layout, parallel
        self.schedule = self.runner.schedule
        self.gradient_sync = install_gradient_sync(self.runner)
        self.optimizer = optimizer_class(
            self.part, layout, optimizer.lr, optimizer.betas, optimizer.eps,
            optimizer.weight_decay, True, self.sharded,
        )  # fmt: skip
        self.runner.optimizer = self.optimizer
        self.lr = optimizer.lr

    def optimizer_state(self) -> list[torch.Tensor]:
        """What the memory tracker counts as optimizer state (read at every mark): AdamW's
        moments and the float32 masters that do not share the parameters' storage."""
        state = [t for s in self.optimizer.optimizer.state.values() for t in s.values()]
        masters = [s.master for s in self.optimizer.shards if not s.shares_storage]
        return state + masters

    def forward_backward(self, ids: torch.Tensor, labels: torch.Tensor) -> float:
        return forward_backward(self.runner, self.optimizer, self.sharded, ids, labels)

    def evaluate(self, ids: torch.Tensor, labels: torch.Tensor) -> float:
        loss = super().evaluate(ids, labels)
        for unit in self.gradient_sync.all_units():
            unit.reshard()  # a forward-only pass leaves them gathered when not resharding
        return loss

    def optimizer_step(self) -> None:
        grads = [(p, p.grad) for p in self.part.parameters()]
        self.optimizer.prepare_gradients_on_device()
        self.optimizer.step(self.lr)
        for param, grad in grads:
            param.grad = grad
        self.update_expert_biases()
