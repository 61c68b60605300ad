"""The communication estimate (`optimized.estimator.communication`) against the counter
(`models.runtime.communication`) on real runs: every rank, kind and group, calls and bytes sent
and received, to the byte, for the reference, optimized and FSDP2 runners with balanced
routing; with real routing every kind but the all-to-all still exact, and the all-to-all
exact once the routing the run saw is given (what is left is the routing's skew)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from harness.compare.stacks import stack_class as _stack_class
from models.hf import resolve_model
from models.network import BalancedRouting, RoutingTape, attach_routing_tape, build_model
from models.runtime import (
    OptimizerConfig,
    ParallelConfig,
    counted_step,
    launch,
    make_layout,
    synthetic_batch,
)
from optimized.estimator.communication import balanced_rows, predict_traffic
from optimized.estimator.config import EstimateConfig

RUNNERS = ("reference", "optimized", "optimized-fsdp")
FSDP_MODES = (
    "optimized-fsdp:micro-batch",
    "optimized-fsdp:step:reshard",
    "optimized-fsdp:micro-batch:reshard",
)
"""The FSDP runner's other ``--grad-sync`` and ``--reshard-after-forward`` settings, as
``stack:grad_sync[:reshard]`` (plain ``optimized-fsdp``: step, reshard off, the default)."""


def _runner(parallel, runner: str):
    """``runner``'s stack name and its `ParallelConfig` (with its FSDP settings)."""
    stack, *mode = runner.split(":")
    if mode:
        parallel = replace(
            parallel, grad_sync=mode[0], reshard_after_forward=mode[1:] == ["reshard"]
        )
    return stack, parallel


