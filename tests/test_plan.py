"""`twinpipe plan`: layouts, the bubble against the schedule's action counts, traffic, CLI."""

from __future__ import annotations

import json

import pytest

from harness.cli import main as cli_main
from models.network import preset
from optimized.estimator.bubble import simulate
from optimized.estimator.plan import PlanRequest, layouts, parse_size, plan, smallest_change
from optimized.estimator.schedule import rank_actions

MIB = 1024**2


@pytest.mark.parametrize("pp,m", [(1, 2), (2, 4), (2, 6), (4, 8), (4, 12), (8, 16)])
def test_bubble_against_action_counts(pp, m):
    costs = (1.0, 2.0, 0.5)
    bubble = simulate(pp, m, costs)
    for rank in range(pp):
        actions = list(rank_actions(rank, pp, m))
        forwards = sum(a.kind in ("F", "FB") for a in actions)
        backwards = sum(a.kind in ("B", "FB") for a in actions)
        deferred = sum(a.kind == "B" and a.deferred for a in actions)
        weights = sum(a.kind == "W" for a in actions)
        # Every weight gradient is computed once: at its backward or at its W step.
        assert deferred == weights and forwards == backwards == 2 * m
        busy = bubble.busy[rank]
        assert (busy.f, busy.b, busy.w) == (forwards, backwards, backwards - deferred + weights)
        assert busy.value == forwards * 1.0 + backwards * 2.0 + (backwards) * 0.5
        idle = bubble.idle[rank]
        assert idle.value == pytest.approx(bubble.makespan.value - busy.value)
        assert (idle.f, idle.b, idle.w) == (
            bubble.makespan.f - busy.f,
            bubble.makespan.b - busy.b,
            bubble.makespan.w - busy.w,
        )
        assert idle.value >= 0
    if pp == 1:
        assert bubble.idle_fraction == 0


def test_bubble_by_hand_pp2():
    # PP2, M4, F = B = W = 1 (traced by hand action by action): rank 0 waits 2 units for
    # rank 1's first chunk-1 output, rank 1 for rank 0's chunk-0 inputs; the step takes 26.
    bubble = simulate(2, 4)
    assert str(bubble.makespan) == "10F + 8B + 8W" and bubble.makespan.value == 26
    assert [str(idle) for idle in bubble.idle] == ["2F", "2F"]
    assert bubble.idle_fraction == pytest.approx(2 / 26)
    # More micro-batches amortise the same fill and drain.
    assert simulate(2, 8).idle_fraction < bubble.idle_fraction
    assert simulate(4, 8).idle_fraction > simulate(2, 8).idle_fraction


def test_plan_traffic_is_the_communication_model():
    planned = [p for p in plan(request()) if p.fits]
    assert planned
    for p in planned:
        c = p.config
        from optimized.estimator.communication import bytes_sent_by_plan_kind, predict_traffic

        partition = []
        start = 0
        for count in p.partition:
            partition.append(range(start, start + count))
            start += count
        per_rank = [
            bytes_sent_by_plan_kind(
                predict_traffic(c, rank * c.dp, partition, trainer=c.blocked_update)
            )
            for rank in range(c.pp)
        ]
        assert p.traffic == {k: max(t[k] for t in per_rank) for k in per_rank[0]}
        # Sends leave the rank only where there is a peer: no p2p at PP 1, no all-to-all
        # at EP 1.
        assert (p.traffic["p2p"] > 0) == (c.pp > 1)
        assert (p.traffic["all_to_all"] > 0) == (c.ep > 1)


def request(**fields) -> PlanRequest:
    values = dict(
        model=preset("tiny-qwen3-moe"), gpus=4, gpu_memory=6 * MIB, seq_len=64,
        global_batch=8, dtype="float32",
    )  # fmt: skip
    values.update(fields)
    return PlanRequest(**values)


def test_layouts_are_the_valid_ones():
    found = layouts(request())
    keys = {(c.pp, c.dp, c.ep, c.micro_batch_size, c.num_microbatches, c.fsdp) for c in found}
    # PP1: DP4, EP 1/2/4, 2 sequences per rank -> mbs1 M2 (mbs2 M1 is too few); PP2: DP2,
    # EP 1/2, 4 per rank -> mbs1 M4 (mbs2 M2 < 2 * PP). FSDP on and off each.
    expected = {(1, 4, ep, 1, 2, fsdp) for ep in (1, 2, 4) for fsdp in (False, True)} | {
        (2, 2, ep, 1, 4, fsdp) for ep in (1, 2) for fsdp in (False, True)
    }
    assert keys == expected
    for config in found:
        assert config.dp * config.num_microbatches * config.micro_batch_size == 8
        # The trainer's AdamW: float32 masters, and state sharded with FSDP2 only (the
        # trainer has no optimizer sharding without it).
        assert config.shard_optimizer == config.fsdp and config.master_weights
        assert config.optimizer_state_dtype == "float32"


def test_plan_sorts_fitting_by_bubble_then_traffic():
    planned = plan(request())
    fitting = [p for p in planned if p.fits]
    assert fitting and fitting == planned[: len(fitting)]
    budget = request().budget
    for p in planned:
        assert p.fits == (p.largest_peak is not None and p.largest_peak <= budget)
    keys = [(p.bubble["idle_fraction"], p.traffic_total) for p in fitting]
    assert keys == sorted(keys)


def test_nothing_fits_names_the_smallest_change():
    tight = request(gpu_memory=3 * MIB)
    assert not any(p.fits for p in plan(tight))
    changes = smallest_change(tight)
    assert any(change.startswith("--seq-len") for change in changes)
    shorter = int(next(c for c in changes if c.startswith("--seq-len")).split()[1])
    assert any(p.fits for p in plan(request(gpu_memory=3 * MIB, seq_len=shorter)))


