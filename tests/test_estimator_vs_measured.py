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

from models.network import preset
from models.runtime import ParallelConfig
from tests._measured_peaks import STACKS, check_estimates, measure_launch

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

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
        for (parallel, _), rows in zip(parallels, measure_launch(models, parallels)):
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
    rows, failures = check_estimates(model, parallel, per_rank, stack, TOLERANCE)
    recomputes = "" if recompute else " recompute off"
    print(f"\n{name} {stack} {layout} {dtype}{recomputes}:\n  " + "\n  ".join(rows))
    assert not failures, "\n".join(failures + rows)
