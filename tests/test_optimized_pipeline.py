"""The optimized DualPipeV against the reference, on gloo ranks, with tiny shapes.

Both stacks run inside one launched world (process start-up dominates), on the
same weights and the same data; losses and every gradient are compared under
DESIGN.md's policy, at the same expert choices: the optimized run replays the
reference's routing, and every choice it would have made differently must be a
near-tie (`models.network.routing`; in float32 there must be none). Further tests: the
early frees happen and nothing freed is read again (EP = 1 included, where
buffers share storage), the weight-gradient store is drained at the end of each
step, forward-only evaluation, determinism, and the saved-tensor profile.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models.network import SeededWeights, build_model, preset
from models.runtime import OptimizerConfig, ParallelConfig, launch, make_layout, synthetic_batch

PRESETS = ("tiny-deepseek-v2", "tiny-gpt-oss", "tiny-qwen3-moe")
TOLERANCE = {"float32": (1e-5, 1e-8), "bfloat16": (1e-4, 2e-3)}
"""(loss relative error, gradient 1 - cos). float32 is DESIGN.md's policy. bfloat16 is
tighter than its 1e-2 (DESIGN: tighten where the code allows): at the same expert
choices the measured worst is 1.6e-5 and 3.3e-4 over every preset and layout here."""
STEPS = 1


def _launch(runs, world_size):
    """``runs``: ``(layout_id, parallel, cases, repeat_optimized)`` for layouts of one world
    size, all served by one launched world (each builds its own process groups)."""
    names = sorted({name for *_, cases, _ in runs for _, name in cases})
    return launch(_compare_worker, world_size, (runs, _states(names)))


def _run(pipeline, model, parallel, baseline=None) -> dict:
    """Training steps and one evaluation: losses, gradients, and the optimized stack's store
    and free records of its last *training* step (the evaluation after it runs in a fresh
    context, forward only: what it frees says nothing of a training step's frees).

    With ``baseline`` (the reference pipeline, already run) the evaluation starts from the
    baseline's parameters after its step (lockstep, DESIGN.md): AdamW's first step moves
    each parameter by ``lr * g / (|g| + eps)``, so a gradient element within a few ``eps``
    of zero, where two stacks' roundings differ by their whole size, moves its parameter
    by up to ``lr`` more in one stack than in the other. The evaluation would measure that,
    not its own arithmetic (tiny-gpt-oss, float32, PP 2: router scores 5e-6 and, after the
    attention kernel changed, 2e-5 apart, from gradients within 1e-6 of each other)."""
    steps, records = [], {}
    for step in range(STEPS):
        ids, labels = synthetic_batch(model, parallel, step)
        loss = pipeline.forward_backward(ids, labels)
        grads = {n: p.grad.detach().clone() for n, p in pipeline.part.named_parameters()}
        steps.append((loss, grads))
        context = getattr(pipeline.schedule, "context", None)
        if context is not None:
            records = {
                "store_empty": len(context.weight_grads) == 0,
                "freed": [(what, t.untyped_storage().nbytes()) for what, t in context.freed],
            }
        pipeline.optimizer_step()
    if baseline is not None:
        parameters = dict(baseline.part.named_parameters())
        with torch.no_grad():
            for name, parameter in pipeline.part.named_parameters():
                parameter.copy_(parameters[name])
    evaluation = pipeline.evaluate(*synthetic_batch(model, parallel, 7))
    return {"steps": steps, "eval": evaluation, **records}


def _compare_worker(runs, states):
    """Every layout of ``runs`` and every (dtype, model) case of each, in one launched world:
    starting the ranks costs more than the tiny models' steps."""
    from models.network import RoutingTape, attach_routing_tape
    from optimized.pipeline import OptimizedPipeline
    from reference.pipeline import ReferencePipeline

    results = {}
    for layout_id, parallel, cases, repeat_optimized in runs:
        layout = make_layout(parallel)
        for dtype, name in cases:
            at_dtype = dataclasses.replace(parallel, dtype=dtype)
            model, state = preset(name), states[name]
            reference = ReferencePipeline(model, at_dtype, layout, state, OptimizerConfig())
            tape = RoutingTape()
            attach_routing_tape(reference.part, tape)
            key = (layout_id, dtype, name)
            results[(*key, "reference")] = _run(reference, model, at_dtype)
            runs_here = []
            for _ in range(2 if (dtype, name) in repeat_optimized else 1):
                optimized = OptimizedPipeline(model, at_dtype, layout, state, OptimizerConfig())
                optimized.schedule.record_frees = True
                replay = tape.replay()
                attach_routing_tape(optimized.part, replay)
                runs_here.append(_run(optimized, model, at_dtype, baseline=reference))
                runs_here[-1]["routing"] = replay.result()
            results[(*key, "optimized")] = runs_here
    return results


def _states(names):
    return {
        name: SeededWeights(preset(name))  # each rank reads its slices, in the run's dtype
        for name in names
    }


def _check(results, layout_id, names, dtype):
    loss_tol, cos_tol = TOLERANCE[dtype]
    for name in names:
        for rank_results in results:
            reference = rank_results[layout_id, dtype, name, "reference"]
            for optimized in rank_results[layout_id, dtype, name, "optimized"]:
                assert len(reference["steps"]) == STEPS
                for (ref_loss, ref_grads), (opt_loss, opt_grads) in zip(
                    reference["steps"], optimized["steps"], strict=True
                ):
                    assert abs(opt_loss - ref_loss) <= loss_tol * abs(ref_loss), (name, opt_loss)
                    for param, ref in ref_grads.items():
                        got = opt_grads[param]
                        assert torch.isfinite(got).all(), (name, param)
                        cos = torch.nn.functional.cosine_similarity(
                            got.flatten().double(), ref.flatten().double(), dim=0
                        )
                        if ref.abs().max() == 0:
                            assert got.abs().max() == 0, (name, param)
                            continue
                        assert 1 - cos.item() <= cos_tol, (name, param, 1 - cos.item())
                ref_eval = reference["eval"]
                assert abs(optimized["eval"] - ref_eval) <= loss_tol * abs(ref_eval), name
                assert optimized["store_empty"], name
                # Every early free really released its storage.
                assert all(nbytes == 0 for _, nbytes in optimized["freed"]), name
                # Same expert choices (replayed), and each choice the optimized stack would
                # have made differently is a near-tie (models.network.routing).
                optimized["routing"].check()
                if dtype == "float32":
                    assert not optimized["routing"].swaps, (name, optimized["routing"].as_dict())


LAYOUTS = {"pp2-dp1-ep1": (2, 1, 1), "pp1-dp2-ep2": (1, 2, 2), "pp2-dp2-ep2": (2, 2, 2),
           "pp1-dp2-ep1": (1, 2, 1)}  # fmt: skip
CASES = {
    "pp2-dp1-ep1": (("float32", "tiny-deepseek-v2"), ("bfloat16", "tiny-gpt-oss"),
                    ("float32", "tiny-qwen3-moe")),
    "pp1-dp2-ep2": (("bfloat16", "tiny-deepseek-v2"), ("float32", "tiny-gpt-oss"),
                    ("bfloat16", "tiny-qwen3-moe")),
    "pp2-dp2-ep2": (("float32", "tiny-deepseek-v2"), ("bfloat16", "tiny-gpt-oss"),
                    ("bfloat16", "tiny-qwen3-moe")),
    "pp1-dp2-ep1": (("bfloat16", "tiny-deepseek-v2"), ("float32", "tiny-gpt-oss"),
                    ("float32", "tiny-qwen3-moe")),
}  # fmt: skip
"""(dtype, preset) at each layout, pairwise (docs/testing.md, the case table): every preset
at every layout once, every layout and every preset in both dtypes; float32 and bfloat16
each meet PP 2 with DP 2 / EP 2 together. M = 2 * PP + 1 everywhere (not a multiple of 2 * PP).
"""
DETERMINISM_LAYOUT = "pp2-dp2-ep2"
DETERMINISM_RUN = ("bfloat16", "tiny-qwen3-moe")
"""The optimized stack runs twice here: bf16 with the most sensitive router of the three."""
_MATRIX: dict = {}


LAUNCHES = (("pp2-dp1-ep1",), ("pp1-dp2-ep2", "pp1-dp2-ep1"), ("pp2-dp2-ep2",))
"""Layouts that share one launched world (two ranks, two ranks, four): each builds its own
process groups. Three launches where there were four, each test's share under 90 s."""


def _matrix(layout_id: str):
    """Both stacks at this layout's cases, launched with the other layouts of its group."""
    if layout_id not in _MATRIX:
        (group,) = [g for g in LAUNCHES if layout_id in g]
        runs = []
        for other in group:
            pp, dp, ep = LAYOUTS[other]
            parallel = ParallelConfig(
                pp=pp, dp=dp, ep=ep, micro_batch_size=1, micro_batches=2 * pp + 1, seq_len=32
            )
            repeat = (DETERMINISM_RUN,) if other == DETERMINISM_LAYOUT else ()
            runs.append((other, parallel, CASES[other], repeat))
        results = _launch(runs, pp * dp)
        for other in group:
            _MATRIX[other] = results
    return _MATRIX[layout_id]


def test_the_cases_are_pairwise():
    """Every (layout, preset) pair once; every layout and every preset in both dtypes."""
    pairs = [(layout_id, name) for layout_id, cases in CASES.items() for _, name in cases]
    assert sorted(pairs) == sorted((lay, name) for lay in LAYOUTS for name in PRESETS)
    assert sorted(sum(LAUNCHES, ())) == sorted(LAYOUTS)
    for group in LAUNCHES:  # one world size per launch
        assert len({LAYOUTS[lay][0] * LAYOUTS[lay][1] for lay in group}) == 1, group
    for layout_id, cases in CASES.items():
        assert {dtype for dtype, _ in cases} == set(TOLERANCE), layout_id
    for name in PRESETS:
        dtypes = {dtype for cases in CASES.values() for dtype, at in cases if at == name}
        assert dtypes == set(TOLERANCE), name


def _names(layout_id: str, dtype: str) -> tuple[str, ...]:
    return tuple(name for at, name in CASES[layout_id] if at == dtype)


@pytest.mark.slow
@pytest.mark.parametrize("layout_id", list(LAYOUTS))
def test_optimized_matches_reference_float32(layout_id):
    results = _matrix(layout_id)
    _check(results, layout_id, _names(layout_id, "float32"), "float32")
    # The early frees, on tiny-deepseek-v2 in whichever dtype it runs at this layout (what
    # is freed does not depend on the dtype).
    dtype = next(at for at, name in CASES[layout_id] if name == PRESETS[0])
    optimized = results[0][layout_id, dtype, PRESETS[0], "optimized"][0]
    kinds = {what for what, _ in optimized["freed"]}
    # Every MoE layer frees attention's residual once the aggregate has added it (#21).
    assert "residual" in kinds
    if LAYOUTS[layout_id][0] > 1:  # PP > 1: rank 0 frees each forward output once sent
        assert "sent_activation" in kinds
    if LAYOUTS[layout_id][2] > 1:  # the all-to-alls copy, so the boundary buffers are freed
        assert {"sorted_tokens", "received_tokens", "expert_output"} <= kinds
    else:  # EP = 1: the exchanges are the identity, buffers share storage
        assert "received_tokens" in kinds  # the experts copied it into their grouped buffer
        assert not kinds & {"sorted_tokens", "expert_output"}  # still read downstream


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout_id", "name"),
    [
        pytest.param(layout_id, name, id=f"{layout_id}-{name}")
        for layout_id in LAYOUTS
        for name in _names(layout_id, "bfloat16")
    ],
)  # fmt: skip
def test_optimized_matches_reference_bfloat16(layout_id, name):
    _check(_matrix(layout_id), layout_id, (name,), "bfloat16")


