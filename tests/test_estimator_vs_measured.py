"""The memory estimator against the harness's measured per-rank peak, both stacks.

One launch per layout runs the reference and the optimized pipeline on the same
gloo ranks (`harness.compare._rank_main`, two steps, the peak over both: AdamW
creates its state in the first). Per rank the estimate must agree with the
measured peak within 3%, its weights (parameters and buffers) and optimizer state
must equal the tracker's categories, and its gradient bytes must equal those of the
gradients the step produced.

Cases the estimator does not yet meet are marked xfail with the measured miss
(see the estimator's notes); they are not loosened.

On CPU the optimized stack's kernels run in the Triton interpreter, whose launches
used to leave their arguments' storages in a reference cycle until Python's GC ran
(up to ~1 MB of dead kernel arguments at random moments); `optimized.ops._triton.launch`
now collects that cycle as each launch returns, so the measurement holds only memory
a GPU run would hold too.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from harness.compare import _rank_main  # noqa: E402
from models import SeededWeights, preset  # noqa: E402
from models.distributed import ParallelConfig, launch  # noqa: E402
from models.training import OptimizerConfig  # noqa: E402
from optimized.estimator import estimate_for_compare  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

STACKS = ("reference", "optimized")
MODELS = ("tiny-deepseek-v2", "tiny-gpt-oss", "tiny-qwen3-moe")
MICRO_BATCH_SIZE, SEQ_LEN = 2, 64
LAYOUTS = ((2, 1, 1), (1, 2, 2), (2, 2, 2))
DTYPES = ("float32", "bfloat16")
TOLERANCE = 0.03

# (model, layout, stack) -> what was measured when the case last missed (commit of this file).
KNOWN_MISSES: dict = {}

_RESULTS: dict = {}


def _element_size(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _rank_all(models, parallel, states, optimizer):
    """Both stacks on every model, as `twinpipe compare` measures them (one launch per
    layout: starting the ranks costs more than a tiny model's steps)."""
    return {
        name: _rank_main(model, parallel, states[name], list(STACKS), 2, optimizer, True, False)
        for name, model in models.items()
    }


def _measure(name, layout, dtype):
    key = (layout, dtype)
    if key not in _RESULTS:
        pp, dp, ep = layout
        parallel = ParallelConfig(
            pp=pp, dp=dp, ep=ep, micro_batches=2 * pp if pp > 1 else 2,
            micro_batch_size=MICRO_BATCH_SIZE, seq_len=SEQ_LEN, dtype=dtype,
        )  # fmt: skip
        models = {n: preset(n) for n in MODELS}
        states = {n: SeededWeights(m) for n, m in models.items()}
        args = (models, parallel, states, OptimizerConfig())
        per_rank = launch(_rank_all, parallel.world_size, args)
        _RESULTS[key] = (models, parallel, per_rank)
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
                    yield pytest.param(name, layout, stack, dtype, marks=marks, id=case)


@pytest.mark.parametrize(("name", "layout", "stack", "dtype"), list(_cases()))
def test_estimate_matches_measured_peak(name, layout, stack, dtype):
    model, parallel, per_rank = _measure(name, layout, dtype)
    report = estimate_for_compare(
        model,
        dict(
            pp=parallel.pp, dp=parallel.dp, ep=parallel.ep,
            micro_batch_size=parallel.micro_batch_size, seq_len=parallel.seq_len,
            num_microbatches=parallel.micro_batches, dtype=parallel.dtype,
        ),
        stack,
    )  # fmt: skip
    rows, failures = [], []
    for result in per_rank:
        pp_rank = result["coords"][0]
        measured = max(result[stack]["memory"], key=lambda m: m["total"])
        est = report["ranks"][pp_rank]
        error = est["peak_bytes"] / measured["total"] - 1
        rows.append(
            f"{result['coords']}: est {est['peak_bytes']:,} measured {measured['total']:,} "
            f"({error:+.2%}) at {measured['peak_moment']}"
        )
        static = (("weights_bytes", "parameters"), ("optimizer_bytes", "optimizer_state"))
        for ours, theirs in static:
            if est[ours] != measured[theirs]:
                failures.append(f"{result['coords']} {ours} {est[ours]:,} != {measured[theirs]:,}")
        # Gradients: every parameter's, once the backward is done, equal exactly (at the peak
        # itself only some exist, and which depends on where inside an action the peak falls).
        grads = result[stack]["grads"][-1]
        measured_grads = sum(g.numel() for g in grads.values()) * _element_size(parallel.dtype)
        if est["all_gradients_bytes"] != measured_grads:
            failures.append(
                f"{result['coords']} all_gradients_bytes {est['all_gradients_bytes']:,} "
                f"!= {measured_grads:,}"
            )
        if abs(error) > TOLERANCE:
            failures.append(f"{result['coords']} peak off by {error:+.2%}")
    print(f"\n{name} {stack} {layout} {dtype}:\n  " + "\n  ".join(rows))
    assert not failures, "\n".join(failures + rows)
