"""`ShardedAdamW` held to plain torch: `clip_grad_norm_` and `torch.optim.AdamW`.

The harness compares two stacks that share the optimizer, so no comparison sees a
mistake in it (issue 33: clipping only above ``2 * max_norm`` passed every test). Here a
small model with every kind of parameter the trainer steps (an embedding whose unused
rows get no gradient, a norm weight, a bias, routed-expert weights, matrices with a row
count that does not divide by 2) is stepped four times by `ShardedAdamW` and by torch's
own AdamW on the same whole gradients, clipped by `clip_grad_norm_`:

- clipping: step 1 below ``max_norm`` (untouched), step 2 between ``max_norm`` and
  ``2 * max_norm``, step 3 far above it (x 100), step 4 with clipping off; the global
  norm, the clip factor and the parameters after each step are compared;
- AdamW: betas ``(0.8, 0.9)`` and ``eps = 1e-3`` (of the order of the gradients, so
  ``eps`` moves the update), weight decay 0.1 decoupled (``p *= 1 - lr * wd``) on every
  parameter -- the trainer's rule (`optimized.train.config.OptimSection.weight_decay`):
  norm weights, biases and embeddings decay too, as in `torch.optim.AdamW` over all
  parameters -- a learning rate that changes every step, and bias correction over four
  steps (Adam's first update is ``lr * sign(g)`` whatever the scale, so one step could not
  see a clipping or bias-correction error);
- on one rank, and at two ranks (gloo) unsharded (plain DP, each replica the whole
  state), with ZeRO-1 slices of the state, and with FSDP2 (`fully_shard`, the gradients
  reduce-scattered as the trainer sets it up: a sum, the loss already the global mean).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from models.runtime import Layout, ParallelConfig, launch, make_layout, reduce_gradients
from optimized.train.optimizer import ShardedAdamW

BETAS, EPS, WEIGHT_DECAY = (0.8, 0.9), 1e-3, 0.1
LEARNING_RATES = (2e-2, 1e-2, 3e-2, 5e-3)
CLIP_FACTORS = (2.0, 1 / 1.5, 1 / 100, None)
"""``max_norm`` of each step as a multiple of that step's global norm (None: off):
below, between ``max_norm`` and ``2 * max_norm``, far above, off."""
VOCAB, WIDTH, EXPERTS, TOKENS = 13, 6, 3, 8


class Scale(nn.Module):
    """A norm's learnable weight (1-D)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Experts(nn.Module):
    """Routed experts (``.mlp.experts.`` in the name, 3-D)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(EXPERTS, WIDTH, WIDTH) * 0.4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.einsum("th,ehk->tek", x, self.weight)).mean(1)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = Scale()
        self.mlp = nn.Module()
        self.mlp.experts = Experts()
        self.proj = nn.Linear(WIDTH, 5)  # 5 rows: FSDP2 shards 3 + 2


class Toy(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed_tokens = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList([Layer()])
        self.lm_head = nn.Linear(5, VOCAB, bias=False)

    def leaves(self) -> list[nn.Module]:
        layer = self.layers[0]
        return [self.embed_tokens, layer.input_layernorm, layer.mlp.experts, layer.proj,
                self.lm_head]  # fmt: skip

    def loss_sum(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        layer = self.layers[0]
        x = layer.input_layernorm(self.embed_tokens(ids))
        x = x + layer.mlp.experts(x)
        return F.cross_entropy(self.lm_head(layer.proj(x)), targets, reduction="sum")


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens of step ``step``: ids below VOCAB - 4, so four embedding rows
    never get a gradient (they still decay)."""
    generator = torch.Generator().manual_seed(100 * step + rank)
    return (torch.randint(0, VOCAB - 4, (TOKENS,), generator=generator),
            torch.randint(0, VOCAB, (TOKENS,), generator=generator))  # fmt: skip


def whole_batch_gradients(model: Toy, step: int, ranks: int) -> None:
    """The gradient of the mean loss over every rank's tokens, in one process."""
    model.zero_grad(set_to_none=True)
    total = sum(model.loss_sum(*batch(step, r)) for r in range(ranks))
    (total / (TOKENS * ranks)).backward()


def global_norm(model: nn.Module) -> float:
    return math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))


def single_rank_layout() -> Layout:
    return Layout(0, 0, 0, 0, 1, 1, 1, None, None, None, None)


