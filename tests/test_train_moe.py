"""`twinpipe train`'s expert balancing: the ``[moe]`` section (read, checked, set on the
model before anything is built), the expert load it shows, the bias it moves, saves,
restores and exports (or, where the family's HF layout has none, says it cannot).

The runs use the reference stack's runner (``TWINPIPE_RUNNER``, as tests/test_train.py
does); the host-sync test (tests/test_host_syncs.py) runs the optimized one with balancing.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from harness.report import load_from_metrics, plot_expert_load
from models.hf import CheckpointWeights, save_pretrained, to_hf_state_dict
from models.network import build_model, build_part, preset, state_buffers
from models.runtime import BadInput, launch
from optimized.train import TrainConfig, apply_overrides, load_config, validate_config
from optimized.train.checkpoint_weights import TrainingCheckpointWeights
from optimized.train.cli import _rank_main
from optimized.train.export import export_checkpoint
from optimized.train.metrics import LoggedScalars
from optimized.train.objective import with_moe
from optimized.train.preflight import plan_run
from tests.test_train import _reference_runner, config  # noqa: F401 - fixture

BIAS = "e_score_correction_bias"


# ------------------------------------------------------------------ the [moe] section
def test_the_moe_section_reads_from_toml_set_and_flags(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[moe]\naux_loss = 'pooled'\naux_loss_coef = 0.01\nexpert_bias = true\n")
    cfg = validate_config(load_config(path))
    assert (cfg.moe.aux_loss, cfg.moe.aux_loss_coef, cfg.moe.expert_bias) == ("pooled", 0.01, True)
    assert (cfg.moe.z_loss_coef, cfg.moe.expert_bias_rate) == (0.0, None)  # the defaults
    cfg = apply_overrides(cfg, ["moe.z_loss_coef=1e-3", "moe.expert_bias=off",
                                "moe.expert_bias_rate=0.01", "moe.aux_loss_coef="])  # fmt: skip
    assert cfg.moe.z_loss_coef == 1e-3 and cfg.moe.expert_bias is False
    assert cfg.moe.expert_bias_rate == 0.01 and cfg.moe.aux_loss_coef is None  # unset again
    with pytest.raises(ValueError, match=r"moe.expert_bias = 'maybe' is invalid: expected a bool"):
        apply_overrides(cfg, ["moe.expert_bias=maybe"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("moe.aux_loss=global", "moe.aux_loss = 'global' is invalid: must be one of auto, none, "
                                "pooled, layer, sequence"),
        ("moe.aux_loss_coef=-1", "moe.aux_loss_coef = -1.0 is invalid: must be a finite number"),
        ("moe.z_loss_coef=nan", "moe.z_loss_coef = nan is invalid"),
        ("moe.expert_bias_rate=-0.1", "moe.expert_bias_rate = -0.1 is invalid: must be a "
                                      "finite number >= 0"),
    ],
)  # fmt: skip
def test_bad_moe_values_name_the_key_the_value_and_what_is_valid(override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        validate_config(apply_overrides(TrainConfig(), [override]))


def test_the_section_is_set_on_the_model_and_checked_against_it():
    """`with_moe` maps each key to its `ModelConfig` field; what this model cannot take is
    `BadInput` naming the ``moe.`` key: a form without a coefficient (tiny Qwen3-MoE's
    config gives none), a coefficient for a loss that is off."""

    def moe(*overrides: str) -> TrainConfig:
        return validate_config(apply_overrides(TrainConfig(), list(overrides)))

    model = with_moe(moe("moe.aux_loss=pooled", "moe.aux_loss_coef=0.05", "moe.z_loss_coef=0.01",
                         "moe.expert_bias=on", "moe.expert_bias_rate=0.02"),
                     preset("tiny-qwen3-moe"))  # fmt: skip
    assert (model.aux_loss, model.aux_loss_coef, model.router_z_loss_coef) == ("pooled", 0.05, 0.01)
    assert (model.expert_bias, model.expert_bias_rate) == (True, 0.02)
    assert model.balancing().pooled
    assert with_moe(moe(), preset("mid-deepseek-v2")).balancing().aux_form == "sequence"  # auto
    with pytest.raises(BadInput, match=r"moe.aux_loss = 'pooled' is invalid without a coef"):
        with_moe(moe("moe.aux_loss=pooled"), preset("tiny-qwen3-moe"))
    with pytest.raises(BadInput, match=r"moe.aux_loss_coef = 0.1 is invalid: moe.aux_loss = "):
        with_moe(moe("moe.aux_loss_coef=0.1"), preset("tiny-qwen3-moe"))
    plan = plan_run(moe("model.name=tiny-deepseek-v2", "moe.expert_bias=on"))
    assert plan.model.expert_bias and plan.model.balancing().expert_bias
    # Unset keys keep the model's own: DeepSeek-V3 routes on its bias; a rate of 0 freezes it.
    v3 = with_moe(moe(), preset("tiny-deepseek-v3"))
    assert (v3.expert_bias, v3.expert_bias_rate) == (True, 1e-3)
    assert with_moe(moe("moe.expert_bias_rate=0"), preset("tiny-deepseek-v3")).expert_bias_rate == 0
    assert not with_moe(moe(), preset("tiny-qwen3-moe")).expert_bias
    with pytest.raises(BadInput, match=r"moe.expert_bias = False.*always on"):
        with_moe(moe("moe.expert_bias=off"), preset("tiny-deepseek-v3"))


def _train_main(capsys, *args: str) -> tuple[int, str, str]:
    """``twinpipe train ARGS`` in this process (the command's own code; tests/test_train.py
    runs it as a subprocess): its exit code, stdout and stderr."""
    from harness.cli import main  # noqa: PLC0415

    capsys.readouterr()
    try:
        code = main(["train", *args])
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def test_a_bad_moe_choice_exits_2_before_any_rank_starts(capsys, monkeypatch):
    def no_rank(*args, **kwargs):
        raise AssertionError("a rank was launched")

    monkeypatch.setattr("models.runtime.launch", no_rank)
    code, out, err = _train_main(capsys, "--model", "tiny-qwen3-moe", "--aux-loss", "layer",
                                 "--steps", "1", "--nproc", "1")  # fmt: skip
    assert code == 2, err
    assert "moe.aux_loss = 'layer' is invalid without a coefficient" in err
    assert "step 00000001" not in out


def test_help_and_print_config_show_the_section(capsys):
    code, out, err = _train_main(capsys, "--set", "moe.expert_bias=true", "--print-config")
    assert code == 0, err
    assert "[moe]" in out and "expert_bias = true" in out
    assert "# aux_loss_coef = (unset)" in out
    _, shown, _ = _train_main(capsys, "--help")
    assert "--expert-bias-rate" in shown and "[moe.expert_bias_rate; default: unset]" in shown


# ------------------------------------------------------------------ pieces
def test_the_logged_values_are_read_in_one_copy_vectors_included():
    values = LoggedScalars().read(torch.tensor(1.5), None, torch.tensor([1.0, 2.0, 3.0]))
    assert values == [1.5, None, [1.0, 2.0, 3.0]]


def test_an_hf_folder_without_a_bias_starts_it_at_zero_and_writing_leaves_it_out(tmp_path):
    """DeepSeek-V2's HF layout has no ``e_score_correction_bias``: a model with the bias on
    reads the folder (its bias zero, every parameter as stored), and writing it back leaves
    the bias out rather than inventing a tensor transformers would not load."""
    plain = preset("tiny-deepseek-v2")
    save_pretrained(build_model(plain), tmp_path / "hf")
    biased = plain.replace(expert_bias=True)
    source = CheckpointWeights(tmp_path / "hf", biased)
    assert not source.holds(f"model.layers.1.mlp.gate.{BIAS}")
    model = build_part(biased, source)
    buffers = state_buffers(model)
    assert len(buffers) == biased.moe_layers and all(b.abs().sum() == 0 for _, b in buffers)
    for name, tensor in build_model(plain).state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert not [n for n in to_hf_state_dict(model.state_dict(), biased) if BIAS in n]


def test_the_load_picture_is_drawn(tmp_path):
    load = [[[9, 1, 7, 0, 3, 2, 2, 0], [4] * 8] for _ in range(5)]
    assert plot_expert_load(load, tmp_path / "load.png", layers=[1, 2], target=1.5)
    assert (tmp_path / "load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not plot_expert_load([], tmp_path / "none.png")


def test_tensorboard_gets_each_layers_figures(tmp_path):
    """A real ``SummaryWriter`` writes the event file; TensorBoard's own reader reads it
    back: each MoE layer's figures, the validation loss and perplexity, each MTP depth's
    loss and accuracy, at the step they belong to."""
    from tensorboard.backend.event_processing.event_accumulator import (  # noqa: PLC0415
        EventAccumulator,
    )

    from optimized.train.metrics import MetricsSink, StepMetrics  # noqa: PLC0415

    cfg = apply_overrides(TrainConfig(), [f"logging.tensorboard_dir={tmp_path / 'tb'}"])
    sink = MetricsSink(cfg, enabled=True)
    assert sink.writer is not None, "TensorBoard is in the test extra: the writer must exist"
    sink.record(StepMetrics(
        3, 5, 0.1, 2.0, 1e-3, 0.5, 100.0, 0, "max-rss", moe_layers=[1, 2],
        expert_load=[[3, 1], [2, 2]], load_max_over_mean=[1.5, 1.0],
        load_max_over_mean_worst=1.5, expert_bias_min=[-0.01, 0.0],
        expert_bias_max=[0.01, 0.0], aux_loss=0.01, validation_loss=2.5,
        validation_perplexity=math.exp(2.5), mtp_loss=[2.75], mtp_accuracy=[0.25],
    ))  # fmt: skip
    sink.close()
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    scalars = {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}
    want = {
        "loss": 2.0, "aux_loss": 0.01, "load_max_over_mean_worst": 1.5,
        "moe/load_max_over_mean/layer_2": 1.0, "moe/expert_bias_min/layer_1": -0.01,
        "moe/expert_bias_max/layer_2": 0.0, "validation_loss": 2.5,
        "validation_perplexity": math.exp(2.5), "mtp/loss/depth_1": 2.75,
        "mtp/accuracy/depth_1": 0.25,
    }  # fmt: skip
    for tag, value in want.items():
        assert tag in scalars, (tag, sorted(scalars))
        (event,) = scalars[tag]
        assert event.step == 3 and event.value == pytest.approx(value, rel=1e-6), (tag, event)
    assert "router_z_loss" not in scalars
    assert {"moe/expert_load/layer_1", "moe/expert_load/layer_2"} <= set(
        events.Tags()["histograms"]
    )
    (histogram,) = events.Histograms("moe/expert_load/layer_1")
    assert histogram.step == 3 and histogram.histogram_value.sum == 4.0  # loads 3 and 1


def _gather_rank() -> dict:
    """PP=2: each rank's part of tiny Qwen3-MoE with a made-up load, gathered and counted."""
    from models.network import StepBalance, build_part  # noqa: PLC0415
    from models.runtime import (  # noqa: PLC0415
        CommunicationCounter,
        ParallelConfig,
        group_names,
        make_layout,
        moe_routers,
        rank_chunks,
    )
    from optimized.train import ExpertLoad  # noqa: PLC0415
    from optimized.train.expert_load import traffic_bytes  # noqa: PLC0415

    config = preset("tiny-qwen3-moe", expert_bias=True, router_z_loss_coef=0.1)
    layout = make_layout(ParallelConfig(pp=2, micro_batches=4, seq_len=16))
    held = sorted(sum(rank_chunks([[0], [1], [2], [3]], layout.pp_rank), []))
    part = build_part(config, build_model(config).state_dict(), layers=held,
                      embedding=layout.pp_rank == 0, head=layout.pp_rank == 0)  # fmt: skip
    balance = StepBalance(config.balancing(), 4, 8, 4, torch.device("cpu"))
    for layer, router in moe_routers(part).items():
        balance.load[layer] = torch.arange(8) * (layer + 1)
        router.e_score_correction_bias.copy_(torch.linspace(-1, 1, 8) * (layer + 1))
    balance.z = torch.tensor(0.25 * (layout.rank + 1))
    load = ExpertLoad.of(_Part(part), layout)
    counter = CommunicationCounter(group_names(layout)).install()
    counter.start()
    figures = load.figures(LoggedScalars().read(load.gather(balance))[0])
    counts = counter.stop()
    counter.remove()
    traffic = {f"{kind}/{group}": (t.calls, t.sent) for (kind, group), t in counts.items()}
    return {"figures": figures, "traffic": traffic, "bytes": traffic_bytes(config)}