def test_parse_size():
    assert parse_size("80GiB") == 80 * 1024**3
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("512MiB") == 512 * MIB
    with pytest.raises(ValueError, match="--gpu-memory='lots'"):
        parse_size("lots")


def test_plan_cli(capsys):
    args = ["plan", "--model", "tiny-qwen3-moe", "--gpus", "4", "--gpu-memory", "6MiB",
            "--seq-len", "64", "--global-batch", "8", "--dtype", "float32"]  # fmt: skip
    assert cli_main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fitting"] == sum(layout["fits"] for layout in report["layouts"]) > 0
    top = report["layouts"][0]
    assert top["fits"] and top["largest_peak_bytes"] <= report["budget_bytes"]
    assert set(top["bytes_sent_per_step"]) == {"all_to_all", "p2p", "data_parallel", "total"}
    assert cli_main(args) == 0
    assert "fit" in capsys.readouterr().out
    assert cli_main([*args[:6], "lots", *args[7:]]) == 2
    assert "--gpu-memory='lots'" in capsys.readouterr().err
    assert cli_main([*args, "--margin", "1.5"]) == 2
    assert "--margin=1.5" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.multiprocess
def test_top_layouts_run_and_fit():
    """The best layout `twinpipe plan` proposes for a budget runs under the harness (the
    optimized stack as `twinpipe compare` runs it: torch's AdamW), and its measured peaks
    are below the budget and within the estimator's accuracy: 1% from the routing the run
    saw, and the balanced figure the plan used within what skewed routing moves. (The
    second best is the same layout with recompute on: the estimator's recompute-on figures
    against measured peaks are `tests/test_estimator_vs_measured.py`'s; docs/testing.md.)"""
    from harness.compare.lockstep import run_rank
    from harness.compare.rank import RankPlan
    from models.network import build_model
    from models.runtime import OptimizerConfig, ParallelConfig, launch
    from optimized.estimator import estimate_for_compare
    from optimized.estimator.routing import received_loads

    ask = request(gpu_memory=5 * MIB, optimizer="adamw", fsdp="off")
    fitting = [p for p in plan(ask) if p.fits][:1]
    assert len(fitting) == 1
    model = ask.model
    state = build_model(model).state_dict()
    for planned in fitting:
        c = planned.config
        parallel = ParallelConfig(
            pp=c.pp, dp=c.dp, ep=c.ep, micro_batches=c.num_microbatches,
            micro_batch_size=c.micro_batch_size, seq_len=c.seq_len, dtype=c.dtype,
            recompute=c.recompute,
        )  # fmt: skip
        # Free-running, each stack routing on its own: the optimized stack's step as
        # `twinpipe compare` measures it, with its own expert choices counted.
        run = RankPlan(
            model, parallel, state, "reference", "optimized", 2, OptimizerConfig(),
            trajectory="free", routing="free", progress=False, count_routing=True,
        )  # fmt: skip
        per_rank = launch(run_rank, parallel.world_size, (run,))
        step = 1  # AdamW's state exists in the second step, as the plan assumes
        counts = {r: res["optimized"]["routing_counts"][step] for r, res in enumerate(per_rank)}
        loads = received_loads(counts, c.dp, c.ep, model.num_experts)
        layout = dict(
            pp=c.pp,
            dp=c.dp,
            ep=c.ep,
            micro_batch_size=c.micro_batch_size,
            seq_len=c.seq_len,
            num_microbatches=c.num_microbatches,
            dtype=c.dtype,
            recompute=c.recompute,
        )
        observed = estimate_for_compare(model, layout, "optimized", routing=loads)
        for rank, result in enumerate(per_rank):
            measured = result["optimized"]["memory"][step]["total"]
            assert measured <= ask.budget, (c, rank, measured, ask.budget)
            seen = observed["observed_ranks"][rank]["peak_bytes"]
            assert abs(seen / measured - 1) <= 0.01, (c, rank, seen, measured)
            balanced = planned.peaks[result["coords"][0]]
            assert abs(balanced / measured - 1) <= 0.035, (c, rank, balanced, measured)


def test_recompute_is_a_dimension_of_the_plan():
    both = layouts(request(fsdp="off"))
    assert {c.recompute for c in both} == {False, True}
    assert len(both) == 2 * len(layouts(request(fsdp="off", recompute="on")))
    assert {c.recompute for c in layouts(request(stack="reference"))} == {False}
    with pytest.raises(ValueError, match=r"--recompute='on' is invalid: the reference"):
        request(stack="reference", recompute="on").validate()
    with pytest.raises(ValueError, match=r"--recompute='sometimes' is invalid.*'auto'"):
        request(recompute="sometimes").validate()
    planned = plan(request(fsdp="off", gpu_memory=64 * MIB))
    fitting = [p for p in planned if p.fits]
    # Without recompute the same layout holds more; ties sort recompute off first.
    peaks = {}
    for p in fitting:
        c = p.config
        peaks.setdefault((c.pp, c.ep, c.micro_batch_size), {})[c.recompute] = p.largest_peak
    assert all(pair[False] > pair[True] for pair in peaks.values() if len(pair) == 2)
    keys = [(p.bubble["idle_fraction"], p.traffic_total, p.config.recompute) for p in fitting]
    assert keys == sorted(keys)
    assert {p.as_dict()["recompute_attention"] for p in fitting} == {False, True}


def test_adamw_plans_fsdp_off_under_auto():
    found = layouts(request(optimizer="adamw"))
    assert found and not any(c.fsdp or c.shard_optimizer for c in found)
