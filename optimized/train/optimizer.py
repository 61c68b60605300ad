"""AdamW with float32 state sharded over data-parallel replicas, and global clipping.

Parameters come in two kinds (`optimized.pipeline.sharding` says which and why):

- *FSDP2* parameters (``fully_shard``-ed modules, DTensors sharded on dim 0 over their
  *replica group*: the DP group, or for routed experts the expert-replica group, size
  DP / EP): FSDP2 reduce-scatters their gradients, so this rank holds only its rows of
  the parameter, the gradient and the state. Its float32 master *is* its local rows
  (a view) for float32 parameters, else a float32 copy of them; the step writes the
  rows back and FSDP2 all-gathers them in the next forward;
- *ZeRO-1* parameters (routed experts when EP = DP, an output layer tied to the
  embedding, and everything when sharding is off): whole on every replica, whole
  gradients all-reduced by the runner, and only the optimizer state sharded: each
  parameter is flattened and cut into ``S`` equal slices (the last padded), ``S`` the
  size of its replica group; replica ``i`` owns slice ``i``, its float32 master copy,
  ``exp_avg`` and ``exp_avg_sq``; after the step the updated slices are all-gathered
  into the parameter.

A dim-0 shard of a contiguous tensor is a flat slice whose size is a whole number of
rows, so both kinds are one `ParamShard` (``start``/``stop`` in flattened elements).
The slices make the global gradient norm count each element once: slices of one
replica group partition a parameter, expert shards on different EP ranks are different
experts, and pipeline ranks hold different layers, so one sum of squares over the world
is the norm of the whole model's gradient.

With ``S == 1`` and float32 parameters the master *is* the parameter (a view), so an
unsharded float32 run keeps no extra copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from models.distributed import Layout
from models.model import is_expert_parameter


@dataclass(slots=True)
class ParamShard:
    """One parameter's slice owned by this rank."""

    name: str
    param: torch.nn.Parameter
    master: torch.Tensor
    """float32 ``[chunk]`` (this rank's slice; a view of the parameter's storage when
    ``shares_storage``). FSDP2 slices are not padded: ``[stop - start]``."""
    group: dist.ProcessGroup | None
    group_size: int
    group_rank: int
    chunk: int
    """Elements per slice: ``ceil(numel / group_size)``, or for FSDP2 ``ceil(rows /
    group_size)`` rows (``torch.chunk`` on dim 0, as `fully_shard` cuts)."""
    fsdp: bool = False
    """An FSDP2 parameter: a DTensor whose local tensor is this rank's rows."""
    counted: bool = True
    """Whether this slice enters the global norm: False on all but one of the replicas
    of a parameter that is not sharded over its replicas (so each element counts once)."""

    @property
    def start(self) -> int:
        return min(self.numel, self.group_rank * self.chunk)

    @property
    def stop(self) -> int:
        return min(self.numel, self.start + self.chunk)

    @property
    def numel(self) -> int:
        return self.param.numel()

    @property
    def shares_storage(self) -> bool:
        if self.fsdp:
            return self.param.dtype == torch.float32
        return self.group_size == 1 and self.param.dtype == torch.float32

    def local(self) -> torch.Tensor:
        """This rank's rows of an FSDP2 parameter (its storage), else the parameter."""
        with torch.no_grad():
            return self.param.to_local() if self.fsdp else self.param.detach()


def _slice_of(flat: torch.Tensor, shard: ParamShard) -> torch.Tensor:
    """This rank's slice of a flattened tensor (ZeRO-1 slices zero-padded to ``chunk``)."""
    piece = flat[shard.start : shard.stop]
    if not shard.fsdp and piece.numel() < shard.chunk:
        piece = torch.cat([piece, piece.new_zeros(shard.chunk - piece.numel())])
    return piece


def gather_slices(piece: torch.Tensor, shard: ParamShard) -> torch.Tensor:
    """The whole flattened tensor from every replica's slice (``numel`` elements)."""
    if shard.group_size == 1:
        return piece[: shard.numel]
    if piece.numel() < shard.chunk:
        piece = torch.cat([piece, piece.new_zeros(shard.chunk - piece.numel())])
    pieces = [torch.empty_like(piece) for _ in range(shard.group_size)]
    dist.all_gather(pieces, piece.contiguous(), group=shard.group)
    return torch.cat(pieces)[: shard.numel]


