"""Training checkpoints: each rank writes its own pieces (no gathering), corrupt or partial
ones skipped, streaming HF export, --init-from, mismatched checkpoints refused up front."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from models.hf import (
    INDEX_NAME,
    config_from_hf,
    expected_state_shapes,
    save_pretrained,
    shard_file_name,
)
from models.network import CausalLM, build_model, preset
from models.runtime import launch
from optimized.train import TokenDataset, TokenLoader, default_dataset
from optimized.train.checkpointing import load_model_state, newest_valid
from optimized.train.chunks import CachedReader, tensor_metadata
from optimized.train.export import export, export_checkpoint
from reference.ops import ReferenceOps
from tests.test_train import _reference_runner, config, train  # noqa: F401 - fixture

TENSOR_COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast",
                      "reduce_scatter_tensor", "all_to_all_single")  # fmt: skip


def _counting_rank_main(cfg):
    """Train, counting the tensor collectives each save makes (gathering would be some)."""
    import torch.distributed as dist

    from optimized.train import checkpointing, trainer

    counts = {"save_collectives": 0, "saves": 0}
    save = checkpointing.save_checkpoint

    def counted_save(*args, **kwargs):
        originals = {name: getattr(dist, name) for name in TENSOR_COLLECTIVES}

        def counting(function):
            def call(*a, **k):
                counts["save_collectives"] += 1
                return function(*a, **k)

            return call

        for name, function in originals.items():
            setattr(dist, name, counting(function))
        try:
            counts["saves"] += 1
            return save(*args, **kwargs)
        finally:
            for name, function in originals.items():
                setattr(dist, name, function)

    checkpointing.save_checkpoint = counted_save
    return {**trainer.train(cfg), **counts}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_each_rank_saves_its_own_pieces_without_gathering(tmp_path):
    """PP=2 DP=2 EP=2, FSDP2 on: no tensor collective during the save; DCP's metadata holds
    every parameter at its whole-model shape, its pieces (EP experts, FSDP2 rows) cover it
    exactly once, every rank writing its own file; optimizer state is flat float32."""
    cfg = config("steps=1", "optim.warmup_steps=0", "parallel.pp=2", "parallel.dp=2",
                 "parallel.ep=2", "data.micro_batches=4", f"checkpoint.dir={tmp_path}")  # fmt: skip
    ranks = launch(_counting_rank_main, 4, (cfg,))
    assert [r["saves"] for r in ranks] == [1] * 4
    assert [r["save_collectives"] for r in ranks] == [0] * 4
    folder = newest_valid(tmp_path)
    reader = CachedReader(folder)
    metadata = reader.read_metadata()
    stored = tensor_metadata(metadata)
    model = preset("tiny-deepseek-v2")
    for name, shape in expected_state_shapes(model).items():
        md = stored[f"model.{name}"]
        assert tuple(md.size) == tuple(shape), name
        rows = sorted((c.offsets[0], c.sizes[0]) for c in md.chunks)
        assert [start for start, _ in rows] == [0] + [a + b for a, b in rows[:-1]], name
        assert sum(size for _, size in rows) == shape[0], name
        if ".mlp.experts." in name:  # EP=2, one replica each: a block of E/2 per EP rank
            assert rows == [(0, shape[0] // 2), (shape[0] // 2, shape[0] // 2)], name
        elif shape[0] > 1:  # FSDP2 over DP=2: half the rows each
            assert len(rows) == 2, name
        for key in ("exp_avg", "exp_avg_sq"):
            optim = stored[f"optim.{name}.{key}"]
            assert tuple(optim.size) == (shape.numel(),) and optim.properties.dtype == torch.float32
            assert sum(c.sizes[0] for c in optim.chunks) == shape.numel(), (name, key)
    files = {info.relative_path for info in metadata.storage_data.values()}
    assert len(files) == 4  # every rank wrote its own file


def test_a_mismatched_checkpoint_is_refused_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    """--init-from another model's checkpoint, or one with int32 weights: exit 2, the error
    names the file, the tensor, and what was expected and found; no rank ran (the command
    runs in this process, with `launch` made to fail if it is reached)."""
    from harness.cli import main

    def no_rank(*args, **kwargs):
        raise AssertionError("a rank was launched")

    monkeypatch.setattr("models.runtime.launch", no_rank)

    def train_command(*args: str) -> tuple[int, str]:
        capsys.readouterr()
        try:
            code = main(["train", *args])
        except SystemExit as exit_:
            code = exit_.code
        return code, capsys.readouterr().err

    save_pretrained(build_model(preset("tiny-qwen3-moe")), tmp_path / "qwen")
    code, err = train_command("--model", "tiny-deepseek-v2", "--init-from",
                              str(tmp_path / "qwen"), "--steps", "1", "--warmup-steps", "0",
                              "--nproc", "1")  # fmt: skip
    assert code == 2, err
    assert "holds a qwen3_moe model, not the deepseek_v2 model" in err
    model = build_model(preset("tiny-deepseek-v2")).to(torch.bfloat16)
    save_pretrained(model, tmp_path / "ds")
    from safetensors.torch import load_file, save_file

    weights = tmp_path / "ds" / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)
    save_file(tensors, weights, {"format": "pt"})
    code, err = train_command("--init-from", str(tmp_path / "ds"), "--steps", "1",
                              "--warmup-steps", "0")  # fmt: skip
    assert code == 2, err
    assert "model.norm.weight: expected F32 or BF16 or F16 or F64, found I32" in err
    assert str(weights) in err


@pytest.mark.slow
def test_corrupt_and_partial_checkpoints_are_skipped(tmp_path):
    cfg = config("steps=4", "checkpoint.save_every=2", "checkpoint.keep_last=0",
                 f"checkpoint.dir={tmp_path}")  # fmt: skip
    train(cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "run.json", "step-00000002", "step-00000004"]  # fmt: skip
    data = next((tmp_path / "step-00000004").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    (tmp_path / "step-00000006").mkdir()  # a partial one: no manifest
    with pytest.warns(UserWarning) as caught:
        assert newest_valid(tmp_path).name == "step-00000002"
    messages = [str(w.message) for w in caught]
    assert "step-00000006" in messages[0] and "incomplete" in messages[0]
    assert "step-00000004" in messages[1] and "sha256" in messages[1]
    resumed = train(cfg)[0]
    assert resumed["start"] == 2 and len(resumed["losses"]) == 2


def _first_batch(cfg):
    loader = TokenLoader(
        TokenDataset(default_dataset(), cfg.data.seq_len), cfg.data.micro_batches,
        cfg.data.micro_batch_size, seed=cfg.seed,
    )  # fmt: skip
    batch = next(loader)
    return batch.inputs.reshape(-1, cfg.data.seq_len), batch.labels.reshape(-1, cfg.data.seq_len)


@pytest.mark.slow
def test_export_loads_in_transformers_and_init_from_resumes_it(tmp_path):
    import transformers

    cfg = config("steps=2", f"checkpoint.dir={tmp_path / 'ck'}")
    train(cfg)
    report = export_checkpoint(tmp_path / "ck", tmp_path / "hf", max_shard_bytes=200_000)
    folder = report.folder
    assert report.shards >= 3 and (tmp_path / "hf" / INDEX_NAME).exists()
    assert (tmp_path / "hf" / shard_file_name(0, report.shards)).exists()
    assert report.largest_tensor_bytes == 512 * 64 * 4  # one tensor held, never a shard
    assert export(tmp_path / "ck", tmp_path / "hf") == folder  # again, over the first
    ids, labels = _first_batch(cfg)

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    hf.set_attn_implementation("eager")
    hf.set_experts_implementation("eager")
    with torch.no_grad():
        logits = hf(input_ids=ids).logits.float()
    hf_loss = float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)))

    model_config = config_from_hf(str(folder / "config.json"))
    ours = CausalLM(model_config, ReferenceOps())
    ours.load_state_dict(load_model_state(folder, model_config))
    with torch.no_grad():
        our_loss = float(ours.loss(ids, labels))
    assert math.isfinite(hf_loss) and abs(our_loss - hf_loss) <= 1e-5 * hf_loss

    # Step 1 of a run started from the export sees the same weights and the same batch.
    started = train(config("steps=1", "optim.warmup_steps=0", f"model.init_from={tmp_path / 'hf'}"))
    assert abs(started[0]["losses"][0] - hf_loss) <= 1e-5 * hf_loss


@pytest.mark.slow
@pytest.mark.multiprocess
def test_bfloat16_resume_is_exact_and_resumes_with_fsdp_off(tmp_path, monkeypatch):
    """bfloat16 at DP=2 (FSDP2 on, experts over 2 replicas): stopped after step 1 and
    resumed, the losses equal the uninterrupted run's bit for bit (float32 masters and
    moments come back from the checkpoint's chunks). Resumed with FSDP off instead (each
    rank reads the whole parameters and its ZeRO-1 slices from the FSDP2-written chunks),
    they agree within bfloat16's bound."""
    common = ("steps=3", "dtype=bfloat16", "parallel.dp=2", "parallel.ep=1")
    whole = train(config(*common, "parallel.fsdp=true"))[0]["losses"]
    monkeypatch.setenv("TWINPIPE_FAULT", "sigterm@0:0")
    first = train(config(*common, "parallel.fsdp=true", f"checkpoint.dir={tmp_path / 'true'}"))[0]
    monkeypatch.delenv("TWINPIPE_FAULT")
    assert first["stopped_at"] == 1
    shutil.copytree(tmp_path / "true", tmp_path / "false")  # one stopped run, resumed twice
    resumed = {}
    for fsdp in ("true", "false"):
        folder = tmp_path / fsdp
        second = train(config(*common, f"parallel.fsdp={fsdp}", f"checkpoint.dir={folder}"))[0]
        assert second["start"] == 1
        resumed[fsdp] = first["losses"] + second["losses"]
    assert resumed["true"] == whole
    for a, b in zip(resumed["false"], whole, strict=True):
        assert abs(a - b) <= 1e-2 * abs(b), (resumed["false"], whole)