def _count_one_step(model, parallel, state, runners, balanced: bool) -> dict:
    """One training step of each runner on this rank, counted; with real routing, the rows
    each router call sent to each EP rank (from a recording tape)."""
    layout = make_layout(parallel)
    out = {"coords": (layout.pp_rank, layout.dp_rank, layout.ep_rank)}
    for runner in runners:
        stack, mine = _runner(parallel, runner)
        torch.manual_seed(parallel.seed)
        pipeline = _stack_class(stack)(model, mine, layout, state, OptimizerConfig())
        tape = BalancedRouting() if balanced else RoutingTape()
        attach_routing_tape(pipeline.part, tape)
        steps: list = []
        ids, labels = synthetic_batch(model, parallel, 0)
        with counted_step(layout, steps):
            pipeline.forward_backward(ids, labels)
            pipeline.optimizer_step()
        out[runner] = steps[0]
        if not balanced:
            local = model.num_experts // parallel.ep
            out[f"{runner}:rows"] = [
                np.bincount(call.index.reshape(-1) // local, minlength=parallel.ep).tolist()
                for key in sorted(tape.calls)
                for call in tape.calls[key]
            ]
        del pipeline
    return out


def _estimate(model, parallel, runner: str) -> EstimateConfig:
    stack, parallel = _runner(parallel, runner)
    return EstimateConfig(
        model, pp=parallel.pp, dp=parallel.dp, ep=parallel.ep,
        micro_batch_size=parallel.micro_batch_size, seq_len=parallel.seq_len,
        num_microbatches=parallel.micro_batches,
        stack="reference" if stack == "reference" else "optimized",
        fsdp=stack == "optimized-fsdp", shard_optimizer=stack == "optimized-fsdp",
        grad_sync=parallel.grad_sync, reshard_after_forward=parallel.reshard_after_forward,
    )  # fmt: skip


def _figures(counts) -> dict:
    return {key: (t.calls, t.sent, t.received) for key, t in counts.items()}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "preset, pp, dp, ep, seq_len, runners",
    [
        ("tiny-deepseek-v2", 2, 1, 1, 16, RUNNERS),
        ("tiny-deepseek-v2", 1, 2, 2, 16, RUNNERS),
        ("tiny-deepseek-v2", 2, 2, 2, 13, RUNNERS + FSDP_MODES),
        ("tiny-qwen3-moe", 2, 2, 2, 13, RUNNERS),
        ("tiny-gpt-oss", 2, 2, 2, 13, RUNNERS),
    ],
    ids=[
        "deepseek-pp2-dp1-ep1",
        "deepseek-pp1-dp2-ep2",
        "deepseek-pp2-dp2-ep2-uneven-fsdp-modes",
        "qwen3-pp2-dp2-ep2-uneven",
        "gpt-oss-pp2-dp2-ep2-uneven",
    ],
)
def test_predicted_exactly_with_balanced_routing(preset, pp, dp, ep, seq_len, runners):
    """The three tiny presets (DeepSeek-V2: a dense first layer, shared experts; Qwen3-MoE;
    GPT-OSS: expert and router biases), one step of each runner; at (2,2,2) on DeepSeek-V2
    also the FSDP runner's other ``--grad-sync`` and ``--reshard-after-forward`` settings.
    ``seq_len=13``: 26 routed copies over 8 experts (DeepSeek-V2), so the EP ranks receive
    14 and 12 rows and each rank's sent and received all-to-all bytes differ."""
    model = resolve_model(preset)
    parallel = ParallelConfig(
        pp=pp, dp=dp, ep=ep, micro_batch_size=1, micro_batches=2 * pp, seq_len=seq_len
    )
    state = build_model(model, seed=0).state_dict()
    ranks = launch(_count_one_step, parallel.world_size, (model, parallel, state, runners, True))
    if seq_len == 13 and preset == "tiny-deepseek-v2":
        config = _estimate(model, parallel, "optimized")
        assert balanced_rows(config) == [14, 12]
    for runner in runners:
        config = _estimate(model, parallel, runner)
        for rank, measured in enumerate(ranks):
            assert _figures(measured[runner]) == _figures(predict_traffic(config, rank)), (
                runner,
                rank,
            )
    # The runners differ where they should: FSDP2 gathers and reduce-scatters (at DP > 1),
    # the plain runners all-reduce every gradient; micro-batch sync reduces more often.
    kinds = {runner: {k for k, _ in ranks[0][runner]} for runner in runners}
    if dp > 1:
        assert {"all_gather", "reduce_scatter"} <= kinds["optimized-fsdp"]
        assert "reduce_scatter" not in kinds["optimized"]
    if ep > 1:
        assert "all_to_all" in kinds["reference"] and "all_to_all" in kinds["optimized"]
    if "optimized-fsdp:micro-batch" in runners:
        rs = ("reduce_scatter", "dp")
        for measured in ranks:
            step = measured["optimized-fsdp"][rs].calls
            assert measured["optimized-fsdp:micro-batch"][rs].calls == 2 * pp * step
            gathers = {r: measured[r][("all_gather", "dp")].calls for r in runners[2:]}
            assert gathers["optimized-fsdp:step:reshard"] > gathers["optimized-fsdp"]


