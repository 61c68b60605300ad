"""Parameter buckets, bytes, MoE patterns, MLA, MTP, sharding, the walk and the CLI."""

import dataclasses
import json

import pytest

from harness.cli import main as cli_main
from models.hf import config_to_hf
from models.network import CausalLM, preset
from optimized.estimator import EstimateConfig, compute_weight_and_optimizer_memory, estimate
from optimized.estimator.params import attention_params, layer_params, model_params, shard
from optimized.estimator.schedule import walk


def cfg(name="tiny-qwen3-moe", **fields):
    fields.setdefault("num_microbatches", 2 * fields.get("pp", 1))
    fields.setdefault("seq_len", 64)
    return EstimateConfig(preset(name), **fields)


def test_qwen_layer_buckets_by_hand():
    # norms 2*64 + q/k norm 2*16 + router 8*64; q,o 64*64, k,v 64*32; experts 8*(2*32*64+64*32)
    count = layer_params(cfg(), 0)
    assert count.numel == {"tensor_sharded": 12288, "replicated": 672, "routed_experts": 49152}
    assert model_params(cfg()).total == 2 * 512 * 64 + 64 + 4 * (12288 + 672 + 49152)


@pytest.mark.parametrize(
    "name", ["tiny-deepseek-v2", "tiny-deepseek-v3", "tiny-gpt-oss", "tiny-qwen3-moe"]
)
def test_total_matches_built_model(name):
    model = CausalLM(preset(name))
    assert model_params(cfg(name)).total == sum(p.numel() for p in model.parameters())


def test_published_totals():
    assert model_params(cfg("deepseek-v2-lite")).total == 15_706_484_224
    assert model_params(cfg("gpt-oss-20b")).total == 20_914_757_184
    assert model_params(cfg("qwen3-30b-a3b")).total == 30_532_122_624
    # Counted by transformers on the meta device (DeepSeek-V3 without its MTP module), and
    # its MTP layer (the preset's, as published) counted by our model built on the meta device.
    assert model_params(cfg("deepseek-v3", num_mtp_layers=0)).total == 671_026_404_352
    assert model_params(cfg("deepseek-v3")).total == 671_026_404_352 + 11_610_067_968
    assert model_params(cfg("moonlight-16b-a3b")).total == 15_960_108_544


def test_active_params():
    report = estimate(cfg())
    routed = report["params"]["buckets"]["routed_experts"]
    assert report["params"]["active"] == report["params"]["total"] - routed * (1 - 2 / 8)


def test_mla_by_hand():
    # q 64*4*24, kv_a 64*(32+8), kv_b 32*4*(16+16), o 4*16*64; kv_a_layernorm 32
    count = attention_params(preset("tiny-deepseek-v2"))
    assert count.numel["tensor_sharded"] == 6144 + 2560 + 4096 + 4096
    assert count.numel["replicated"] == 32
    lora = attention_params(preset("tiny-deepseek-v2", q_lora_rank=16))
    assert lora.numel["tensor_sharded"] == 64 * 16 + 16 * 96 + 2560 + 4096 + 4096
    assert lora.numel["replicated"] == 48


def test_mtp_adds_a_block():
    base = model_params(cfg("tiny-deepseek-v2")).total
    one = model_params(cfg("tiny-deepseek-v2", num_mtp_layers=1)).total
    moe_layer = layer_params(cfg("tiny-deepseek-v2"), 1).total
    assert one - base == 3 * 64 + 2 * 64 * 64 + moe_layer


def test_moe_pattern_int_and_list():
    dense_mlp = 3 * 64 * 128
    every_other = cfg(moe_layer_pattern=2)
    assert every_other.moe_layers() == [True, False, True, False]
    listed = cfg(moe_layer_pattern=[0, 1, 1, 0])
    assert listed.moe_layers() == [False, True, True, False]
    assert layer_params(listed, 0).numel["tensor_sharded"] == 12288 + dense_mlp
    assert layer_params(listed, 1).numel["routed_experts"] == 49152
    with pytest.raises(TypeError):
        cfg(moe_layer_pattern="every").moe_layers()
    with pytest.raises(ValueError, match="moe_layer_pattern"):
        cfg(moe_layer_pattern=[1, 0])


def test_dense_model_positive():
    report = estimate(cfg(moe_layer_pattern=[0, 0, 0, 0]))
    assert report["params"]["buckets"]["routed_experts"] == 0
    assert all(rank["peak_bytes"] > 0 for rank in report["ranks"])


