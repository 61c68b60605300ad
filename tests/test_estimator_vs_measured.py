"""The memory estimator against the harness's measured per-rank peak, both stacks.

One launch per layout and dtype runs the reference and the optimized pipeline on the
same gloo ranks (`harness.compare.lockstep.run_rank`, two steps, counting every router call's
expert choices). Per rank the estimate of the step with the higher peak, from the
routing that step saw (`optimized.estimator.routing`), must agree with the measured
peak within 1%; its weights (parameters and buffers) and optimizer state must equal the
tracker's categories, and its gradient bytes those of the gradients the step produced.
The balanced-routing estimate is printed beside it (``pytest -s``): with EP > 1 a
skewed router moves one EP rank's peak up and another's down by about 1 to 2% here.

The optimized stack with attention recomputation off (``ParallelConfig.recompute``: it
keeps each attention block's activations) is held to the same bar at (2, 2, 2)
(`RECOMPUTE_OFF_MODELS`) for one step (the first: no optimizer state yet, the peak among
the kept activations), run in the launch of recompute on (the reference never
recomputes: its cases are the ones above).

Cases the estimator does not yet meet are marked xfail with the measured miss
(see the estimator's notes); they are not loosened.

On CPU the optimized stack's kernels run in the Triton interpreter, whose launches
used to leave their arguments' storages in a reference cycle until Python's GC ran
(up to ~1 MB of dead kernel arguments at random moments); `optimized.ops._triton.launch`
now collects that cycle as each launch returns, so the measurement holds only memory
a GPU run would hold too.
"""

from __future__ import annotations

import pytest
import torch

from harness.compare.lockstep import run_rank
from harness.compare.rank import RankPlan
from models.network import SeededWeights, preset
from models.runtime import OptimizerConfig, ParallelConfig, launch
from optimized.estimator import estimate_for_compare
from optimized.estimator.routing import received_loads

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

STACKS = ("reference", "optimized")
MODELS = ("tiny-deepseek-v2", "tiny-gpt-oss", "tiny-qwen3-moe")
MICRO_BATCH_SIZE, SEQ_LEN = 2, 64
LAYOUTS = ((2, 1, 1), (1, 2, 2), (2, 2, 2))
DTYPES = ("float32", "bfloat16")
RECOMPUTE_OFF_LAYOUT = (2, 2, 2)
# Recompute off, per dtype: the models run (about 7 s each; in float32 tiny-deepseek-v2 and
# tiny-qwen3-moe passed too when added, worst -0.00% and -0.01%, and are left out for time).
RECOMPUTE_OFF_MODELS = {"float32": ("tiny-gpt-oss",), "bfloat16": MODELS}
TOLERANCE = 0.01

# (model, layout, stack) -> what was measured when the case last missed (commit of this file).
KNOWN_MISSES: dict = {}

_RESULTS: dict = {}


