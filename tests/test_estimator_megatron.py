"""Megatron's figure against Megatron's own unit tests, and our Megatron-named API's meaning.

The configs and numbers below are those of Megatron-LM's
``tests/unit_tests/training/test_weight_and_optimizer_memory.py`` (PR #4687, commit
a7c9e8c) and of Megatron-Bridge's port of it (``tests/unit_tests/training/utils/
test_theoretical_memory_utils.py``, commit 6de1d8b); the tests are written here.
Bridge's later estimator (915e5ff, f43e405) gives other dense figures on the same configs
(3400 and 30600 where Megatron-LM's formula gives 3472 and 31248): not ported as ours,
and why, term for term, in
`test_bridge_later_dense_numbers_differ_by_norms_router_and_context_parallelism`.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from models.network import preset
from optimized.estimator import EstimateConfig, compute_weight_and_optimizer_memory, estimate
from optimized.estimator.megatron import (
    MegatronArgs,
    compute_activation_memory,
    compute_activation_memory_without_sp,
    megatron_args,
    megatron_params,
    megatron_shard,
    report_theoretical_memory,
)
from optimized.estimator.megatron import (
    compute_weight_and_optimizer_memory as megatron_weight_and_optimizer,
)
from optimized.estimator.params import model_params


def megatron_lm_args(**overrides) -> MegatronArgs:
    """Megatron-LM's ``_make_args``: 2 layers (dense, then MoE), 4 experts, hidden 8."""
    fields = dict(
        add_bias_linear=False, data_parallel_size=16, expert_model_parallel_size=2,
        expert_tensor_parallel_size=4, ffn_hidden_size=16, group_query_attention=False,
        hidden_size=8, kv_channels=4, moe_ffn_hidden_size=16, moe_layer_freq=[0, 1],
        moe_router_topk=1, moe_shared_expert_gate=False, moe_shared_expert_intermediate_size=8,
        mtp_num_layers=None, multi_latent_attention=False, normalization="RMSNorm",
        num_attention_heads=2, num_experts=4, num_layers=2, padded_vocab_size=32,
        pipeline_model_parallel_size=1, swiglu=False, tensor_model_parallel_size=2,
        untie_embeddings_and_output_weights=False, use_distributed_optimizer=True, world_size=32,
    )  # fmt: skip
    fields.update(overrides)
    return MegatronArgs(**fields)


def test_megatron_lm_accounts_for_expert_parallelism():
    args = megatron_lm_args(pipeline_model_parallel_size=2, world_size=64)
    # Megatron-LM's expected figure, term for term: TP-sharded, replicated, routed experts.
    tp_sharded = ((256 + 256 + 256 + 128) / 2 + 256) / 2
    replicated = (16 + 16 + 32 + 8) / 2
    routed = 1024 / 2 / (4 * 2)
    # DP = 64 / 2 (TP) / 2 (PP) = 16; expert-DP = 64 / 4 (ETP) / 2 (EP) / 2 (PP) = 4
    expected = (tp_sharded + replicated) * (6 + 12 / 16) + routed * (6 + 12 / 4)
    assert math.isclose(megatron_weight_and_optimizer(args), expected)
    shard = megatron_shard(args)
    assert (shard.tensor_sharded, shard.replicated, shard.routed_experts) == (
        tp_sharded,
        replicated,
        routed,
    )


def test_megatron_lm_decreases_with_tensor_parallelism():
    memories = [
        megatron_weight_and_optimizer(
            megatron_lm_args(
                data_parallel_size=16,
                expert_model_parallel_size=1,
                expert_tensor_parallel_size=1,
                tensor_model_parallel_size=tp,
                use_distributed_optimizer=False,
                world_size=16 * tp,
            )  # fmt: skip
        )
        for tp in (1, 2, 4)
    ]
    assert memories[0] > memories[1] > memories[2]


