"""The stacks `twinpipe compare` runs on one rank, and how their state is shared or copied.

Lockstep (`harness.compare.lockstep`) needs the candidate to start every step from the
baseline's parameters and optimizer state. Two ways, by what the stacks are:

- **shared** (two unsharded stacks with the same AdamW settings: reference and
  optimized): the candidate's part is built with the *baseline's* `nn.Parameter`
  objects and uses the baseline's optimizer. Nothing is copied and no second set of
  parameters or moments exists; the harness only moves the baseline's gradients aside
  while the candidate's backward runs (`take_gradients`). The candidate's update is
  computed on the side, chunk by chunk, by the same optimizer class with the same
  settings (`shadow_update`), so that the parameters after both updates can be compared
  while the baseline's update is the one that is kept;
- **copied** (one side is FSDP2-sharded): the candidate keeps its own state and takes
  the baseline's before each step, one parameter at a time (`copy_state`).

Either way the routers' expert biases (`models.network.state_buffers`) are training state
too, and each stack keeps its own: the candidate takes the baseline's before each step
(`copy_buffers`), or a bias that differed once would differ at every step after it.

The truth of a bfloat16 comparison is the reference stack in float32, loaded from the
baseline's parameters before each step (`load_parameters`).
The float32 truth takes the baseline's biases with its parameters (`load_parameters`).
DeepSeek-V3's bias is native to the family and goes the same ways.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from models.network import is_expert_parameter, state_buffers

STACKS = {
    "reference": "reference.pipeline:ReferencePipeline",
    "optimized": "optimized.pipeline:OptimizedPipeline",
    "optimized-fsdp": "optimized.pipeline:ShardedOptimizedPipeline",
}
SIDES = ("oracle",) + tuple(STACKS)
STACK_ARGUMENTS = {"optimized-fsdp": {"optimizer_class": "optimized.train:ShardedAdamW"}}
"""What a stack's constructor takes beyond the runner's arguments (``module:name`` each):
`optimized.pipeline` never imports `optimized.train`, so the FSDP2 stack is handed the
trainer's optimizer here."""


def _resolve(path: str) -> Any:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def stack_class(name: str) -> Callable[..., Any]:
    """The constructor of stack ``name``, called as ``(model, parallel, layout, source,
    optimizer, stages=None)`` whatever the stack (its `STACK_ARGUMENTS` bound), and with
    ``device=`` where it takes one (`takes_device`)."""
    arguments = {key: _resolve(path) for key, path in STACK_ARGUMENTS.get(name, {}).items()}
    return functools.partial(_resolve(STACKS[name]), **arguments)


def takes_device(name: str) -> bool:
    """Whether stack ``name``'s constructor takes the device to build on (``device=``)."""
    return "device" in inspect.signature(_resolve(STACKS[name])).parameters


def device_problem(sides: tuple[str, ...], kind: str) -> str | None:
    """Why ``sides`` cannot run on ranks computing on ``kind`` (``cuda``/``cpu``), or None:
    a stack whose constructor takes no device builds on the CPU only."""
    if kind == "cpu":
        return None
    fixed = [side for side in sides if side in STACKS and not takes_device(side)]
    if not fixed:
        return None
    return (
        f"--device {kind}: the {', '.join(fixed)} stack builds its part on the CPU only (its "
        "constructor takes no device); compare it with --device cpu"
    )


def is_sharded(pipeline: Any) -> bool:
    """Whether a stack keeps FSDP2 shards and its own optimizer (`ShardedAdamW`)."""
    return hasattr(pipeline, "sharded") and hasattr(pipeline.optimizer, "shards")


def shares_state(baseline: Any, candidate: Any) -> bool:
    """Whether the candidate can run on the baseline's parameters and optimizer: both
    unsharded, both torch optimizers of one class with the same settings."""
    if is_sharded(baseline) or is_sharded(candidate):
        return False
    a, b = baseline.optimizer, candidate.optimizer
    if type(a) is not type(b) or not isinstance(a, torch.optim.Optimizer):
        return False
    settings = [{k: v for k, v in g.items() if k != "params"} for g in a.param_groups]
    return settings == [{k: v for k, v in g.items() if k != "params"} for g in b.param_groups]