def _element_size(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _rank_all(models, parallels, states, optimizer):
    """Both stacks on the models, as `twinpipe compare` measures them, for each of
    ``parallels`` (a list of ``(parallel config, model names)``; one launch per layout:
    starting the ranks costs more than a tiny model's steps). The ops audit runs with
    recompute on only: it is not in the measured peak (`harness.compare.ops_audit`), and recompute
    off changes none of the ops it checks."""
    return [
        {
            name: run_rank(
                RankPlan(
                    model,
                    parallel,
                    states[name],
                    *STACKS,
                    2 if parallel.recompute else 1,
                    optimizer,
                    progress=False,
                    count_routing=True,
                    ops_audit=parallel.recompute,
                )  # fmt: skip
            )
            for name, model in models.items()
            if name in names
        }
        for parallel, names in parallels
    ]


def _measure(name, layout, dtype, recompute=True):
    key = (layout, dtype, recompute)
    if key not in _RESULTS:
        pp, dp, ep = layout
        # The recompute-off runs share the launch of their layout and dtype, after it.
        recomputes = (True, False) if layout == RECOMPUTE_OFF_LAYOUT else (True,)
        fields = dict(
            pp=pp, dp=dp, ep=ep, micro_batches=2 * pp if pp > 1 else 2,
            micro_batch_size=MICRO_BATCH_SIZE, seq_len=SEQ_LEN, dtype=dtype,
        )  # fmt: skip
        parallels = [
            (
                ParallelConfig(recompute=each, **fields),
                MODELS if each else RECOMPUTE_OFF_MODELS[dtype],
            )
            for each in recomputes
        ]
        models = {n: preset(n) for n in MODELS}
        states = {n: SeededWeights(m) for n, m in models.items()}
        args = (models, parallels, states, OptimizerConfig())
        per_rank = launch(_rank_all, parallels[0][0].world_size, args)
        for index, (parallel, _) in enumerate(parallels):
            rows = [result[index] for result in per_rank]
            _RESULTS[layout, dtype, parallel.recompute] = (models, parallel, rows)
    models, parallel, per_rank = _RESULTS[key]
    return models[name], parallel, [result[name] for result in per_rank]


def _cases():
    for dtype in DTYPES:
        for layout in LAYOUTS:
            for name in MODELS:
                for stack in STACKS:
                    marks = []
                    if (name, layout, stack, dtype) in KNOWN_MISSES:
                        reason = KNOWN_MISSES[name, layout, stack, dtype]
                        marks.append(pytest.mark.xfail(reason=reason, strict=True))
                    case = f"{name}-{stack}-{layout}-{dtype}"
                    yield pytest.param(name, layout, stack, dtype, True, marks=marks, id=case)
    for dtype in DTYPES:
        for name in RECOMPUTE_OFF_MODELS[dtype]:
            case = f"{name}-optimized-{RECOMPUTE_OFF_LAYOUT}-{dtype}-recompute-off"
            yield pytest.param(name, RECOMPUTE_OFF_LAYOUT, "optimized", dtype, False, id=case)


@pytest.mark.parametrize(("name", "layout", "stack", "dtype", "recompute"), list(_cases()))
def test_estimate_matches_measured_peak(name, layout, stack, dtype, recompute):
    model, parallel, per_rank = _measure(name, layout, dtype, recompute)
    layout_fields = dict(
        pp=parallel.pp, dp=parallel.dp, ep=parallel.ep,
        micro_batch_size=parallel.micro_batch_size, seq_len=parallel.seq_len,
        num_microbatches=parallel.micro_batches, dtype=parallel.dtype,
        recompute=parallel.recompute,
    )  # fmt: skip
    # The step each rank peaked in, and the loads its experts received in that step.
    steps = [
        max(range(len(r[stack]["memory"])), key=lambda s: r[stack]["memory"][s]["total"])
        for r in per_rank
    ]
    observed = {}
    for step in set(steps):
        counts = {rank: r[stack]["routing_counts"][step] for rank, r in enumerate(per_rank)}
        loads = received_loads(counts, parallel.dp, parallel.ep, model.num_experts)
        mine = {rank: loads[rank] for rank in range(len(per_rank)) if steps[rank] == step}
        report = estimate_for_compare(
            model, layout_fields, stack, routing=mine, first_step=step == 0
        )
        observed.update(report["observed_ranks"])
    balanced = estimate_for_compare(model, layout_fields, stack, first_step=max(steps) == 0)
    rows, failures = [], []
    for rank, result in enumerate(per_rank):
        pp_rank = result["coords"][0]
        measured = result[stack]["memory"][steps[rank]]
        est = observed[rank]
        error = est["peak_bytes"] / measured["total"] - 1
        even = balanced["ranks"][pp_rank]["peak_bytes"] / measured["total"] - 1
        rows.append(
            f"{result['coords']}: est {est['peak_bytes']:,} measured {measured['total']:,} "
            f"({error:+.2%}; balanced routing {even:+.2%}) at {measured['peak_moment']}"
        )
        static = (("weights_bytes", "parameters"), ("optimizer_bytes", "optimizer_state"))
        for ours, theirs in static:
            if est[ours] != measured[theirs]:
                failures.append(f"{result['coords']} {ours} {est[ours]:,} != {measured[theirs]:,}")
        # Gradients: every parameter's, once the backward is done, equal exactly (at the peak
        # itself only some exist, and which depends on where inside an action the peak falls).
        # Both stacks run on the same parameters (lockstep), whose gradients have their size.
        measured_grads = result["param_elements"] * _element_size(parallel.dtype)
        if est["all_gradients_bytes"] != measured_grads:
            failures.append(
                f"{result['coords']} all_gradients_bytes {est['all_gradients_bytes']:,} "
                f"!= {measured_grads:,}"
            )
        if abs(error) > TOLERANCE:
            failures.append(f"{result['coords']} peak off by {error:+.2%}")
    recomputes = "" if recompute else " recompute off"
    print(f"\n{name} {stack} {layout} {dtype}{recomputes}:\n  " + "\n  ".join(rows))
    assert not failures, "\n".join(failures + rows)
