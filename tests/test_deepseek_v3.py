"""DeepSeek-V3: its router against transformers' ``DeepseekV3TopkRouter`` (at a tie between
two groups too), its config read as transformers reads it, and what stays refused.

The whole model's parity with transformers (logits, loss, every gradient, bf16, checkpoints
both ways) is in `tests/test_hf_parity.py`; FP8 checkpoints in `tests/test_fp8.py`."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from models.hf import config_from_hf, config_to_hf
from models.network import Router, RoutingTape, attach_routing_tape, max_group_scores, preset

MOONLIGHT = {  # moonshotai/Moonlight-16B-A3B's config.json (auto_map and token ids left out)
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "ep_size": 1,
    "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 11264, "kv_lora_rank": 512,
    "max_position_embeddings": 8192, "model_type": "deepseek_v3",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
    "n_shared_experts": 2, "norm_topk_prob": True, "num_attention_heads": 16,
    "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16,
    "num_nextn_predict_layers": 0, "pretraining_tp": 1, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 50000.0, "routed_scaling_factor": 2.446,
    "scoring_func": "sigmoid", "seq_aux": True, "tie_word_embeddings": False, "topk_group": 1,
    "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "use_cache": True,
    "v_head_dim": 128, "vocab_size": 163840,
}  # fmt: skip
DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3's config.json (auto_map and token ids left out)
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "ep_size": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                            "quant_method": "fp8", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "seq_aux": True, "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip


def _routers(config, seed: int = 0):
    """Ours and transformers' router of ``config`` with the same weight and bias."""
    hf = DeepseekV3TopkRouter(transformers.AutoConfig.for_model(**config_to_hf(config)))
    ours = Router(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hf.weight.shape, generator=generator) * 0.3)
        hf.e_score_correction_bias.copy_(torch.randn(config.num_experts, generator=generator))
        hf.e_score_correction_bias.mul_(0.1)
        ours.weight.copy_(hf.weight)
        ours.e_score_correction_bias.copy_(hf.e_score_correction_bias)
    return ours, hf


@pytest.mark.parametrize(
    "overrides",
    [{}, {"norm_topk_prob": False}, {"n_group": 8, "topk_group": 3, "num_experts_per_tok": 4},
     {"n_group": 1, "topk_group": 1}],
)  # fmt: skip
def test_router_chooses_and_weighs_as_transformers(overrides):
    """The same experts in the same order and bit-equal weights, float32 and bfloat16 inputs."""
    config = preset("tiny-deepseek-v3", **overrides)
    ours, hf = _routers(config)
    x = torch.randn(512, config.hidden_size, generator=torch.Generator().manual_seed(1))
    for dtype in (torch.float32, torch.bfloat16):
        routed = ours(x.to(dtype), record=True)
        logits, weights, experts = hf(x.to(dtype))
        assert torch.equal(routed.experts, experts)
        assert torch.equal(routed.weights, weights)
        assert torch.equal(routed.logits, logits)
    # The losses' distribution: DeepSeek-V3's normalised sigmoid scores, a gradient path.
    assert torch.allclose(routed.probs, logits.sigmoid() / logits.sigmoid().sum(-1, True))
    assert routed.probs.requires_grad and routed.weights.requires_grad


def _at_a_group_tie():
    """A router whose logits are its input (8 experts in 4 groups of 2, 2 groups kept, top-2)
    and one token where group 1 {2, 3} and group 2 {4, 5} are close: group 2 holds the best
    expert (0.95) but the lower top-2 sum (1.25 against 1.32)."""
    config = preset(
        "tiny-deepseek-v3", hidden_size=8, num_experts=8, n_group=4, topk_group=2,
        num_experts_per_tok=2, routed_scaling_factor=1.0,
    )  # fmt: skip
    ours, hf = _routers(config)
    with torch.no_grad():
        for router in (ours, hf):
            router.weight.copy_(torch.eye(8))
            router.e_score_correction_bias.zero_()
    scores = torch.tensor([[0.90, 0.60, 0.70, 0.62, 0.95, 0.30, 0.10, 0.10]])
    return ours, hf, torch.log(scores / (1 - scores))  # logit: sigmoid gives the scores back


def test_a_bias_that_flips_a_groups_top2_sum_changes_the_choice_as_transformers():
    """Expert 5's bias raises group 2's top-2 sum past group 1's. Swept four float32 steps of
    the group scores each side of the tie, ours picks what transformers picks at every step,
    exactly, and the pick moves from {0, 2} (groups 0 and 1) to {0, 4} (groups 0 and 2)."""
    ours, hf, x = _at_a_group_tie()
    scores = x.sigmoid()[0]
    tie = float((scores[2] + scores[3]) - (scores[4] + scores[5]))
    group = scores[2] + scores[3]
    step = float(torch.nextafter(group, torch.tensor(2.0)) - group)  # a float32 step of it
    picks = []
    for steps in range(-4, 5):
        bias = tie + steps * step
        with torch.no_grad():
            for router in (ours, hf):
                router.e_score_correction_bias[5] = bias
        routed = ours(x)
        _, weights, experts = hf(x)
        assert torch.equal(routed.experts, experts) and torch.equal(routed.weights, weights)
        picks.append(tuple(sorted(experts[0].tolist())))
    assert picks[0] == (0, 2) and picks[-1] == (0, 4), picks
    # The weights stay the unbiased scores, normalised: the bias only chooses.
    expected = scores[[0, 4]] / (scores[0] + scores[4])
    assert torch.allclose(routed.weights[0].sort().values, expected.sort().values)