def share_parameters(baseline: Any, candidate: Any) -> None:
    """Make ``candidate`` run on ``baseline``'s parameters and optimizer (see the module
    docstring). The candidate's own parameters are dropped; its training-state buffers stay
    its own (the candidate moves its bias, and the verdict compares the two moves)."""
    theirs = dict(baseline.part.named_parameters(remove_duplicate=False))
    owners = dict(candidate.part.named_modules())
    for name, mine in list(candidate.part.named_parameters(remove_duplicate=False)):
        if name not in theirs:
            raise RuntimeError(f"the baseline holds no parameter {name} on this rank")
        other = theirs[name]
        if other.shape != mine.shape or other.dtype != mine.dtype:
            raise RuntimeError(
                f"{name}: baseline {tuple(other.shape)} {other.dtype}, candidate "
                f"{tuple(mine.shape)} {mine.dtype}; the stacks must hold the same layers"
            )
        prefix, _, attribute = name.rpartition(".")
        setattr(owners[prefix], attribute, other)
    if set(theirs) != set(dict(candidate.part.named_parameters(remove_duplicate=False))):
        raise RuntimeError("the two stacks hold different parameters on this rank")
    candidate.optimizer = baseline.optimizer


# ----------------------------------------------------------------- gradients
def take_gradients(part: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, detached from the parameter (which is left without one)."""
    grads = {}
    for name, param in part.named_parameters():
        if param.grad is not None:
            grads[name] = param.grad
            param.grad = None
    return grads


def put_gradients(part: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    for name, param in part.named_parameters():
        param.grad = grads.get(name)


def storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a mapping or iterable)."""
    values = tensors.values() if isinstance(tensors, dict) else tensors
    seen: dict[int, int] = {}
    for tensor in values:
        if tensor is None:
            continue
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


# ------------------------------------------------------------ the shadow update
SHADOW_CHUNK = 1 << 20
"""Elements a shadow update handles at a time."""


@torch.no_grad()
def shadow_update(
    optimizer: torch.optim.Optimizer,
    part: nn.Module,
    grads: dict[str, torch.Tensor],
    chunk: int = SHADOW_CHUNK,
) -> dict[str, torch.Tensor]:
    """The parameters ``optimizer`` would produce from ``grads``, without touching its
    parameters or state: per parameter, chunk by chunk, a fresh optimizer of the same
    class and settings steps copies of the chunk and its state. AdamW is elementwise, so
    each chunk's result is what the whole step would give (`tests/test_compare_inplace.py`
    checks it bit for bit). Each gradient is released once its parameter is done, so the
    results take the gradients' place in memory."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    out: dict[str, torch.Tensor] = {}
    for name, param in part.named_parameters():
        grad = grads.pop(name, None)
        if grad is None:
            continue
        group = group_of.get(id(param))
        if group is None:
            raise RuntimeError(f"{name} is not in the optimizer")
        settings = {k: v for k, v in group.items() if k != "params"}
        state = optimizer.state.get(param, {})
        result = torch.empty_like(param)
        flat_param, flat_grad, flat_out = param.reshape(-1), grad.reshape(-1), result.view(-1)
        for start in range(0, param.numel(), chunk):
            piece = slice(start, start + chunk)
            copy = nn.Parameter(flat_param[piece].clone())
            copy.grad = flat_grad[piece].clone()
            shadow = type(optimizer)([copy])
            shadow.param_groups[0].update(settings)  # every setting, as the group holds it
            if state:
                shadow.state[copy] = {
                    key: value.reshape(-1)[piece].clone()
                    if torch.is_tensor(value) and value.numel() == param.numel()
                    else (value.clone() if torch.is_tensor(value) else value)
                    for key, value in state.items()
                }
            shadow.step()
            flat_out[piece].copy_(copy)
        del grad
        out[name] = result
    return out


# ---------------------------------------------------------- whole parameters
def _shard_of(pipeline: Any) -> dict[str, Any]:
    return {s.name: s for s in pipeline.optimizer.shards} if is_sharded(pipeline) else {}


def whole_parameters(pipeline: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every parameter as this rank's part holds it whole (an FSDP2
    shard gathered over its group: a collective, one parameter at a time)."""
    shards = _shard_of(pipeline)
    for name, param in pipeline.part.named_parameters():
        if name in shards:
            yield name, pipeline.optimizer.full_parameter(shards[name])
        else:
            yield name, param.detach()


def load_parameters(target: Any, source: Any) -> None:
    """Set ``target``'s (unsharded) parameters to ``source``'s values, in its own dtype
    (storage released by `release_parameters` is given back first), and its expert biases."""
    mine = dict(target.part.named_parameters())
    with torch.no_grad():
        for name, value in whole_parameters(source):
            storage = mine[name].untyped_storage()
            wanted = mine[name].numel() * mine[name].element_size()
            if storage.nbytes() < wanted:
                storage.resize_(wanted)
            mine[name].copy_(value)
    copy_buffers(source, target)


def buffer_key(name: str) -> str:
    """A buffer's name as the model names it: the components wrappers add (activation
    checkpointing, torch.compile: ``_...``) dropped, so it is the same in every stack."""
    return ".".join(part for part in name.split(".") if not part.startswith("_"))


def stack_buffers(pipeline: Any) -> dict[str, torch.Tensor]:
    """A stack's training-state buffers (the routers' expert biases), by `buffer_key`."""
    return {buffer_key(name): buffer for name, buffer in state_buffers(pipeline.part)}


def copy_buffers(source: Any, target: Any) -> None:
    """``target``'s training-state buffers set to ``source``'s (``source`` may hold more:
    the oracle holds every layer)."""
    theirs = stack_buffers(source)
    with torch.no_grad():
        for name, mine in stack_buffers(target).items():
            if name not in theirs:
                raise RuntimeError(f"the source stack holds no buffer {name} on this rank")
            mine.copy_(theirs[name])


def release_parameters(part: nn.Module) -> None:
    """Free the storage of ``part``'s (unsharded) parameters; `load_parameters` gives it
    back. The float32 truth holds its parameters only while it runs, and the bfloat16
    stacks' parameters, exact in float32, are not needed meanwhile."""
    with torch.no_grad():
        for param in part.parameters():
            if not isinstance(param, DTensor):
                param.untyped_storage().resize_(0)


def _adam_state(pipeline: Any, name: str, param: torch.Tensor) -> tuple[dict, int]:
    """Whole ``exp_avg`` / ``exp_avg_sq`` of one parameter and its step count."""
    shards = _shard_of(pipeline)
    if name in shards:
        from optimized.train import gather_slices  # noqa: PLC0415

        shard = shards[name]
        step = pipeline.optimizer.step_count
        tensors = pipeline.optimizer.state_tensors(shard)
        whole = {
            key: gather_slices(tensors[key].reshape(-1), shard).view(param.shape)
            for key in ("exp_avg", "exp_avg_sq")
        }
        return (whole if step else {}), step
    state = pipeline.optimizer.state.get(param, {})
    if not state:
        return {}, 0
    return {k: state[k] for k in ("exp_avg", "exp_avg_sq")}, int(state["step"])


def _states(source: Any, target: Any) -> Iterator[tuple[str, torch.Tensor, dict, int]]:
    """``(name, value, moments, step)`` of each parameter ``target`` holds, from ``source``:
    its own whole parameters (the same layers and experts), or the rows of the oracle's
    whole tensors that ``target`` holds (its layers; its block of experts)."""
    mine = dict(source.part.named_parameters())
    if source.name != "oracle":
        for name, value in whole_parameters(source):
            yield name, value, *_adam_state(source, name, mine[name])
        return
    owners = {name: module for name, module in target.part.named_modules()}
    for name, param in target.part.named_parameters():
        rows = slice(None)
        if is_expert_parameter(name):
            first = getattr(owners[name.rpartition(".")[0]], "first_expert", 0)
            rows = slice(first, first + param.shape[0])
        moments, step = _adam_state(source, name, mine[name])
        yield name, mine[name].detach()[rows], {k: v[rows] for k, v in moments.items()}, step


def copy_state(source: Any, target: Any) -> None:
    """``target`` takes ``source``'s parameters, AdamW moments and expert biases, one
    parameter at a time (both stacks hold the same layers and experts on this rank, or
    ``source`` is the oracle, which holds them all)."""
    shards = _shard_of(target)
    params = dict(target.part.named_parameters())
    with torch.no_grad():
        for name, value, moments, step in _states(source, target):
            if name in shards:
                shard = shards[name]
                target.optimizer.set_parameter(shard, value)
                if step:
                    target.optimizer.load_state(shard, moments, step)
                else:
                    target.optimizer.optimizer.state.pop(shard.master, None)
            else:
                params[name].copy_(value)
                state = target.optimizer.state
                if step:
                    mine = state.setdefault(params[name], {})
                    for key, tensor in moments.items():
                        if key in mine:
                            mine[key].copy_(tensor)
                        else:
                            mine[key] = tensor.to(params[name].dtype).clone()
                    mine["step"] = torch.tensor(float(step))
                else:
                    state.pop(params[name], None)
        if shards:
            target.optimizer.reset_masters()
    copy_buffers(source, target)
