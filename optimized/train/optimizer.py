"""AdamW with its state sharded over data-parallel replicas, and global clipping.

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

The update is `torch.optim.AdamW`'s (tests/test_semantics_optimizer.py holds it there, and
the clipping to `torch.nn.utils.clip_grad_norm_`): decoupled weight decay on every
parameter, norm weights, biases and embeddings included (``optim.weight_decay``).

Precision (``state_dtype``, ``master_weights``): by default the moments are float32 and
16-bit parameters get a float32 master, 16 bytes of state per bf16 parameter on top of its
own 2 (what lets a long run add updates smaller than a bf16 ulp). ``state_dtype="bfloat16"``
keeps the moments in bfloat16 and ``master_weights=False`` steps the parameter's own rows
(the master is then the parameter, or for a ZeRO-1 slice a copy in its dtype), 4 bytes of
state per bf16 parameter.

Memory of the step: nothing whole is copied. The gradient slices stay in the gradient's
dtype (views of the reduced gradients); their squares for the global norm are summed, and
torch's single-tensor AdamW update is computed in float32 (bit for bit), block by block of
`UPDATE_BLOCK` elements, the clipping scale applied to each gradient block as it is read,
and rounded once into the stored dtypes. The step's transient is a few 16 MiB blocks, not
float32 copies of every gradient (1.2 GiB on mid-gpt-oss's rank 0 at PP2 DP2 EP2) nor
float64 squares of the largest slice (0.7 GiB there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from models.network import host_side, is_expert_parameter
from models.runtime import Layout

STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""``optim.state_dtype`` values: the dtype AdamW's ``exp_avg``/``exp_avg_sq`` are kept,
saved and resumed in."""
UPDATE_BLOCK = 1 << 22
"""Elements per block of the float32 update when a stored dtype is not float32 (16 MiB)."""


@dataclass(slots=True)
class ParamShard:
    """One parameter's slice owned by this rank."""

    name: str
    param: torch.nn.Parameter
    master: torch.Tensor
    """``[chunk]`` in ``master_dtype`` (this rank's slice; a view of the parameter's storage
    when ``shares_storage``). FSDP2 slices are not padded: ``[stop - start]``."""
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
    master_weights: bool = True
    """Step a float32 master of a 16-bit parameter; False: step the parameter's dtype."""
    gradient: torch.Tensor | None = None
    """This rank's gradient slice in the gradient's dtype, set by
    `ShardedAdamW.prepare_gradients` (a view of the reduced gradient; a zero-padded copy for
    the last ZeRO-1 replica's short slice); read block by block by the update."""

    @property
    def master_dtype(self) -> torch.dtype:
        return torch.float32 if self.master_weights else self.param.dtype

    @property
    def keeps_master(self) -> bool:
        """Whether the master is a float32 copy of a 16-bit parameter (saved as ``.master``)."""
        return self.master_dtype != self.param.dtype

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
        if self.keeps_master:
            return False
        return self.fsdp or self.group_size == 1

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


def square_sum(piece: torch.Tensor) -> torch.Tensor:
    """The float64 sum of squares of ``piece``'s elements, block by block (`UPDATE_BLOCK`)."""
    flat = piece.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=piece.device)
    for begin in range(0, flat.numel(), UPDATE_BLOCK):
        total += flat[begin : begin + UPDATE_BLOCK].double().pow(2).sum()
    return total


def _adamw_blocks(
    s: ParamShard,
    state: dict,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    scale: torch.Tensor | float | None = None,
) -> None:
    """torch's single-tensor AdamW update of ``s`` (``state['step']`` already counted) on its
    gradient times ``scale`` (the clipping factor, a float32 tensor on the device; None: no
    clipping), computed in float32 block by block and stored in the master's and moments'
    dtypes. A float32 gradient block is scaled in place (the step drops the gradients), so
    clipping costs no block; a 16-bit one is scaled in its float32 copy."""
    with host_side():  # torch's AdamW keeps the step count on the CPU
        step = float(state["step"])
    step_size = lr / (1 - beta1**step)
    correction2_sqrt = (1 - beta2**step) ** 0.5
    stored = (s.master, state["exp_avg"], state["exp_avg_sq"])
    for begin in range(0, s.master.numel(), UPDATE_BLOCK):
        end = min(begin + UPDATE_BLOCK, s.master.numel())
        param, exp_avg, exp_avg_sq = (t[begin:end].float() for t in stored)
        grad = s.gradient[begin:end].float()
        if scale is not None:  # float32 times the factor, as clipping a float32 copy gave
            grad.mul_(scale)
        param.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)
        for target, value in zip(stored, (param, exp_avg, exp_avg_sq)):
            if target.dtype != torch.float32:
                target[begin:end].copy_(value)


