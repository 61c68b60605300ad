"""FSDP2 sharding in `twinpipe train`: what it shards, and that it changes nothing beyond
rounding (float32: losses and gradient norms rel <= 1e-6 per step, gradients 1 - cos <=
1e-10), with both pipeline runners."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.distributed.tensor import DTensor

from models.distributed import launch, make_layout
from models.model import is_expert_parameter
from models.presets import resolve_model
from models.training import OptimizerConfig
from optimized import sharding, trainer
from optimized.data import TokenDataset, TokenLoader, default_dataset
from optimized.optimizer import ShardedAdamW, gather_slices
from tests.test_train import REFERENCE_RUNNER, _reference_runner, config, train  # noqa: F401

OPTIMIZED_RUNNER = "optimized.pipeline:OptimizedPipeline"


def _one_step_gradients(runner_name: str, fsdp: bool, overrides: tuple[str, ...]) -> dict:
    """One forward/backward of the trainer's first batch; whole gradients by name."""
    os.environ["TWINPIPE_RUNNER"] = runner_name
    cfg = config(*overrides, f"parallel.fsdp={str(fsdp).lower()}")
    model = resolve_model(cfg.model.name)
    parallel = trainer.parallel_config(cfg, model)
    layout = make_layout(parallel)
    runner = trainer.runner_class()(
        model, parallel, layout, trainer.initial_state(cfg, model), OptimizerConfig()
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
    if fsdp:
        loss = sharding.forward_backward(runner, optimizer, sharded, ids, labels)
    else:
        loss = runner.forward_backward(ids, labels)
    norm = optimizer.prepare_gradients()
    grads = {
        s.name: gather_slices(s.master.grad, s).view(s.param.shape).clone()
        for s in optimizer.shards
    }
    kinds = {
        name: (isinstance(p, DTensor), tuple(p.to_local().shape) if isinstance(p, DTensor)
               else tuple(p.shape), tuple(p.shape))
        for name, p in runner.part.named_parameters()
    }  # fmt: skip
    state = sum(s.master.numel() for s in optimizer.shards)
    return {"loss": loss, "norm": norm, "grads": grads, "kinds": kinds, "sharded": sharded,
            "master_elements": state}  # fmt: skip


@pytest.mark.parametrize("runner_name", [REFERENCE_RUNNER, OPTIMIZED_RUNNER])
def test_fsdp_shards_leaf_modules_and_keeps_gradients(runner_name):
    """DP=2 EP=2: FSDP2 holds half the rows of every non-expert parameter but the output
    layer; experts stay whole (EP shards them); the reduced gradients equal the unsharded
    run's."""
    overrides = ("parallel.dp=2", "parallel.ep=2")
    sharded = launch(_one_step_gradients, 2, (runner_name, True, overrides))
    whole = launch(_one_step_gradients, 2, (runner_name, False, overrides))
    for rank in range(2):
        got, want = sharded[rank], whole[rank]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
        assert got["norm"] == pytest.approx(want["norm"], rel=1e-6)
        for name, (is_dtensor, local, shape) in got["kinds"].items():
            on_fsdp = not is_expert_parameter(name) and not name.startswith("lm_head.")
            assert is_dtensor == on_fsdp == (name in got["sharded"]), name
            if on_fsdp:
                rows = -(-shape[0] // 2)
                assert local == (min(rows, shape[0] - rank * rows),) + shape[1:], name
        for name, grad in got["grads"].items():
            ref = want["grads"][name].double()
            cos = torch.nn.functional.cosine_similarity(
                grad.double().flatten(), ref.flatten(), dim=0
            )
            assert 1 - float(cos) <= 1e-10, (name, float(cos))
        # Optimizer state: the FSDP2 rows of this rank plus the whole experts and head.
        assert got["master_elements"] < 0.75 * sum(g.numel() for g in got["grads"].values())


def _losses_and_norms(tmp_path, name: str, *overrides: str) -> tuple[list, list]:
    metrics = tmp_path / f"{name}.jsonl"
    losses = train(config(*overrides, f"logging.metrics_file={metrics}"))[0]["losses"]
    norms = [json.loads(line)["gradient_norm"] for line in metrics.read_text().splitlines()]
    return losses, norms


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