def test_megatron_lm_decreases_with_expert_parallelism():
    memories = [
        megatron_weight_and_optimizer(
            megatron_lm_args(expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        )
        for ep, etp in ((1, 1), (2, 1), (2, 2), (4, 2))
    ]
    assert memories[0] > memories[1] > memories[2] > memories[3]


def bridge_args(world_size: int = 1, distributed: bool = False, **model) -> MegatronArgs:
    """Megatron-Bridge's ``MockModelConfig`` (LayerNorm, SwiGLU, vocabulary 1024 already a
    multiple of 128) and ``_make_config`` (DP = world / (TP * PP))."""
    fields = dict(
        num_layers=4, hidden_size=128, ffn_hidden_size=512, num_attention_heads=4,
        num_query_groups=4, kv_channels=32, padded_vocab_size=1024, normalization="LayerNorm",
        add_bias_linear=False, swiglu=True, moe_layer_freq=1, moe_router_topk=1,
    )  # fmt: skip
    fields.update(model)
    tp = fields.get("tensor_model_parallel_size", 1)
    pp = fields.get("pipeline_model_parallel_size", 1)
    fields.setdefault("expert_tensor_parallel_size", tp)  # Bridge: ETP None means TP
    return MegatronArgs(
        **fields,
        world_size=world_size,
        data_parallel_size=world_size // (tp * pp),
        use_distributed_optimizer=distributed,
    )


def test_bridge_dense_model_is_positive():
    assert megatron_weight_and_optimizer(bridge_args()) > 0


def test_bridge_expert_parallelism_reduces_routed_experts():
    moe = dict(num_experts=8, moe_ffn_hidden_size=256, moe_router_topk=2,
               tensor_model_parallel_size=2, expert_tensor_parallel_size=1)  # fmt: skip
    one = megatron_weight_and_optimizer(bridge_args(8, expert_model_parallel_size=1, **moe))
    four = megatron_weight_and_optimizer(bridge_args(8, expert_model_parallel_size=4, **moe))
    assert four < one


def test_bridge_distributed_optimizer_scales_with_dp():
    one = megatron_weight_and_optimizer(bridge_args(1, distributed=True))
    eight = megatron_weight_and_optimizer(bridge_args(8, distributed=True))
    assert eight < one


def test_bridge_moe_layer_freq_list():
    moe = dict(num_experts=4, moe_ffn_hidden_size=256)
    some = megatron_weight_and_optimizer(bridge_args(moe_layer_freq=[0, 1, 0, 0], **moe))
    every = megatron_weight_and_optimizer(bridge_args(moe_layer_freq=[1, 1, 1, 1], **moe))
    assert some < every


def test_bridge_invalid_moe_layer_freq_type_raises():
    with pytest.raises(TypeError, match="moe_layer_freq"):
        bridge_args(num_experts=4, moe_ffn_hidden_size=256, moe_layer_freq="every-other")


def test_megatron_untied_output_layer_at_pp1_and_final_norm():
    # The case: DeepSeek-V2-Lite at PP1 EP8 DP8. Megatron adds V * H / TP for the
    # untied output layer at PP = 1, and the final norm; MLA as Megatron counts it equals our
    # count at TP = 1, so the most loaded shard is the whole model with the experts / EP.
    config = EstimateConfig(
        preset("deepseek-v2-lite"), pp=1, dp=8, ep=8, num_microbatches=2, shard_optimizer=True
    )
    args = megatron_args(config)
    shard = megatron_shard(args)
    ours = model_params(config)
    assert shard.total_parameters == ours.total == 15_706_484_224
    routed = ours.numel["routed_experts"]
    assert shard.most_loaded == ours.total - routed + routed / 8
    tied = megatron_shard(dataclasses.replace(args, untie_embeddings_and_output_weights=False))
    assert shard.most_loaded - tied.most_loaded == 102_400 * 2048  # V * H
    # At PP = 2 the output layer sits on the last stage, not the most loaded (first) one.
    two = megatron_shard(dataclasses.replace(args, pipeline_model_parallel_size=2))
    assert two.tensor_sharded < shard.tensor_sharded - 102_400 * 2048 / 2 + 1


def test_megatron_counts_deepseek_v3_as_we_do():
    """DeepSeek-V3 at Megatron's fields (MLA with q_lora, 3 dense layers, a shared expert):
    the same total; the expert bias is a buffer, not a parameter, in both."""
    config = EstimateConfig(preset("deepseek-v3"), pp=8, dp=8, ep=8, num_microbatches=16)
    args = megatron_args(config)
    assert args.multi_latent_attention and args.q_lora_rank == 1536
    assert args.moe_layer_freq == [0] * 3 + [1] * 58
    assert args.mtp_num_layers == 1  # the preset's MTP layer, as published
    # Megatron's count of the MTP block is its decoder layer's: it leaves out eh_proj [H, 2H]
    # and the three norms (enorm, hnorm, the shared head's), which we count.
    left_out = 7168 * 2 * 7168 + 3 * 7168
    assert megatron_shard(args).total_parameters + left_out == model_params(config).total
    plain = EstimateConfig(preset("deepseek-v3", num_mtp_layers=0), pp=8, dp=8, ep=8,
                           num_microbatches=16)  # fmt: skip
    assert megatron_shard(megatron_args(plain)).total_parameters == model_params(plain).total


def test_megatron_mtp_whole_on_the_last_stage_and_of_the_last_layers_kind():
    args = megatron_args(EstimateConfig(preset("tiny-deepseek-v2"), pp=2, num_microbatches=4))
    layer = megatron_params(args)
    plain = megatron_shard(args)
    mtp = megatron_shard(dataclasses.replace(args, mtp_num_layers=2))
    # Whole on the most loaded shard (not divided by PP): two MoE layers as Megatron counts
    # them (the last layer is MoE); TP = EP = 1 leaves every bucket whole.
    assert mtp.mtp_block == 2 * layer.moe_layer()
    assert mtp.most_loaded - plain.most_loaded == 2 * layer.moe_layer()
    # The block takes the last layer's kind: dense when it is, though the others are MoE.
    dense_last = dataclasses.replace(args, moe_layer_freq=[0, 1, 1, 0], mtp_num_layers=1)
    assert megatron_shard(dense_last).mtp_block == layer.dense_layer()
    # Ours follows the same rule.
    config = EstimateConfig(
        preset("tiny-deepseek-v2"), moe_layer_pattern=[0, 1, 1, 0], num_mtp_layers=1,
        num_microbatches=2,
    )  # fmt: skip
    dense = model_params(config.replace(num_mtp_layers=0)).total
    hidden = 64
    mlp = 3 * hidden * 128
    assert (
        model_params(config).numel["routed_experts"]
        == model_params(config.replace(num_mtp_layers=0)).numel["routed_experts"]
    )
    assert model_params(config).total - dense == 3 * hidden + 2 * hidden * hidden + (
        2 * hidden + mlp + layer.attention  # MLA at TP = 1: Megatron's count is ours
    )


def bridge_head_args(**overrides) -> MegatronArgs:
    """Megatron-Bridge's later ``_make_config`` (f43e405): hidden 16, 4 layers, TP2 PP2 DP4,
    micro-batch 2, sequence parallel with selective recompute, LayerNorm, tied embeddings."""
    fields = dict(
        num_layers=4, hidden_size=16, seq_length=8, ffn_hidden_size=64, num_attention_heads=4,
        kv_channels=4, padded_vocab_size=32, tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2, data_parallel_size=4, world_size=16,
        micro_batch_size=2, use_distributed_optimizer=True, sequence_parallel=True,
        recompute_granularity="selective", normalization="LayerNorm", add_bias_linear=False,
        moe_router_topk=1,
    )  # fmt: skip
    fields.update(overrides)
    return MegatronArgs(**fields)


def test_bridge_dense_total_parameters():
    assert megatron_shard(bridge_head_args()).total_parameters == 13088


def test_bridge_routed_experts_over_expert_parallelism():
    # PP1, CP2 (world 32 = TP2 x CP2 x DP8), 8 experts every other layer, EP4: the routed
    # experts' count, per-GPU count and bytes (6 + 12 / expert-DP 8) are Bridge's numbers.
    args = bridge_head_args(
        pipeline_model_parallel_size=1, data_parallel_size=8, world_size=32, num_experts=8,
        moe_layer_freq=2, moe_ffn_hidden_size=32, expert_model_parallel_size=4,
    )  # fmt: skip
    shard = megatron_shard(args)
    assert megatron_params(args).routed_experts * 2 == 16384
    assert shard.routed_experts == 4096
    routed_bytes = megatron_weight_and_optimizer(args) - megatron_weight_and_optimizer(
        dataclasses.replace(args, moe_ffn_hidden_size=0)
    )
    assert routed_bytes == 30720


def test_bridge_later_dense_numbers_differ_by_norms_router_and_context_parallelism():
    """Why Megatron-Bridge's later dense figures are not ours (not ported as ours, on purpose).

    Bridge's mainline never took the PR #4687 port (6de1d8b, on a branch); its estimator
    was rewritten in 915e5ff ("memory estimator breakdown", kept by f43e405, which only adds
    uneven pipeline stages, fields `MegatronArgs` does not have) on the pre-#4687 arithmetic:
    (1) the whole dense count is divided by TP, norms included, where Megatron-LM (and
    Megatron itself) keeps the norms whole on every TP rank; (2) a MoE layer's router is
    not counted; (3) the dense optimizer state is split over DP x CP, where Megatron-LM's
    formula splits it over DP (it has no CP term). Our figure follows Megatron-LM; Bridge's
    numbers are ours with those three changes, term for term."""
    h, layers, tp, pp = 16, 4, 2, 2
    norms = layers * 2 * (2 * h) + 2 * h  # two LayerNorms (weight, bias) a layer, final: 288
    shard = megatron_shard(bridge_head_args())
    assert shard.tensor_sharded == (layers * (1024 + 2048) / pp + 32 * h) / tp == 3328
    assert shard.replicated == norms / pp == 144
    ours, bytes_per_parameter = 3472, 6 + 12 / 4  # DP 4, no CP: 9
    assert shard.tensor_sharded + shard.replicated == ours
    assert megatron_weight_and_optimizer(bridge_head_args()) == ours * bytes_per_parameter == 31248
    # Bridge (test_dense_model_state_estimate_matches_legacy_arithmetic): norms / TP too.
    bridge = shard.tensor_sharded + norms / (pp * tp)
    assert (bridge, bridge * bytes_per_parameter) == (3400, 30600)

    # test_moe_estimate_accounts_for_expert_parallel_sharding: PP1, CP2 (world 32 = TP2 x
    # CP2 x DP8), 8 experts on layers 0 and 2. Bridge: dense 8992 (4496 a GPU, 6.75 bytes
    # each: 6 + 12 / (DP8 x CP2), 30348 bytes); ours: 9248 (the two routers' 2 x 8 x 16
    # more), 4896 a GPU at 6 + 12 / DP8 = 7.5 bytes (36720). The routed experts agree.
    args = bridge_head_args(
        pipeline_model_parallel_size=1, data_parallel_size=8, world_size=32, num_experts=8,
        moe_layer_freq=2, moe_ffn_hidden_size=32, expert_model_parallel_size=4,
    )  # fmt: skip
    shard = megatron_shard(args)
    routers = 2 * 8 * h
    assert shard.total_parameters - megatron_params(args).routed_experts * 2 == 8992 + routers
    assert shard.replicated == norms + routers
    assert shard.tensor_sharded + shard.replicated == 4896
    dense_bytes = megatron_weight_and_optimizer(args) - shard.routed_experts * 7.5
    assert dense_bytes == 4896 * (6 + 12 / 8) == 36720
    bridge = shard.tensor_sharded + norms / tp
    assert (bridge, bridge * (6 + 12 / 16)) == (4496, 30348)
    assert bridge * 6.75 + shard.routed_experts * 7.5 == 61068


def test_bridge_activation_numbers():
    # Bridge divides by CP as well (9568 at CP2); Megatron-LM's formula has no CP term.
    assert (
        compute_activation_memory(
            bridge_head_args(pipeline_model_parallel_size=1), num_microbatches=1
        )
        == 2 * 9568
    )
    vpp = bridge_head_args(virtual_pipeline_model_parallel_size=2)
    assert compute_activation_memory(vpp, num_microbatches=4) == 22240


def test_bridge_report_prints_megabytes(capsys):
    weights, activation, total = report_theoretical_memory(bridge_head_args(), num_microbatches=4)
    out = capsys.readouterr().out
    assert "weight and optimizer=0.03 MB" in out
    assert "activation=0.02 MB" in out and "total=0.05 MB" in out
    assert math.isclose(total, weights + activation)


def test_activation_without_sequence_parallelism_by_hand():
    args = bridge_head_args(pipeline_model_parallel_size=1, sequence_parallel=False)
    s, b, h, v = 8, 2, 16, 32
    layers = s * b * h * (10 + 24 / 2) * 4 + 8 * s * b + s * b * h
    expected = layers + (s * b * v / 2 + s * b * h) * 2
    assert math.isclose(compute_activation_memory_without_sp(args, 1), expected * 1.05)
    captured = report_theoretical_memory(args, 1)
    assert math.isclose(captured[1] * 1024**2, expected * 1.05)


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "qwen3-30b-a3b", "tiny-gpt-oss", "gpt-oss-20b"])
def test_megatron_omissions_are_reproduced(name):
    """Megatron's count leaves out Qwen3's q/k norms, and GPT-OSS's attention biases, sinks
    and expert biases; our count keeps them, the Megatron figure does not."""
    config = EstimateConfig(preset(name), num_microbatches=2)
    m = config.model
    ours = model_params(config).total
    theirs = megatron_shard(megatron_args(config)).total_parameters
    layers = m.num_hidden_layers
    if m.model_type == "qwen3_moe":
        omitted = layers * 2 * m.head_dim
    else:
        q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
        attention_biases = q + 2 * kv + m.hidden_size
        sinks = m.num_attention_heads
        expert_biases = m.num_experts * (2 * m.moe_intermediate_size + m.hidden_size)
        omitted = layers * (attention_biases + sinks + expert_biases)
    assert ours - theirs == omitted