class _Part:
    """What `ExpertLoad.of` asks of a runner: its part."""

    def __init__(self, part) -> None:
        self.part = part


@pytest.mark.multiprocess
def test_the_load_of_every_layer_is_gathered_in_one_counted_all_reduce():
    """Layers on two pipeline ranks: every rank gets every layer's load and bias range in
    layer order, and the shares summed, from one all-reduce over the world of
    ``8 x (L x (E + 2) + 2)`` bytes, which the communication counter sees."""
    ranks = launch(_gather_rank, 2)
    for result in ranks:
        figures = result["figures"]
        assert figures["moe_layers"] == [0, 1, 2, 3]
        assert figures["expert_load"] == [[e * (layer + 1) for e in range(8)] for layer in range(4)]
        assert figures["expert_bias_max"] == pytest.approx([1.0, 2.0, 3.0, 4.0])
        assert figures["expert_bias_min"] == pytest.approx([-1.0, -2.0, -3.0, -4.0])
        assert figures["load_max_over_mean"] == pytest.approx([2.0] * 4)  # 7 / mean 3.5
        assert figures["aux_loss"] is None  # off
        assert figures["router_z_loss"] == pytest.approx(0.25 + 0.5)  # both ranks' shares
        assert result["bytes"] == 8 * (4 * (8 + 2) + 2)
        assert result["traffic"] == {"all_reduce/world": (1, result["bytes"])}  # (2 - 1) x bytes


