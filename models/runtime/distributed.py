"""The parallel layout (PP x DP with EP inside DP), its process groups, the differentiable
all-to-all both stacks dispatch with, and the launcher.

Both stacks and the harness run on this: it is plain `torch.distributed` (gloo on
CPU, NCCL on GPU), started either by `torchrun` (env:// rendezvous) or by
`launch` (`models.runtime.spawn`), which spawns N local processes for tests, the harness and
the CLI.

Rank numbering: ``rank = pp_rank * DP + dp_rank``. The EP group of a rank is the
block of EP consecutive dp-ranks that holds it; expert replicas are the dp-ranks
with the same ep-rank (size DP / EP). Non-expert gradients reduce over DP,
expert gradients over the expert replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from models.network import ExpertParallel, ModelConfig
from models.runtime.p2p import StreamGroups, new_stream_groups

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
GRAD_SYNC = ("step", "micro-batch")


@dataclass(slots=True)
class ParallelConfig:
    """How a training step is laid out over ranks and cut into micro-batches."""

    pp: int = 1
    """Pipeline-parallel ranks; each holds two DualPipeV stages (2 * pp stages)."""
    dp: int = 1
    """Data-parallel ranks per pipeline rank."""
    ep: int = 1
    """Expert-parallel ranks inside each data-parallel group; divides dp and the expert count."""
    micro_batch_size: int = 1
    """Sequences per micro-batch."""
    micro_batches: int = 2
    """Micro-batches per step on each data-parallel rank (M); DualPipeV needs M >= 2 * pp."""
    seq_len: int = 64
    """Tokens per sequence."""
    dtype: str = "float32"
    """Parameter and activation dtype: float32 or bfloat16."""
    seed: int = 0
    """Seed of the weights and of the synthetic data."""
    grad_sync: str = "step"
    """When FSDP2 reduces gradients (sharded runners only): ``step``, once per step per
    unit at the schedule's last backward (or last W) of its chunk, holding the unsharded
    gradient across the micro-batches; ``micro-batch``, after every backward."""
    reshard_after_forward: bool = False
    """FSDP2 (sharded runners only): free gathered parameters after each forward and gather
    them again for the backward (on: 2 M all-gathers per unit and step); off (default): gather
    at a unit's first forward of the step and keep them until its last backward (one
    all-gather per step, the rank's part held unsharded meanwhile; README: the measurement)."""
    recompute: bool = True
    """Optimized runners: recompute each attention block in backward (selective
    recomputation, the default) or keep its activations (more memory, one attention forward
    less per backward). The reference stack always keeps them."""

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def global_batch(self) -> int:
        """Sequences per step over all data-parallel ranks."""
        return self.dp * self.micro_batches * self.micro_batch_size

    def validate(self, model: ModelConfig | None = None) -> None:
        """Raise ValueError naming the field and value of any impossible layout."""

        def bad(name: str, value: Any, valid: str) -> ValueError:
            return ValueError(f"ParallelConfig.{name}={value!r} is invalid: {valid}")

        for name in ("pp", "dp", "ep", "micro_batch_size", "micro_batches", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(name, value, "expected a positive integer")
        if self.dtype not in DTYPES:
            raise bad("dtype", self.dtype, f"expected one of {tuple(DTYPES)}")
        if self.grad_sync not in GRAD_SYNC:
            raise bad("grad_sync", self.grad_sync, f"expected one of {GRAD_SYNC}")
        if not isinstance(self.reshard_after_forward, bool):
            raise bad("reshard_after_forward", self.reshard_after_forward, "expected a boolean")
        if not isinstance(self.recompute, bool):
            raise bad("recompute", self.recompute, "expected True or False")
        if self.micro_batches < 2 * self.pp:
            raise bad(
                "micro_batches",
                self.micro_batches,
                f"DualPipeV needs at least 2 * pp = {2 * self.pp} micro-batches",
            )
        if self.dp % self.ep:
            raise bad("ep", self.ep, f"must divide dp={self.dp}")
        if model is not None:
            if model.num_hidden_layers < 2 * self.pp:
                raise bad(
                    "pp",
                    self.pp,
                    f"{model.num_hidden_layers} layers cannot fill 2 * pp = {2 * self.pp} stages",
                )
            if model.num_experts and model.num_experts % self.ep:
                raise bad("ep", self.ep, f"must divide num_experts={model.num_experts}")
            if self.seq_len > model.max_position_embeddings:
                raise bad(
                    "seq_len",
                    self.seq_len,
                    f"exceeds max_position_embeddings={model.max_position_embeddings}",
                )


class Layout(NamedTuple):
    """This rank's place in the layout and its process groups."""

    rank: int
    pp_rank: int
    dp_rank: int
    ep_rank: int
    pp: int
    dp: int
    ep: int
    pp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    ep_group: dist.ProcessGroup | None
    expert_replica_group: dist.ProcessGroup | None
    streams: StreamGroups | None = None
    """This pipeline's point-to-point streams, one group each (`models.runtime.p2p`); None at PP 1,
    where nothing travels point to point."""
    host_group: dist.ProcessGroup | None = None
    """A group over the world with gloo for host-side values (Python objects, counts kept on
    the CPU): the default group where it has gloo (every job `models.runtime.spawn` starts), a gloo
    group of its own beside NCCL alone. Tensors on the rank's device go through the groups
    above."""

    @property
    def expert_parallel(self) -> ExpertParallel:
        return ExpertParallel(self.ep_group if self.ep > 1 else None, self.ep_rank, self.ep)

    def global_rank(self, pp_rank: int, dp_rank: int | None = None) -> int:
        return pp_rank * self.dp + (self.dp_rank if dp_rank is None else dp_rank)


def make_layout(parallel: ParallelConfig) -> Layout:
    """Create every process group (all ranks must call this, in the same order)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != parallel.world_size:
        raise ValueError(
            f"world size {world} does not match pp * dp = {parallel.pp} * {parallel.dp}"
        )
    pp, dp, ep = parallel.pp, parallel.dp, parallel.ep
    pp_rank, dp_rank = divmod(rank, dp)
    mine: dict[str, Any] = {"streams": None}
    for d in range(dp):
        group = dist.new_group([p * dp + d for p in range(pp)])
        if d == dp_rank:
            mine["pp"] = group
        if pp > 1:
            streams = new_stream_groups([p * dp + d for p in range(pp)])
            if d == dp_rank:
                mine["streams"] = streams
    for p in range(pp):
        group = dist.new_group([p * dp + d for d in range(dp)])
        if p == pp_rank:
            mine["dp"] = group
        for block in range(dp // ep):
            ranks = [p * dp + block * ep + e for e in range(ep)]
            group = dist.new_group(ranks)
            if rank in ranks:
                mine["ep"] = group
        for e in range(ep):
            ranks = [p * dp + d for d in range(e, dp, ep)]
            group = dist.new_group(ranks)
            if rank in ranks:
                mine["replica"] = group
    # The default group carries host tensors where it has gloo (a CPU job, or the launcher's
    # ``cpu:gloo,cuda:nccl``); a job that joined with NCCL alone gets a gloo group of its own.
    has_gloo = "gloo" in str(dist.get_backend())
    host = dist.group.WORLD if has_gloo else dist.new_group(backend="gloo")
    return Layout(
        rank, pp_rank, dp_rank, dp_rank % ep, pp, dp, ep,
        mine["pp"], mine["dp"], mine["ep"], mine["replica"], mine["streams"], host,
    )  # fmt: skip


# ------------------------------------------------------------ communication
def _exchange(out, inp, output_split_sizes, input_split_sizes, group) -> None:
    """`all_to_all_single`, started asynchronously and waited here.

    The blocking call leaves gloo's worker thread holding the buffers until it next
    gets the GIL, so when they are freed, and the measured peak, varied from run to
    run by one buffer; a waited handle gives them back as soon as it is dropped.
    """
    work = dist.all_to_all_single(
        out, inp, output_split_sizes, input_split_sizes, group=group, async_op=True
    )
    work.wait()


class AllToAll(torch.autograd.Function):
    """`all_to_all_single` whose backward sends gradients back the way rows came."""

    @staticmethod
    def forward(ctx, x, output_split_sizes, input_split_sizes, group):
        ctx.output_split_sizes = output_split_sizes
        ctx.input_split_sizes = input_split_sizes
        ctx.group = group
        out = x.new_empty((sum(output_split_sizes),) + tuple(x.shape[1:]))
        _exchange(out, x.contiguous(), output_split_sizes, input_split_sizes, group)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        grad_in = grad_out.new_empty((sum(ctx.input_split_sizes),) + tuple(grad_out.shape[1:]))
        _exchange(
            grad_in, grad_out.contiguous(), ctx.input_split_sizes, ctx.output_split_sizes, ctx.group
        )
        return grad_in, None, None, None


def all_to_all(
    x: torch.Tensor,
    output_split_sizes: list[int],
    input_split_sizes: list[int],
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Rows of ``x`` exchanged by split sizes; the identity when ``group`` is None or size 1."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    if sum(input_split_sizes) != x.shape[0]:
        raise ValueError(
            f"input_split_sizes sum to {sum(input_split_sizes)} but x has {x.shape[0]} rows"
        )
    return AllToAll.apply(x, list(output_split_sizes), list(input_split_sizes), group)
