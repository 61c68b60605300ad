"""DeepSeek-V3's multi-token prediction at every layout: a tiny random DeepSeek-V3 with
D = 1 and D = 2 gives the oracle's main loss, MTP losses and accuracies, every gradient
(the MTP layers', and the shared embedding's and head's), the load of every router (the
MTP layer's too) and the expert biases after the step, in both pipeline stacks, at (PP,
DP, EP) = (1,1,1), (2,1,1), (2,2,2) and PP 4 with 8 layers, at the balancing tests' bars.

One launch per world size (a test each) runs every case there; the oracle (`reference.oracle`, which
writes the MTP position by position from the report's equations) runs once per case here."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from models.network import SeededWeights, mtp_labels, preset
from models.runtime import (
    OptimizerConfig,
    ParallelConfig,
    counted_step,
    launch,
    make_layout,
    moe_routers,
    synthetic_batch,
)
from optimized.estimator import EstimateConfig
from optimized.estimator.communication import predict_traffic
from optimized.pipeline import OptimizedPipeline
from optimized.pipeline.sharding import apply_fsdp, forward_backward
from optimized.train.optimizer import ShardedAdamW
from reference.oracle import Oracle
from reference.pipeline import ReferencePipeline

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

LOSS_REL = 1e-5
GRAD_REL = 1e-4
"""The balancing tests' bars (`tests/test_balancing_layouts.py`)."""
OPTIMIZER = OptimizerConfig(lr=1e-5)
STEPS = 1
"""One step: its biases after the update are compared too (the MTP router's moves)."""
CASES = {
    # D = 1 with the pooled loss: the MTP router's counts pool with the main model's.
    "d1-pooled": dict(num_mtp_layers=1, mtp_loss_coef=0.3, aux_loss="pooled",
                      aux_loss_coef=0.1, expert_bias_rate=0.01),
    # D = 2 with DeepSeek's per-sequence loss.
    "d2-sequence": dict(num_mtp_layers=2, aux_loss_alpha=0.03, expert_bias_rate=0.01),
}  # fmt: skip


def _config(case: str, layers: int = 4):
    return preset("tiny-deepseek-v3", num_hidden_layers=layers, **CASES[case])


def _parallel(pp: int, dp: int, ep: int) -> ParallelConfig:
    return ParallelConfig(pp=pp, dp=dp, ep=ep, micro_batches=2 * pp, micro_batch_size=1,
                          seq_len=16)  # fmt: skip


def _oracle(case: str, layers: int, parallel: ParallelConfig) -> list[dict]:
    cfg = _config(case, layers)
    oracle = Oracle(cfg, SeededWeights(cfg, seed=7), OPTIMIZER, micro_batch_size=1)
    out = []
    for step in range(STEPS):
        ids, labels = synthetic_batch(cfg, parallel, step)
        loss = oracle.forward_backward(ids, labels)
        grads = {n: p.grad.detach().clone() for n, p in oracle.model.named_parameters()}
        mtp, load = oracle.mtp_values().clone(), oracle.step_load()
        oracle.optimizer_step()
        biases = {i: r.e_score_correction_bias.clone()
                  for i, r in moe_routers(oracle.model).items()}  # fmt: skip
        out.append(dict(loss=loss, mtp=mtp, grads=grads, load=load, biases=biases))
    return out


def _build(cls, cfg, parallel, layout, fsdp: bool):
    """A stack's runner; ``fsdp``: as `twinpipe train` runs it at DP > 1 (FSDP2 on every
    unit, the MTP layers' included, and `ShardedAdamW`)."""
    if not fsdp:
        return cls(cfg, parallel, layout, SeededWeights(cfg, seed=7), OPTIMIZER), None
    sharded: set[str] = set()
    pipe = cls(
        cfg,
        parallel,
        layout,
        SeededWeights(cfg, seed=7),
        OPTIMIZER,
        shard=lambda part: sharded.update(apply_fsdp(part, layout, torch.device("cpu"))),
    )
    pipe.optimizer = ShardedAdamW(
        pipe.part,
        layout,
        OPTIMIZER.lr,
        OPTIMIZER.betas,
        OPTIMIZER.eps,
        OPTIMIZER.weight_decay,
        True,
        sharded,
    )
    return pipe, sharded  # fmt: skip