# ------------------------------------------------------------------ runs
def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_pooled_loss_z_loss_and_bias_at_pp2_dp2(tmp_path):
    """tiny Qwen3-MoE, PP=2 DP=2 EP=2, the pooled loss, the router z-loss and the bias, 2
    steps: each record holds every MoE layer's load (every routed copy of the global batch
    counted once: summed over DP, gathered over PP), its max/mean, the two losses and the
    bias's range; the log line shows the worst max/mean; the bias moved once per step; the
    checkpoint holds it; the export leaves it out and says so."""
    metrics = tmp_path / "m.jsonl"
    cfg = config("model.name=tiny-qwen3-moe", "steps=2", "optim.warmup_steps=1",
                 "parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "data.micro_batches=4",
                 "moe.aux_loss=pooled", "moe.aux_loss_coef=0.05", "moe.z_loss_coef=0.01",
                 "moe.expert_bias=true", "moe.expert_bias_rate=0.01",
                 f"logging.metrics_file={metrics}",
                 f"checkpoint.dir={tmp_path / 'ckpt'}")  # fmt: skip
    launch(_rank_main, 4, (cfg,))
    records = _records(metrics)
    copies = 2 * 4 * 1 * 16 * 2  # DP x M x micro-batch x seq_len x top-k
    for record in records:
        assert record["moe_layers"] == [0, 1, 2, 3]
        assert [sum(row) for row in record["expert_load"]] == [copies] * 4
        ratios = [max(row) * 8 / copies for row in record["expert_load"]]
        assert record["load_max_over_mean"] == pytest.approx(ratios)
        assert record["load_max_over_mean_worst"] == pytest.approx(max(ratios))
        assert record["aux_loss"] > 0 and record["router_z_loss"] > 0
        assert math.isfinite(record["loss"])
    # the bias the routers chose with: zero in step 1, one update (+-rate) in step 2
    assert records[0]["expert_bias_min"] == records[0]["expert_bias_max"] == [0.0] * 4
    assert records[1]["expert_bias_min"] == pytest.approx([-0.01] * 4)
    assert records[1]["expert_bias_max"] == pytest.approx([0.01] * 4)
    folder = tmp_path / "ckpt" / "step-00000002"
    source = TrainingCheckpointWeights(folder)
    for layer in range(4):
        name = f"model.layers.{layer}.mlp.gate.{BIAS}"
        assert source.holds(name)
        bias = torch.empty(8)
        source.fill(name, bias)
        steps = bias / 0.01  # two updates of +-rate (or 0 at the mean): whole steps, |2| at most
        assert torch.allclose(steps, steps.round(), atol=1e-4) and steps.abs().max() <= 2 + 1e-4
        assert bias.abs().max() > 0
    with pytest.warns(UserWarning, match=r"expert bias .* of MoE layers 0, 1, 2, 3.*qwen3_moe's "
                                         r"Hugging Face layout has no such tensor"):  # fmt: skip
        report = export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    assert report.dropped == tuple(f"model.layers.{i}.mlp.gate.{BIAS}" for i in range(4))
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert not [name for name in index["weight_map"] if BIAS in name]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sequence_loss_at_pp2_dp2_and_a_skipped_step_moves_no_bias(tmp_path, monkeypatch):
    """tiny DeepSeek-V2, PP=2 DP=2, DeepSeek's sequence loss and the bias, 3 steps, the
    second one's gradients NaN on rank 1 and skipped (``skip_nonfinite``): the bias step 3
    routes with is the one step 2 routed with (the skipped step moved nothing); the dense
    first layer shows no load. A checkpoint without the bias (a run that had it off) then
    starts a bias-on model at zero."""
    metrics = tmp_path / "m.jsonl"
    cfg = config("steps=3", "optim.warmup_steps=1", "parallel.pp=2", "parallel.dp=2",
                 "data.micro_batches=4", "moe.aux_loss=sequence", "moe.aux_loss_coef=0.1",
                 "moe.expert_bias=true", "moe.expert_bias_rate=0.01",
                 "optim.skip_nonfinite=true", f"logging.metrics_file={metrics}")  # fmt: skip
    monkeypatch.setenv("TWINPIPE_FAULT", "nan-grad@1:1")
    losses = launch(_rank_main, 4, (cfg,))[0]["losses"]
    assert losses[1] is None and losses[0] is not None and losses[2] is not None
    records = _records(metrics)
    assert [r["skipped"] for r in records] == [False, True, False]
    assert all(r["moe_layers"] == [1, 2, 3] and r["aux_loss"] > 0 for r in records)
    assert all(r["router_z_loss"] is None for r in records)
    assert records[1]["expert_bias_max"] == pytest.approx([0.01] * 3)  # step 1's update
    assert records[2]["expert_bias_min"] == records[1]["expert_bias_min"]
    assert records[2]["expert_bias_max"] == records[1]["expert_bias_max"]
    steps, layers, load = load_from_metrics(metrics)
    assert steps == [1, 2, 3] and layers == [1, 2, 3] and len(load[0]) == 3


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_training_checkpoint_without_a_bias_starts_it_at_zero(tmp_path):
    """A checkpoint of a run without the bias, resumed (or ``init_from``) with it on: the
    source holds no bias, the model builds with zeros, and the checkpoint passes the
    preflight's check of its tensors."""
    from optimized.train.checkpointing import validate_training_checkpoint  # noqa: PLC0415

    cfg = config("steps=1", "optim.warmup_steps=0", f"checkpoint.dir={tmp_path}")
    launch(_rank_main, 1, (cfg,))
    folder = tmp_path / "step-00000001"
    biased = preset("tiny-deepseek-v2", expert_bias=True)
    validate_training_checkpoint(folder, biased)
    source = TrainingCheckpointWeights(folder)
    assert not source.holds(f"model.layers.1.mlp.gate.{BIAS}")
    model = build_part(biased, source)
    assert [n for n, b in state_buffers(model) if b.abs().sum() == 0] == [
        f"model.layers.{i}.mlp.gate.{BIAS}" for i in (1, 2, 3)
    ]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_deepseek_v3_trains_on_its_own_bias_and_exports_it_in_float32(tmp_path):
    """tiny DeepSeek-V3 with the ``[moe]`` section left alone routes on its native bias and
    moves it (a V3 run needs no flag); the export, cast to bfloat16, writes the trained bias
    under its HF name in float32, equal to the checkpoint's."""
    from safetensors import safe_open  # noqa: PLC0415

    cfg = config("model.name=tiny-deepseek-v3", "steps=2", "optim.warmup_steps=0",
                 f"checkpoint.dir={tmp_path / 'ckpt'}")  # fmt: skip
    launch(_rank_main, 1, (cfg,))
    model = preset("tiny-deepseek-v3")
    source = TrainingCheckpointWeights(tmp_path / "ckpt" / "step-00000002")
    report = export_checkpoint(tmp_path / "ckpt", tmp_path / "hf", "bfloat16")
    assert report.dropped == ()
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    layers = [i for i in range(model.num_hidden_layers) if model.is_moe_layer(i)]
    for layer in layers:
        name = f"model.layers.{layer}.mlp.gate.{BIAS}"
        trained = torch.empty(model.num_experts)
        source.fill(name, trained)
        assert trained.abs().max() > 0, name  # moved by the run
        with safe_open(str(tmp_path / "hf" / index["weight_map"][name]), "pt") as f:
            written = f.get_tensor(name)
        assert written.dtype == torch.float32 and torch.equal(written, trained), name
