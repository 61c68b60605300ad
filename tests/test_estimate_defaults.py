"""`twinpipe estimate` and `twinpipe plan` default to what `twinpipe train` does: the
estimate of a command line is the trainer's run of the same flags, field by field, and
mid-deepseek-v2 at PP1 4 x 4096 tokens is the 13.77 GiB the trainer's defaults make
(13.83 GiB measured on an H100, `GPU.md`)."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from models.network import preset
from optimized.estimator import EstimateConfig, estimate
from optimized.estimator.cli import add_arguments, config_from_args
from optimized.estimator.plan import PlanRequest, layouts
from optimized.train import TrainConfig, apply_overrides

GIB = 1024**3


def from_command_line(*argv: str) -> EstimateConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


def trainer_run(model_name: str, *overrides: str) -> EstimateConfig:
    """What `twinpipe train` with ``overrides`` holds, written out from the trainer's own
    reading of its config (`optimized.train.trainer`): FSDP2 where ``parallel.fsdp`` (unset:
    DP > 1) and DP > 1, `ShardedAdamW` sharded with it and not without, its moments' dtype
    and masters, the batch, dtype, gradient sync, resharding and recomputation."""
    cfg = apply_overrides(TrainConfig(), [f"model.name={model_name}", *overrides])
    par, data, optim = cfg.parallel, cfg.data, cfg.optim
    fsdp = (par.dp > 1 if par.fsdp is None else par.fsdp) and par.dp > 1
    return EstimateConfig(
        preset(model_name), pp=par.pp, dp=par.dp, ep=par.ep,
        micro_batch_size=data.micro_batch_size, seq_len=data.seq_len,
        num_microbatches=data.micro_batches, dtype=cfg.dtype, stack="optimized", fsdp=fsdp,
        shard_optimizer=fsdp, optimizer_state_dtype=optim.state_dtype,
        master_weights=optim.master_weights, grad_sync=par.grad_sync,
        reshard_after_forward=par.reshard_after_forward, recompute=par.recompute,
    )  # fmt: skip


def assert_same(got: EstimateConfig, want: EstimateConfig) -> None:
    for spec in dataclasses.fields(EstimateConfig):
        if spec.compare:
            assert getattr(got, spec.name) == getattr(want, spec.name), spec.name


@pytest.mark.parametrize(
    "flags, overrides",
    [
        ((), ()),
        (("--dp", "2", "--ep", "2"), ("parallel.dp=2", "parallel.ep=2")),
        (("--dp", "2", "--no-fsdp"), ("parallel.dp=2", "parallel.fsdp=false")),
        (("--pp", "2", "--grad-sync", "micro-batch"),
         ("parallel.pp=2", "parallel.grad_sync=micro-batch")),
        (("--dtype", "bfloat16", "--optimizer-state-dtype", "bfloat16", "--no-master-weights",
          "--recompute", "off", "--seq-len", "64", "--micro-batch-size", "3"),
         ("dtype=bfloat16", "optim.state_dtype=bfloat16", "optim.master_weights=false",
          "parallel.recompute=false", "data.seq_len=64", "data.micro_batch_size=3")),
    ],
)  # fmt: skip
def test_estimate_defaults_are_the_trainers(flags, overrides):
    got = from_command_line("--model", "tiny-qwen3-moe", *flags)
    assert_same(got, trainer_run("tiny-qwen3-moe", *overrides))


def test_the_estimators_own_choices_stay_available():
    """torch's AdamW as `twinpipe compare` runs it, and a ZeRO-1 optimizer without FSDP."""
    got = from_command_line("--model", "tiny-qwen3-moe", "--dp", "2", "--no-fsdp",
                            "--shard-optimizer", "--optimizer-state-dtype", "param")  # fmt: skip
    assert got.shard_optimizer and not got.fsdp and got.optimizer_state_dtype == "param"
    # M: the trainer's, raised to the least DualPipeV runs where PP asks for more.
    assert from_command_line("--model", "tiny-qwen3-moe", "--pp", "2").num_microbatches == 4
    assert from_command_line("--model", "qwen3-30b-a3b", "--pp", "4").num_microbatches == 8