def test_megatron_divides_mla_norms_by_tp():
    config = EstimateConfig(preset("tiny-deepseek-v2", q_lora_rank=16), tp=2, num_microbatches=2)
    args = megatron_args(config)
    one = megatron_shard(dataclasses.replace(args, tensor_model_parallel_size=1))
    two = megatron_shard(args)
    # Everything in the attention term, the lora norms (16 + 32 per layer) included, halves.
    assert one.tensor_sharded - 2 * two.tensor_sharded == 0
    assert one.replicated == two.replicated


def ours(ep: int, etp: int, **fields) -> EstimateConfig:
    model = preset("tiny-qwen3-moe", num_experts=4)
    return EstimateConfig(model, dp=8, ep=ep, etp=etp, num_microbatches=2, seq_len=32, **fields)


def test_our_weight_and_optimizer_memory_has_megatrons_meaning():
    # Weights, every gradient and the optimizer state: it falls as EP and ETP grow (the old
    # figure, the gradients alive at the activation peak only, rose from EP2 to EP2 ETP2).
    memories = [
        compute_weight_and_optimizer_memory(ours(ep, etp))
        for ep, etp in ((1, 1), (2, 1), (2, 2), (4, 2))
    ]
    assert memories[0] > memories[1] > memories[2] > memories[3]
    rank = estimate(ours(2, 1))["ranks"][0]
    assert (
        memories[1] == rank["weights_bytes"] + rank["all_gradients_bytes"] + rank["optimizer_bytes"]
    )


