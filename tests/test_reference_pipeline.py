"""Reference DualPipeV + EP + DP against the single-process oracle (issue: reference pipeline)."""

from __future__ import annotations

import pytest

from harness.compare.inplace import compare_sums
from harness.compare.lockstep import run_rank
from harness.compare.rank import RankPlan
from models.network import SeededWeights, build_model, preset
from models.runtime import (
    OptimizerConfig,
    ParallelConfig,
    RankFailed,
    launch,
    make_layout,
    synthetic_batch,
)
from reference.pipeline import ReferencePipeline
from tests._world import SharedWorlds

PRESETS = ("tiny-deepseek-v2", "tiny-gpt-oss", "tiny-qwen3-moe")
LOSS_REL, GRAD_COS = 1e-6, 1e-10  # DESIGN.md: reference DualPipeV vs single-process model
GRAD_REL = 1e-5
"""Relative L2 error of each gradient, oracle against reference (float32)."""


def _layout_worker(plans):
    return [run_rank(plan) for plan in plans]


def _plans(configs, parallel, steps=1):
    optimizer = OptimizerConfig()
    return [
        RankPlan(
            cfg,
            parallel,
            SeededWeights(cfg, seed=7),
            "oracle",
            "reference",
            steps,
            optimizer,
            track_memory=False,
            progress=False,
        )  # fmt: skip
        for cfg in configs
    ]


ORACLE_LAYOUTS = [(2, 1, 1), (1, 2, 2), (2, 2, 2), (1, 2, 1), (2, 2, 1)]
"""EP = 1 with DP = 2: every expert has two replicas whose gradients must be averaged
(`models.runtime.reduce_gradients`), a rule no optimized-vs-reference test can check."""
PP4 = ParallelConfig(pp=4, dp=1, ep=1, micro_batch_size=1, micro_batches=8, seq_len=16, seed=5)
TRAJECTORY = dict(micro_batch_size=1, seq_len=32, seed=2)
TRAJECTORY_LAYOUTS = {
    "pipeline": ParallelConfig(pp=2, dp=1, ep=1, micro_batches=4, **TRAJECTORY),
    "data": ParallelConfig(pp=1, dp=2, ep=1, micro_batches=2, **TRAJECTORY),
}


def _oracle_parallel(pp, dp, ep):
    return ParallelConfig(
        pp=pp, dp=dp, ep=ep, micro_batch_size=1, micro_batches=2 * pp, seq_len=32, seed=3
    )


def _pp4_configs():
    eight = {"tiny-gpt-oss": dict(layer_types=["sliding_attention", "full_attention"] * 4)}
    return [preset(name, num_hidden_layers=8, **eight.get(name, {})) for name in PRESETS]


def _jobs():
    """Every multi-rank case of this module that cannot fail on purpose, by world size:
    one launch of two ranks and one of four serve them all (tests/_world.py)."""
    jobs: dict[int, dict] = {2: {}, 4: {}}
    for layout in ORACLE_LAYOUTS:
        parallel = _oracle_parallel(*layout)
        plans = _plans([preset(name) for name in PRESETS], parallel)
        jobs[parallel.world_size][f"oracle-{layout}"] = (_layout_worker, (plans,))
    jobs[4]["oracle-pp4"] = (_layout_worker, (_plans(_pp4_configs(), PP4),))
    cfg = preset("tiny-qwen3-moe")
    state = SeededWeights(cfg, seed=11)
    for key, parallel in TRAJECTORY_LAYOUTS.items():
        jobs[2][f"trajectory-{key}"] = (_trajectory_worker, (cfg, parallel, state, 3))
    for pp in (2, 4):
        cfg = preset("tiny-qwen3-moe", num_hidden_layers=2 * pp)
        parallel = ParallelConfig(pp=pp, micro_batch_size=1, micro_batches=2 * pp, seq_len=16)
        jobs[pp][f"sequential-{pp}"] = (
            _sequential_worker, (cfg, parallel, SeededWeights(cfg, seed=4))
        )  # fmt: skip
    return jobs


WORLDS = SharedWorlds(_jobs)


def _check_against_oracle(configs, per_rank, steps=1):
    """The oracle and the reference on every rank (`harness.compare.lockstep`: lockstep, the
    reference replaying the oracle's routing), each rank comparing the gradients it holds
    with the oracle's same rows (`harness.compare.inplace`)."""
    for index, cfg in enumerate(configs):
        ranks = [r[index] for r in per_rank]
        first = ranks[0]
        assert first["lockstep"]  # against the oracle too (the default)
        for step in range(steps):
            record = first["steps"][step]
            oracle, ref = record.loss["baseline"], record.loss["candidate"]
            rel = abs(ref - oracle) / oracle
            assert rel <= LOSS_REL, (cfg.model_type, step, rel)
            rows = compare_sums(record.grads)  # worst first
            assert len(rows) == len(dict(build_model(cfg).named_parameters()))
            worst = rows[0]
            assert worst.one_minus_cos == max(r.one_minus_cos for r in rows)
            assert worst.one_minus_cos <= GRAD_COS, (cfg.model_type, step, worst)
            # A gradient scaled as a whole keeps its direction: 1 - cos cannot see it.
            largest = max(rows, key=lambda r: r.rel)
            assert largest.rel <= GRAD_REL, (cfg.model_type, step, largest)
            assert all(s.finite and s.count for s in record.grads.values())
            # Pinned (the default): the reference replays the oracle's choices; a swap only
            # where the scores explain it, so a near-tie cannot fail the layout by chance.
            for rank in ranks:
                assert rank["steps"][step].routing["candidate"].problems() == []
        losses = first["eval"]["loss"]
        eval_rel = abs(losses["candidate"] - losses["baseline"]) / losses["baseline"]
        assert eval_rel <= LOSS_REL, (cfg.model_type, "forward-only", eval_rel)
        # every rank reports the same global loss
        assert len({r["steps"][0].loss["candidate"] for r in ranks}) == 1


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("pp,dp,ep", ORACLE_LAYOUTS)
def test_reference_matches_oracle(pp, dp, ep):
    per_rank = WORLDS.result(f"oracle-{(pp, dp, ep)}")
    _check_against_oracle([preset(name) for name in PRESETS], per_rank)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_reference_pp4_matches_oracle():
    _check_against_oracle(_pp4_configs(), WORLDS.result("oracle-pp4"))