# The routing controls that communicate (`optimized.estimator.balancing`): the pooled loss's
# counts beside every p2p message (the z-loss beside it sends nothing), and the expert bias's
# load all-reduce over DP, on a model whose second pipeline rank holds no MoE layer
# (DeepSeek-V2 with three dense layers of four: nothing to reduce there).
CONTROLLED = {
    "pooled": ("tiny-qwen3-moe", dict(aux_loss="pooled", aux_loss_coef=0.01,
                                      router_z_loss_coef=0.001)),
    "bias": ("tiny-deepseek-v2", dict(first_k_dense_replace=3, expert_bias=True)),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("controls", sorted(CONTROLLED))
def test_predicted_exactly_with_routing_controls(controls):
    """PP=2 DP=2 EP=2, balanced routing, the three runners: every kind to the byte with the
    controls on, and the controls' own traffic where the model says it is."""
    name, fields = CONTROLLED[controls]
    model = replace(resolve_model(name), **fields)
    parallel = ParallelConfig(pp=2, dp=2, ep=2, micro_batch_size=1, micro_batches=4, seq_len=13)
    state = build_model(model, seed=0).state_dict()
    ranks = launch(_count_one_step, 4, (model, parallel, state, RUNNERS, True))
    plain = replace(model, aux_loss="none", router_z_loss_coef=0.0, expert_bias=False)
    for runner in RUNNERS:
        config = _estimate(model, parallel, runner)
        for rank, measured in enumerate(ranks):
            predicted = _figures(predict_traffic(config, rank))
            assert _figures(measured[runner]) == predicted, (runner, rank)
            without = _figures(predict_traffic(_estimate(plain, parallel, runner), rank))
            added = {k: tuple(a - b for a, b in zip(v, without.get(k, (0, 0, 0))))
                     for k, v in predicted.items() if v != without.get(k)}  # fmt: skip
            experts = model.num_experts
            if controls == "pooled":  # a [2, E] after each activation, an [E] after each grad
                assert added and {kind for kind, _ in added} == {"send", "recv"}, added
                for (_, stream), (calls, sent, received) in added.items():
                    per_call = (2 if stream.startswith("forward") else 1) * experts * 4
                    assert sent + received == calls * per_call, added
            elif measured["coords"][0] == 0:  # one MoE layer here: its load reduced over DP
                assert added == {("all_reduce", "dp"): (1, experts * 8, experts * 8)}, added
            else:
                assert added == {}, added


def test_the_trainers_step_adds_its_expert_load_all_reduce():
    """`twinpipe train`'s step (``trainer``): one float64 all-reduce over the world of every
    MoE layer's load, its bias range and the two balancing values, ``L (E + 2) + 2`` of them
    (`optimized.train.expert_load`); nothing else differs, and nothing on one rank."""
    model = resolve_model("tiny-deepseek-v2")  # three MoE layers of four, 8 experts
    parallel = ParallelConfig(pp=2, dp=2, ep=2, micro_batch_size=1, micro_batches=4, seq_len=16)
    config = _estimate(model, parallel, "optimized-fsdp")
    for rank in range(4):
        step = _figures(predict_traffic(config, rank))
        trainer = _figures(predict_traffic(config, rank, trainer=True))
        world = ("all_reduce", "world")
        calls, sent, received = step[world]
        moved = 3 * 8 * (3 * (8 + 2) + 2)
        assert trainer.pop(world) == (calls + 1, sent + moved, received + moved)
        step.pop(world)
        assert trainer == step
    one = _estimate(model, replace(parallel, pp=1, dp=1, ep=1, micro_batches=2), "optimized")
    assert _figures(predict_traffic(one, 0, trainer=True)) == _figures(predict_traffic(one, 0))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_real_routing_differs_only_by_its_skew():
    """PP=1 DP=2 EP=2, the routers' own choices: every kind but the all-to-all is as
    predicted; the all-to-all's calls too, and its bytes once the estimate is given the
    rows the recorded routing sent and received; the balanced figure is off by the skew."""
    model = resolve_model("tiny-qwen3-moe")
    parallel = ParallelConfig(pp=1, dp=2, ep=2, micro_batch_size=1, micro_batches=2, seq_len=16)
    state = build_model(model, seed=0).state_dict()
    runners = ("optimized",)
    ranks = launch(_count_one_step, 2, (model, parallel, state, runners, False))
    config = _estimate(model, parallel, "optimized")
    skewed = False
    for rank, measured in enumerate(ranks):
        peer = ranks[1 - rank]
        mine, theirs = measured["optimized:rows"], peer["optimized:rows"]
        ep_rank = measured["coords"][2]
        out = sum(sum(call) - call[ep_rank] for call in mine)
        back = sum(call[ep_rank] for call in theirs)
        balanced = _figures(predict_traffic(config, rank))
        observed = _figures(predict_traffic(config, rank, routed=(out, back)))
        got = _figures(measured["optimized"])
        assert got == observed
        a2a = ("all_to_all", "ep")
        assert {k: v for k, v in got.items() if k != a2a} == {
            k: v for k, v in balanced.items() if k != a2a
        }
        assert got[a2a][0] == balanced[a2a][0]  # the calls do not depend on routing
        skewed |= got[a2a] != balanced[a2a]
    assert skewed, "the routers' own choices were perfectly balanced: no skew was exercised"
