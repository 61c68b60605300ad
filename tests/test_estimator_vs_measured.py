"""The memory estimator against the harness's measured per-rank peak, both stacks.

One launch per layout (two at PP2 DP2 EP2) runs the reference and the optimized pipeline
on the same gloo ranks (`harness.compare.lockstep.run_rank`, two steps, counting every router call's
expert choices). Per rank the estimate of the step with the higher peak, from the
routing that step saw (`optimized.estimator.routing`), must agree with the measured
peak within 1%; its weights (parameters and buffers) and optimizer state must equal the
tracker's categories, and its gradient bytes those of the gradients the step produced.
The balanced-routing estimate is printed beside it (``pytest -s``): with EP > 1 a
skewed router moves one EP rank's peak up and another's down by about 1 to 2% here.

The cases (`CASES`) cover the combinations pairwise, not their full product (docs/testing.md,
"The case table"): each family at each layout, each family and each layout in both dtypes,
both stacks in every case. With attention recomputation off (``ParallelConfig.recompute``:
the optimized stack keeps each attention block's activations; the reference never
recomputes) each family runs one step at (2, 2, 2) (the first: no optimizer state yet,
the peak among the kept activations), in both dtypes (Qwen3-MoE in bfloat16, the others in
float32 with their routing controls). The routing controls that change
what a step holds (`optimized.estimator.balancing`) are on in one case per family at
(2, 2, 2): on Qwen3-MoE and GPT-OSS the pooled load-balancing loss (its counts beside every
p2p message), the router z-loss (the saved logits and log-sum-exp; GPT-OSS's new
all-expert softmax) and the expert bias (a float32 buffer per MoE router, held exactly in
the weights; the previous step's load kept by the runner); on DeepSeek-V2 its
sequence-level loss, which the published presets train with. The estimate without the
controls is printed beside those (``pytest -s``): what leaving them out would cost.

Cases the estimator does not yet meet are marked xfail with the measured miss
(see the estimator's notes); they are not loosened.

On CPU the optimized stack's kernels run in the Triton interpreter, whose launches
used to leave their arguments' storages in a reference cycle until Python's GC ran
(up to ~1 MB of dead kernel arguments at random moments); `optimized.ops._triton.launch`
now collects that cycle as each launch returns, so the measurement holds only memory
a GPU run would hold too.
"""

from __future__ import annotations

import dataclasses

import pytest

from models.network import preset
from models.runtime import ParallelConfig
from tests._measured_peaks import STACKS, check_estimates, measure_cases

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

TOLERANCE = 0.01
ALL_ON = dict(aux_loss="pooled", aux_loss_coef=0.01, router_z_loss_coef=0.001, expert_bias=True)
CONTROLS = {
    "tiny-deepseek-v2": dict(aux_loss_alpha=0.001),  # seq_aux: the `sequence` form
    "tiny-qwen3-moe": ALL_ON,
    "tiny-gpt-oss": ALL_ON,
}
OFF = dict(aux_loss="none", router_z_loss_coef=0.0, expert_bias=False)

CASES = {
    # launch: [(model, (pp, dp, ep), dtype, routing controls on, recompute), ...]
    "pp2": [
        ("tiny-deepseek-v2", (2, 1, 1), "float32", False, True),
        ("tiny-gpt-oss", (2, 1, 1), "bfloat16", False, True),
        ("tiny-qwen3-moe", (2, 1, 1), "float32", False, True),
    ],
    "dp2-ep2": [
        ("tiny-deepseek-v2", (1, 2, 2), "bfloat16", False, True),
        ("tiny-gpt-oss", (1, 2, 2), "float32", False, True),
        ("tiny-qwen3-moe", (1, 2, 2), "bfloat16", False, True),
    ],
    # tiny-deepseek-v2 first: its reference rank (1, 1, 1) measured 67,584 bytes (1%) lower
    # when it ran after the other two than alone or first, as the estimate says (memory the
    # tracker had not seen made, freed inside its step).
    "pp2-dp2-ep2-float32": [
        ("tiny-deepseek-v2", (2, 2, 2), "float32", True, False),
        ("tiny-qwen3-moe", (2, 2, 2), "float32", True, True),
        ("tiny-gpt-oss", (2, 2, 2), "float32", True, False),
    ],
    "pp2-dp2-ep2-bfloat16": [
        ("tiny-qwen3-moe", (2, 2, 2), "bfloat16", False, False),
    ],
}
"""One launch per entry (of one world size), its cases in order: each family at each layout,
each family, layout and recompute setting in both dtypes, the routing controls and recompute
off on each family. DeepSeek-V2's recompute off runs with its controls in float32 (it ran
apart, in bfloat16 at (2, 2, 2): the pairs hold without that case)."""

