"""The estimator with DeepSeek-V3's MTP layer (`models.network.mtp`): on pp-rank 0 (the loss
stage) its parameters, gradients and optimizer state, and each depth's activations; its
MoE all-to-all counted like any MoE layer's; at DP > 1 its FSDP2 units sharded, gathered
and reduced as `optimized.pipeline.sharding` runs them (tests/test_mtp_layouts.py holds the
traffic against a counted run)."""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from models.network import CausalLM, Router, StepBalance, mtp_loss, mtp_step, preset
from optimized.estimator import EstimateConfig, estimate
from optimized.estimator.activations import mtp_depth_saved, mtp_final_norm_saved, mtp_saved
from optimized.estimator.communication import predict_traffic
from optimized.estimator.mtp_memory import optimized_mtp_depth
from optimized.estimator.sharded_step import unit_groups
from reference.ops import ReferenceOps
from tests._memtrack import StorageTracker
from tests._ranks import on_cpu_rank


def _config(depths: int, **fields) -> EstimateConfig:
    model = preset("tiny-deepseek-v3", num_mtp_layers=depths)
    return EstimateConfig(model, num_microbatches=2 * fields.get("pp", 1), seq_len=32, **fields)


def _mtp_numel(experts: bool = True) -> int:
    """The MTP layer's parameters as our model builds them (layer 4 of tiny-deepseek-v3);
    ``experts`` False: without its routed experts."""
    with torch.device("meta"):
        model = CausalLM(preset("tiny-deepseek-v3", num_mtp_layers=1))
    return sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.layers.4.")
               and (experts or ".mlp.experts." not in n))  # fmt: skip


def test_memory_moves_by_the_mtp_layer_on_pp_rank_0_only():
    """Weights by the layer's parameters and buffers (its rotary table and expert bias, 80
    bytes here: as a measured run holds them), gradients by its parameters exactly, AdamW's
    two moments at least twice that; the loss forward's rise by at most a depth's saved
    tensors (eh_proj's [tokens, 2H] input, the decoder layer, the shared head's norm) and
    its head's kept state; the other rank unmoved."""
    plain, mtp = estimate(_config(0, pp=2)), estimate(_config(1, pp=2))
    numel = _mtp_numel()
    zero, one = plain["ranks"][0], mtp["ranks"][0]
    with torch.device("meta"):
        model = CausalLM(preset("tiny-deepseek-v3", num_mtp_layers=1))
    buffers = sum(b.numel() * 4 for n, b in model.named_buffers() if ".layers.4." in n)
    assert buffers == 80
    assert one["weights_bytes"] - zero["weights_bytes"] == numel * 4 + buffers
    assert one["gradients_bytes"] - zero["gradients_bytes"] == numel * 4
    assert one["optimizer_bytes"] - zero["optimizer_bytes"] >= 2 * numel * 4
    assert mtp["params"]["total"] - plain["params"]["total"] == numel
    config = _config(1, pp=2)
    depth = sum(item.nbytes for item in mtp_depth_saved(config))
    assert depth > config.tokens * 2 * 64 * 4  # at least eh_proj's input
    # The loss forward's rise (peak over start of the action) grows, by at most the depth's
    # saved tensors and its head's kept state; the peak by the states and some activations.
    rise = {}
    for name, report in (("plain", plain), ("mtp", mtp)):
        f1 = next(t for t in report["ranks"][0]["timeline"] if t["mark"].endswith(":F1"))
        rise[name] = f1["peak_bytes"] - f1["start_bytes"]
    assert 0 < rise["mtp"] - rise["plain"] <= depth + config.tokens * 64 * 4 * 3
    states = sum(one[k] - zero[k] for k in ("weights_bytes", "gradients_bytes", "optimizer_bytes"))
    assert one["peak_bytes"] - zero["peak_bytes"] > states
    assert one["activation_bytes"] > zero["activation_bytes"]
    for key in ("weights_bytes", "gradients_bytes", "activation_bytes", "peak_bytes"):
        assert mtp["ranks"][1][key] == plain["ranks"][1][key], key