def test_group_score_of_the_best_expert_picks_otherwise():
    """The seam the planted bug uses (`Router.group_score`): scoring a group by its best
    expert, as DeepSeek-V2 does, keeps group 2 without any bias, where V3 keeps group 1."""
    ours, hf, x = _at_a_group_tie()
    assert sorted(hf(x)[2][0].tolist()) == sorted(ours(x).experts[0].tolist()) == [0, 2]
    ours.group_score = max_group_scores
    assert sorted(ours(x).experts[0].tolist()) == [0, 4]


def test_a_replay_judges_a_flip_of_groups_on_the_group_scores():
    """Two stacks a hair apart at the group tie keep different groups: the replay explains
    the flip by the group scores' difference (no problem); a candidate scoring groups by
    their best expert is refused, its group scores named."""
    baseline, _, x = _at_a_group_tie()
    candidate, _, _ = _at_a_group_tie()
    scores = x.sigmoid()[0]
    tie = float((scores[2] + scores[3]) - (scores[4] + scores[5]))
    group = scores[2] + scores[3]
    step = float(torch.nextafter(group, torch.tensor(2.0)) - group)
    with torch.no_grad():
        baseline.e_score_correction_bias[5] = tie + 2 * step  # keeps groups 0 and 2
        candidate.e_score_correction_bias[5] = tie - 2 * step  # keeps groups 0 and 1
    tape = RoutingTape()
    attach_routing_tape(baseline, tape)
    assert sorted(baseline(x).experts[0].tolist()) == [0, 4]
    replay = tape.replay()
    attach_routing_tape(candidate, replay)
    assert sorted(candidate(x).experts[0].tolist()) == [0, 4]  # the baseline's
    result = replay.result()
    assert len(result.swaps) == 1 and result.problems() == []
    swap = result.swaps[0]
    assert 0 <= swap.gap <= swap.drift < 1e-6  # judged on the group scores, not the experts'
    wrong = tape.replay()
    candidate.group_score = max_group_scores
    attach_routing_tape(candidate, wrong)
    candidate(x)
    assert any("(its group scores)" in p for p in wrong.result().problems())


# ---------------------------------------------------------------------- config
def test_published_configs_read_as_the_presets():
    assert config_from_hf(MOONLIGHT) == preset("moonlight-16b-a3b")
    published = dict(DEEPSEEK_V3)  # its num_nextn_predict_layers = 1 is the preset's
    assert published["num_nextn_predict_layers"] == 1
    published.pop("quantization_config")  # describes the checkpoint's files, not the model
    assert config_from_hf(published) == preset("deepseek-v3")


def test_fields_left_out_take_transformers_defaults():
    """A config.json that leaves routing fields out means transformers' defaults (8 groups,
    4 kept, normalised, times 2.5, 3 dense layers, interleaved rotary), not ours."""
    config = config_from_hf({"model_type": "deepseek_v3", "num_hidden_layers": 4})
    hf = transformers.AutoConfig.for_model("deepseek_v3", num_hidden_layers=4)
    assert (config.n_group, config.topk_group, config.norm_topk_prob) == (8, 4, True)
    assert config.routed_scaling_factor == hf.routed_scaling_factor == 2.5
    assert config.first_k_dense_replace == hf.first_k_dense_replace == 3
    assert config.rope_interleave is hf.rope_interleave is True
    assert (config.num_experts, config.q_lora_rank) == (hf.n_routed_experts, hf.q_lora_rank)
    assert config.expert_bias and config.topk_method == "noaux_tc"


def test_our_config_json_round_trips():
    for name in ("tiny-deepseek-v3", "mid-deepseek-v3", "deepseek-v3"):
        config = preset(name)
        assert config_from_hf(config_to_hf(config)) == config
    hf = transformers.AutoConfig.for_model(**config_to_hf(preset("tiny-deepseek-v3")))
    assert hf.num_nextn_predict_layers == 0  # transformers' default is one MTP layer


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"num_nextn_predict_layers": -1}, r"num_nextn_predict_layers = -1 .*integer >= 0"),
        ({"scoring_func": "softmax"}, r"scoring_func = 'softmax'.*'sigmoid'"),
        ({"topk_method": "greedy"}, r"topk_method = 'greedy'.*'noaux_tc'"),
        ({"moe_layer_freq": 2}, r"moe_layer_freq = 2"),
        ({"n_group": 64}, r"n_group=64.*at least 2"),
    ],
)
def test_what_twinpipe_does_not_compute_is_refused_by_name(change, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf({**MOONLIGHT, **change})


def test_the_expert_bias_is_part_of_the_model():
    """A V3 config always routes on its bias; ``expert_bias_rate = 0`` keeps it fixed."""
    with pytest.raises(ValueError, match=r"expert_bias=False.*always on.*expert_bias_rate"):
        preset("tiny-deepseek-v3", expert_bias=False)
    frozen = preset("tiny-deepseek-v3", expert_bias_rate=0.0).balancing()
    assert frozen.expert_bias and frozen.bias_rate == 0.0
    assert preset("tiny-deepseek-v3").balancing().bias_rate == 1e-3
    with pytest.raises(ValueError, match=r"topk_method='noaux_tc'"):
        preset("tiny-deepseek-v2", topk_method="noaux_tc")
