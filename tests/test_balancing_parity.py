"""The load-balancing losses against their sources.

- transformers' ``load_balancing_loss_func`` (Qwen3-MoE, GPT-OSS with
  ``output_router_logits``): a tiny random transformers model in float64 gives the aux loss
  and the gradient of ``CE + coef * aux`` for every parameter; ours, loaded from its files,
  computes them the way the pipelines do (one `MicroBatchBalance` through every layer, the
  pooled totals closed at the loss, the terms' gradients attached to the residuals);
- DeepSeek-V2's sequence-level and per-layer losses (its own ``MoEGate`` code; transformers'
  modeling has none) against a float64 transcription of that code (`reference.oracle`).
"""

from __future__ import annotations

import pytest
import torch

from models.hf import from_pretrained
from models.network import (
    IGNORE_INDEX,
    SeededWeights,
    StepBalance,
    build_part,
    preset,
    shift_labels,
)
from models.runtime import OptimizerConfig
from reference.ops import ReferenceOps
from reference.oracle import Oracle
from tests._hf import hf_model

BATCH, SEQ = 2, 24


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread, as the ranks run: these ops are tiny, and a second thread per
    pytest process (two workers on two cores) spends its CPU waiting in OpenMP."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _pipeline_way(model, ids: torch.Tensor) -> tuple[torch.Tensor, StepBalance]:
    """CE with the balancing terms attached as a pipeline attaches them, one micro-batch;
    backward run; returns the CE and the step (its ``aux`` and ``z`` hold the values)."""
    config = model.config
    labels = shift_labels(ids)
    step = StepBalance(config.balancing(), config.moe_layers, config.num_experts, 1, ids.device)
    balance = step.micro_batch()
    hidden = model.embed(ids)
    for layer in model.decoder_layers:
        hidden = layer(hidden, model.ops, balance)
    count = (labels != IGNORE_INDEX).sum()
    ce = model.loss_sum(hidden, labels) / count
    balance.close(ids.numel())
    ce.backward()
    return ce, step


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return (a - b).norm().item() / b.norm().item()


CASES = {
    "qwen3-moe": ("tiny-qwen3-moe", 0.02),
    "qwen3-moe/no-norm-mlp-only": ("tiny-qwen3-moe", 0.02),
    "gpt-oss": ("tiny-gpt-oss", 0.9),
}
OVERRIDES = {"qwen3-moe/no-norm-mlp-only": {"norm_topk_prob": False, "mlp_only_layers": [1]}}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_pooled_loss_and_gradients_match_transformers(case, dtype, tmp_path):
    """Aux value, total loss and every gradient against transformers in float64 (ours in
    float64 and in float32)."""
    name, coef = CASES[case]
    config = preset(
        name, output_router_logits=True, router_aux_loss_coef=coef, **OVERRIDES.get(case, {})
    )
    hf = hf_model(config, dtype=torch.float64)
    hf.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path, ops=ReferenceOps(), dtype=dtype)
    assert ours.config.balancing().pooled
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator())
    out = hf(input_ids=ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    ce, step = _pipeline_way(ours, ids)
    # transformers accumulates the counts and probabilities in float32 whatever the model's
    # dtype (``load_balancing_loss_func``), as ours does: the value agrees to float32.
    bound = 1e-6
    aux = float(out.aux_loss.detach())
    assert aux > 1.0  # k = 2 when balanced; random init is not
    assert abs(float(step.aux) - coef * aux) <= bound * coef * aux
    assert abs(float(ce.detach() + step.aux) - float(out.loss.detach())) <= bound * float(out.loss)
    hf_params = dict(hf.named_parameters())
    worst = max(
        (rel(p.grad, hf_params[n].grad), n) for n, p in ours.named_parameters() if p.numel()
    )
    assert worst[0] <= (1e-6 if dtype == torch.float64 else 2e-5), worst
    # the router gradient is where the aux loss acts: without it the router's gradient differs
    router = "model.layers.0.mlp.router.weight" if name == "tiny-gpt-oss" else None
    router = router or "model.layers.0.mlp.gate.weight"
    hf.zero_grad()
    hf(input_ids=ids, labels=ids, output_router_logits=False).loss.backward()
    assert rel(dict(ours.named_parameters())[router].grad, hf_params[router].grad) > 1e-3


@pytest.mark.parametrize("seq_aux", [True, False])
def test_deepseek_aux_matches_a_float64_transcription_of_its_code(seq_aux):
    """DeepSeek-V2's loss as the pipelines attach it (float32) against its ``MoEGate`` code
    transcribed in float64 (`reference.oracle`, whole batch, one micro-batch)."""
    config = preset("tiny-deepseek-v2", aux_loss_alpha=0.05, seq_aux=seq_aux)
    assert config.balancing().aux_form == ("sequence" if seq_aux else "layer")
    weights = SeededWeights(config, seed=4)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator())
    oracle = Oracle(config, weights, OptimizerConfig(), dtype=torch.float64)
    oracle.forward_backward(ids, shift_labels(ids))
    ours = build_part(config, weights, ops=ReferenceOps())
    _, step = _pipeline_way(ours, ids)
    expected = float(oracle.balancing_values()[0])
    assert expected > 0
    assert abs(float(step.aux) - expected) <= 2e-6 * expected
    theirs = dict(oracle.model.named_parameters())
    worst = max((rel(p.grad, theirs[n].grad), n) for n, p in ours.named_parameters())
    assert worst[0] <= 2e-5, worst
