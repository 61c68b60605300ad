"""Each stack's per-layer memory moments against a storage tracker on real layers (fast).

The estimator's transients are read off the code (`optimized.estimator.reference_layer`,
`optimized.estimator.steps`, `optimized.estimator.recompute`); here every one is held
against what a byte-accurate tracker sees while one decoder layer runs: the reference
layer's forward and backward, the optimized layer's fourteen stage steps (and a
deferred backward's experts step and its W step). Routing is the layer's own (the
estimate takes the rows each expert received: ``expert_load``), weight gradients already
exist (a steady step). Known small misses, under 4 KiB each, are bounded below; a
transient left out costs tens of kilobytes and fails.

The last test pins the optimized walk's per-rank peaks at a small layout to the tracker's
measurement, so a step transient dropped from the walk itself fails here, not only in the
slow estimator-vs-measured test.

The tracker counts CPU storage byte for byte, and the estimate is of CPU ranks (the
interpreter's blocks), so the optimized layers run on a CPU rank (`tests._ranks.on_cpu_rank`:
in place where this process interprets Triton, in one spawned CPU rank on a GPU machine).
"""

from __future__ import annotations

import contextlib
import gc

import numpy as np
import pytest
import torch

from models.network import DecoderLayer, RMSNorm, Router, StepBalance, preset
from optimized.estimator import EstimateConfig, estimate_for_compare
from optimized.estimator.memory import layer_profile
from optimized.estimator.steps import step_profile
from reference.ops import ReferenceOps
from tests._memtrack import StorageTracker
from tests._ranks import on_cpu_rank

PRESETS = ("tiny-deepseek-v2", "tiny-deepseek-v3", "tiny-gpt-oss", "tiny-qwen3-moe")
BATCH, SEQ = 2, 32
DEVICE = torch.device("cpu")


def _layer(name: str, index: int, dtype: str, controls: dict | None = None):
    model = preset(name, **(controls or {}))
    torch.manual_seed(0)
    layer = DecoderLayer(model, index).to(getattr(torch, dtype))
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.normal_(0.0, 0.02)
    loads: list[np.ndarray] = []
    for module in layer.modules():
        if isinstance(module, Router):
            module.register_forward_hook(
                lambda _m, _i, out: loads.append(
                    np.bincount(out[1].detach().numpy().ravel(), minlength=model.num_experts)
                )
            )
    return model, layer, loads


def _balance(model):
    """A training forward's `MicroBatchBalance` of the model's routing controls (made before
    the tracker starts: the walk counts the micro-batch's own balancing state)."""
    step = StepBalance(model.balancing(), model.moe_layers, model.num_experts, 1, DEVICE)
    return step.micro_batch()


def _config(model, dtype: str, stack: str, loads) -> EstimateConfig:
    config = EstimateConfig(
        model, micro_batch_size=BATCH, seq_len=SEQ, dtype=dtype, stack=stack, num_microbatches=2
    )
    if loads:
        config = config.replace(expert_load=tuple(int(count) for count in loads[-1]))
    return config


# DeepSeek's first layer is dense; GPT-OSS's and Qwen3-MoE's layers are all alike.
LAYERS = [("tiny-deepseek-v2", 0), ("tiny-deepseek-v2", 1), ("tiny-deepseek-v3", 1),
          ("tiny-gpt-oss", 1), ("tiny-qwen3-moe", 1)]  # fmt: skip
# The routing controls that change what a MoE layer saves (`optimized.estimator.balancing`):
# every one on the families whose HF loss is the pooled one; DeepSeek's own sequence form.
ALL_ON = dict(aux_loss="pooled", aux_loss_coef=0.01, router_z_loss_coef=0.001, expert_bias=True)
SEQUENCE_Z = dict(aux_loss="sequence", aux_loss_coef=0.01, router_z_loss_coef=0.001)
CONTROLLED = [("tiny-deepseek-v2", 1, SEQUENCE_Z), ("tiny-gpt-oss", 1, ALL_ON),
              ("tiny-qwen3-moe", 1, ALL_ON)]  # fmt: skip
CASES = [pytest.param(name, index, None, id=f"{name}-{index}") for name, index in LAYERS] + [
    pytest.param(name, index, controls, id=f"{name}-{index}-controls")
    for name, index, controls in CONTROLLED
]


