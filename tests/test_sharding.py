"""FSDP2 sharding in `twinpipe train`: what it shards, and that it changes nothing beyond
rounding (float32: losses and gradient norms rel <= 1e-6 per step, gradients 1 - cos <=
1e-10), with both pipeline runners."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.distributed.tensor import DTensor

from models.hf import resolve_model
from models.network import is_expert_parameter
from models.runtime import OptimizerConfig, launch, make_layout
from optimized.ops.grouped_linear import WeightGradStore
from optimized.pipeline import gradient_sync, sharding
from optimized.train import TokenDataset, TokenLoader, default_dataset, trainer
from optimized.train.optimizer import ShardedAdamW, gather_slices
from tests.test_train import REFERENCE_RUNNER, _reference_runner, config, train  # noqa: F401

OPTIMIZED_RUNNER = "optimized.pipeline:OptimizedPipeline"


def _one_step_gradients(runner_name: str, fsdp: bool, overrides: tuple[str, ...]) -> dict:
    """One forward/backward of the trainer's first batch; whole gradients by name, and how
    many W steps ran and how many parameter groups still had W gradients at the end."""
    os.environ["TWINPIPE_RUNNER"] = runner_name
    cfg = config(*overrides, f"parallel.fsdp={str(fsdp).lower()}")
    model = resolve_model(cfg.model.name)
    parallel = trainer.parallel_config(cfg, model)
    layout = make_layout(parallel)
    runner = trainer.runner_class()(
        model, parallel, layout, trainer.weight_source(cfg, model), OptimizerConfig()
    )
    sharded = sharding.apply_fsdp(runner.part, layout, torch.device("cpu")) if fsdp else set()
    optimizer = ShardedAdamW(runner.part, layout, 1e-3, (0.9, 0.95), 1e-8, 0.0, fsdp, sharded)
    runner.optimizer = optimizer
    loader = TokenLoader(
        TokenDataset(default_dataset(), cfg.data.seq_len), cfg.data.micro_batches,
        cfg.data.micro_batch_size, layout.dp_rank, layout.dp, cfg.seed, cfg.data.shuffle,
    )  # fmt: skip
    batch = next(loader)
    ids, labels = trainer.global_batch(batch.inputs, batch.labels, layout)
    counts = {"w_steps": 0, "pending_at_end": 0}
    pop, pending = WeightGradStore.pop, gradient_sync.reduce_pending_gradients

    def counted_pop(store):
        counts["w_steps"] += 1
        pop(store)

    def counted_pending(part):
        counts["pending_at_end"] += pending(part)
        return counts["pending_at_end"]

    WeightGradStore.pop, gradient_sync.reduce_pending_gradients = counted_pop, counted_pending
    if fsdp:
        loss = sharding.forward_backward(runner, optimizer, sharded, ids, labels)
        counts["reduced_after_w"] = runner.schedule.gradient_sync.reductions
    else:
        loss = runner.forward_backward(ids, labels)
    norm = optimizer.prepare_gradients()
    grads = {
        s.name: gather_slices(s.gradient.float(), s).view(s.param.shape).clone()
        for s in optimizer.shards
    }
    kinds = {
        name: (isinstance(p, DTensor), tuple(p.to_local().shape) if isinstance(p, DTensor)
               else tuple(p.shape), tuple(p.shape))
        for name, p in runner.part.named_parameters()
    }  # fmt: skip
    state = sum(s.master.numel() for s in optimizer.shards)
    return {"loss": loss, "norm": norm, "grads": grads, "kinds": kinds, "sharded": sharded,
            "master_elements": state, "dp_rank": layout.dp_rank, **counts}  # fmt: skip


def _check_sharded_like_unsharded(overrides: tuple[str, ...], runner_name: str) -> list[dict]:
    """Run sharded and unsharded; check what FSDP2 shards, over which group, and that every
    gradient, the loss and the norm equal the unsharded run's (float32 rounding)."""
    dp = int(next(o for o in overrides if o.startswith("parallel.dp=")).split("=")[1])
    ep = int(next(o for o in overrides if o.startswith("parallel.ep=")).split("=")[1])
    pp = int(next((o for o in overrides if o.startswith("parallel.pp=")), "=1").split("=")[1])
    sharded = launch(_one_step_gradients, pp * dp, (runner_name, True, overrides))
    whole = launch(_one_step_gradients, pp * dp, (runner_name, False, overrides))
    for got, want in zip(sharded, whole, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
        assert got["norm"] == pytest.approx(want["norm"], rel=1e-6)
        for name, (is_dtensor, local, shape) in got["kinds"].items():
            expert = is_expert_parameter(name)
            # Experts are sharded over their replicas (DP / EP of them), the rest over DP.
            size, index = (dp // ep, got["dp_rank"] // ep) if expert else (dp, got["dp_rank"])
            assert is_dtensor == (size > 1) == (name in got["sharded"]), name
            if is_dtensor:
                rows = -(-shape[0] // size)
                assert local == (min(rows, shape[0] - index * rows),) + shape[1:], name
        for name, grad in got["grads"].items():
            ref = want["grads"][name].double()
            cos = torch.nn.functional.cosine_similarity(
                grad.double().flatten(), ref.flatten(), dim=0
            )
            assert 1 - float(cos) <= 1e-10, (name, float(cos))
            assert torch.allclose(grad.double(), ref, rtol=1e-5, atol=1e-7), name
        # Optimizer state: this rank's FSDP2 rows (plus whole experts where EP = DP).
        assert got["master_elements"] < 0.75 * sum(g.numel() for g in got["grads"].values())
    return sharded


@pytest.mark.slow
@pytest.mark.parametrize("runner_name", [REFERENCE_RUNNER, OPTIMIZED_RUNNER])
def test_fsdp_shards_leaf_modules_and_keeps_gradients(runner_name):
    """DP=2 EP=2: FSDP2 holds half the rows of every non-expert parameter, the output layer
    included; experts stay whole (EP shards them, one replica each); the reduced gradients
    equal the unsharded run's."""
    _check_sharded_like_unsharded(("parallel.dp=2", "parallel.ep=2"), runner_name)


@pytest.mark.slow
@pytest.mark.parametrize("runner_name", [REFERENCE_RUNNER, OPTIMIZED_RUNNER])
def test_fsdp_shards_experts_over_their_replicas(runner_name):
    """DP=2 EP=1, GPT-OSS (expert biases; every layer MoE, so stage 0 has experts): the
    routed experts are FSDP2 DTensors sharded over their 2 replicas. The optimized
    schedule defers stage 0's expert weight gradients to a W step after their last
    backward; those are reduced once after that W (the chunk's last-weight mark), and every
    gradient equals the unsharded run's (a W gradient reduced twice, or never, would not)."""
    overrides = ("model.name=tiny-gpt-oss", "parallel.dp=2", "parallel.ep=1")
    ranks = _check_sharded_like_unsharded(overrides, runner_name)
    for got in ranks:
        assert got["pending_at_end"] == 0, got  # grad_sync="step": nothing left at the end
        if runner_name == OPTIMIZED_RUNNER:
            assert got["w_steps"] >= 1 and got["reduced_after_w"] >= 1, got
        else:
            assert got["w_steps"] == got["reduced_after_w"] == 0, got


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ("parallel.pp=2", "parallel.dp=2", "parallel.ep=1", "data.micro_batches=4"),
        ("parallel.pp=1", "parallel.dp=4", "parallel.ep=2", "data.micro_batches=2"),
    ],
    ids=["pp2-dp2-ep1", "pp1-dp4-ep2"],
)
def test_fsdp_reduces_w_gradients_at_4_ranks(overrides):
    """Optimized, tiny-qwen3-moe. PP=2 DP=2 EP=1: W steps run between two backwards of the
    same experts (nB1W1F1), so the next backward's reduce-scatter carries them; the rest
    wait for the step's end. DP=4 EP=2: experts sharded over EP and FSDP2 over their 2
    replicas at once. Every gradient equals the unsharded run's."""
    ranks = _check_sharded_like_unsharded(("model.name=tiny-qwen3-moe",) + overrides,
                                          OPTIMIZED_RUNNER)  # fmt: skip
    for got in ranks:
        assert got["w_steps"] >= 1, got


def _losses_and_norms(tmp_path, name: str, *overrides: str) -> tuple[list, list]:
    metrics = tmp_path / f"{name}.jsonl"
    losses = train(config(*overrides, f"logging.metrics_file={metrics}"))[0]["losses"]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    TRAFFIC[name] = [r["communication_bytes"] for r in records]
    return losses, [r["gradient_norm"] for r in records]


TRAFFIC: dict[str, list[dict]] = {}
"""Each run's ``communication_bytes`` per step (the metrics file's), by run name."""


@pytest.mark.slow
def test_sharding_changes_no_loss_beyond_rounding_pp2(tmp_path):
    """PP=2 DP=2 EP=2, 3 steps sharded (the default at DP > 1) against unsharded: every
    step's loss and gradient norm within float32 rounding (rel <= 1e-6). DP=2 EP=2 is
    checked the same way in tests/test_train.py::test_exact_resume_after_sigterm."""
    layout = ("steps=3", "parallel.pp=2", "parallel.dp=2", "parallel.ep=2",
              "data.micro_batches=4")  # fmt: skip
    losses, norms = _losses_and_norms(tmp_path, "sharded", *layout)
    plain, plain_norms = _losses_and_norms(tmp_path, "plain", *layout, "parallel.fsdp=false")
    assert len(losses) == len(norms) == 3
    for a, b in zip(losses + norms, plain + plain_norms, strict=True):
        assert abs(a - b) <= 1e-6 * abs(b), (losses, plain, norms, plain_norms)
    # The metrics file's bytes per step: FSDP2 gathers and reduce-scatters where the plain
    # run all-reduces; the same activations travel point to point.
    for sharded, whole in zip(TRAFFIC["sharded"], TRAFFIC["plain"], strict=True):
        assert sharded["all_gather"] > 0 and sharded["reduce_scatter"] > 0, sharded
        assert "reduce_scatter" not in whole and whole["all_reduce"] > sharded["all_reduce"]
        for kind in ("send", "recv"):  # the all-to-all's rows follow the routing
            assert sharded[kind] == whole[kind] > 0, (kind, sharded, whole)
        assert sharded["all_to_all"] > 0 and whole["all_to_all"] > 0