class ShardedAdamW:
    """AdamW over float32 master slices of this rank's part; see the module docstring."""

    def __init__(
        self,
        part: torch.nn.Module,
        layout: Layout,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        shard: bool,
        fsdp: set[str] = frozenset(),
    ) -> None:
        """``fsdp``: names of the parameters `fully_shard` manages (sharded over their
        replica group: experts over the expert replicas, the rest over DP)."""
        self.layout = layout
        self.sharded = shard
        self.shards: list[ParamShard] = []
        self.local_square_sum = 0.0
        for name, param in part.named_parameters():
            if is_expert_parameter(name):
                group, size = layout.expert_replica_group, layout.dp // layout.ep
                group_rank = layout.dp_rank // layout.ep
            else:
                group, size, group_rank = layout.dp_group, layout.dp, layout.dp_rank
            counted = True
            if not shard and name not in fsdp:
                counted = group_rank == 0
                group, size, group_rank = None, 1, 0
            if name in fsdp:
                row = math.prod(param.shape[1:])
                chunk = math.ceil(param.shape[0] / size) * row
            else:
                chunk = math.ceil(param.numel() / size)
            entry = ParamShard(
                name, param, torch.empty(0), group, size, group_rank, chunk, name in fsdp,
                counted,
            )  # fmt: skip
            if entry.fsdp and entry.local().numel() != entry.stop - entry.start:
                raise AssertionError(f"{name}: FSDP2 shard is not rows [{entry.start}, ...)")
            if entry.shares_storage:
                entry.master = entry.local().view(-1)
            elif entry.fsdp:
                entry.master = entry.local().reshape(-1).float().clone()
            else:
                flat = param.detach().reshape(-1).float()
                entry.master = _slice_of(flat, entry).clone()
            self.shards.append(entry)
        self.optimizer = torch.optim.AdamW(
            [s.master for s in self.shards], lr=lr, betas=betas, eps=eps,
            weight_decay=weight_decay, foreach=False,
        )  # fmt: skip

    # ------------------------------------------------------------------ step
    def zero_grad(self, set_to_none: bool = True) -> None:
        for s in self.shards:
            s.param.grad = None
            s.master.grad = None

    def prepare_gradients(self) -> float:
        """Take this rank's float32 gradient slices; return the global gradient norm."""
        device = self.shards[0].master.device if self.shards else torch.device("cpu")
        square_sum = torch.zeros((), dtype=torch.float64, device=device)
        local = torch.zeros((), dtype=torch.float64, device=device)
        for s in self.shards:
            grad = s.param.grad
            if grad is None:
                piece = torch.zeros_like(s.master)
            elif s.fsdp:  # already reduce-scattered by FSDP2: this rank's rows
                piece = grad.to_local().detach().reshape(-1).float()
            else:
                piece = _slice_of(grad.detach().reshape(-1).float(), s)
            s.master.grad = piece
            squares = piece.double().pow(2).sum()
            local += squares
            if s.counted:
                square_sum += squares
        self.local_square_sum = float(local)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(square_sum)
        return math.sqrt(float(square_sum))

    def clip(self, norm: float, max_norm: float) -> None:
        """Scale the gradient slices so the global norm is at most ``max_norm`` (0: off)."""
        if max_norm > 0 and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for s in self.shards:
                s.master.grad.mul_(scale)

    def step(self, lr: float) -> None:
        """One AdamW step on the slices, then every parameter rebuilt from its replicas
        (FSDP2 parameters: this rank's rows; FSDP2 gathers them at the next forward)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        with torch.no_grad():
            for s in self.shards:
                if s.shares_storage:
                    continue
                if s.fsdp:
                    local = s.local()
                    local.copy_(s.master.view_as(local))
                else:
                    whole = gather_slices(s.master, s)
                    s.param.copy_(whole.view_as(s.param))
        self.zero_grad()

    # --------------------------------------------------------- whole tensors
    def full_parameter(self, s: ParamShard) -> torch.Tensor:
        """The whole parameter (collective over ``s``'s group for FSDP2 parameters)."""
        if not s.fsdp:
            return s.param.detach()
        return gather_slices(s.local().reshape(-1), s).view(s.param.shape)

    def set_parameter(self, s: ParamShard, full: torch.Tensor) -> None:
        """Set the parameter from its whole value (FSDP2: this rank's rows of it)."""
        with torch.no_grad():
            if s.fsdp:
                local = s.local()
                local.copy_(_slice_of(full.reshape(-1), s).view_as(local).to(local.device))
            else:
                s.param.copy_(full)

    # ---------------------------------------------------------------- state
    def state_tensors(self, s: ParamShard) -> dict[str, torch.Tensor]:
        """This rank's slices of ``s``'s state: exp_avg, exp_avg_sq (and master when kept)."""
        state = self.optimizer.state.get(s.master, {})
        out = {}
        for key in ("exp_avg", "exp_avg_sq"):
            out[key] = state[key] if key in state else torch.zeros_like(s.master)
        if not s.shares_storage:
            out["master"] = s.master
        return out

    @property
    def step_count(self) -> int:
        for s in self.shards:
            state = self.optimizer.state.get(s.master)
            if state:
                return int(state["step"])
        return 0

    def reset_masters(self) -> None:
        """Master slices re-read from the parameters (after the parameters were loaded)."""
        with torch.no_grad():
            for s in self.shards:
                if s.fsdp and not s.shares_storage:
                    s.master.copy_(s.local().reshape(-1).float())
                elif not s.shares_storage:
                    s.master.copy_(_slice_of(s.param.detach().reshape(-1).float(), s))

    def load_state(self, s: ParamShard, full: dict[str, torch.Tensor], step: int) -> None:
        """Set ``s``'s state from whole flattened tensors (this EP rank's experts only)."""
        with torch.no_grad():
            if "master" in full and not s.shares_storage:
                s.master.copy_(_slice_of(full["master"].reshape(-1).float(), s).to(s.master.device))
            if step == 0:
                return
            state = self.optimizer.state[s.master]
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = _slice_of(full[key].reshape(-1).float(), s).to(s.master.device).clone()
            state["step"] = torch.tensor(float(step))  # AdamW keeps step on the CPU
