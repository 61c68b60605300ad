"""The trainer's config: TOML, --set, generated flags, precedence, validation, lr_at."""

from __future__ import annotations

import argparse
import io
import itertools
import math

import pytest

from harness.cli import main
from optimized.train import (
    FIELDS,
    TrainConfig,
    add_config_arguments,
    apply_overrides,
    config_from_args,
    config_to_toml,
    load_config,
    lr_at,
    print_config,
    validate_config,
)


def parse(argv: list[str]) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def test_every_field_documented_and_flags_unique():
    assert all(spec.doc for spec in FIELDS), [spec.key for spec in FIELDS if not spec.doc]
    flags = [spec.flag for spec in FIELDS]
    assert len(set(flags)) == len(flags)
    keys = {spec.key for spec in FIELDS}
    for expected in (
        "steps", "seed", "dtype", "model.name", "model.init_from", "data.path", "data.seq_len",
        "data.micro_batch_size", "data.micro_batches", "parallel.pp", "parallel.dp",
        "parallel.ep", "parallel.fsdp", "parallel.nproc", "optim.lr", "optim.min_lr",
        "optim.warmup_steps", "optim.lr_schedule", "optim.weight_decay", "optim.betas",
        "optim.grad_clip", "optim.skip_nonfinite", "checkpoint.dir", "checkpoint.save_every",
        "checkpoint.keep_last", "logging.metrics_file", "logging.tensorboard_dir",
        "logging.log_every",
    ):  # fmt: skip
        assert expected in keys
    assert {"micro-batch-size", "lr", "checkpoint-dir", "model", "data"} <= set(flags)
    assert validate_config(TrainConfig()) is not None
    assert TrainConfig.__slots__ and not hasattr(TrainConfig(), "__dict__")


def test_toml_load_types_and_sections(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        "steps = 50\ndtype = 'bfloat16'\n"
        "[optim]\nlr = 1\nbetas = [0.8, 0.99]\nlr_schedule = 'constant'\n"
        "[parallel]\npp = 2\ndp = 4\nep = 2\nfsdp = false\n"
        "[data]\nmicro_batches = 8\nshuffle = false\n"
    )
    cfg = validate_config(load_config(path))
    assert cfg.steps == 50 and cfg.dtype == "bfloat16"
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)  # TOML int for a float
    assert cfg.optim.betas == (0.8, 0.99) and cfg.optim.lr_schedule == "constant"
    assert (cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.ep) == (2, 4, 2)
    assert cfg.parallel.world_size == 8 and cfg.parallel.use_fsdp is False
    assert cfg.data.micro_batches == 8 and cfg.data.shuffle is False
    assert cfg.optim.weight_decay == TrainConfig().optim.weight_decay  # untouched default


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ("[optim]\nlrr = 1.0\n", r"unknown config key 'optim.lrr' in \[optim\].*optim\.lr\b"),
        ("lr = 1.0\n", r"unknown config key 'lr'.*did you mean 'optim.lr'"),
        (
            "[optimizer]\nlr = 1.0\n",
            r"unknown config section \[optimizer\].*did you mean \[optim\]",
        ),
        ("model = 'tiny-gpt-oss'\n", r"model is a section; write \[model\] with keys name"),
        ("steps = '10'\n", r"config steps = '10' is invalid: expected an integer"),
        ("[data]\nshuffle = 1\n", r"data.shuffle = 1 is invalid: expected a boolean"),
        (
            "[parallel]\nrecompute = 'off'\n",
            r"parallel.recompute = 'off' is invalid: expected a boolean \(true or false\)",
        ),
        ("[optim]\nbetas = [0.9]\n", r"optim.betas = \[0.9\] is invalid: expected a pair"),
        ("steps = 1.5\n", r"steps = 1.5 is invalid"),
        ("steps = \n", r"not valid TOML"),
    ],
)
def test_bad_toml_is_a_value_error_naming_the_key(tmp_path, document, message):
    path = tmp_path / "bad.toml"
    path.write_text(document)
    with pytest.raises(ValueError, match=message):
        load_config(path)


