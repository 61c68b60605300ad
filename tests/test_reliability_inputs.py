"""#19, bad input: every probe is refused before any process group starts, through the CLI
as a user calls it, with exit 2 and a message naming the file, the field, the value and
what would be valid. A check that went missing would start real work (ranks, steps), so
each case also asserts that none started: no step line, no rank launched."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.cli import main
from models.hf import save_pretrained
from models.network import build_model, preset
from optimized.data.preparation import prepare_data
from optimized.data.tokenizers import ByteTokenizer
from optimized.train import TrainConfig

TRAIN = ["train", "--seq-len", "16", "--micro-batch-size", "1", "--micro-batches", "2",
         "--steps", "2"]  # fmt: skip
COMPARE = ["compare", "--pp", "1", "--dp", "1", "--ep", "1", "--micro-batches", "2",
           "--micro-batch-size", "1", "--seq-len", "16", "--steps", "1", "--no-memory"]  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Model configs, checkpoints and data folders, each wrong in one way."""
    root = tmp_path_factory.mktemp("inputs")
    save_pretrained(build_model(preset("tiny-deepseek-v2"), seed=0), root / "hf")
    save_pretrained(build_model(preset("tiny-qwen3-moe"), seed=0), root / "hf-qwen")
    weights = root / "hf" / "model.safetensors"
    tensors = load_file(weights)

    def variant(name, change=None, raw=None):
        shutil.copytree(root / "hf", root / name)
        if raw is not None:
            (root / name / "model.safetensors").write_bytes(raw)
        if change is not None:
            changed = dict(tensors)
            change(changed)
            save_file(changed, root / name / "model.safetensors", metadata={"format": "pt"})

    data = weights.read_bytes()
    variant("hf-truncated", raw=data[: len(data) // 2])
    variant("hf-int32", change=lambda t: t.update({"model.norm.weight": torch.ones(64).int()}))
    variant("hf-shape", change=lambda t: t.update({"model.norm.weight": torch.ones(63)}))
    variant("hf-other", raw=(root / "hf-qwen" / "model.safetensors").read_bytes())
    config = json.loads((root / "hf" / "config.json").read_text())
    for name, text in {
        "truncated": json.dumps(config)[:100],
        "list": json.dumps([config]),
        "llama": json.dumps({**config, "model_type": "llama"}),
        "empty": "",
        "no-hidden-size": json.dumps({k: v for k, v in config.items() if k != "hidden_size"}),
        "sigmoid": json.dumps({**config, "scoring_func": "sigmoid"}),
        "noaux": json.dumps({**config, "topk_method": "noaux_tc"}),
        "gelu": json.dumps({**config, "hidden_act": "gelu"}),
        "dropout": json.dumps({**config, "attention_dropout": 0.1}),
    }.items():
        (root / f"{name}.json").write_text(text)
    qwen = json.loads((root / "hf-qwen" / "config.json").read_text())
    aux = {**qwen, "output_router_logits": True, "router_aux_loss_coef": -0.5}
    (root / "qwen-aux.json").write_text(json.dumps(aux))
    (root / "qwen-window.json").write_text(json.dumps({**qwen, "use_sliding_window": True}))
    (root / "no-config").mkdir()
    (root / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    prepare_data([root / "text.txt"], ByteTokenizer(), root / "data", progress=False)
    (root / "one.txt").write_text("x")  # one byte and the end-of-document id
    prepare_data([root / "one.txt"], ByteTokenizer(), root / "data-1", progress=False)
    (root / "data-empty").mkdir()
    (root / "data-old").mkdir()  # the format before Megatron's: tokens.bin + index.json
    (root / "data-old" / "index.json").write_text('{"format": "twinpipe-tokens", "version": 1}')

    class Wide(ByteTokenizer):  # a tokenizer with more ids than the tiny model's 512
        vocab_size = 1000

        def encode(self, text):
            return super().encode(text) + 500  # "z" becomes 622

    prepare_data([root / "text.txt"], Wide(), root / "data-wide", progress=False)
    return root


def refused(argv, capsys, *needles):
    """Run ``argv``; it must exit 2 before any work, naming every needle on stderr."""
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (code, out, err)
    assert "step 0000" not in out and "launching" not in err, out + err
    for needle in needles:
        assert needle in err, (needle, err)
    assert "Traceback" not in err, err
    return err


MODEL_CONFIGS = [
    ("truncated", ["truncated.json", "not valid JSON"]),
    ("list", ["list.json", "JSON list, not an object"]),
    ("llama", ["llama.json", "model_type='llama'", "deepseek_v2"]),
    ("empty", ["empty.json", "is empty"]),
    ("no-hidden-size", ["no-hidden-size.json", "'hidden_size' is missing"]),
    ("no-config", ["no-config", "without a config.json"]),
    ("sigmoid", ["sigmoid.json", "scoring_func = 'sigmoid' is not implemented", "'softmax'"]),
    ("noaux", ["noaux.json", "topk_method = 'noaux_tc' is not implemented"]),
    ("gelu", ["gelu.json", "hidden_act = 'gelu' is not implemented", "'silu'"]),
    ("dropout", ["dropout.json", "attention_dropout = 0.1 is not implemented"]),
    ("qwen-aux", ["qwen-aux.json", "router_aux_loss_coef=-0.5", "expected a float >= 0"]),
    ("qwen-window", ["qwen-window.json", "use_sliding_window = True is not implemented"]),
]


@pytest.mark.parametrize("command", ["train", "compare", "estimate", "plan"])
@pytest.mark.parametrize("name, needles", MODEL_CONFIGS, ids=[c[0] for c in MODEL_CONFIGS])
def test_every_bad_model_config_is_refused_by_every_command(files, capsys, command, name, needles):
    path = files / name if name == "no-config" else files / f"{name}.json"
    argv = {
        "train": [*TRAIN, "--data", str(files / "data")],
        "compare": COMPARE,
        "estimate": ["estimate"],
        "plan": [
            "plan",
            "--gpus",
            "4",
            "--gpu-memory",
            "80GiB",
            "--seq-len",
            "64",
            "--global-batch",
            "8",
        ],
    }[command]
    refused([*argv, "--model", str(path)], capsys, *needles)


CHECKPOINTS = [
    ("hf-truncated", "is truncated"),
    ("hf-int32", "model.norm.weight: expected F32 or BF16 or F16 or F64, found I32"),
    ("hf-shape", "model.norm.weight: expected [64], found [63]"),
    ("hf-other", "does not hold the deepseek_v2 model being run"),
    ("no-config", "without a config.json"),
]


@pytest.mark.parametrize("name, needle", CHECKPOINTS, ids=[c[0] for c in CHECKPOINTS])
def test_bad_checkpoints_are_refused_before_spawning(files, capsys, name, needle):
    ckpt = str(files / name)
    refused([*TRAIN, "--data", str(files / "data"), "--init-from", ckpt], capsys, ckpt, needle)
    refused([*COMPARE, "--checkpoint", ckpt], capsys, ckpt, needle)


def test_a_checkpoint_of_another_family_is_named(files, capsys):
    # --model named: with it unset, the checkpoint's own model would be trained.
    argv = [*TRAIN, "--model", "tiny-deepseek-v2", "--data", str(files / "data")]
    argv += ["--init-from", str(files / "hf-qwen")]
    refused(argv, capsys, "holds a qwen3_moe model, not the deepseek_v2 model")


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--seq-len", "300"], ["data.seq_len = 300", "max_position_embeddings=256"]),
        (["--pp", "3", "--micro-batches", "6"], ["parallel.pp = 3", "4 layers cannot fill"]),
        (["--ep", "3", "--dp", "3"], ["parallel.ep = 3", "num_experts=8"]),
        (["--data-key", "data-empty"], ["data.path", "data-empty", "no twinpipe-data.json"]),
        (["--data-key", "data-old"], ["data.path", "old format", "prepare-data --convert OLD"]),
        (["--data-key", "data-1"], ["data.path", "holds 2 tokens", "fewer than one global batch"]),
        (
            ["--data-key", "data-wide"],
            ["data.path", "beyond the model's vocabulary", "vocab_size = 512"],
        ),  # fmt: skip
        (["--config", "{root}/missing.toml"], ["--config", "missing.toml", "cannot read"]),
        (["--config", "{root}"], ["--config", "is a folder; expected a TOML file"]),
        (["--lr", "nan"], ["optim.lr = nan is invalid", "finite"]),
        (["--warmup-steps", "5"], ["optim.warmup_steps = 5", "or unset for min(10, steps)"]),
    ],
    ids=[
        "seq-len",
        "pp-vs-layers",
        "ep-vs-experts",
        "empty-data",
        "old-data",
        "one-token",
        "vocab",
        "config-missing",
        "config-folder",
        "lr-nan",
        "warmup-too-long",
    ],  # fmt: skip
)
def test_train_refuses_bad_input_in_the_parent(files, capsys, args, needles):
    args = [a.replace("{root}", str(files)) for a in args]
    data = str(files / "data")
    if args[0] == "--data-key":
        data, args = str(files / args[1]), []
    refused([*TRAIN, "--data", data, *args], capsys, *needles)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--lr", "nan"], "--lr=nan is invalid"),
        (["--lr", "0"], "--lr=0.0 is invalid"),
        (["--seed", "-1"], "--seed=-1 is invalid"),
        (["--timeout", "0"], "--timeout=0.0 is invalid"),
        (["--seq-len", "300"], "exceeds max_position_embeddings=256"),
        (["--dtype", "float16"], "dtype='float16' is invalid"),
        (["--baseline", "oracle", "--candidate", "oracle"], "both 'oracle'"),
    ],
)
def test_compare_refuses_bad_input_before_any_rank(capsys, args, needle):
    refused([*COMPARE, *args], capsys, needle)


