"""`twinpipe train` on real corpora's shapes: what megatron-core's ``IndexedDatasetBuilder``
writes, blended and split; held-out evaluation against the single-process oracle at PP 1 and
at PP 2 / DP 2 / EP 2; exact resume of the data position at another layout; WSD extended on
resume only before its decay.

The ranks run the reference stack's runner through the trainer's one seam (as
tests/test_train.py does): the trainer and its data path are the same code.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from _cli import REFERENCE_RUNNER, twinpipe
from test_blend import documents, megatron_prefix

from models.runtime import BadInput, OptimizerConfig, launch
from optimized.data.corpus import held_out
from optimized.train import TrainConfig, apply_overrides, validate_config
from optimized.train.checkpoint_weights import TrainingCheckpointWeights
from optimized.train.cli import _rank_main
from optimized.train.preflight import plan_run
from reference.oracle import Oracle

LOSS_REL = 1e-5
"""float32: a pipeline against the oracle (DESIGN.md's bound)."""


@pytest.fixture(autouse=True)
def _reference_runner(monkeypatch):
    monkeypatch.setenv("TWINPIPE_RUNNER", REFERENCE_RUNNER)
    monkeypatch.delenv("TWINPIPE_FAULT", raising=False)


def oracle_eval(model, folder: Path, spec: str, split: str | None, eval_spec: str | None,
                batches: int, global_batch: int, seed: int = 0) -> float:  # fmt: skip
    """The held-out loss the single-process oracle gives the checkpoint's weights on the
    evaluation's batches (taken from the corpus here, not from the run)."""
    oracle = Oracle(model, TrainingCheckpointWeights(folder), OptimizerConfig(lr=0.0))
    corpus = held_out(spec, eval_spec, split, 16)
    losses = [oracle.forward_backward(x, y) for x, y in corpus.batches(seed, batches, global_batch)]
    return sum(losses) / len(losses)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_train_on_megatron_builder_data_blended_with_held_out_data(tmp_path):
    """Two bare prefixes megatron-core's builder wrote, blended 0.7/0.3 by ``--data``, held
    out by ``--eval-data`` (a third prefix); one rank. The log shows the validation loss and
    the small source's new epochs; the metrics file holds the loss and perplexity at the
    evaluated steps, and the last equals the oracle's on the saved weights; the dashboard's
    training view draws the file."""
    web = megatron_prefix(tmp_path / "web", documents(40, seed=1))
    code = megatron_prefix(tmp_path / "code", documents(2, seed=2))  # 1 to 4 samples
    held = megatron_prefix(tmp_path / "held", documents(20, seed=3))
    blend = f"0.7 {web} 0.3 {code}"
    run = twinpipe(
        "train", "--model", "tiny-deepseek-v2", "--data", blend, "--eval-data", held,
        "--eval-every", "2", "--eval-batches", "2", "--steps", "4", "--seq-len", "16",
        "--micro-batch-size", "2", "--micro-batches", "2", "--warmup-steps", "1",
        "--device", "cpu", "--metrics-file", str(tmp_path / "m.jsonl"),
        "--checkpoint-dir", str(tmp_path / "ckpt"), TWINPIPE_RUNNER=REFERENCE_RUNNER,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "validation-loss" in run.stdout and "validation-perplexity" in run.stdout
    assert f"data: {code} ran out after epoch 1 of its" in run.stdout, run.stdout
    logged = {r["step"]: r for r in records(tmp_path / "m.jsonl")}
    assert [s for s, r in logged.items() if r["validation_loss"] is not None] == [2, 4]
    last = logged[4]
    assert last["validation_perplexity"] == pytest.approx(math.exp(last["validation_loss"]))
    cfg = validate_config(apply_overrides(TrainConfig(), ["model.name=tiny-deepseek-v2"]))
    model = plan_run(cfg).model
    want = oracle_eval(model, tmp_path / "ckpt" / "step-00000004", blend, None, held, 2, 4)
    assert abs(last["validation_loss"] - want) <= LOSS_REL * want, (last, want)

    from harness.cli import main  # the dashboard's training view of the metrics file

    (tmp_path / "history").mkdir()
    site, metrics = tmp_path / "site", str(tmp_path / "m.jsonl")
    argv = ["dashboard", str(tmp_path / "history"), "--out", str(site), "--no-results"]
    assert main([*argv, "--training", str(tmp_path / "none.jsonl")]) == 2
    assert main([*argv, "--training", metrics]) == 0
    page = (site / "index.html").read_text()
    assert "Training runs" in page and f"{last['validation_loss']:.4f}" in page
    assert (site / "training-0-m-jsonl.png").stat().st_size > 0


def config(*overrides: str) -> TrainConfig:
    base = [
        "model.name=tiny-deepseek-v2", "data.seq_len=16", "data.micro_batch_size=1",
        "optim.warmup_steps=0", "optim.lr=3e-3", "optim.min_lr=3e-4", "optim.lr_schedule=wsd",
        "optim.decay_fraction=0.5", "moe.expert_bias=true", "moe.expert_bias_rate=0.01",
        "data.split=80,20", "data.eval_batches=2",
    ]  # fmt: skip
    return validate_config(apply_overrides(TrainConfig(), base + list(overrides)))


def train(cfg: TrainConfig) -> dict:
    return launch(_rank_main, cfg.parallel.world_size, (cfg,))[0]


@pytest.mark.slow
def test_held_out_loss_and_resume_at_another_layout(tmp_path):
    """One corpus of 60 documents, ``--split 80,20``, WSD decaying over the last half:

    - A: 4 steps at PP 1 (M 8), evaluating after every step;
    - B: the same run's first 2 steps, evaluating only at its end, saved;
    - C: B resumed to 4 steps at PP 2 / DP 2 / EP 2 (M 4 per DP rank), evaluating each step.

    B's steps are A's bit for bit, expert load included (an evaluation moves no weight, no
    expert bias and counts no load); B + C read A's global batches (their digests, nothing
    repeated or skipped) to the same losses; A's and C's held-out losses agree, and each
    run's last one equals the oracle's on that run's saved weights. Raising B's decay
    before extending it is refused, and so is resuming B with another seed (its data
    position would not fit), both before any rank starts."""
    data = megatron_prefix(tmp_path / "corpus", documents(60, seed=4))
    spec = f"data.path={data}"
    one = ("data.micro_batches=8",)
    a = train(config(spec, *one, "steps=4", "data.eval_every=1", f"checkpoint.dir={tmp_path / 'a'}",
                     f"logging.metrics_file={tmp_path / 'a.jsonl'}"))  # fmt: skip
    b = train(config(spec, *one, "steps=2", f"checkpoint.dir={tmp_path / 'b'}",
                     f"logging.metrics_file={tmp_path / 'b.jsonl'}"))  # fmt: skip
    assert a["losses"][:2] == b["losses"] and list(b["eval_losses"]) == [2]
    load = [r["expert_load"] for r in records(tmp_path / "a.jsonl")[:2]]
    assert load == [r["expert_load"] for r in records(tmp_path / "b.jsonl")]
    assert a["eval_losses"][2] == b["eval_losses"][2]

    with pytest.raises(BadInput, match="step 2 ran at lr"):  # a decay over all 4 steps
        plan_run(config(spec, *one, "steps=4", "optim.decay_fraction=1.0",
                        f"checkpoint.dir={tmp_path / 'b'}"))  # fmt: skip
    with pytest.raises(BadInput, match=r"cannot go on with this data: .* seed = 0, this run's 1"):
        plan_run(config(spec, *one, "steps=4", "seed=1", f"checkpoint.dir={tmp_path / 'b'}"))
    other = ("parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "data.micro_batches=4")
    c = train(config(spec, *other, "steps=4", "data.eval_every=1",
                     f"checkpoint.dir={tmp_path / 'b'}"))  # fmt: skip
    assert c["start"] == 2
    assert b["batch_digests"] + c["batch_digests"] == a["batch_digests"]
    assert len(set(a["batch_digests"])) == 4
    for x, y in zip(b["losses"] + c["losses"], a["losses"], strict=True):
        assert abs(x - y) <= LOSS_REL * y, (b["losses"] + c["losses"], a["losses"])
    for step in (3, 4):
        want = a["eval_losses"][step]
        assert abs(c["eval_losses"][step] - want) <= LOSS_REL * want, (a, c)

    model = plan_run(config(spec, *one, "steps=4")).model
    for run, folder in ((a, tmp_path / "a"), (c, tmp_path / "b")):
        want = oracle_eval(model, folder / "step-00000004", data, "80,20", None, 2, 8)
        assert abs(run["eval_losses"][4] - want) <= LOSS_REL * want, (run["eval_losses"], want)


def test_bad_data_input_exits_2_naming_what_and_where(tmp_path, capsys):
    """Every bad blend, split or evaluation setting stops ``twinpipe train`` with exit code 2
    before any rank starts, naming the key, the entry and what would be valid."""
    from harness.cli import main
    from optimized.data.indexed import SIDECAR_FILE, IndexedWriter
    from optimized.data.preparation import prepare_data
    from optimized.data.tokenizers import ByteTokenizer

    good = megatron_prefix(tmp_path / "good", documents(20, seed=5))
    (tmp_path / "text.txt").write_text("some words to prepare, again and again. " * 40)
    byte = prepare_data([tmp_path / "text.txt"], ByteTokenizer(), tmp_path / "byte",
                        progress=False).out_dir  # fmt: skip
    (tmp_path / "plain").mkdir()
    for name, change in (("other-tokenizer", {"tokenizer": {"kind": "hf", "sha256": "ab" * 32}}),
                         ("other-vocab", {"vocab_size": 300})):  # fmt: skip
        shutil.copytree(byte, tmp_path / name)
        sidecar = tmp_path / name / SIDECAR_FILE
        sidecar.write_text(json.dumps({**json.loads(sidecar.read_text()), **change}))
    with IndexedWriter(tmp_path / "wide", "uint16") as writer:  # ids beyond vocab_size 512
        writer.add_document(np.arange(500, 600))
    cases = [
        (["--data", f"-0.5 {good}"], ["data.path", "the weight -0.5 must be a finite number"]),
        (["--data", f"0 {good} 0 {byte}"], ["data.path", "weights sum to 0"]),
        (["--data", f"x {good}"], ["data.path", "'x' does not exist"]),
        (["--data", f"{good} 0.5"], ["data.path", "'0.5' looks like a weight"]),
        (["--data", f"1 {good} two {byte}"], ["entry 2", "'two' is not a number"]),
        (["--data", f"1 {good} 1 {tmp_path / 'plain'}"],
         ["data.path", "plain", "not a prepared data folder"]),
        (["--data", f"1 {good} 1 {tmp_path / 'none'}"], ["data.path", "none' does not exist"]),
        (["--data", f"{good} {tmp_path / 'wide'}"], ["wide holds token id 599", "= 512"]),
        (["--data", f"{byte} {tmp_path / 'other-tokenizer'}"],
         ["other-tokenizer was tokenized with hf abab", "with byte", "same one"]),
        (["--data", str(byte), "--eval-data", str(tmp_path / "other-vocab")],
         ["data.eval_path", "other-vocab has vocab_size 300", "257"]),
        (["--data", good, "--split", "0,0"], ["data.split = '0,0'", "sum to a positive"]),
        (["--data", good, "--split", "99,x"], ["data.split = '99,x'", "part 2 'x'"]),
        (["--data", good, "--eval-every", "2"], ["data.eval_every = 2", "--eval-data, or --split"]),
        (["--data", good, "--split", "99,1"], ["held-out part", "too few for one sample"]),
    ]  # fmt: skip
    for args, needles in cases:
        code = main(["train", "--seq-len", "16", "--micro-batch-size", "1", "--micro-batches",
                     "2", "--steps", "2", "--model", "tiny-deepseek-v2", *args])  # fmt: skip
        out, err = capsys.readouterr()
        assert code == 2 and "step 0000" not in out, (args, code, out, err)
        assert all(n in err for n in needles) and "Traceback" not in err, (args, err)