@pytest.mark.slow
def test_optimized_is_deterministic_bfloat16():
    for rank_results in _matrix(DETERMINISM_LAYOUT):
        first, second = rank_results[(DETERMINISM_LAYOUT, *DETERMINISM_RUN, "optimized")]
        for (loss_a, grads_a), (loss_b, grads_b) in zip(
            first["steps"], second["steps"], strict=True
        ):
            assert loss_a == loss_b
            assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)


@pytest.mark.slow
def test_saved_tensor_profile_splits_parameters_and_activations(compute_device):
    from optimized.ops import OptimizedOps
    from optimized.pipeline.profile import STAGES, profile_part

    model = build_model(preset("tiny-deepseek-v2")).to(compute_device)
    hidden = torch.randn(1, 16, model.config.hidden_size).to(compute_device)
    profiles = profile_part(model, hidden, OptimizedOps())
    assert [p.layer for p in profiles] == list(range(model.config.num_hidden_layers))
    for profile in profiles:
        assert set(profile.as_dict()) == set(STAGES)
        assert profile.stages["attention"].activation_bytes > 0
        assert profile.stages["dispatch"].activation_bytes == 0  # comm keeps no tensors
        assert profile.stages["combine"].activation_bytes == 0
    moe = profiles[-1]
    assert moe.stages["experts"].activation_bytes > 0
    assert moe.stages["experts"].parameter_bytes > 0  # the expert weights, by storage


