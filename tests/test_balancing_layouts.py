"""The routing controls at every layout: each load-balancing form, the router z-loss and the
expert bias give the same loss, gradients, balancing values, load and bias updates in both
pipeline stacks as in the single-process oracle, which computes them plainly from their
sources' formulas (`reference.oracle`), at PP 1/2/4, DP 1/2, EP 1/2 and several M.

Every form runs at every layout (`LAYOUTS`), in one stack or both: both at PP2 DP2 EP2, where
the layout can break what a single rank gets right; elsewhere the optimized stack (the
Triton kernels, interpreted on a CPU: the costly one) for some forms and the reference for
the rest, so that each form and each layout meets each stack (docs/testing.md, "The case
table").

Pinned: every rank replays its micro-batches' rows of the oracle's expert choices
(`models.network.RoutingTape.replay`), so the load and the bias must be equal at any seed,
and a choice the pipeline would make differently must be a near-tie its scores explain;
free routing would pass or fail by whether the seed puts a near-tie under a rounding."""

from __future__ import annotations

import pytest
import torch

from models.network import RoutingTape, SeededWeights, attach_routing_tape, preset, router_keys
from models.runtime import (
    OptimizerConfig,
    ParallelConfig,
    launch,
    make_layout,
    moe_routers,
    synthetic_batch,
)
from optimized.pipeline import OptimizedPipeline
from reference.oracle import Oracle
from reference.pipeline import ReferencePipeline

LOSS_REL = 1e-5
"""float32: both stacks against the oracle (DESIGN.md's optimized-vs-reference bound)."""
GRAD_REL = 1e-4
"""Relative L2 of each gradient against the oracle's same rows (float32 noise)."""
OPTIMIZER = OptimizerConfig(lr=1e-5)
"""A small step: AdamW's first steps normalise each gradient, so float32 noise in a near-zero
gradient would otherwise move the second step's weights apart by more than noise; the
second step is there for the bias (it routes with the first step's bias)."""

CASES = {
    # qwen3: transformers' pooled loss, the router z-loss and the expert bias at once
    "qwen3-pooled-z-bias": (
        "tiny-qwen3-moe",
        dict(output_router_logits=True, router_aux_loss_coef=0.05, router_z_loss_coef=0.01,
             expert_bias=True, expert_bias_rate=0.01),
    ),
    "gpt-oss-pooled-bias": (
        "tiny-gpt-oss",
        dict(output_router_logits=True, router_aux_loss_coef=0.9, expert_bias=True),
    ),
    # DeepSeek-V2: a dense first layer (a stage may hold no MoE layer), group-limited routing
    "deepseek-sequence-bias": (
        "tiny-deepseek-v2",
        dict(aux_loss_alpha=0.03, seq_aux=True, expert_bias=True, expert_bias_rate=0.02),
    ),
    "deepseek-layer-z": (
        "tiny-deepseek-v2",
        dict(aux_loss_alpha=0.03, seq_aux=False, router_z_loss_coef=0.001),
    ),
    # the pooled form on a family whose own config has no such loss ([moe] aux_loss)
    "deepseek-pooled": ("tiny-deepseek-v2", dict(aux_loss="pooled", aux_loss_coef=0.1)),
}  # fmt: skip