@pytest.mark.parametrize(("name", "index", "controls"), CASES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_layer_moments_match_tracker(name, index, controls, dtype):
    model, layer, loads = _layer(name, index, dtype, controls)
    dt = getattr(torch, dtype)
    for _ in range(2):  # the first run under a tracker pays one-time imports and makes grads
        loads.clear()
        x = torch.randn(BATCH, SEQ, model.hidden_size, dtype=dt, requires_grad=True)
        grad = torch.randn(BATCH, SEQ, model.hidden_size, dtype=dt)
        balance = _balance(model)
        gc.collect()
        gc.disable()
        tracker = StorageTracker()
        with tracker:
            out = layer(x, ReferenceOps(), balance)
            forward = tracker.peak
            balance.close(BATCH * SEQ)  # the loss stage's: the pooled totals backward needs
            tracker.peak = start = tracker.current
            torch.autograd.backward(out, grad)
            backward = tracker.peak - start
        gc.enable()
        del out
    profile = layer_profile(_config(model, dtype, "reference", loads), index)
    # The layer's input was made outside the tracker: in float32 it is the saved float input.
    leaf = BATCH * SEQ * model.hidden_size * 4 if dtype == "float32" else 0
    assert abs(forward - (profile.saved - leaf + profile.forward_transient)) <= 1024
    assert abs(backward - (profile.backward_transient - profile.aggregate)) <= 2048


def _optimized_rises(model, layer, dtype: str, defer: bool, recompute: bool = True):
    """Each of the fourteen steps' rise above its start (and a W's), in a training forward
    with the model's routing controls."""
    from optimized.pipeline.execution import ExecutionContext
    from optimized.pipeline.overlap import BACKWARD_STEPS, FORWARD_STEPS, LayerRun

    dt = getattr(torch, dtype)
    for _ in range(2):
        ctx = ExecutionContext(recompute_attention=recompute)
        rises = {}
        balance = _balance(model)
        gc.collect()
        gc.disable()
        tracker = StorageTracker()
        with tracker:
            run = LayerRun(layer, ctx, balance)
            run.input = torch.randn(BATCH, SEQ, model.hidden_size, dtype=dt)
            for step in FORWARD_STEPS:
                tracker.peak = start = tracker.current
                step(run)
                rises[step.__name__] = tracker.peak - start
            balance.close(BATCH * SEQ)  # the loss stage's: the pooled totals backward needs
            run.grad_output = torch.randn_like(run.output)
            deferring = ctx.weight_grads.deferring() if defer else contextlib.nullcontext()
            with deferring:
                for step in BACKWARD_STEPS:
                    tracker.peak = start = tracker.current
                    step(run)
                    rises[step.__name__] = tracker.peak - start
            if defer:
                tracker.peak = start = tracker.current
                ctx.weight_grads.pop()
                rises["W"] = tracker.peak - start
        gc.enable()
        del run
    return rises


STEP_CASES = [pytest.param(name, None, id=name) for name in PRESETS] + [
    pytest.param(name, controls, id=f"{name}-controls") for name, _, controls in CONTROLLED
]


@pytest.mark.parametrize(("name", "controls"), STEP_CASES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("defer", [False, True])
def test_optimized_layer_steps_match_tracker(name, controls, dtype, defer):
    on_cpu_rank(_check_optimized_layer_steps, name, dtype, defer, controls)


def _check_optimized_layer_steps(name: str, dtype: str, defer: bool, controls=None) -> None:
    model, layer, loads = _layer(name, 1, dtype, controls)
    rises = _optimized_rises(model, layer, dtype, defer)
    profile = step_profile(_config(model, dtype, "optimized", loads), 1)
    expected = {name: step.transient for name, step in profile.forward.items()}
    expected.update({name: step.transient for name, step in profile.backward.items()})
    if defer:
        expected["experts_backward"] = profile.deferred_experts_rise
        expected["W"] = max(profile.weight_transients)
    misses = {
        step: (rises[step], want) for step, want in expected.items()
        if abs(rises[step] - want) > 4096
    }  # fmt: skip
    assert not misses, misses


# Without recompute: the MoE layers, DeepSeek-V2's dense first layer and GPT-OSS's banded
# sliding first layer (the block's kept tensors differ by layer kind), each in float32. In
# bfloat16 one layer per family's attention and MLP kind: DeepSeek-V2's dense and MoE layers
# (MLA's kv_a slice, the shared experts' residual), GPT-OSS's layer 0 (its float norm, the
# sinks' probabilities, the experts' bias gradients; sliding or full attention keeps the same
# tensors) and Qwen3-MoE's (q/k norms, the per-call rotary tables). DeepSeek-V3's bfloat16
# kept block differs from V2's only by its rotary tables, held by the recompute's bfloat16
# V3 case (the recomputed block is the same `attention_saved` entries) and the reference
# layer's; GPT-OSS's layer 1 in bfloat16 differs from layer 0 only by the window.
KEPT_LAYERS = LAYERS + [("tiny-gpt-oss", 0)]
KEPT_BF16 = [("tiny-deepseek-v2", 0), ("tiny-deepseek-v2", 1), ("tiny-gpt-oss", 0),
             ("tiny-qwen3-moe", 1)]  # fmt: skip
KEPT_CASES = [
    pytest.param(name, index, "float32", id=f"float32-{name}-{index}")
    for name, index in KEPT_LAYERS
] + [
    pytest.param(name, index, "bfloat16", id=f"bfloat16-{name}-{index}")
    for name, index in KEPT_BF16
]


@pytest.mark.parametrize(("name", "index", "dtype"), KEPT_CASES)
def test_optimized_layer_steps_without_recompute_match_tracker(name, index, dtype):
    on_cpu_rank(_check_optimized_layer_steps_without_recompute, name, index, dtype)


def _check_optimized_layer_steps_without_recompute(name: str, index: int, dtype: str) -> None:
    model, layer, loads = _layer(name, index, dtype)
    rises = _optimized_rises(model, layer, dtype, defer=False, recompute=False)
    config = _config(model, dtype, "optimized", loads).replace(recompute=False)
    profile = step_profile(config, index)
    expected = {name: step.transient for name, step in profile.forward.items()}
    expected.update({name: step.transient for name, step in profile.backward.items()})
    misses = {
        step: (rises[step], want) for step, want in expected.items()
        if abs(rises[step] - want) > 4096
    }  # fmt: skip
    assert not misses, misses
    # The kept block is what recompute saves: the forward holds exactly that much more.
    with_recompute = step_profile(_config(model, dtype, "optimized", loads), index)
    kept = profile.forward["attention_forward"].delta
    assert kept > with_recompute.forward["attention_forward"].delta


# Measured by the harness's tracker (`twinpipe compare --pp 2 --dp 1 --ep 1 --micro-batches 4
# --micro-batch-size 2 --seq-len 64 --steps 2`, the candidate's second step, seed 0) since every
# training step keeps a `StepBalance` (an int64 load per MoE layer, the aux and z shares: 136
# bytes on a rank of two MoE layers); the estimate is within 8 bytes of them (one or two
# float32 scalars the tracker sees and the walk does not count).
PINNED = {
    "tiny-deepseek-v2": ([6_018_308, 8_183_392], [6_018_300, 8_183_388]),
    "tiny-qwen3-moe": ([8_320_508, 7_486_576], [8_320_504, 7_486_572]),
}
# With the routing controls that change what a step holds (`ALL_ON`: the pooled counts beside
# each message, the z-loss's and the all-expert softmax's saved tensors, the bias buffers),
# tiny-qwen3-moe as above with the optimized stack as the baseline
# (it runs the optimizer step and the bias update): `harness.compare.lockstep.run_rank(
# RankPlan(model, ParallelConfig(pp=2, dp=1, ep=1, micro_batches=4, micro_batch_size=2,
# seq_len=64), SeededWeights(model), "optimized", "reference", 2, OptimizerConfig()))`, its
# second step; within 32 bytes (the terms' float32 scalars).
PINNED_CONTROLS = {"tiny-qwen3-moe": ([8_344_016, 7_510_084], [8_343_992, 7_510_060])}
PINNED_CASES = [pytest.param(name, None, 8, id=name) for name in sorted(PINNED)] + [
    pytest.param(name, ALL_ON, 32, id=f"{name}-controls") for name in sorted(PINNED_CONTROLS)
]


@pytest.mark.parametrize(("name", "controls", "bound"), PINNED_CASES)
def test_optimized_walk_peaks_pinned_to_the_tracker(name, controls, bound):
    measured, pinned = (PINNED_CONTROLS if controls else PINNED)[name]
    layout = dict(pp=2, dp=1, ep=1, micro_batch_size=2, seq_len=64, num_microbatches=4)
    model = preset(name, **(controls or {}))
    report = estimate_for_compare(model, {**layout, "dtype": "float32"}, "optimized")
    peaks = [rank["peak_bytes"] for rank in report["ranks"]]
    assert peaks == pinned
    for estimated, tracked in zip(peaks, measured, strict=True):
        assert abs(estimated - tracked) <= bound


def test_fused_loss_transient_matches_tracker():
    """The optimized loss stage (final norm, chunked linear cross-entropy) holds, at its peak,
    what it keeps for the backward plus `fused_loss_transient`: the norm's output, the
    per-token losses, z-losses and softmax statistics, and one buffer of ``[tokens, chunk]``
    logits (262 KB here, 1/32 of the 8.2 MB of logits; 2.1 MB at mid width)."""
    on_cpu_rank(_check_fused_loss_transient)


def _check_fused_loss_transient() -> None:
    from optimized.estimator.memory import (
        fused_loss_transient,
        loss_buffer_elements,
        loss_chunk_vocab,
    )
    from optimized.ops.linear_cross_entropy import chunk_plan, default_chunk_vocab
    from optimized.pipeline.dualpipev import SummedLinearCrossEntropy
    from optimized.pipeline.overlap import leaf

    for vocab, hidden in ((512, 64), (32000, 64), (32000, 2048), (102400, 2048), (3, 7)):
        chunk = default_chunk_vocab(vocab, hidden)
        assert loss_chunk_vocab(vocab, hidden) == chunk
        for tokens in (0, 1, 100, 128, 4096):
            for size, accumulator in ((2, 4), (4, 0)):
                plan = chunk_plan(tokens, vocab, hidden, chunk, size, accumulator)
                assert loss_buffer_elements(tokens, vocab, hidden, size) == plan.buffer_elements
    model = preset("tiny-qwen3-moe", vocab_size=32000)
    config = EstimateConfig(
        model, micro_batch_size=BATCH, seq_len=64, dtype="bfloat16", stack="optimized"
    )
    torch.manual_seed(0)
    norm = RMSNorm(model.hidden_size, model.rms_norm_eps).to(torch.bfloat16)
    weight = torch.nn.Parameter(0.02 * torch.randn(model.vocab_size, model.hidden_size))
    weight.data = weight.data.to(torch.bfloat16)
    labels = torch.randint(0, model.vocab_size, (BATCH, 64))

    def loss_stage(hidden):  # `OptimizedDualPipeV._loss_sum`
        return SummedLinearCrossEntropy()(norm(hidden), weight, labels)[0]

    for _ in range(2):
        hidden = torch.randn(BATCH, 64, model.hidden_size, dtype=torch.bfloat16)
        gc.collect()
        gc.disable()
        tracker = StorageTracker()
        with tracker:
            loss = loss_stage(leaf(hidden))
            rise = tracker.peak - tracker.current
        gc.enable()
        del loss
    assert abs(rise - fused_loss_transient(config)) <= 64


# The optimized stack's per-action peaks at PP1 DP1 EP1 (micro-batch size 2, M=2, seq 64,
# bf16, step 1) of tiny-qwen3-moe with a 32000 vocabulary, measured by the harness's tracker
# (`harness.compare.lockstep.run_rank`, seed 0; each region's `MemoryTracker.timeline`), last when
# the fused loss went to vocabulary chunks (F1: 34.54 -> 32.76 MB, its 2.05 MB buffer of 32
# token rows now 262 KB of 1024 vocabulary columns) and the deferred expert gradients lost
# their staging copy (W: 35.35 -> 35.28 MB). At PP1 the loss stage's
# forward overlaps the embedding's backward (F1&B0): the walk used to miss the fused loss's
# logits buffer (F1: -2.04 MB) and to drop the last layer's late-held tensors before the
# embedding backward instead of at the action's end (F1&B0 -193 KB, B0 -181 KB).
BIG_VOCAB_MOMENTS = {
    ("nF0F1:F0", 0): 26_908_772, ("nF0F1:F1", 0): 32_758_088,
    ("nF0B1F1B0:F0", 1): 33_313_768, ("nF0B1F1B0:B1", 0): 33_279_016,
    ("nF0B1F1B0:F1&B0", 1): 41_395_912, ("nB1B0:B1", 1): 41_165_524,
    ("nB1B0:B0", 1): 39_545_700, ("nW:W", None): 35_284_836,
}  # fmt: skip


def test_optimized_walk_moments_at_pp1_with_a_large_vocabulary():
    layout = dict(pp=1, dp=1, ep=1, micro_batch_size=2, seq_len=64, num_microbatches=2)
    model = preset("tiny-qwen3-moe", vocab_size=32000)
    report = estimate_for_compare(model, {**layout, "dtype": "bfloat16"}, "optimized",
                                  first_step=False)  # fmt: skip
    timeline = report["ranks"][0]["timeline"]
    moments = {(t["mark"], t["micro_batch"]): t["peak_bytes"] for t in timeline}
    misses = {
        key: (moments[key], measured) for key, measured in BIG_VOCAB_MOMENTS.items()
        if abs(moments[key] - measured) > 40_000
    }  # fmt: skip
    assert not misses, misses
