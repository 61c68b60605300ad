"""The estimator with DeepSeek-V3's MTP layer (`models.network.mtp`): on pp-rank 0 (the loss
stage) its parameters, gradients and optimizer state, and each depth's activations; its
MoE all-to-all counted like any MoE layer's, its parameters off FSDP2 all-reduced."""

from __future__ import annotations

import pytest
import torch

from models.network import CausalLM, preset
from optimized.estimator import EstimateConfig, estimate
from optimized.estimator.activations import mtp_depth_saved
from optimized.estimator.communication import predict_traffic


def _config(depths: int, **fields) -> EstimateConfig:
    model = preset("tiny-deepseek-v3", num_mtp_layers=depths)
    return EstimateConfig(model, num_microbatches=2 * fields.get("pp", 1), seq_len=32, **fields)


def _mtp_numel() -> int:
    """The MTP layer's parameters as our model builds them (layer 4 of tiny-deepseek-v3)."""
    with torch.device("meta"):
        model = CausalLM(preset("tiny-deepseek-v3", num_mtp_layers=1))
    return sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.layers.4."))


def test_memory_moves_by_the_mtp_layer_on_pp_rank_0_only():
    """Weights and gradients by the layer's parameters exactly, AdamW's two moments at least
    twice that; the loss forward's rise by at most a depth's saved tensors (eh_proj's
    [tokens, 2H] input, the decoder layer, the shared head's norm) and its head's kept
    state; the other rank unmoved."""
    plain, mtp = estimate(_config(0, pp=2)), estimate(_config(1, pp=2))
    numel = _mtp_numel()
    zero, one = plain["ranks"][0], mtp["ranks"][0]
    assert one["weights_bytes"] - zero["weights_bytes"] == numel * 4
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
    (5 calls: the counts, dispatch and combine, and their backwards); pp-rank 1 none more;
    the MTP layer's gradients are all-reduced over DP (off FSDP2)."""
    fields = dict(pp=2, dp=2, ep=2, fsdp=fsdp)
    for rank, more in ((0, 1), (2, 0)):
        plain = predict_traffic(_config(0, **fields), rank)
        mtp = predict_traffic(_config(1, **fields), rank)
        calls = mtp[("all_to_all", "ep")].calls - plain[("all_to_all", "ep")].calls
        assert calls == more * 5 * 4, rank
        reduced = mtp[("all_reduce", "dp")].sent - plain[("all_reduce", "dp")].sent
        assert (reduced > 0) == bool(more), rank


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
