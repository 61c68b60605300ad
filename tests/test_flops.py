"""The FLOP count of `optimized.estimator.flops` against torch's FlopCounterMode on real
forward and backward passes of the tiny models (the reference stack's plain matmuls), and
the GPU peak table."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from models.network import build_model, causal_mask, preset
from optimized.estimator.flops import (
    attended_keys,
    forward_flops,
    known_gpu,
    layer_flops,
    peak_tflops,
    training_flops,
)
from reference.ops import ReferenceOps

FAMILIES = ("tiny-deepseek-v2", "tiny-deepseek-v3", "tiny-gpt-oss", "tiny-qwen3-moe")
BATCH, SEQ = 2, 40  # longer than tiny-gpt-oss's 16-token window


class RecomputingReferenceOps(ReferenceOps):
    """The reference's plain ops with the optimized stack's attention recomputation: the
    decoder layer checkpoints its attention block, so the backward reruns it."""

    recompute_attention = True


def _counted(name: str, backward: bool, ops=None) -> FlopCounterMode:
    torch.manual_seed(0)
    model = build_model(preset(name), ops=ops or ReferenceOps())
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ))
    with FlopCounterMode(display=False) as counter:
        logits = model(ids)
        if backward:
            logits.float().square().mean().backward()
    return counter


def _sum(counts: dict, module: str) -> int:
    return sum(counts.get(module, {}).values())


@pytest.mark.parametrize("name", FAMILIES)
def test_forward_matches_the_instrumented_matmuls_part_by_part(name):
    config, tokens = preset(name), BATCH * SEQ
    counts = _counted(name, backward=False).get_flop_counts()
    bmm = torch.ops.aten.bmm
    for layer in range(config.num_hidden_layers):
        prefix = f"CausalLM.model.layers.{layer}"
        formula = layer_flops(config, layer, SEQ)
        unmasked = layer_flops(config, layer, SEQ, dense_attention=True)
        attention = counts[f"{prefix}.self_attn"]
        # The projections, exactly: everything in self_attn but the two batched products.
        projections = formula.attention_projections + formula.attention_output
        assert projections * tokens == _sum(counts, f"{prefix}.self_attn") - attention[bmm]
        assert formula.attention_output * tokens == _sum(counts, f"{prefix}.self_attn.o_proj")
        # Q K^T and P V: the eager kernel computes every key of the sequence ...
        assert unmasked.attention_scores * tokens == attention[bmm]
        # ... and the count keeps only the keys the mask lets a query see, counted here off
        # the model's own mask (causal, or GPT-OSS's sliding window on alternate layers).
        mask = causal_mask(SEQ, _window(config, layer), torch.device("cpu"))
        seen = int((mask == 0).sum())
        assert formula.attention_scores * tokens == pytest.approx(attention[bmm] * seen / SEQ**2)
        if config.is_moe_layer(layer):  # MoE.forward is not called: its parts are
            router = "router" if config.model_type == "gpt_oss" else "gate"
            assert formula.router * tokens == _sum(counts, f"{prefix}.mlp.{router}")
            assert formula.routed_experts * tokens == _sum(counts, f"{prefix}.mlp.experts")
            shared = _sum(counts, f"{prefix}.mlp.shared_experts")
            assert formula.shared_experts * tokens == shared
            assert (shared > 0) == (config.n_shared_experts > 0) and formula.dense_mlp == 0
        else:
            assert formula.dense_mlp * tokens == _sum(counts, f"{prefix}.mlp") > 0
            assert formula.router == formula.routed_experts == formula.shared_experts == 0
        # Nothing else in the layer multiplies matrices.
        assert unmasked.total * tokens == _sum(counts, prefix)
    assert forward_flops(config, SEQ).head * tokens == _sum(counts, "CausalLM.lm_head")
    total = sum(counts["Global"].values())
    assert forward_flops(config, SEQ, dense_attention=True).total * tokens == total


def _window(config, layer: int) -> int | None:
    return config.sliding_window if config.layer_type(layer) == "sliding_attention" else None


@pytest.mark.parametrize("name", FAMILIES)
def test_a_training_step_is_three_forwards_plus_the_recomputed_attention(name):
    """Forward and backward instrumented: 3 x the forward, and with the optimized stack's
    attention recomputation the attention block's rerun on top."""
    config, tokens = preset(name), BATCH * SEQ
    plain = _counted(name, backward=True).get_total_flops()
    step = training_flops(config, SEQ, recompute=False, dense_attention=True)
    assert step.model * tokens == plain and step.hardware == step.model
    recomputed = _counted(name, backward=True, ops=RecomputingReferenceOps()).get_total_flops()
    step = training_flops(config, SEQ, recompute=True, dense_attention=True)
    assert step.hardware * tokens == recomputed
    # torch's checkpoint stops before the output projection: nothing saved its output.
    forward = step.forward
    assert step.recomputed == forward.attention_projections + forward.attention_scores


def test_attended_keys_against_the_mask():
    for seq, window in [(1, None), (7, None), (40, 16), (16, 16), (17, 16), (5, 1), (9, 100)]:
        seen = int((causal_mask(seq, window, torch.device("cpu")) == 0).sum())
        assert attended_keys(seq, window) * seq == seen
    with pytest.raises(ValueError, match="seq_len=0"):
        attended_keys(0)


def test_mid_deepseek_v2_at_4096_tokens_is_the_published_shape():
    """GPU.md: about 2.62 GFLOP per token (395 M active matmul parameters plus attention)."""
    step = training_flops(preset("mid-deepseek-v2"), 4096)
    linear = step.forward.total - step.forward.attention_scores
    assert linear / 2 == pytest.approx(395.5e6, rel=1e-3)
    assert step.model == pytest.approx(2.625e9, rel=1e-3)
    assert step.hardware > step.model


def test_peaks_of_known_gpus():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4
    assert peak_tflops("NVIDIA H100 PCIe", "bfloat16") == 756.0
    assert peak_tflops("NVIDIA H200", "bfloat16") == 989.4
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "tf32") == 156.0
    assert peak_tflops("NVIDIA B200", "bfloat16") == 2250.0
    assert peak_tflops("NVIDIA L40S", "float32") == 91.6
    assert known_gpu("NVIDIA L40S").name == "L40S" and known_gpu("NVIDIA L4").name == "L4"
    assert known_gpu("NVIDIA A10G") is None and known_gpu("cpu") is None
    assert peak_tflops("NVIDIA GeForce GTX 1080", "bfloat16") is None
    with pytest.raises(ValueError, match="precision='fp8'"):
        peak_tflops("NVIDIA H100", "fp8")