def run_steps(mode: str, layout: Layout) -> list[dict]:
    """Four steps of `ShardedAdamW` (``mode``: ``single``, ``dp``, ``zero1``, ``fsdp``)
    and of torch's AdamW after `clip_grad_norm_` on the whole batch's gradients; each
    step's norms, clip factors and parameter differences."""
    ranks = layout.dp
    ours, truth = Toy(seed=0), Toy(seed=0)
    sharded: set[str] = set()
    if mode == "fsdp":
        mesh = DeviceMesh.from_group(layout.dp_group, "cpu", mesh_dim_names=("dp",))
        ids = {id(p) for m in ours.leaves() for p in m.parameters()}
        sharded = {n for n, p in ours.named_parameters() if id(p) in ids}
        for module in ours.leaves():
            fully_shard(module, mesh=mesh, reshard_after_forward=False)
            module.set_gradient_divide_factor(1.0)  # a sum, as optimized.pipeline.sharding
            module.set_force_sum_reduction_for_comms(True)
    optimizer = ShardedAdamW(ours, layout, LEARNING_RATES[0], BETAS, EPS, WEIGHT_DECAY,
                             shard=mode in ("zero1", "fsdp"), fsdp=sharded)  # fmt: skip
    reference = torch.optim.AdamW(truth.parameters(), lr=LEARNING_RATES[0], betas=BETAS,
                                  eps=EPS, weight_decay=WEIGHT_DECAY, foreach=False)  # fmt: skip
    start = {n: p.detach().clone() for n, p in truth.named_parameters()}
    records = []
    for step, (lr, factor) in enumerate(zip(LEARNING_RATES, CLIP_FACTORS)):
        # This rank's share of the global mean loss; the gradients summed over DP.
        optimizer.zero_grad()
        ids, targets = batch(step, layout.dp_rank)
        (ours.loss_sum(ids, targets) / (TOKENS * ranks)).backward()
        if mode in ("dp", "zero1"):
            reduce_gradients(ours, layout)
        whole = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                 for n, p in ours.named_parameters()}  # fmt: skip
        whole_batch_gradients(truth, step, ranks)
        gradient_error = max(
            float((whole[n] - p.grad).norm() / p.grad.norm().clamp(min=1e-30))
            for n, p in truth.named_parameters()
        )
        norm = global_norm(truth)
        max_norm = 0.0 if factor is None else factor * norm
        clipped_norm = float(torch.nn.utils.clip_grad_norm_(truth.parameters(), max_norm)
                             if max_norm else norm)  # fmt: skip
        truth_clipped = global_norm(truth)  # the norm clip_grad_norm_ left
        ours_norm = optimizer.prepare_gradients()
        optimizer.clip(ours_norm, max_norm)
        optimizer.step(lr)
        for group in reference.param_groups:
            group["lr"] = lr
        reference.step()
        expected_factor = min(1.0, max_norm / (clipped_norm + 1e-6)) if max_norm else 1.0
        params = {}
        for name, param in ours.named_parameters():
            value = param.full_tensor() if isinstance(param, DTensor) else param.detach()
            want = dict(truth.named_parameters())[name].detach()
            moved = (want - start[name]).norm()
            params[name] = (float((value - want).norm() / moved), float(moved))
        records.append({"norm": ours_norm, "truth_norm": clipped_norm, "max_norm": max_norm,
                        "factor": optimizer.clip_factor, "truth_factor": expected_factor,
                        "clipped": truth_clipped,
                        "params": params, "gradient_error": gradient_error})  # fmt: skip
    return records


def check(records: list[dict], mode: str) -> None:
    for step, record in enumerate(records):
        where = f"{mode}, step {step + 1} ({CLIP_FACTORS[step]} x the norm)"
        assert record["gradient_error"] <= 1e-6, (where, record["gradient_error"])
        assert record["norm"] == pytest.approx(record["truth_norm"], rel=1e-6), where
        assert record["factor"] == pytest.approx(record["truth_factor"], rel=1e-6), where
        clipped = record["factor"] * record["norm"]
        assert clipped == pytest.approx(record["clipped"], rel=1e-6), where
        for name, (error, moved) in record["params"].items():
            # Every parameter moved (decay alone moves those without a gradient) and
            # lies where torch's AdamW put it, to float32 rounding of the update.
            assert moved > 0, (where, name)
            assert error <= 1e-4, (where, name, error)


def test_one_rank_clips_and_steps_as_torch():
    check(run_steps("single", single_rank_layout()), "one rank")


def test_the_trainer_s_rule_decays_every_parameter():
    """With no gradient at all, AdamW's update is the decay alone: every parameter, norm
    weights and biases included, shrinks by ``1 - lr * wd`` per step."""
    model = Toy(seed=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = ShardedAdamW(model, single_rank_layout(), 0.5, BETAS, EPS, WEIGHT_DECAY, False)
    for lr in (0.5, 0.25):
        optimizer.zero_grad()
        assert optimizer.prepare_gradients() == 0.0
        optimizer.step(lr)
    for name, param in model.named_parameters():
        expected = before[name] * (1 - 0.5 * WEIGHT_DECAY) * (1 - 0.25 * WEIGHT_DECAY)
        torch.testing.assert_close(param.detach(), expected, rtol=1e-6, atol=0, msg=name)


def _two_rank_worker() -> dict[str, list[dict]]:
    layout = make_layout(ParallelConfig(dp=2, ep=1, micro_batches=2))
    return {mode: run_steps(mode, layout) for mode in ("dp", "zero1", "fsdp")}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_clip_and_step_as_torch_unsharded_zero1_and_fsdp():
    """Plain DP (the norm counted on one replica), ZeRO-1 slices (5 x 6 = 30 elements cut
    15 + 15, 13 x 6 cut 39 + 39) and FSDP2 rows (5 rows: 3 + 2), against one process."""
    for rank, by_mode in enumerate(launch(_two_rank_worker, 2)):
        for mode, records in by_mode.items():
            check(records, f"{mode}, rank {rank}")