def _memory_worker(names, parallel):
    from harness.memory import MemoryTracker
    from optimized.pipeline import OptimizedPipeline
    from reference.pipeline import ReferencePipeline

    layout = make_layout(parallel)
    figures = {}
    for name in names:
        model = preset(name)
        state = SeededWeights(model)
        for runner in (ReferencePipeline, OptimizedPipeline):
            pipeline = runner(model, parallel, layout, state, OptimizerConfig())
            pipeline.train_step(*synthetic_batch(model, parallel, 0))  # optimizer state exists
            tracker = MemoryTracker("cpu")
            tracker.register(parameters=pipeline.part, optimizer_state=pipeline.optimizer)
            pipeline.observer = tracker.mark
            with tracker.step():
                pipeline.train_step(*synthetic_batch(model, parallel, 1))
            figures[name, runner.name] = tracker.summary()
            del pipeline, tracker
    return figures


PEAK_MODELS = ("tiny-deepseek-v2", "tiny-gpt-oss")
_PEAKS: list = []


@pytest.mark.slow
@pytest.mark.parametrize("name", PEAK_MODELS)
def test_activation_peak_at_most_0_6x_reference(name):
    """Issue 5's memory target, and #20's for GPT-OSS (sinks through flash attention, no
    S x S saved; it was 0.60-0.73x with eager attention). Measured 0.455-0.552x per rank on
    tiny-deepseek-v2: fused attention drops the S x S probabilities, selective recomputation
    the attention block's projections, the chunked linear cross-entropy the logits, early
    frees the stage-boundary buffers. Both models in one launch of four ranks."""
    if not _PEAKS:
        parallel = ParallelConfig(
            pp=2, dp=2, ep=2, micro_batch_size=2, micro_batches=4, seq_len=128
        )  # fmt: skip
        _PEAKS.append(launch(_memory_worker, 4, (PEAK_MODELS, parallel)))
    figures = _PEAKS[0]
    ratios = [
        f[name, "optimized"]["activations"] / f[name, "reference"]["activations"] for f in figures
    ]
    print(name, "optimized / reference activation peak per rank:", [f"{r:.3f}" for r in ratios])
    for rank, ratio in enumerate(ratios):
        assert ratio <= 0.6, (rank, ratio)