def _worker(runs, oracles):
    out = []
    for (case, layers, parallel, fsdp), trajectory in zip(runs, oracles, strict=True):
        if parallel.world_size != torch.distributed.get_world_size():
            continue
        layout = make_layout(parallel)
        cfg = _config(case, layers)
        for cls in (ReferencePipeline, OptimizedPipeline):
            pipe, sharded = _build(cls, cfg, parallel, layout, fsdp)
            owners = {f"{prefix}.{p}" if prefix else p: module
                      for prefix, module in pipe.part.named_modules()
                      for p, _ in module.named_parameters(recurse=False)}  # fmt: skip
            for step, oracle in enumerate(trajectory):
                ids, labels = synthetic_batch(cfg, parallel, step)
                traffic = None
                if fsdp:  # FSDP2's own collectives counted, for the traffic estimator
                    steps: list = []
                    with counted_step(layout, steps):
                        loss = forward_backward(pipe, pipe.optimizer, sharded, ids, labels)
                    traffic = _fsdp_figures(steps[0])
                else:
                    loss = pipe.forward_backward(ids, labels)
                mtp = pipe.mtp_values()
                worst = (0.0, "")
                for name, param in pipe.part.named_parameters():
                    grad = param.grad
                    if isinstance(grad, DTensor):  # this rank's rows: gather them (DP group)
                        grad = grad.full_tensor()
                    theirs = oracle["grads"][name]
                    if ".mlp.experts." in name:
                        first = owners[name].first_expert
                        theirs = theirs[first : first + grad.shape[0]]
                    rel = float((grad - theirs).norm() / theirs.norm().clamp_min(1e-30))
                    worst = max(worst, (rel, name))
                routers = moe_routers(pipe.part)
                rows = [list(moe_routers_of(cfg)).index(i) for i in routers]
                load_equal = torch.equal(pipe.step_load().cpu(), oracle["load"][rows].cpu())
                if fsdp:  # the biases move by the load alone
                    pipe.update_expert_biases()
                else:
                    pipe.optimizer_step()
                bias = max((float((r.e_score_correction_bias - oracle["biases"][i]).abs().max())
                            for i, r in routers.items()), default=0.0)  # fmt: skip
                mtp_prefix = f"model.layers.{layers}."
                fsdp_names = sorted(n for n in sharded or () if n.startswith(mtp_prefix))
                out.append(dict(
                    where=(case, layers, parallel.pp, parallel.dp, parallel.ep, cls.name, step,
                           fsdp),
                    loss=(oracle["loss"], loss), mtp=(oracle["mtp"], mtp.cpu()), worst=worst,
                    load_equal=load_equal, bias=bias, layers=list(routers),
                    mtp_grads=[n for n in dict(pipe.part.named_parameters())
                               if n.startswith(f"model.layers.{layers}.")],
                    mtp_sharded=fsdp_names, traffic=traffic,
                    rank=layout.pp_rank * parallel.dp + layout.dp_rank,
                ))  # fmt: skip
    return out


def _fsdp_figures(counts) -> dict:
    """``(kind, group) -> (calls, sent, received)`` of FSDP2's all-gathers and
    reduce-scatters."""
    return {key: (t.calls, t.sent, t.received) for key, t in counts.items()
            if key[0] in ("all_gather", "reduce_scatter")}  # fmt: skip


def _estimate(case: str, layers: int, parallel: ParallelConfig) -> EstimateConfig:
    return EstimateConfig(
        _config(case, layers), pp=parallel.pp, dp=parallel.dp, ep=parallel.ep,
        micro_batch_size=parallel.micro_batch_size, seq_len=parallel.seq_len,
        num_microbatches=parallel.micro_batches, fsdp=True, shard_optimizer=True,
    )  # fmt: skip