def test_compare_and_estimate_refuse_more_stages_than_layers(capsys):
    """`--pp 3` on the 4-layer default model, as train refuses it (``pp-vs-layers``)."""
    needle = "pp=3 is invalid: 4 layers cannot fill 2 * pp = 6 stages"
    refused([*COMPARE, "--pp", "3", "--micro-batches", "6"], capsys, needle)
    refused(["estimate", "--model", "tiny-deepseek-v2", "--pp", "3"], capsys, needle)


def test_estimate_and_plan_refuse_a_sequence_beyond_the_positions(capsys):
    err = refused(["estimate", "--model", "tiny-deepseek-v2", "--seq-len", "1000000000"], capsys)
    assert "--seq-len=1000000000 is invalid" in err and "max_position_embeddings=256" in err
    plan = ["plan", "--model", "tiny-deepseek-v2", "--gpus", "2", "--gpu-memory", "1GiB",
            "--global-batch", "4", "--seq-len"]  # fmt: skip
    refused([*plan, "1000000000"], capsys, "--seq-len=1000000000 is invalid")
    # The default is `twinpipe train`'s sequence length, which fits.
    assert main(["estimate", "--model", "tiny-deepseek-v2"]) == 0
    assert f"seq={TrainConfig().data.seq_len} " in capsys.readouterr().out


def test_export_refuses_what_is_no_checkpoint(files, capsys):
    refused(["export", "--checkpoint", str(files / "hf"), "--out", str(files / "x")], capsys,
            "holds no twinpipe checkpoint")  # fmt: skip
    refused(["export", "--checkpoint", str(files / "nope"), "--out", str(files / "x")], capsys,
            "no such checkpoint folder")  # fmt: skip
    assert not (files / "x").exists()