def test_set_overrides_parse_to_field_types():
    cfg = apply_overrides(
        TrainConfig(),
        [
            "steps=7",
            "optim.lr=2e-3",
            "optim.betas=0.5,0.6",
            "data.shuffle=off",
            "parallel.fsdp=on",
            "parallel.nproc=2",
            "checkpoint.dir=/tmp/ckpt",
            "logging.metrics_file=m.jsonl",
        ],
    )
    assert cfg.steps == 7 and cfg.optim.lr == 2e-3 and cfg.optim.betas == (0.5, 0.6)
    assert cfg.data.shuffle is False and cfg.parallel.fsdp is True and cfg.parallel.nproc == 2
    assert cfg.checkpoint.dir == "/tmp/ckpt" and cfg.logging.metrics_file == "m.jsonl"
    cleared = apply_overrides(cfg, ["parallel.fsdp=auto", "parallel.nproc=none", "checkpoint.dir="])
    assert (cleared.parallel.fsdp, cleared.parallel.nproc, cleared.checkpoint.dir) == (None,) * 3
    assert cfg.checkpoint.dir == "/tmp/ckpt"  # overrides return a copy
    for item, message in [
        ("steps=ten", r"config steps = 'ten' is invalid: expected an integer"),
        ("optim.lrr=1", r"unknown config key 'optim.lrr'"),
        ("optim", r"override 'optim' is invalid: expected key=value"),
        ("data.shuffle=maybe", r"data.shuffle = 'maybe' is invalid: expected a boolean"),
        ("optim=1", r"config key 'optim' is a section"),
    ]:
        with pytest.raises(ValueError, match=message):
            apply_overrides(TrainConfig(), [item])