def _config(case: str, layers: int | None = None):
    name, fields = CASES[case]
    if layers is not None:
        fields = dict(fields, num_hidden_layers=layers)
        if name == "tiny-gpt-oss":
            fields["layer_types"] = ["sliding_attention", "full_attention"] * (layers // 2)
    return preset(name, **fields)


def _rows(oracle_param: torch.Tensor, module, name: str, local: torch.Tensor) -> torch.Tensor:
    first = getattr(module, "first_expert", 0) if ".mlp.experts." in name else 0
    return oracle_param[first : first + local.shape[0]]


def _oracle_steps(case: str, layers: int | None, parallel: ParallelConfig, steps: int) -> list:
    """The oracle's trajectory of ``case``, run once here in the test process (every rank
    and both stacks are held against it): per step the loss, the balancing values, every
    gradient, the load of every MoE layer and the biases after the step."""
    cfg = _config(case, layers)
    oracle = Oracle(cfg, SeededWeights(cfg, seed=7), OPTIMIZER, micro_batch_size=1)
    out = []
    for step in range(steps):
        ids, labels = synthetic_batch(cfg, parallel, step)
        routing = RoutingTape()
        attach_routing_tape(oracle.model, routing)
        loss = oracle.forward_backward(ids, labels)
        attach_routing_tape(oracle.model, None)
        grads = {n: p.grad.detach().clone() for n, p in oracle.model.named_parameters()}
        values, load = oracle.balancing_values().tolist(), oracle.step_load()
        oracle.optimizer_step()
        biases = {
            i: r.e_score_correction_bias.clone()
            for i, r in moe_routers(oracle.model).items()
            if r.e_score_correction_bias is not None
        }
        out.append(
            dict(loss=loss, values=values, grads=grads, load=load, biases=biases, routing=routing)
        )
    return out


def _worker(cases, parallel, oracles):
    """Each case's pipelines on this rank, against the oracle's trajectory; per step: losses,
    balancing values, the worst gradient difference, the load and the biases after the step."""
    layout = make_layout(parallel)
    out = []
    for (case, layers, stacks), trajectory in zip(cases, oracles, strict=True):
        cfg = _config(case, layers)
        weights = SeededWeights(cfg, seed=7)
        for stack in stacks:
            cls = ReferencePipeline if stack == "reference" else OptimizedPipeline
            pipe = cls(cfg, parallel, layout, weights, OPTIMIZER)
            owners = {
                f"{prefix}.{p}" if prefix else p: module
                for prefix, module in pipe.part.named_modules()
                for p, _ in module.named_parameters(recurse=False)
            }
            for step, oracle in enumerate(trajectory):
                ids, labels = synthetic_batch(cfg, parallel, step)
                rows, keys = _token_rows(layout, parallel), router_keys(pipe.part)
                replay = oracle["routing"].replay(rows, keys)
                attach_routing_tape(pipe.part, replay)
                loss_pipe = pipe.forward_backward(ids, labels)
                attach_routing_tape(pipe.part, None)
                result = replay.result()
                values = pipe.balancing_values()
                worst = (0.0, "")
                for name, param in pipe.part.named_parameters():
                    theirs = _rows(oracle["grads"][name], owners[name], name, param)
                    rel = float((param.grad - theirs).norm() / theirs.norm().clamp_min(1e-30))
                    worst = max(worst, (rel, name))
                routers = moe_routers(pipe.part)
                load = pipe.step_load()
                expected_load = oracle["load"][[_moe_index(cfg, i) for i in routers]]
                before = {
                    i: r.e_score_correction_bias.clone()
                    for i, r in routers.items()
                    if r.e_score_correction_bias is not None
                }
                pipe.optimizer_step()
                bias_diff = max(
                    (
                        float(
                            (routers[i].e_score_correction_bias - oracle["biases"][i]).abs().max()
                        )
                        for i in before
                    ),
                    default=0.0,
                )
                # This step's move (a sign update can undo the last one: +rate, then -rate).
                moved = max(
                    (
                        float((routers[i].e_score_correction_bias - b).abs().max())
                        for i, b in before.items()
                    ),
                    default=0.0,
                )
                out.append(
                    dict(
                        case=case, stack=stack, step=step, loss=(oracle["loss"], loss_pipe),
                        values=(oracle["values"], values.tolist()), worst=worst,
                        load_equal=bool(torch.equal(load.cpu(), expected_load.cpu())),
                        layers=list(routers), bias_diff=bias_diff, bias_moved=moved,
                        routing=result.problems(), swaps=len(result.swaps),
                        replayed=result.choices,
                    )
                )  # fmt: skip
    return out


def _token_rows(layout, parallel: ParallelConfig) -> list[tuple[int, int]]:
    """This rank's micro-batches as token ranges of the oracle's one call per router."""
    size = parallel.micro_batch_size * parallel.seq_len
    first = layout.dp_rank * parallel.micro_batches * size
    return [(first + j * size, first + (j + 1) * size) for j in range(parallel.micro_batches)]


def _moe_index(cfg, layer: int) -> int:
    """Row of ``layer`` in the oracle's load (its MoE layers in order)."""
    return [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)].index(layer)


def _run(cases, parallel, steps):
    """The oracle once per case here, then the case's stacks on every rank against it
    (``cases``: ``(case, layers, stacks)``)."""
    threads = torch.get_num_threads()
    # One intra-op thread, as each rank runs: these ops are tiny, and with two threads a
    # pytest process on a busy 2-core machine spent 4.0 s of CPU a case, with one 0.3 s.
    torch.set_num_threads(1)
    try:
        oracles = [_oracle_steps(case, layers, parallel, steps) for case, layers, _ in cases]
    finally:
        torch.set_num_threads(threads)
    return launch(_worker, parallel.world_size, (cases, parallel, oracles))