def test_mid_deepseek_v2_at_the_gpu_runs_layout_is_the_trainers_13_77_gib():
    argv = ("--model", "mid-deepseek-v2", "--pp", "1", "--dp", "1", "--ep", "1",
            "--micro-batches", "4", "--micro-batch-size", "1", "--seq-len", "4096",
            "--dtype", "bfloat16")  # fmt: skip
    config = from_command_line(*argv)
    peak = max(rank["peak_bytes"] for rank in estimate(config)["ranks"])
    assert peak / GIB == pytest.approx(13.769, abs=0.001)
    # What the old defaults (torch's AdamW: bf16 moments, no masters) said for it.
    old = config.replace(optimizer_state_dtype="param", master_weights=False)
    assert max(r["peak_bytes"] for r in estimate(old)["ranks"]) / GIB == pytest.approx(
        8.400, abs=1e-3
    )


def test_plan_defaults_are_the_trainers():
    request = PlanRequest(preset("tiny-qwen3-moe"), gpus=4, gpu_memory=64 * 1024**2,
                          seq_len=32, global_batch=8)  # fmt: skip
    assert request.dtype == TrainConfig().dtype
    found = layouts(request)
    assert {c.fsdp for c in found} == {True, False}
    for c in found:
        overrides = [f"parallel.pp={c.pp}", f"parallel.dp={c.dp}", f"parallel.ep={c.ep}",
                     f"parallel.fsdp={str(c.fsdp).lower()}",
                     f"parallel.recompute={str(c.recompute).lower()}", "data.seq_len=32",
                     f"data.micro_batch_size={c.micro_batch_size}",
                     f"data.micro_batches={c.num_microbatches}"]  # fmt: skip
        assert_same(c, trainer_run("tiny-qwen3-moe", *overrides))


def test_routing_controls_flow_into_the_estimate(capsys):
    """`twinpipe estimate` and `twinpipe plan` take the trainer's ``[moe]`` routing controls:
    each flag set on the model's config, so the estimate is of the run that trains with
    them (more saved per MoE layer, the bias buffers in the weights); none given: what the
    model's config asks (deepseek-v2-lite's published sequence form); a bad value is refused
    by name with exit 2."""
    from harness.cli import main as cli_main  # noqa: PLC0415

    plain = from_command_line("--model", "tiny-qwen3-moe")
    assert not plain.model.balancing().active
    controlled = from_command_line(
        "--model", "tiny-qwen3-moe", "--aux-loss", "pooled", "--aux-loss-coef", "0.01",
        "--z-loss-coef", "0.001", "--expert-bias", "--expert-bias-rate", "0.01",
    )  # fmt: skip
    controls = controlled.model.balancing()
    assert (controls.aux_form, controls.aux_coef, controls.z_coef) == ("pooled", 0.01, 0.001)
    assert controls.expert_bias and controls.bias_rate == 0.01
    moe_layers, experts = plain.model.moe_layers, plain.model.num_experts
    without, with_controls = estimate(plain)["ranks"][0], estimate(controlled)["ranks"][0]
    assert with_controls["weights_bytes"] - without["weights_bytes"] == moe_layers * experts * 4
    assert with_controls["activation_bytes"] > without["activation_bytes"]
    lite = from_command_line("--model", "deepseek-v2-lite", "--pp", "2")
    assert lite.model.balancing().aux_form == "sequence"
    off = from_command_line("--model", "deepseek-v2-lite", "--pp", "2", "--aux-loss", "none")
    assert not off.model.balancing().aux
    assert cli_main(["estimate", "--model", "tiny-qwen3-moe", "--aux-loss", "pooled"]) == 2
    assert "aux_loss" in capsys.readouterr().err  # no coefficient: Qwen3's tiny preset has 0
    argv = ["plan", "--model", "tiny-qwen3-moe", "--gpus", "2", "--gpu-memory", "64MiB",
            "--seq-len", "32", "--global-batch", "4", "--expert-bias", "--json"]  # fmt: skip
    assert cli_main(argv) == 0
    assert json.loads(capsys.readouterr().out)["fitting"] > 0