def test_a_region_of_a_stored_chunk_is_read_as_its_own_bytes(tmp_path, monkeypatch):
    """A resume at another layout asks for some rows of a stored chunk (8 of 64 experts):
    they are read as one byte range straight into the tensor, not the chunk loaded whole
    and narrowed (DCP's way, 8x the bytes here), and the values are the saved ones."""
    from optimized.train import chunks

    experts = torch.randn(64, 12, 6).to(torch.bfloat16)
    flat = torch.randn(1000)
    chunks.save(
        {"experts": chunks.rows(experts, 0, tuple(experts.shape)),
         "flat": chunks.rows(flat, 0, tuple(flat.shape))},
        tmp_path / "ck",
    )  # fmt: skip
    whole_loads = []
    monkeypatch.setattr(
        chunks.dcp.FileSystemReader, "read_data",
        lambda self, plan, planner: whole_loads.append(plan.items),
    )  # fmt: skip
    read = []
    original = chunks.CachedReader._read_rows

    def counted(self, request, planner):
        done = original(self, request, planner)
        read.append(math.prod(request.lengths) if done else 0)
        return done

    monkeypatch.setattr(chunks.CachedReader, "_read_rows", counted)
    mine = torch.empty(8, 12, 6, dtype=torch.bfloat16)
    part = torch.empty(300)
    chunks.load(
        {"experts": chunks.rows(mine, 16, tuple(experts.shape)),
         "flat": chunks.rows(part, 500, tuple(flat.shape))},
        tmp_path / "ck", collective=False,
    )  # fmt: skip
    assert torch.equal(mine, experts[16:24]) and torch.equal(part, flat[500:800])
    assert whole_loads == [] and sorted(read) == [300, 8 * 12 * 6]
