"""AdamW with float32 state, sharded over data-parallel replicas (ZeRO-1), and global clipping.

Why its own class rather than FSDP2: the DualPipeV schedule runs each stage's backward
on its own with detached stage boundaries and reduces gradients itself, which does not
match the module-level hooks `fully_shard` installs. What sharding buys in memory is the
optimizer state, and that is done here with plain `torch.distributed`:

- every parameter is flattened and cut into ``S`` equal slices (the last padded), where
  ``S`` is the size of its *replica group*: the DP group for non-expert parameters, the
  expert-replica group (size DP / EP) for routed experts. Replica ``i`` owns slice ``i``:
  its float32 master copy, ``exp_avg`` and ``exp_avg_sq`` -- 1/S of the state;
- after the step the updated slices are all-gathered into the (bfloat16 or float32)
  parameter.

The same slices make the global gradient norm count each element once: slices of one
replica group partition a parameter, expert shards on different EP ranks are different
experts, and pipeline ranks hold different layers, so one sum of squares over the world
is the norm of the whole model's gradient.

This is ZeRO-1, not FSDP2: parameters stay whole on every replica and the runner
all-reduces whole gradients (as the reference does); only the optimizer state and the
float32 master copy are sharded.

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
    """float32 ``[chunk]`` (this rank's slice; a view of the parameter when unsharded fp32)."""
    group: dist.ProcessGroup | None
    group_size: int
    group_rank: int
    chunk: int
    """Elements per slice (``ceil(numel / group_size)``)."""

    @property
    def start(self) -> int:
        return self.group_rank * self.chunk

    @property
    def stop(self) -> int:
        return min(self.param.numel(), self.start + self.chunk)

    @property
    def shares_storage(self) -> bool:
        return self.group_size == 1 and self.param.dtype == torch.float32


def _slice_of(flat: torch.Tensor, shard: ParamShard) -> torch.Tensor:
    """This rank's slice of a flattened tensor, zero-padded to ``chunk``."""
    piece = flat[shard.start : shard.stop]
    if piece.numel() < shard.chunk:
        piece = torch.cat([piece, piece.new_zeros(shard.chunk - piece.numel())])
    return piece


def gather_slices(piece: torch.Tensor, shard: ParamShard) -> torch.Tensor:
    """The whole flattened tensor from every replica's slice (``numel`` elements)."""
    if shard.group_size == 1:
        return piece[: shard.param.numel()]
    pieces = [torch.empty_like(piece) for _ in range(shard.group_size)]
    dist.all_gather(pieces, piece.contiguous(), group=shard.group)
    return torch.cat(pieces)[: shard.param.numel()]


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
    ) -> None:
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
            if not shard:
                group, size, group_rank = None, 1, 0
            chunk = math.ceil(param.numel() / size)
            entry = ParamShard(name, param, torch.empty(0), group, size, group_rank, chunk)
            if entry.shares_storage:
                entry.master = param.detach().view(-1)
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
        device = self.shards[0].param.device if self.shards else torch.device("cpu")
        square_sum = torch.zeros((), dtype=torch.float64, device=device)
        for s in self.shards:
            grad = s.param.grad
            if grad is None:
                grad = torch.zeros_like(s.param)
            piece = _slice_of(grad.detach().reshape(-1).float(), s)
            s.master.grad = piece
            square_sum += piece.double().pow(2).sum()
        self.local_square_sum = float(square_sum)
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
        """One AdamW step on the slices, then every parameter rebuilt from its replicas."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        with torch.no_grad():
            for s in self.shards:
                if s.shares_storage:
                    continue
                whole = gather_slices(s.master, s)
                s.param.copy_(whole.view_as(s.param))
        self.zero_grad()

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
                if not s.shares_storage:
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