def test_etp_as_megatron_defines_it():
    # EP2 ETP4 and EP4 ETP2 with 4 experts are valid (ep * etp divides the 8 ranks).
    for ep, etp in ((2, 4), (4, 2)):
        config = ours(ep, etp)
        layer = estimate(config)["ranks"][0]["params"]["routed_experts"]
        # EP divides the experts, ETP each one's width: all experts / (ep * etp).
        assert layer == 4 * 4 * 3 * 32 * 64 // (ep * etp)
    from optimized.estimator.memory import layer_profile

    config = ours(2, 2)
    # Gradients of the 2 local experts at half their FFN width: divided by ETP once.
    assert layer_profile(config, 0).expert_grad == 2 * 3 * (32 // 2) * 64 * 4
    with pytest.raises(ValueError, match=r"EstimateConfig\.etp=4 .*ep \* etp = 16"):
        ours(4, 4)
    with pytest.raises(ValueError, match=r"EstimateConfig\.ep=8 .*num_experts=4"):
        ours(8, 1)
    with pytest.raises(ValueError, match=r"EstimateConfig\.etp=3 .*moe_intermediate_size=32"):
        EstimateConfig(preset("tiny-qwen3-moe"), dp=3, etp=3, num_microbatches=2)


@pytest.mark.parametrize(
    "field,value",
    [
        ("context_parallel_size", 2),
        ("virtual_pipeline_model_parallel_size", 2),
        ("moe_latent_size", 16),
    ],
)
def test_megatron_fields_we_do_not_model_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=rf"EstimateConfig\.{field}={value}"):
        EstimateConfig(preset("tiny-qwen3-moe"), num_microbatches=2, **{field: value})


