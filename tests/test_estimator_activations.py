"""The per-layer activation formula against what autograd really keeps (saved-tensor hooks).

The optimized layer's held bytes are counted on CPU storage (the estimate is of CPU ranks),
so that test runs on a CPU rank (`tests._ranks.on_cpu_rank`)."""

import gc
import weakref

import pytest
import torch

from models.network import DecoderLayer, StepBalance, preset
from optimized.estimator.activations import layer_saved
from optimized.estimator.config import EstimateConfig
from reference.ops import ReferenceOps
from tests._ranks import on_cpu_rank

PRESETS = ("tiny-deepseek-v2", "tiny-deepseek-v3", "tiny-gpt-oss", "tiny-qwen3-moe")


def measured_saved_bytes(model, layer_index, batch, seq, dtype) -> int:
    """Bytes of the distinct non-parameter storages saved for backward and still alive
    after the layer's forward (nodes that died with their outputs do not count). The layer
    runs as a training forward does: with a `MicroBatchBalance` of the model's routing
    controls. The hook keeps a detached alias: an output saved by its own node would
    otherwise hold that node, and so itself, in a cycle past its death (no backward runs)."""
    torch.manual_seed(1234)
    layer = DecoderLayer(model, layer_index).to(dtype)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.normal_(0.0, 0.02)
    params = {p.untyped_storage()._cdata for p in layer.parameters()}
    x = torch.randn(batch, seq, model.hidden_size, dtype=dtype, requires_grad=True)
    step = StepBalance(model.balancing(), model.moe_layers, model.num_experts, 1, x.device)
    seen = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        key = storage._cdata
        known = seen.get(key)
        # An address freed by a dead temporary can come back for a new storage.
        if key not in params and (known is None or known[0]() is None):
            seen[key] = (weakref.ref(storage), storage.nbytes())
        return tensor.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = layer(x, ReferenceOps(), step.micro_batch())
    gc.collect()
    total = sum(nbytes for ref, nbytes in seen.values() if ref() is not None)
    del out
    return total


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch,seq", [(2, 64), (1, 32), (3, 48)])
def test_layer_formula_matches_saved_tensors(name, dtype, batch, seq):
    model = preset(name)
    config = EstimateConfig(
        model, micro_batch_size=batch, seq_len=seq, dtype=dtype, stack="reference",
        num_microbatches=2,
    )  # fmt: skip
    for layer in range(2):  # a dense first layer (DeepSeek) and a MoE one
        got = measured_saved_bytes(model, layer, batch, seq, getattr(torch, dtype))
        estimate = sum(item.nbytes for item in layer_saved(config, layer))
        # Routing moves a few index/mask storages in and out of sharing; 2% bounds it.
        assert abs(estimate - got) <= 0.02 * got, (name, dtype, layer, estimate, got)


CONTROLS = {
    "pooled": dict(aux_loss="pooled", aux_loss_coef=0.01),
    "layer": dict(aux_loss="layer", aux_loss_coef=0.01),
    "sequence": dict(aux_loss="sequence", aux_loss_coef=0.01),
    "z-loss": dict(router_z_loss_coef=0.001),
    "all": dict(aux_loss="pooled", aux_loss_coef=0.01, router_z_loss_coef=0.001, expert_bias=True),
}


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_routing_controls_add_what_they_save(name, dtype):
    """Each routing control's saved tensors (`activations.balancing_saved`), to the byte: the
    same layer, weights, input and routing with the controls on and off."""

    def saved(model) -> tuple[int, int]:
        got = measured_saved_bytes(model, 1, 3, 48, getattr(torch, dtype))
        config = EstimateConfig(
            model, micro_batch_size=3, seq_len=48, dtype=dtype, stack="reference",
            num_microbatches=2,
        )  # fmt: skip
        return got, sum(item.nbytes for item in layer_saved(config, 1))

    off = saved(preset(name))
    for controls, fields in CONTROLS.items():
        on = saved(preset(name, **fields))
        measured, estimated = on[0] - off[0], on[1] - off[1]
        assert measured == estimated, (controls, measured, estimated)
        # Only the pooled form saves nothing, where the router saves its softmax already.
        assert measured > 0 or controls == "pooled" and name != "tiny-gpt-oss", controls


def measured_optimized_held(model, layer_index, batch, seq, dtype) -> int:
    """Bytes one optimized `LayerRun` holds after its seven forward steps (EP=1), measured
    with the storage tracker (non-reentrant checkpoint hides its keeps from outer hooks)."""
    from optimized.pipeline.execution import ExecutionContext
    from optimized.pipeline.overlap import FORWARD_STEPS, LayerRun
    from tests._memtrack import StorageTracker

    torch.manual_seed(1234)
    layer = DecoderLayer(model, layer_index).to(dtype)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.normal_(0.0, 0.02)
    x = torch.randn(batch, seq, model.hidden_size, dtype=dtype)
    tracker = StorageTracker()
    with tracker:
        run = LayerRun(layer, ExecutionContext())
        run.input = x
        for step in FORWARD_STEPS:
            step(run)
        gc.collect()
        held = tracker.current
    return held


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("tiny-deepseek-v2", "float32"), ("tiny-deepseek-v2", "bfloat16"),
     ("tiny-deepseek-v3", "bfloat16"), ("tiny-qwen3-moe", "float32")],
)  # fmt: skip
def test_optimized_layer_steps_match_measured(name, dtype):
    on_cpu_rank(_check_optimized_layer_steps, name, dtype)


def _check_optimized_layer_steps(name: str, dtype: str) -> None:
    from optimized.estimator.steps import step_profile

    model = preset(name)
    config = EstimateConfig(
        model, micro_batch_size=2, seq_len=64, dtype=dtype, stack="optimized", num_microbatches=2
    )
    for layer in range(2):
        got = measured_optimized_held(model, layer, 2, 64, getattr(torch, dtype))
        assert step_profile(config, layer).held == got, (name, dtype, layer)
