"""Data-parallel sharding of `twinpipe train` with FSDP2 (`fully_shard`), leaf by leaf.

The DualPipeV stages call a decoder layer's stage methods, never ``layer.forward``
(the optimized stack) or run a layer's stages one after another (the reference), but
every *leaf* module inside them is called through its own ``forward``: the norms, the
attention block, the dense MLP, the router, the shared experts, the embedding and the
final norm. Each of those is `fully_shard`-ed on its own over this rank's DP group (a
`DeviceMesh` made from ``layout.dp_group``), so each is its own FSDP2 parameter group:

- parameters, gradients and AdamW state are sharded along dim 0 over DP; the
  pre-forward hook all-gathers a module's parameters, the post-forward hook frees them
  (``reshard_after_forward``), the pre-backward hook gathers them again and the
  post-backward hook reduce-scatters the gradients (a *sum*: divide factor 1, the loss
  is already the mean over the global batch) into the sharded ``.grad``;
- every leaf is its own FSDP root: nothing forwards the pipeline part as a whole, so
  there is no module above them whose forward could be the root's.

What stays off FSDP2, on `ShardedAdamW`'s ZeRO-1 path (whole parameters and gradients,
gradients all-reduced here, optimizer state sharded as flat slices):

- the routed experts. Their weight gradients may be deferred to the zero-bubble W
  steps (`WeightGradStore`), which write ``.grad`` outside autograd *after* FSDP2's
  post-backward hook has run; FSDP2 would reshard and never reduce them (or reduce them
  with the next micro-batch's). Turning deferral off would remove the W steps that make
  DualPipeV's bubble small, and the experts' replica group (DP / EP) is 1 whenever
  EP = DP. Their optimizer state is still sharded over the expert-replica group;
- the output layer (``lm_head``): the optimized loss stage fuses it with the
  cross-entropy and reads ``lm_head.weight`` directly (never ``lm_head.forward``), so no
  FSDP2 hook would gather it; with tied embeddings the embedding shares that weight and
  stays off too.

Gradient accumulation: every micro-batch's backward reduce-scatters its gradients into
the sharded ``.grad`` (FSDP2's default), which the micro-batches then sum; the schedule
interleaves micro-batches and chunks, so "the last backward of this module" is not
known to the trainer, and ``set_requires_gradient_sync(False)`` would need one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from models.distributed import Layout
from models.model import CausalLM, is_expert_parameter
from models.training import micro_batches_of, share_loss, token_count


def fsdp_modules(part: CausalLM) -> list[nn.Module]:
    """The leaf modules FSDP2 shards: each is called through its ``forward`` by both stacks."""
    modules: list[nn.Module] = []
    backbone = part.model
    tied = part.config.tie_word_embeddings
    if getattr(backbone, "embed_tokens", None) is not None and not tied:
        modules.append(backbone.embed_tokens)
    for layer in part.decoder_layers:
        modules += [layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm]
        if not layer.is_moe:
            modules.append(layer.mlp)
            continue
        modules.append(layer.mlp.router_module)
        if layer.mlp.shared_experts is not None:
            modules.append(layer.mlp.shared_experts)
    if getattr(backbone, "norm", None) is not None:
        modules.append(backbone.norm)
    return modules


def apply_fsdp(part: CausalLM, layout: Layout, device: torch.device) -> set[str]:
    """`fully_shard` each of `fsdp_modules` over the DP group; the names of the parameters
    FSDP2 now manages (DTensors sharded on dim 0)."""
    mesh = DeviceMesh.from_group(layout.dp_group, device.type, mesh_dim_names=("dp",))
    ids = {id(p) for m in fsdp_modules(part) for p in m.parameters()}
    names = {n for n, p in part.named_parameters() if id(p) in ids}
    if any(is_expert_parameter(n) for n in names):
        raise AssertionError("routed experts must stay off FSDP2 (deferred weight gradients)")
    for module in fsdp_modules(part):
        fully_shard(module, mesh=mesh, reshard_after_forward=True)
        module.set_gradient_divide_factor(1.0)  # sum over DP: the loss is already a mean
        module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return names


def reduce_unsharded_gradients(part: nn.Module, layout: Layout, sharded: set[str]) -> None:
    """All-reduce the gradients FSDP2 does not reduce: experts over their replicas, the
    rest over DP (as `models.training.reduce_gradients`)."""
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


def forward_backward(runner, optimizer, sharded: set[str], ids, labels) -> float:
    """The runner's ``forward_backward`` with FSDP2 reducing the sharded gradients: the
    same schedule step, then only the unsharded gradients all-reduced."""
    optimizer.zero_grad()
    layout = runner.layout
    batches = micro_batches_of(ids, labels, runner.parallel, layout.dp_rank)
    loss = runner.schedule.step(batches, token_count(labels))
    reduce_unsharded_gradients(runner.part, layout, sharded)
    return share_loss(loss, layout)