def moe_routers_of(cfg) -> list[int]:
    """Every MoE layer of the model and its MTP module, in order (the oracle's load rows)."""
    total = cfg.num_hidden_layers + cfg.num_mtp_layers
    return [i for i in range(total) if cfg.is_moe_layer(i)]


LAYOUTS = [(4, (1, 1, 1)), (4, (2, 1, 1)), (4, (2, 2, 2)), (8, (4, 1, 1))]


RUNS = [(case, layers, _parallel(*layout)) for case in CASES for layers, layout in LAYOUTS]
FSDP_RUNS = [("d1-pooled", 4, _parallel(2, 2, 1))]
"""Run as `twinpipe train` runs DP > 1 (FSDP2 and `ShardedAdamW`), in the world-4 launch:
PP2 DP2 EP1 shards the MTP layer's non-expert rows over DP and its experts over their 2
replicas, and its units sync in the loss stage beside the main layers' W-deferred ones."""
WORLDS = sorted({parallel.world_size for _, _, parallel in RUNS})


@pytest.mark.parametrize("world", WORLDS)
def test_every_layout_and_stack_is_the_oracle(world):
    """One launch per world size (each its own test, so no one test holds them all); the
    FSDP2 runs (`FSDP_RUNS`) join the launch of their size."""
    runs = [(*run, False) for run in RUNS if run[2].world_size == world]
    runs += [(*run, True) for run in FSDP_RUNS if run[2].world_size == world]
    oracles = [_oracle(case, layers, parallel) for case, layers, parallel, _ in runs]
    results = [r for rank in launch(_worker, world, (runs, oracles)) for r in rank]
    seen = set()
    for r in results:
        where = r["where"]
        seen.add((*where[:5], where[-1]))
        if where[-1]:
            if r["mtp_grads"]:  # FSDP2: every MTP parameter sharded (DP2 EP1)
                assert r["mtp_sharded"] == sorted(r["mtp_grads"]), (where, r["mtp_sharded"])
            # Its gathers and reductions as the traffic estimator predicts them: one of each
            # per unit, the MTP layer's included, the head the MTP module reruns too.
            predicted = predict_traffic(_estimate(*where[:2], _parallel(*where[2:5])), r["rank"])
            assert r["traffic"] == _fsdp_figures(predicted), (where, r["rank"])
        oracle, pipe = r["loss"]
        assert abs(pipe - oracle) <= LOSS_REL * abs(oracle), (where, oracle, pipe)
        mtp_o, mtp_p = r["mtp"]
        assert torch.allclose(mtp_p[0], mtp_o[0], rtol=LOSS_REL, atol=0), (where, mtp_o, mtp_p)
        assert torch.equal(mtp_p[1], mtp_o[1].float()) or torch.allclose(
            mtp_p[1], mtp_o[1], rtol=1e-6
        ), (where, mtp_o, mtp_p)
        assert r["worst"][0] <= GRAD_REL, (where, r["worst"])
        assert r["load_equal"], where
        assert r["bias"] == 0.0, (where, r["bias"])
    assert len(seen) == len(runs)
    # The loss stage (pp-rank 0) holds the MTP layers, and their router is balanced.
    first = [r for r in results if r["mtp_grads"]]
    assert first and all(r["layers"][-1] >= 4 for r in first)


def test_the_runs_cover_every_depth_at_every_layout():
    assert {(case, layers, p.pp, p.dp, p.ep) for case, layers, p in RUNS} == {
        (case, layers, *layout) for case in CASES for layers, layout in LAYOUTS
    }


def test_targets_never_wrap_nor_cross_a_document():
    labels = torch.tensor([[1, 2, 9, 4, 5, -100]])  # 9: end of document
    assert mtp_labels(labels, 1).tolist() == [[2, 9, 4, 5, -100, -100]]
    assert mtp_labels(labels, 1, eod_id=9).tolist() == [[2, 9, -100, 5, -100, -100]]
    assert mtp_labels(labels, 2, eod_id=9).tolist() == [[9, -100, -100, -100, -100, -100]]
