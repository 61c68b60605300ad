"""Every Triton kernel of a step launched before it (`optimized.ops.precompile`), checked by
the launch registry (`optimized.ops.launches`): keys as Triton keys, and a tiny optimized
DualPipeV step (PP 2 as threads, seq 16, `tests.test_p2p_order`'s NCCL model) that meets no
kernel key for the first time inside `scheduled_step`, and that does without the pass."""

from __future__ import annotations

import pytest
import torch

from models.runtime import scheduled_step
from optimized.ops import launches, silu_and_mul
from optimized.ops.activations import _silu_and_mul_forward_kernel
from optimized.ops.precompile import precompile
from tests._ranks import on_cpu_rank
from tests.test_p2p_order import _config, _one_thread, build_schedules, run_pipeline, whole_model

SEQ_LEN = 16


def test_keys_follow_triton_specialisation():
    """Keyed as Triton keys: an integer's multiple of 16 and a tensor's 16-byte alignment
    and dtype change the key, a constexpr's value too; another value with the same
    properties does not. A key first launched inside a step is listed."""
    x = torch.zeros(64)
    kernel = _silu_and_mul_forward_kernel

    def key(*args, **kwargs):
        return launches.specialisation(kernel, args, kwargs)[1]

    assert key(x, x, 32, 16, BLOCK=64) == key(x, x, 48, 16, BLOCK=64)
    assert key(x, x, 32, 16, BLOCK=64) != key(x, x, 33, 16, BLOCK=64)
    assert key(x, x, 32, 16, BLOCK=64) != key(x[1:], x, 32, 16, BLOCK=64)
    assert key(x, x, 32, 16, BLOCK=64) != key(x.bfloat16(), x, 32, 16, BLOCK=64)
    assert key(x, x, 32, 16, BLOCK=64) != key(x, x, 32, 16, BLOCK=128)
    assert key(x, x, 32, 16, BLOCK=64) != key(x, x, 32, 1, BLOCK=64)  # 1 is a constant
    launches.forget()
    try:
        silu_and_mul(torch.randn(4, 32))
        with scheduled_step():
            silu_and_mul(torch.randn(4, 32))  # the same key: seen before the step
        assert launches.first_seen_in_step() == []
        with scheduled_step():
            silu_and_mul(torch.randn(3, 34))  # a new key inside the step
        (line,) = launches.first_seen_in_step()
        assert "_silu_and_mul_forward_kernel" in line
    finally:
        launches.forget()


def _batches(config, m: int):
    generator = torch.Generator().manual_seed(m)
    ids = torch.randint(0, config.vocab_size, (m, 1, SEQ_LEN + 1), generator=generator)
    return [(row[:, :-1], row[:, 1:]) for row in ids]


@_one_thread()
def _steps() -> dict:
    """One step with no preparation, then (registry cleared) the preparation and one step:
    the keys first met inside each step, and the kernels each step launched."""
    pp = 2
    config = _config(pp)
    schedules = build_schedules("optimized", config, pp, whole_model(config).state_dict())
    batches = _batches(config, 2 * pp)
    result = {}
    try:
        for prepared in (False, True):
            launches.forget()
            if prepared:
                for schedule in schedules:
                    precompile(schedule.part, 1, SEQ_LEN, schedule.loss_fn)
            before = launches.seen()
            run_pipeline(schedules, batches, "dualpipev")
            in_step = {name for (name, key), entry in launches.seen().items()
                       if entry.launches > before.get((name, key), entry._replace(launches=0))
                       .launches}  # fmt: skip
            result[prepared] = {"first": launches.first_seen_in_step(), "kernels": in_step}
    finally:
        launches.forget()
    return result


@pytest.fixture(scope="module")
def steps() -> dict:
    return on_cpu_rank(_steps)


EXPECTED = {"_silu_and_mul_forward_kernel", "_silu_and_mul_backward_kernel",
            "_row_stats_kernel", "_row_grad_kernel"}  # fmt: skip


@pytest.mark.slow
def test_prepared_step_meets_no_kernel_key_first(steps):
    """After `precompile` on each rank's part, the step launches the attention, expert and
    loss kernels, and none of them with a key it had not launched before the step."""
    prepared = steps[True]
    short = {name.rsplit(".", 1)[-1] for name in prepared["kernels"]}
    assert EXPECTED <= short and any("attention" in name for name in prepared["kernels"]), short
    assert prepared["first"] == [], "\n".join(prepared["first"])


@pytest.mark.slow
def test_without_the_preparation_the_check_fails(steps):
    """The same step with no preparation: every kernel's key is first met inside it."""
    first = steps[False]["first"]
    short = {line.split(" ", 1)[0].rsplit(".", 1)[-1] for line in first}
    assert EXPECTED <= short, first


@pytest.mark.slow
def test_compare_meets_no_kernel_key_first_in_step_one():
    """`twinpipe compare`'s ranks (`Rank.prepare`, then the steps): the optimized candidate's
    first step meets no Triton kernel key it had not launched before (one rank, PP 1, seq 16,
    a tiny GPT-OSS: sinks, a window, biases and the clamped SwiGLU)."""
    from harness.compare.rank import RankPlan  # noqa: PLC0415
    from models.network import SeededWeights, preset  # noqa: PLC0415
    from models.runtime import OptimizerConfig, ParallelConfig, launch  # noqa: PLC0415
    from tests._compare import _run_plans  # noqa: PLC0415

    model = preset("tiny-gpt-oss")
    parallel = ParallelConfig(pp=1, micro_batches=2, seq_len=SEQ_LEN)
    plan = RankPlan(model, parallel, SeededWeights(model), "reference", "optimized", 1,
                    OptimizerConfig(), track_memory=False, progress=False)  # fmt: skip
    (results,) = launch(_run_plans, 1, ([plan],))
    assert results[0]["kernels_first_in_step"] == [], results[0]["kernels_first_in_step"]