def _trajectory_worker(cfg, parallel, state, steps):
    layout = make_layout(parallel)
    pipeline = ReferencePipeline(cfg, parallel, layout, state, OptimizerConfig())
    return [pipeline.train_step(*synthetic_batch(cfg, parallel, step)) for step in range(steps)]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_layout_does_not_change_the_loss_trajectory():
    pipeline, data = TRAJECTORY_LAYOUTS["pipeline"], TRAJECTORY_LAYOUTS["data"]
    assert pipeline.global_batch == data.global_batch
    a = WORLDS.result("trajectory-pipeline")[0]
    b = WORLDS.result("trajectory-data")[0]
    assert len(a) == 3
    for x, y in zip(a, b):
        assert abs(x - y) / abs(x) <= 1e-6, (a, b)
    assert a[0] != a[2]  # the optimizer moved the weights


def _sequential_worker(cfg, parallel, state):
    """This rank's gradients and loss in the DualPipeV order and one micro-batch at a time."""
    layout = make_layout(parallel)
    out = []
    for sequential in (False, True):
        pipeline = ReferencePipeline(cfg, parallel, layout, state, OptimizerConfig())
        pipeline.schedule.sequential = sequential
        loss = pipeline.forward_backward(*synthetic_batch(cfg, parallel, 0))
        grads = {n: p.grad.clone() for n, p in pipeline.part.named_parameters()}
        out.append((loss, grads))
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("pp", [2, 4])
def test_sequential_order_gives_the_same_step(pp):
    """The float32 truth's order (`ReferenceDualPipeV.sequential`): the same loss and
    gradients as the DualPipeV order, every rank (middle ranks too at PP4)."""
    for (loss, grads), (seq_loss, seq_grads) in WORLDS.result(f"sequential-{pp}"):
        assert abs(seq_loss - loss) <= 1e-6 * abs(loss)
        assert grads.keys() == seq_grads.keys() and grads
        for name, grad in grads.items():
            err = (seq_grads[name] - grad).norm() / grad.norm()
            assert err <= 1e-6, (name, float(err))


def _planted_failure_worker(cfg, parallel, state):
    layout = make_layout(parallel)
    pipeline = ReferencePipeline(cfg, parallel, layout, state, OptimizerConfig())
    if layout.rank == 1:
        raise RuntimeError("planted failure on rank 1")
    ids, labels = synthetic_batch(cfg, parallel, 0)
    pipeline.train_step(ids, labels)  # rank 0 would wait for rank 1 forever
    return None


@pytest.mark.slow
@pytest.mark.multiprocess
def test_planted_exception_ends_every_rank():
    cfg = preset("tiny-qwen3-moe")
    parallel = ParallelConfig(pp=2, dp=1, micro_batches=4, seq_len=16)
    state = SeededWeights(cfg)
    # timeout_s is a hang guard only: a hang would end as a timeout, not as rank 1's error.
    with pytest.raises(RankFailed, match="planted failure on rank 1") as failure:
        launch(_planted_failure_worker, 2, (cfg, parallel, state), timeout_s=300)
    assert str(failure.value).startswith("rank 1 failed first")


@pytest.mark.parametrize(
    "fields,field",
    [
        (dict(pp=2, micro_batches=3), "micro_batches"),
        (dict(pp=3, micro_batches=6), "pp"),  # 4 layers cannot fill 6 stages
        (dict(dp=2, ep=3), "ep"),  # ep must divide dp
        (dict(dp=3, ep=3), "ep"),  # ep must divide the 8 experts
        (dict(pp=0), "pp"),
        (dict(dtype="float16"), "dtype"),
        (dict(seq_len=100_000), "seq_len"),
    ],
)
def test_invalid_parallel_config_names_the_field(fields, field):
    parallel = ParallelConfig(**fields)
    with pytest.raises(ValueError, match=rf"ParallelConfig\.{field}="):
        parallel.validate(preset("tiny-deepseek-v2"))


def test_compare_cli_rejects_bad_layout_before_spawning(capsys):
    from harness.cli import main

    code = main(
        [
            "compare",
            "--pp",
            "2",
            "--micro-batches",
            "2",
            "--baseline",
            "oracle",
            "--candidate",
            "reference",
        ]
    )
    assert code == 2
    assert "micro_batches=2" in capsys.readouterr().err