def _check(results, cases):
    seen = set()
    expected = {(case, stack) for case, _, stacks in cases for stack in stacks}
    moved: dict[tuple[str, str], float] = {}
    for r in results:
        seen.add((r["case"], r["stack"]))
        where = (r["case"], r["stack"], r["step"])
        oracle, pipe = r["loss"]
        assert abs(pipe - oracle) <= LOSS_REL * abs(oracle), (where, oracle, pipe)
        (aux_o, z_o), (aux_p, z_p) = r["values"]
        assert abs(aux_p - aux_o) <= LOSS_REL * max(abs(aux_o), 1e-12), (where, aux_o, aux_p)
        assert abs(z_p - z_o) <= LOSS_REL * max(abs(z_o), 1e-12), (where, z_o, z_p)
        assert r["worst"][0] <= GRAD_REL, (where, r["worst"])
        assert r["routing"] == [], (where, r["routing"])  # every swap a near-tie, explained
        assert r["replayed"] > 0 or not r["layers"], where
        assert r["load_equal"], where
        assert r["bias_diff"] == 0.0, (where, r["bias_diff"])
        name, fields = CASES[r["case"]]
        if (
            fields.get("aux_loss_alpha")
            or fields.get("router_aux_loss_coef")
            or fields.get("aux_loss_coef")
        ):
            assert aux_o > 0, (where, "no load-balancing loss was computed")
        if fields.get("router_z_loss_coef"):
            assert z_o > 0, (where, "no z-loss was computed")
        if fields.get("expert_bias") and r["layers"]:
            key = (r["case"], r["stack"])
            moved[key] = max(moved.get(key, 0.0), r["bias_moved"])
    assert seen == expected
    # A balanced step leaves the bias where it was; some step must move it.
    for key, most in moved.items():
        assert most > 0, (key, "the expert bias never moved")


BOTH, OPTIMIZED, REFERENCE = ("reference", "optimized"), ("optimized",), ("reference",)
LAYOUTS = {
    # (pp, dp, ep, M): the stacks each form runs in (M = 5: not a multiple of 2 * PP)
    (1, 1, 1, 2): dict(qwen3_pooled_z_bias=OPTIMIZED),
    (2, 1, 1, 5): dict(gpt_oss_pooled_bias=OPTIMIZED, deepseek_layer_z=OPTIMIZED),
    (1, 2, 1, 3): dict(deepseek_sequence_bias=OPTIMIZED, deepseek_pooled=OPTIMIZED),
    (2, 2, 2, 4): {case: BOTH for case in CASES},
}
"""Per layout, the forms run in the optimized stack (``case`` with ``_`` for ``-``); the
others run in the reference."""


def _cases(stacks: dict, layers: int | None = None) -> list:
    named = {name.replace("_", "-"): chosen for name, chosen in stacks.items()}
    assert set(named) <= set(CASES)
    return [(case, layers, named.get(case, REFERENCE)) for case in CASES]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(
    "pp,dp,ep,m", list(LAYOUTS), ids=[f"pp{p}-dp{d}-ep{e}-m{m}" for p, d, e, m in LAYOUTS]
)
def test_every_form_matches_the_oracle(pp, dp, ep, m):
    parallel = ParallelConfig(
        pp=pp, dp=dp, ep=ep, micro_batch_size=1, micro_batches=m, seq_len=16, seed=3
    )
    cases = _cases(LAYOUTS[pp, dp, ep, m])
    results = _run(cases, parallel, 2)
    for rank_results in results:
        _check(rank_results, cases)


PP4 = dict(qwen3_pooled_z_bias=OPTIMIZED, deepseek_sequence_bias=OPTIMIZED,
           deepseek_layer_z=OPTIMIZED)  # fmt: skip
"""At PP 4 (8 layers): the forms in the optimized stack, the others in the reference."""


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_form_matches_the_oracle_at_pp4():
    parallel = ParallelConfig(
        pp=4, dp=1, ep=1, micro_batch_size=1, micro_batches=8, seq_len=8, seed=5
    )
    cases = _cases(PP4, 8)
    results = _run(cases, parallel, 1)
    for rank_results in results:
        _check(rank_results, cases)


def test_each_form_and_each_layout_meets_each_stack():
    """The pairs the layouts' table must hold: every form in both stacks somewhere, every
    layout with both stacks, and both stacks for every form at PP2 DP2 EP2."""
    tables = [*(_cases(t) for t in LAYOUTS.values()), _cases(PP4, 8)]
    for table in tables:
        assert {s for _, _, stacks in table for s in stacks} == set(BOTH), table
    for case in CASES:
        assert {s for t in tables for c, _, stacks in t if c == case for s in stacks} == set(BOTH)
    assert all(stacks == BOTH for _, _, stacks in _cases(LAYOUTS[2, 2, 2, 4]))