class ShardedAdamW:
    """AdamW over master slices of this rank's part; see the module docstring."""

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
        state_dtype: str = "float32",
        master_weights: bool = True,
    ) -> None:
        """``fsdp``: names of the parameters `fully_shard` manages (sharded over their
        replica group: experts over the expert replicas, the rest over DP).
        ``state_dtype``: the moments' dtype (`STATE_DTYPES`); ``master_weights``: a float32
        master of each 16-bit parameter."""
        if state_dtype not in STATE_DTYPES:
            raise ValueError(
                f"optim.state_dtype = {state_dtype!r} is invalid: must be one of "
                f"{', '.join(STATE_DTYPES)}"
            )
        self.layout = layout
        self.state_dtype = STATE_DTYPES[state_dtype]
        self.master_weights = master_weights
        self.hyper = (betas[0], betas[1], eps, weight_decay)
        self.sharded = shard
        self.shards: list[ParamShard] = []
        self.local_squares: torch.Tensor | None = None
        """This rank's float64 sum of squares of its gradient slices, on the device (the
        non-finite report reads it: `local_square_sum`)."""
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
                counted, master_weights,
            )  # fmt: skip
            if entry.fsdp and entry.local().numel() != entry.stop - entry.start:
                raise AssertionError(f"{name}: FSDP2 shard is not rows [{entry.start}, ...)")
            if entry.shares_storage:
                entry.master = entry.local().view(-1)
            elif entry.fsdp:
                entry.master = entry.local().reshape(-1).to(entry.master_dtype).clone()
            else:
                flat = param.detach().reshape(-1).to(entry.master_dtype)
                entry.master = _slice_of(flat, entry).clone()
            self.shards.append(entry)
        # torch's AdamW holds the state (the tracker and checkpoints read it there); the
        # update is `_adamw_blocks`, its single-tensor step block by block.
        self.optimizer = torch.optim.AdamW(
            [s.master for s in self.shards], lr=lr, betas=betas, eps=eps,
            weight_decay=weight_decay, foreach=False,
        )  # fmt: skip
        self.scale: torch.Tensor | float | None = None
        """The clipping factor of this step's gradients (`clip`), a float32 tensor on the
        device, applied by the update; None: not clipped."""

    # ------------------------------------------------------------------ step
    def zero_grad(self, set_to_none: bool = True) -> None:
        for s in self.shards:
            s.param.grad = None
            s.gradient = None

    def prepare_gradients(self) -> float:
        """Take this rank's gradient slices (views, in the gradient's dtype); return the
        global gradient norm, read on the host."""
        return float(self.prepare_gradients_on_device())

    def prepare_gradients_on_device(self) -> torch.Tensor:
        """`prepare_gradients`, the norm left on the device as a 0-dim float64 tensor: the
        squares are summed, all-reduced and rooted there, and nothing is read on the host."""
        device = self.shards[0].master.device if self.shards else torch.device("cpu")
        square_total = torch.zeros((), dtype=torch.float64, device=device)
        local = torch.zeros((), dtype=torch.float64, device=device)
        self.scale = None
        for s in self.shards:
            grad = s.param.grad
            if grad is None:
                piece = torch.zeros(s.master.shape, device=s.master.device)
            elif s.fsdp:  # already reduce-scattered by FSDP2: this rank's rows
                piece = grad.to_local().detach().reshape(-1)
            else:
                piece = _slice_of(grad.detach().reshape(-1), s)
            s.gradient = piece
            squares = square_sum(piece)
            local += squares
            if s.counted:
                square_total += squares
        self.local_squares = local
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(square_total)
        return square_total.sqrt()

    @property
    def local_square_sum(self) -> float:
        """This rank's sum of squares of its gradient slices (read on the host: reports)."""
        return 0.0 if self.local_squares is None else float(self.local_squares)

    @property
    def clip_factor(self) -> float:
        """This step's clipping factor read on the host (1.0: not clipped): what reports and
        tests read; the update itself uses `scale` where it lies."""
        return 1.0 if self.scale is None else float(self.scale)

    def clip(self, norm: torch.Tensor | float, max_norm: float) -> None:
        """Scale the gradient slices so the global norm is at most ``max_norm`` (0: off):
        the update multiplies each float32 gradient block by the factor as it reads it.
        A tensor ``norm`` (`prepare_gradients_on_device`) gives the factor on the device,
        ``max_norm / (norm + 1e-6)`` where the norm exceeds ``max_norm``, else exactly 1,
        with no read on the host."""
        if max_norm <= 0:
            self.scale = None
        elif isinstance(norm, torch.Tensor):
            # A true division (``float / tensor`` is a reciprocal times the float in torch):
            # the same double as ``max_norm / (norm + 1e-6)`` on the host.
            factor = torch.full_like(norm, max_norm) / (norm + 1e-6)
            factor = torch.where(norm > max_norm, factor, 1.0)
            self.scale = factor.to(torch.float32)
        elif norm > max_norm:
            self.scale = max_norm / (norm + 1e-6)

    def step(self, lr: float) -> None:
        """One AdamW step on the slices, then every parameter rebuilt from its replicas
        (FSDP2 parameters: this rank's rows; FSDP2 gathers them at the next forward)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._step_blocks(lr)
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

    @torch.no_grad()
    def _step_blocks(self, lr: float) -> None:
        for s in self.shards:
            state = self.optimizer.state[s.master]
            if not state:
                state["step"] = torch.tensor(0.0)  # AdamW keeps step on the CPU
                for key in ("exp_avg", "exp_avg_sq"):
                    state[key] = torch.zeros(
                        s.master.shape, dtype=self.state_dtype, device=s.master.device
                    )
            state["step"] += 1
            _adamw_blocks(s, state, lr, *self.hyper, scale=self.scale)

    def state_bytes(self) -> int:
        """Bytes of this rank's optimizer state: the moments and the masters kept apart
        from the parameters."""
        moments = sum(
            t.numel() * t.element_size()
            for state in self.optimizer.state.values()
            for t in state.values()
            if t.dim() > 0
        )
        masters = sum(
            s.master.numel() * s.master.element_size() for s in self.shards if not s.shares_storage
        )
        return moments + masters

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
        """This rank's slices of ``s``'s state: exp_avg, exp_avg_sq in ``state_dtype`` (and
        the float32 master of a 16-bit parameter when it keeps one)."""
        state = self.optimizer.state.get(s.master, {})
        out = {}
        for key in ("exp_avg", "exp_avg_sq"):
            out[key] = state[key] if key in state else self.zero_moment(s)
        if s.keeps_master:
            out["master"] = s.master
        return out

    def zero_moment(self, s: ParamShard) -> torch.Tensor:
        """A moment slice of ``s`` at zero, in ``state_dtype``."""
        return torch.zeros(s.master.shape, dtype=self.state_dtype, device=s.master.device)

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
                    s.master.copy_(s.local().reshape(-1))
                elif not s.shares_storage:
                    s.master.copy_(_slice_of(s.param.detach().reshape(-1), s))

    def load_state(self, s: ParamShard, full: dict[str, torch.Tensor], step: int) -> None:
        """Set ``s``'s state from whole flattened tensors (this EP rank's experts only)."""
        with torch.no_grad():
            if "master" in full and not s.shares_storage:
                master = _slice_of(full["master"].reshape(-1), s)
                s.master.copy_(master.to(s.master.device))
            if step == 0:
                return
            state = self.optimizer.state[s.master]
            for key in ("exp_avg", "exp_avg_sq"):
                piece = _slice_of(full[key].reshape(-1), s).to(s.master.device, self.state_dtype)
                state[key] = piece.clone()
            state["step"] = torch.tensor(float(step))  # AdamW keeps step on the CPU
