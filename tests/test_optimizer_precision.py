"""`ShardedAdamW`'s precision options (``optim.state_dtype``, ``optim.master_weights``): the
blocked float32 update is torch's AdamW bit for bit, 16-bit state resumes exactly and is
saved in its dtype, a resume with other settings says what it converts, bad values are
refused by name, and the estimator counts what the trainer keeps."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from models.hf import resolve_model
from optimized.estimator import EstimateConfig, estimate
from optimized.estimator import memory as estimator_memory
from optimized.train import optimizer as sharded_adamw
from optimized.train.checkpointing import _metadata, precision_changes
from optimized.train.optimizer import ParamShard, _adamw_blocks
from tests.test_train import _reference_runner, config, train  # noqa: F401

LOW_PRECISION = ("dtype=bfloat16", "optim.state_dtype=bfloat16", "optim.master_weights=false")


def test_blocked_update_is_torch_adamw_bit_for_bit(monkeypatch):
    """In float32 the blocked update (blocks of 7 elements here) is torch's AdamW exactly."""
    assert estimator_memory.UPDATE_BLOCK == sharded_adamw.UPDATE_BLOCK
    monkeypatch.setattr(sharded_adamw, "UPDATE_BLOCK", 7)
    generator = torch.Generator().manual_seed(0)
    ours = torch.randn(5, 6, generator=generator)
    theirs = torch.nn.Parameter(ours.clone())
    adamw = torch.optim.AdamW([theirs], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1,
                              foreach=False)  # fmt: skip
    shard = ParamShard("w", torch.nn.Parameter(ours), ours.view(-1), None, 1, 0, 30)
    state = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(30), "exp_avg_sq": torch.zeros(30)}
    for _ in range(3):
        grad = torch.randn(5, 6, generator=generator)
        theirs.grad = grad.clone()
        adamw.step()
        shard.gradient = grad.view(-1).clone()
        state["step"] += 1
        _adamw_blocks(shard, state, 1e-2, 0.9, 0.95, 1e-8, 0.1)
    assert torch.equal(ours, theirs.detach())
    assert torch.equal(state["exp_avg_sq"], adamw.state[theirs]["exp_avg_sq"].view(-1))


@pytest.mark.slow
def test_sixteen_bit_state_resumes_exactly_and_is_saved_in_its_dtype(tmp_path):
    """bf16 moments and no masters at DP=2 FSDP: 3 steps saving each; resumed from step 1,
    steps 2 and 3 repeat bit for bit. The checkpoint holds bf16 moments and no masters, and
    the state a rank holds (the metrics' ``optimizer_state_bytes``) is what the estimator
    counts for these settings."""
    metrics = tmp_path / "m.jsonl"
    folder = tmp_path / "ck"
    common = ("steps=3", "parallel.dp=2", "parallel.ep=2", "checkpoint.save_every=1",
              "checkpoint.keep_last=0", f"checkpoint.dir={folder}") + LOW_PRECISION  # fmt: skip
    whole = train(config(*common, f"logging.metrics_file={metrics}"))[0]["losses"]
    stored = _metadata(folder / "step-00000003")
    moments = {md.properties.dtype for k, md in stored.items() if ".exp_avg" in k}
    assert moments == {torch.bfloat16} and not any(k.endswith(".master") for k in stored)
    for later in ("step-00000002", "step-00000003"):
        shutil.rmtree(folder / later)
    resumed = train(config(*common))[0]
    assert resumed["start"] == 1 and resumed["losses"] == whole[1:]
    low = json.loads(metrics.read_text().splitlines()[-1])["optimizer_state_bytes"]
    estimated = EstimateConfig(
        resolve_model("tiny-deepseek-v2"), dp=2, ep=2, seq_len=16, num_microbatches=2,
        dtype="bfloat16", fsdp=True, shard_optimizer=True, optimizer_state_dtype="bfloat16",
        master_weights=False,
    )  # fmt: skip
    # The estimator also counts AdamW's float32 step per tensor (52 here): 0.03% apart.
    predicted = estimate(estimated)["ranks"][0]["optimizer_bytes"]
    assert abs(predicted / low - 1) < 1e-3, (predicted, low)


def test_a_resume_with_other_settings_says_what_it_converts():
    def stored(dtype, masters):
        keys = {"optim.w.exp_avg": dtype, "optim.w.exp_avg_sq": dtype}
        if masters:
            keys["optim.w.master"] = torch.float32
        return {k: SimpleNamespace(properties=SimpleNamespace(dtype=d)) for k, d in keys.items()}

    def run(state_dtype, masters):
        shard = SimpleNamespace(param=torch.empty(1, dtype=torch.bfloat16))
        return SimpleNamespace(state_dtype=state_dtype, master_weights=masters, shards=[shard])

    same = precision_changes(stored(torch.float32, True), run(torch.float32, True))
    assert same == []
    down = precision_changes(stored(torch.float32, True), run(torch.bfloat16, False))
    assert "optim.state_dtype" in down[0] and "float32" in down[0] and "bfloat16" in down[0]
    assert "optim.master_weights" in down[1] and "not read" in down[1]
    up = precision_changes(stored(torch.bfloat16, False), run(torch.float32, True))
    assert "converted" in up[0] and "start from the 16-bit parameters" in up[1]


def test_a_bad_state_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match=r"optim.state_dtype = 'float16' is invalid: must be one "
                       r"of float32, bfloat16"):  # fmt: skip
        config("optim.state_dtype=float16")


def test_the_estimator_counts_what_the_trainer_keeps():
    model = resolve_model("tiny-deepseek-v2")
    kept = {}
    settings = (("float32", True), ("bfloat16", False), ("float32", False), ("param", True))
    for state, masters in settings:
        cfg = EstimateConfig(model, dtype="bfloat16", optimizer_state_dtype=state,
                             master_weights=masters)  # fmt: skip
        kept[state, masters] = (cfg.optimizer_bytes_per_param, cfg.blocked_update)
    # ShardedAdamW (every train setting) steps block by block; torch's AdamW on the
    # parameters' own dtype (compare's unsharded stacks) steps whole tensors.
    assert kept == {("float32", True): (12, True), ("bfloat16", False): (4, True),
                    ("float32", False): (8, True), ("param", True): (8, False)}  # fmt: skip