def test_precedence_file_then_set_then_flags(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("seed = 3\n[optim]\nlr = 1e-3\nwarmup_steps = 4\n")
    assert parse(["--config", str(path)]).optim.lr == 1e-3
    with_set = parse(["--config", str(path), "--set", "optim.lr=2e-3"])
    assert with_set.optim.lr == 2e-3
    flagged = parse(["--lr", "3e-3", "--config", str(path), "--set", "optim.lr=2e-3"])
    assert flagged.optim.lr == 3e-3
    # what no later source names keeps the file's value, or the default
    assert flagged.seed == 3 and flagged.optim.warmup_steps == 4
    assert flagged.optim.min_lr == TrainConfig().optim.min_lr
    # flags of every kind
    cfg = parse(
        ["--micro-batch-size", "4", "--no-shuffle", "--fsdp", "off", "--betas", "0.7,0.8"]
        + ["--checkpoint-dir", "ck", "--model", "tiny-qwen3-moe", "--no-skip-nonfinite"]
    )
    assert cfg.data.micro_batch_size == 4 and cfg.data.shuffle is False
    assert cfg.parallel.fsdp is False and cfg.optim.betas == (0.7, 0.8)
    assert cfg.checkpoint.dir == "ck" and cfg.model.name == "tiny-qwen3-moe"
    assert cfg.optim.skip_nonfinite is False


def test_bad_flag_value_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(["--micro-batch-size", "four"])
    assert exit_info.value.code == 2
    assert "--micro-batch-size" in capsys.readouterr().err


def test_bad_recompute_exits_2_naming_the_field_the_value_and_the_choices(capsys):
    assert main(["train", "--set", "parallel.recompute=bogus"]) == 2
    assert "parallel.recompute = 'bogus' is invalid: expected a boolean (true or false)" in (
        capsys.readouterr().err
    )


def test_toml_round_trip_and_print(tmp_path):
    cfg = apply_overrides(
        TrainConfig(),
        ["optim.betas=0.8,0.9", "parallel.fsdp=false", 'checkpoint.dir=out dir/"q"', "steps=9"],
    )
    text = config_to_toml(cfg)
    assert "# nproc = (unset)" in text and "[optim]" in text
    stream = io.StringIO()
    print_config(cfg, stream)
    assert stream.getvalue() == text
    path = tmp_path / "round.toml"
    path.write_text(text)
    assert load_config(path) == cfg


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["steps=0"], r"steps = 0 is invalid: must be >= 1"),
        (["optim.lr=-1"], r"optim.lr = -1.0 is invalid: must be a finite number >= 0"),
        (["optim.lr=nan"], r"optim.lr = nan is invalid"),
        (["optim.min_lr=1.0"], r"optim.min_lr = 1.0 is invalid: must be in \[0, optim.lr"),
        (["optim.lr_schedule=linear"], r"optim.lr_schedule = 'linear'.*cosine, constant"),
        (["optim.betas=0.9,1.0"], r"optim.betas = \(0.9, 1.0\) is invalid: each must be in"),
        (["optim.warmup_steps=500"], r"optim.warmup_steps = 500 is invalid: must be in \[0, st"),
        (["parallel.dp=4", "parallel.ep=3"], r"parallel.ep = 3 is invalid: .*divide parallel.dp"),
        (["parallel.pp=4"], r"data.micro_batches = 4 is invalid: must be >= 2 \* parallel.pp = 8"),
        (["parallel.nproc=3", "parallel.dp=2"], r"parallel.nproc = 3 is invalid: .* = 2"),
        (["dtype=float16"], r"dtype = 'float16' is invalid: must be one of float32, bfloat16"),
        (["model.name=tiny-nothing"], r"model.name = 'tiny-nothing' is invalid: .*tiny-gpt-oss"),
        (["data.path=/no/such/dir"], r"data.path = '/no/such/dir' is invalid"),
        (["logging.log_every=0"], r"logging.log_every = 0 is invalid: must be >= 1"),
        (["checkpoint.keep_last=-1"], r"checkpoint.keep_last = -1 is invalid"),
    ],
)
def test_validation_names_field_value_and_range(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate_config(apply_overrides(TrainConfig(), overrides))


def test_validation_accepts_paths_and_auto_fsdp(tmp_path):
    config_json = tmp_path / "config.json"
    config_json.write_text("{}")
    cfg = apply_overrides(
        TrainConfig(),
        [f"model.name={config_json}", f"data.path={tmp_path}", "parallel.dp=2", "parallel.ep=2"],
    )
    assert validate_config(cfg).parallel.use_fsdp is True  # auto: on when dp > 1
    assert TrainConfig().parallel.use_fsdp is False


def _schedule(**optim) -> TrainConfig:
    cfg = TrainConfig()
    cfg.steps = 110
    for name, value in {"lr": 1.0, "min_lr": 0.1, "warmup_steps": 10, **optim}.items():
        setattr(cfg.optim, name, value)
    return validate_config(cfg)


def test_lr_schedule_values():
    cfg = _schedule()
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(4, cfg) == pytest.approx(0.5)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)  # cosine starts at the peak
    assert lr_at(60, cfg) == pytest.approx(0.55)  # halfway: (lr + min_lr) / 2
    assert lr_at(35, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_at(110, cfg) == pytest.approx(0.1)
    assert lr_at(500, cfg) == pytest.approx(0.1)
    values = [lr_at(step, cfg) for step in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(values))

    constant = _schedule(lr_schedule="constant")
    assert [lr_at(s, constant) for s in (0, 9, 10, 109, 1000)] == pytest.approx(
        [0.1, 1.0, 1.0, 1.0, 1.0]
    )
    no_warmup = _schedule(warmup_steps=0)
    assert lr_at(0, no_warmup) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="step = -1"):
        lr_at(-1, cfg)


def test_the_shipped_example_config_loads():
    import pathlib

    from optimized.train import load_config

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "tiny-deepseek-v2.toml"
    cfg = load_config(path)
    assert cfg.model.name == "tiny-deepseek-v2"
    assert (cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.ep, cfg.parallel.nproc) == (2, 2, 2, 4)
    assert cfg.steps == 200