@pytest.mark.parametrize("fsdp", [False, True])
def test_traffic_counts_the_mtp_layers_exchanges(fsdp):
    """At PP2 DP2 EP2 pp-rank 0 exchanges one more MoE layer's all-to-all per micro-batch
    (5 calls: the counts, dispatch and combine, and their backwards); pp-rank 1 none more.
    Plain, the MTP layer's gradients are all-reduced over DP; under FSDP2 its units (the
    non-expert modules: EP = DP keeps the experts whole) are gathered and reduce-scattered
    once a step, and the all-reduce grows only by one more router's expert-bias load."""
    fields = dict(pp=2, dp=2, ep=2, fsdp=fsdp)
    model = preset("tiny-deepseek-v3")
    numel = _mtp_numel(experts=False)
    with torch.device("meta"):
        built = CausalLM(preset("tiny-deepseek-v3", num_mtp_layers=1))
    half_rows = sum(-(-p.shape[0] // 2) * (p.numel() // p.shape[0])
                    for n, p in built.named_parameters()
                    if n.startswith("model.layers.4.") and ".mlp.experts." not in n)  # fmt: skip
    for rank, more in ((0, 1), (2, 0)):
        plain = predict_traffic(_config(0, **fields), rank)
        mtp = predict_traffic(_config(1, **fields), rank)
        calls = mtp[("all_to_all", "ep")].calls - plain[("all_to_all", "ep")].calls
        assert calls == more * 5 * 4, rank
        reduced = mtp[("all_reduce", "dp")].sent - plain[("all_reduce", "dp")].sent
        if not fsdp:
            assert reduced == more * (numel * 4 + model.num_experts * 8), rank  # + bias load
            continue
        assert reduced == more * model.num_experts * 8, rank  # the bias load (int64)
        for kind in ("all_gather", "reduce_scatter"):
            # This rank sends its half of each unit's rows (rounded up), once a step, in
            # float32, and nothing for the experts.
            grew = mtp[(kind, "dp")].sent - plain[(kind, "dp")].sent
            assert grew == more * half_rows * 4, (kind, rank)


def test_fsdp_shards_the_mtp_layer_as_it_runs():
    """PP2 DP2 EP1 with FSDP2 (its defaults: reduced once a step, gathered from the loss
    stage's first forward to its last backward): pp-rank 0's weights grow by the MTP
    layer's half rows (its shard, 1/DP, experts over their 2 replicas too) plus the whole
    layer gathered at the peak, 1.5 x its 514,528 bytes = 771,792; with reshard-after-
    forward by the shard alone. Its gradients are whole at the peak (accumulated until the
    loss stage's last backward), its AdamW moments half (plus a step per tensor), and after
    the step every gradient is this rank's half."""
    numel = _mtp_numel()
    layout = dict(pp=2, dp=2, ep=1, fsdp=True)
    for reshard, gathered in ((False, numel), (True, 0)):
        fields = dict(layout, reshard_after_forward=reshard)
        plain, mtp = estimate(_config(0, **fields)), estimate(_config(1, **fields))
        zero, one = plain["ranks"][0], mtp["ranks"][0]
        grew = one["weights_bytes"] - zero["weights_bytes"] - 80  # its buffers, whole
        assert grew == (numel // 2 + gathered) * 4, reshard
        assert one["gradients_bytes"] - zero["gradients_bytes"] == numel * 4, reshard
        assert one["optimizer_bytes"] - zero["optimizer_bytes"] == 2 * numel // 2 * 4 + 19 * 4
        assert one["all_gradients_bytes"] - zero["all_gradients_bytes"] == numel // 2 * 4
        for key in ("weights_bytes", "gradients_bytes", "activation_bytes", "peak_bytes"):
            assert mtp["ranks"][1][key] == plain["ranks"][1][key], key
    # The FSDP2 unit groups hold the layer: non-expert rows over DP, experts over replicas.
    groups = unit_groups(_config(1, **layout), [0, 3], True)
    assert groups["dense.4"].sharded_grads + groups["experts.4"].sharded_grads == numel // 2 * 4


def test_plan_counts_the_mtp_layer(tmp_path, capsys):
    """`twinpipe plan` of a config.json with D = 1: each layout's pp-rank 0 peak and its
    traffic above the same layout's at D = 0, the other ranks' peaks unmoved (the estimate
    it ranks is the one above)."""
    import json

    from harness.cli import main
    from models.hf import config_to_hf

    layouts = {}
    for depths in (0, 1):
        folder = tmp_path / str(depths)
        folder.mkdir()
        model = preset("tiny-deepseek-v3", num_mtp_layers=depths)
        (folder / "config.json").write_text(json.dumps(config_to_hf(model)))
        argv = ["plan", "--model", str(folder / "config.json"), "--gpus", "4",
                "--gpu-memory", "64MiB", "--seq-len", "32", "--global-batch", "8", "--json",
                "--top", "3"]  # fmt: skip
        capsys.readouterr()
        assert main(argv) == 0
        found = json.loads(capsys.readouterr().out)["layouts"]
        layouts[depths] = {(x["pp"], x["dp"], x["ep"], x["recompute_attention"]): x for x in found}
    common = layouts[0].keys() & layouts[1].keys()
    assert common
    for key in common:
        plain, mtp = layouts[0][key], layouts[1][key]
        first, *rest = mtp["peak_bytes_per_rank"]
        assert first > plain["peak_bytes_per_rank"][0], key  # pp-rank 0: the loss stage
        assert rest == plain["peak_bytes_per_rank"][1:], key
        assert mtp["bytes_sent_per_step"]["total"] > plain["bytes_sent_per_step"]["total"], key


def _mtp_part(ops, depths: int, dtype=torch.float32):
    """The loss stage's MTP as each stack runs it, on a part with the embedding and the head
    (no main layer: the depth's input is a made-up normed state), its router's load kept
    (16 experts)."""
    model = preset("tiny-deepseek-v3", num_mtp_layers=depths)
    torch.manual_seed(0)
    part = CausalLM(model, ops, layers=[], embedding=True, head=True).to(dtype)
    loads = []
    for module in part.modules():
        if isinstance(module, Router):
            module.register_forward_hook(
                lambda _m, _i, out: loads.append(
                    tuple(torch.bincount(out[1].detach().ravel(), minlength=16).tolist())
                )
            )
    ids = torch.randint(0, model.vocab_size, (2, 32))
    labels = torch.randint(0, model.vocab_size, (2, 32))
    step_balance = StepBalance(model.balancing(), model.moe_layers, 16, 1, torch.device("cpu"))
    return model, part, loads, ids, labels, mtp_step(model, labels), step_balance


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_mtp_saved_matches_tracker(dtype):
    """The reference's MTP (`models.network.mtp.mtp_loss`, two depths) keeps what
    `mtp_saved` counts: the final norm's rerun, each depth's inputs, decoder layer, shared head
    norm and log-softmax (a later depth's ``hnorm`` input being the earlier depth's saved
    output), within 4 KiB (the per-depth int64 targets and the loss's scalars)."""
    dt = getattr(torch, dtype)
    model, part, _, ids, labels, step, step_balance = _mtp_part(ReferenceOps(), 2, dt)
    hidden = torch.randn(2, 32, model.hidden_size, dtype=dt, requires_grad=True)
    gc.collect()
    gc.disable()
    tracker = StorageTracker()
    with tracker:
        normed = part.model.norm(hidden)
        out = mtp_loss(part, normed, ids, labels, step, step_balance.micro_batch())
        del normed
    gc.enable()
    config = EstimateConfig(model, micro_batch_size=2, seq_len=32, dtype=dtype, stack="reference")
    counted = sum(item.nbytes for item in mtp_saved(config))
    assert abs(tracker.current - counted) <= 4096, (tracker.current, counted)
    del out


BF16_MISS = (
    "bfloat16: the backward's high point estimated 7,800 to 8,568 bytes above the tracker's "
    "(about one [tokens, H] more than it holds; 2 x 32 tokens, commit of this test); its kept "
    "bytes and forward's high point within 200 bytes, as float32's"
)


@pytest.mark.parametrize(
    "dtype",
    ["float32", pytest.param("bfloat16", marks=pytest.mark.xfail(reason=BF16_MISS, strict=True))],
)
def test_optimized_mtp_depth_matches_tracker(dtype):
    """The optimized stack's MTP (`optimized.pipeline.mtp_stage`, one depth, attention
    recomputed, the fused loss) against `mtp_memory.optimized_mtp_depth` with the depth's
    own routing: what it keeps to the backward, its forward's high point and its backward's
    (a steady micro-batch: the gradients exist), each within 4 KiB."""
    on_cpu_rank(_check_optimized_mtp_depth, dtype)


def _check_optimized_mtp_depth(dtype: str) -> None:
    from optimized.ops import OptimizedOps
    from optimized.pipeline.dualpipev import SummedLinearCrossEntropy
    from optimized.pipeline.mtp_stage import MtpStage

    ops = OptimizedOps(recompute_attention=True)
    dt = getattr(torch, dtype)
    model, part, loads, ids, labels, step, step_balance = _mtp_part(ops, 1, dt)
    stage = MtpStage(part, SummedLinearCrossEntropy())
    for _ in range(2):  # the first makes the gradients
        loads.clear()
        stage.begin(torch.device("cpu"))
        balance = step_balance.micro_batch()
        hidden = torch.randn(2, 32, model.hidden_size, dtype=dt, requires_grad=True)
        gc.collect()
        gc.disable()
        tracker = StorageTracker()
        with tracker:
            objective = stage.objective(hidden, ids, labels, step, balance)
            kept, forward = tracker.current, tracker.peak
            tracker.peak = kept
            objective.backward()
            backward = tracker.peak - kept
        gc.enable()
        del objective
    config = EstimateConfig(
        model, micro_batch_size=2, seq_len=32, dtype=dtype, expert_load=loads[-1]
    )
    depth = optimized_mtp_depth(config)
    h0 = sum(item.nbytes for item in mtp_final_norm_saved(config))
    counted = {
        "kept": h0 + sum(item.nbytes for item in depth.saved),
        "forward": h0 + max(depth.layer_rise, depth.loss_rise),
        "backward": depth.backward_rise,
    }
    measured = {"kept": kept, "forward": forward, "backward": backward}
    misses = {k: (measured[k], counted[k]) for k in counted if abs(measured[k] - counted[k]) > 4096}
    assert not misses, misses


def test_top1_logits_are_made_in_blocks_the_estimator_counts():
    """The optimized top-1 figure makes its logits `top1_rows` tokens at a time: the same
    count as the reference's whole-logits argmax (blocks of 7 tokens over 64 here, the last
    one short), and its high point one block's logits and argmax as
    `mtp_memory.optimized_mtp_depth` counts them; the stage and the estimator take the
    block size from the one `models.network.top1_rows`."""
    on_cpu_rank(_check_top1_blocks)


def _check_top1_blocks() -> None:
    from models.network import top1_correct as whole
    from models.network import top1_rows
    from optimized.estimator import mtp_memory
    from optimized.pipeline import mtp_stage

    assert mtp_memory.top1_rows is mtp_stage.top1_rows is top1_rows
    assert top1_rows(129_280) == 129  # DeepSeek-V3: 33 MB of bf16 logits, not 1 GB
    vocab, hidden_size, tokens = 300, 16, 64
    torch.manual_seed(0)
    weight = torch.randn(vocab, hidden_size)
    hidden = torch.randn(tokens, hidden_size)
    target = torch.randint(0, vocab, (tokens,))
    target[::5] = -100  # ignored positions
    best = (hidden @ weight.t()).argmax(dim=-1)
    target[1::3] = best[1::3]  # some right, so the count is no accident of zeros
    mtp = sys.modules[top1_rows.__module__]  # where its block size lives
    saved, mtp.TOP1_LOGITS = mtp.TOP1_LOGITS, 7 * vocab + 5
    try:
        assert top1_rows(vocab) == 7
        tracker = StorageTracker()
        with tracker:
            got = mtp_stage.top1_correct(hidden, weight, target)
        assert got.item() == whole(hidden @ weight.t(), target).item() > 0
        block = 7 * vocab * 4 + 7 * 8  # one block's float32 logits and its int64 argmax
        assert abs(tracker.peak - block) <= 256, (tracker.peak, block)
    finally:
        mtp.TOP1_LOGITS = saved