MTP_CASES = {"pp2": [("tiny-deepseek-v3+mtp2", (2, 1, 1), "float32", False, True)]}
"""DeepSeek-V3 with its multi-token prediction (`models.network.mtp`), measured in the launch
of the same layout, beside the pairwise table (not part of it): pp-rank 0's loss stage runs
each depth (its saved tensors, its forward's and backward's high points, its gradients and
the embedding's: `optimized.estimator.mtp_memory`). Two depths: every term of one depth
(the published D = 1) and the chaining of a second (8.8 s more in the launch; D = 1
alone, measured apart, is within 0.002% in both stacks: docs/results.md)."""
VARIANTS = {"tiny-deepseek-v3+mtp2": ("tiny-deepseek-v3", dict(num_mtp_layers=2))}

# (model, layout, dtype, controls, recompute, stack) -> what was measured when the case
# last missed (commit of this file).
KNOWN_MISSES: dict = {}

_RESULTS: dict = {}


def _model(name: str, controls: bool):
    if name in VARIANTS:
        base, fields = VARIANTS[name]
        return preset(base, **fields)
    return preset(name, **CONTROLS[name]) if controls else preset(name)


def _launch_cases(launch: str) -> list:
    return CASES[launch] + MTP_CASES.get(launch, [])


def _parallel(layout, dtype, recompute) -> ParallelConfig:
    pp, dp, ep = layout
    return ParallelConfig(
        pp=pp, dp=dp, ep=ep, micro_batches=2 * pp if pp > 1 else 2, micro_batch_size=2,
        seq_len=64, dtype=dtype, recompute=recompute,
    )  # fmt: skip


def _measure(launch: str, case: tuple):
    if launch not in _RESULTS:
        cases = [
            (each, _model(each[0], each[3]), _parallel(*each[1:3], each[4]))
            for each in _launch_cases(launch)
        ]
        _RESULTS[launch] = {key: (model, parallel) for key, model, parallel in cases}
        for key, per_rank in measure_cases(cases).items():
            _RESULTS[launch][key] += (per_rank,)
    return _RESULTS[launch][case]


def _case_id(name, layout, dtype, controls, recompute, stack) -> str:
    extra = ("-controls" if controls else "") + ("" if recompute else "-recompute-off")
    return f"{name}-{stack}-{layout}-{dtype}{extra}"


def _params():
    for launch in CASES:
        for case in _launch_cases(launch):
            for stack in STACKS:
                marks = []
                reason = KNOWN_MISSES.get((*case, stack))
                if reason is not None:
                    marks.append(pytest.mark.xfail(reason=reason, strict=True))
                yield pytest.param(launch, case, stack, marks=marks, id=_case_id(*case, stack))


@pytest.mark.parametrize(("launch", "case", "stack"), list(_params()))
def test_estimate_matches_measured_peak(launch, case, stack):
    model, parallel, per_rank = _measure(launch, case)
    beside = None
    if case[3]:  # routing controls on: the estimate without them beside it
        assert model.balancing().active
        beside = ("controls left out", dataclasses.replace(model, **OFF))
    rows, failures = check_estimates(model, parallel, per_rank, stack, TOLERANCE, beside)
    print(f"\n{_case_id(*case, stack)}:\n  " + "\n  ".join(rows))
    assert not failures, "\n".join(failures + rows)


def test_the_cases_cover_every_pair():
    """Each family at each layout; each family, layout, routing-control setting and
    recompute setting in both dtypes (the table of docs/testing.md)."""
    cases = [case for launch in CASES.values() for case in launch]
    names = {case[0] for case in cases}
    layouts = {case[1] for case in cases}
    assert {(c[0], c[1]) for c in cases} == {(n, lay) for n in names for lay in layouts}
    dtypes = {("float32",), ("bfloat16",)}
    for index in (0, 1, 4):  # family, layout, recompute: each in both dtypes
        seen = {(c[index], c[2]) for c in cases}
        assert seen == {(c[index], d) for c in cases for (d,) in dtypes}, index
    assert {c[0] for c in cases if c[3]} == names  # the controls on each family
    assert {c[0] for c in cases if not c[4]} == names  # recompute off on each family