def test_ep_and_etp_shard_routed_experts():
    one = estimate(cfg(dp=2))["ranks"][0]["params"]["routed_experts"]
    two = estimate(cfg(dp=2, ep=2))["ranks"][0]["params"]["routed_experts"]
    assert two == one // 2 == 4 * 49152 // 2
    etp = estimate(cfg(dp=2, ep=2, etp=2, tp=2))["ranks"][0]["params"]
    assert etp["routed_experts"] == 4 * 49152 // 4
    assert etp["tensor_sharded"] == (4 * 12288 + 2 * 512 * 64) // 2


def test_optimizer_bytes_exact_and_sharding():
    config = cfg()
    count = model_params(config)
    expected = count.total * 8 + 4 * count.num_tensors  # fp32 AdamW moments + step per tensor
    assert estimate(config)["ranks"][0]["optimizer_bytes"] == expected
    previous = None
    for dp in (1, 2, 4):
        value = compute_weight_and_optimizer_memory(cfg(dp=dp, shard_optimizer=True))
        assert previous is None or value < previous
        previous = value


def test_expert_dp_group():
    config = cfg(pp=2, dp=4, ep=2, shard_optimizer=True)
    assert config.world_size == 8 and config.expert_dp == 2
    rank = estimate(config)["ranks"][1]
    dense = rank["params"]["tensor_sharded"] + rank["params"]["replicated"]
    experts = rank["params"]["routed_experts"]
    tensors = 2 * 11  # per layer: 2 norms, q/k/v/o, q/k norms, router, 2 expert tensors
    assert rank["optimizer_bytes"] == -(-dense // 4) * 8 + -(-experts // 2) * 8 + 4 * tensors


@pytest.mark.parametrize(
    "fields,field",
    [
        ({"dp": 3, "ep": 2}, "ep"),
        ({"dp": 16, "ep": 16}, "ep"),
        ({"pp": 2, "num_microbatches": 3}, "num_microbatches"),
        ({"pp": 3, "num_microbatches": 6}, "pp"),
        ({"layers_per_stage": [1, 2]}, "layers_per_stage"),
        ({"dtype": "int8"}, "dtype"),
    ],
)
def test_impossible_layouts_name_the_field(fields, field):
    with pytest.raises(ValueError, match=rf"EstimateConfig\.{field}="):
        cfg(**fields)


@pytest.mark.parametrize("pp,m", [(1, 2), (2, 4), (4, 8), (4, 16)])
def test_walk_runs_each_micro_batch_once(pp, m):
    for rank in range(pp):
        steps = list(walk(rank, pp, m))
        assert steps[-1].in_flight == (0, 0)
        assert max(sum(s.in_flight) for s in steps) <= 2 * pp + 1


def test_cli_json_and_errors(capsys):
    assert cli_main(["estimate", "--model", "tiny-qwen3-moe", "--pp", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["params"]["total"] > report["params"]["active"] > 0
    assert len(report["ranks"]) == 2 and report["ranks"][0]["peak_bytes"] > 0
    assert cli_main(["estimate", "--model", "tiny-qwen3-moe", "--dp", "3", "--ep", "2"]) == 2
    assert "ep=2" in capsys.readouterr().err


def test_hf_config_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config_to_hf(preset("tiny-gpt-oss"))))
    assert cli_main(["estimate", "--model", str(path), "--pp", "2"]) == 0


def test_fsdp_shards_weights_and_gradients_by_hand():
    from optimized.estimator.memory import (
        head_weight_numel,
        layer_profile,
        rank_params,
        static_bytes,
    )

    # tiny-qwen3-moe at PP=1: routed experts 4 * 49,152 = 196,608, of which an EP=2 rank
    # holds half; everything else 314,048 - 196,608 = 117,440, the output layer
    # (512 * 64 = 32,768) included, is split over the 2 DP ranks.
    def bytes_for(fsdp, ep=2):  # parameters resharded after forward: the shards alone
        config = cfg(pp=1, dp=2, ep=ep, fsdp=fsdp, reshard_after_forward=True)
        stages = (0, 1)
        partition = [range(0, 2), range(2, 4)]
        count = rank_params(config, stages, partition)
        return static_bytes(config, count)

    _, weights, gradients, optimizer = bytes_for(False)
    assert weights == gradients == 4 * (117_440 + 98_304)
    _, weights, gradients, fsdp_optimizer = bytes_for(True)
    assert weights == gradients == 4 * (117_440 // 2 + 98_304)
    # Optimizer state: everything non-expert over DP=2, experts over their expert-DP group
    # (world 2 / EP 2 = 1), two float32 moments each, plus a float32 step per tensor.
    assert fsdp_optimizer == 8 * (117_440 // 2 + 98_304) + 4 * count_tensors()
    assert fsdp_optimizer < optimizer
    # EP=1: each rank holds all 196,608 expert weights, FSDP2 splits them over the 2 replicas.
    _, weights, gradients, _ = bytes_for(True, ep=1)
    assert weights == gradients == 4 * (117_440 // 2 + 196_608 // 2)
    # A tied output layer stays whole (its 32,768 weights are the embedding's); untied, none.
    model = dataclasses.replace(preset("tiny-qwen3-moe"), tie_word_embeddings=True)
    tied = EstimateConfig(
        model, pp=1, dp=2, ep=2, fsdp=True, num_microbatches=2, seq_len=64,
        reshard_after_forward=True,
    )  # fmt: skip
    assert head_weight_numel(tied, (0, 1)) == 32_768
    assert head_weight_numel(cfg(pp=1, dp=2, ep=2, fsdp=True), (0, 1)) == 0
    count = rank_params(tied, (0, 1), [range(0, 2), range(2, 4)])
    params = shard(count, tied)
    dense = params["tensor_sharded"] + params["replicated"]
    held = -(-(dense - 32_768) // 2) + 32_768 + 98_304
    assert static_bytes(tied, count, 32_768)[1] == 4 * held
    # Per layer, reducing after every micro-batch: the expert gradient over the replicas, the
    # rest over DP. Reducing once per step (the default): whole until the chunk's last backward.
    plain = layer_profile(cfg(pp=1, dp=2, ep=1), 1)
    sharded = layer_profile(cfg(pp=1, dp=2, ep=1, fsdp=True, grad_sync="micro-batch"), 1)
    assert sharded.expert_grad * 2 == plain.expert_grad > 0
    assert sharded.dense_grad * 2 == plain.dense_grad > 0
    accumulated = layer_profile(cfg(pp=1, dp=2, ep=1, fsdp=True), 1)
    assert (accumulated.expert_grad, accumulated.dense_grad) == (
        plain.expert_grad,
        plain.dense_grad,
    )
    # Parameters held gathered from the first forward to the last backward: the whole part's
    # unsharded weights on top of the shards (experts where EP = DP are whole already).
    count = rank_params(cfg(pp=1, dp=2, ep=2), (0, 1), [range(0, 2), range(2, 4)])
    gathered = static_bytes(cfg(pp=1, dp=2, ep=2, fsdp=True, reshard_after_forward=False), count)
    assert gathered[1] == 4 * (117_440 // 2 + 98_304) + 4 * 117_440


def count_tensors():
    from optimized.estimator import rank_params

    config = cfg(pp=1, dp=2, ep=2)
    return rank_params(config, (0, 1), [range(0, 2), range(2, 4)]).num_tensors


def test_estimate_cli_counts_fsdp(capsys):
    args = [
        "estimate",
        "--model",
        "tiny-qwen3-moe",
        "--pp",
        "1",
        "--dp",
        "2",
        "--ep",
        "2",
        "--seq-len",
        "64",
        "--micro-batches",
        "2",
        "--dtype",
        "bfloat16",
        "--json",
    ]
    assert cli_main([*args, "--no-fsdp"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli_main([*args, "--fsdp", "--reshard-after-forward"]) == 0
    resharded = json.loads(capsys.readouterr().out)
    assert resharded["ranks"][0]["weights_bytes"] < plain["ranks"][0]["weights_bytes"]
    # By default (as `twinpipe train`) the part's parameters stay gathered through the step:
    # the shards plus the whole non-expert part, 117,440 bfloat16 values (EP = DP: the
    # experts are whole already).
    assert cli_main([*args, "--fsdp"]) == 0
    sharded = json.loads(capsys.readouterr().out)
    gathered = sharded["ranks"][0]["weights_bytes"] - resharded["ranks"][0]["weights_bytes"]
    assert gathered == 2 * 117_440
    # The trainer's optimizer precision is the default: float32 moments and masters of the
    # bfloat16 parameters, 12 bytes per sharded parameter instead of 4.
    assert (
        cli_main([*args, "--fsdp", "--optimizer-state-dtype", "param", "--no-master-weights"]) == 0
    )
    bf16_state = json.loads(capsys.readouterr().out)["ranks"][0]["optimizer_bytes"]
    tensors = count_tensors()
    assert sharded["ranks"][0]["optimizer_bytes"] - 4 * tensors == 3 * (bf16_state - 4 * tensors)