def test_shared_expert_width_independent_of_routed_width():
    base = EstimateConfig(preset("tiny-deepseek-v2"), num_microbatches=2)
    assert base.shared_expert_width == 32  # one shared expert of the routed width
    wide = base.replace(moe_shared_expert_intermediate_size=96)
    moe_layers = sum(base.moe_layers())
    assert model_params(wide).total - model_params(base).total == moe_layers * 3 * 64 * 64
    assert megatron_args(wide).moe_shared_expert_intermediate_size == 96
    peak = estimate(wide)["ranks"][0]["activation_bytes"]
    assert peak > estimate(base)["ranks"][0]["activation_bytes"]


def test_megatron_leaves_the_routing_controls_out(capsys):
    """Megatron's formulas have no router term and count parameters only: the report says
    which of the run's routing controls they leave out, and its figures do not move."""
    from harness.cli import main as cli_main  # noqa: PLC0415

    plain = EstimateConfig(preset("tiny-qwen3-moe"), pp=2, num_microbatches=4, seq_len=64)
    model = preset("tiny-qwen3-moe", aux_loss="pooled", aux_loss_coef=0.01, expert_bias=True)
    ours, theirs = estimate(plain)["megatron"], estimate(plain.replace(model=model))["megatron"]
    assert ours["not_counted"] == [] and len(theirs["not_counted"]) == 3
    assert ours["total_bytes"] == theirs["total_bytes"]
    lite = estimate(EstimateConfig(preset("deepseek-v2-lite"), pp=4, num_microbatches=8))
    assert lite["megatron"]["not_counted"] == [
        "the router tensors the balancing losses keep for backward"
    ]
    argv = ["estimate", "--model", "tiny-qwen3-moe", "--pp", "2", "--expert-bias"]
    assert cli_main(argv) == 0
    assert "do not count: the expert-bias buffers" in capsys.readouterr().out
