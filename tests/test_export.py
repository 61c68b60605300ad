"""`twinpipe export` from a training checkpoint: each stored DCP chunk read once (the bytes
read, counted at the checkpoint's files, stay near the bytes written), every tensor equal
to the checkpoint's."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
from safetensors import safe_open
from torch.distributed.checkpoint.filesystem import FileSystem

from models.config import ModelConfig
from models.hf_layout import INDEX_NAME, to_hf_state_dict
from optimized.train.checkpointing import load_model_state
from optimized.train.chunks import CachedReader
from optimized.train.export import export_checkpoint
from tests.test_train import config, train

READ_OVER_WRITTEN = 1.2
"""Bytes read per byte written: each stored chunk once, with its records' headers (1.16x on
tiny-qwen3-moe's 47 small chunks); reading a chunk per expert piece read 9.2x."""
TORCH_LOAD_REREAD = 4096
"""What `torch.load` reads again of one stored chunk's zip records (1.6 to 3.5 KiB here),
beyond the chunk's stored bytes."""


class _Counted(io.RawIOBase):
    """A file that adds the bytes read from it to ``counter[0]``."""

    def __init__(self, file: io.IOBase, counter: list[int]) -> None:
        super().__init__()
        self.file, self.counter = file, counter

    def readinto(self, buffer) -> int:
        got = self.file.readinto(buffer)
        self.counter[0] += got or 0
        return got

    def read(self, size: int = -1) -> bytes:
        data = self.file.read(size)
        self.counter[0] += len(data)
        return data

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self.file.seek(offset, whence)

    def tell(self) -> int:
        return self.file.tell()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True


@contextlib.contextmanager
def _count_chunk_reads(monkeypatch):
    """Count the bytes read from the checkpoint's ``.distcp`` files (every DCP read opens
    them through `FileSystem.create_stream`); yields the one-element counter."""
    counter = [0]
    original = FileSystem.create_stream

    @contextlib.contextmanager
    def counted(self, path, mode):
        with original(self, path, mode) as stream:
            yield _Counted(stream, counter) if str(path).endswith(".distcp") else stream

    with monkeypatch.context() as patch:
        patch.setattr(FileSystem, "create_stream", counted)
        yield counter


def _exported(folder) -> dict[str, torch.Tensor]:
    with open(folder / INDEX_NAME) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    tensors = {}
    for file in files:
        with safe_open(folder / file, framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})  # noqa: SIM118
    return tensors


def _assert_equal_to_checkpoint(report, out, dtype: torch.dtype) -> None:
    model_config = ModelConfig.from_hf(str(report.folder / "config.json"))
    expected = to_hf_state_dict(load_model_state(report.folder, model_config), model_config)
    exported = _exported(out)
    assert sorted(exported) == sorted(expected)
    for name, tensor in expected.items():
        assert exported[name].dtype == dtype, name
        assert torch.equal(exported[name], tensor.to(dtype)), name


@pytest.fixture(scope="module")
def qwen_checkpoint(tmp_path_factory):
    """tiny-qwen3-moe after one step on one rank: each expert tensor is one stored chunk
    holding all 8 experts, which the on-disk layout cuts into 16 or 8 tensors."""
    root = tmp_path_factory.mktemp("qwen")
    train(
        config(
            "model.name=tiny-qwen3-moe",
            "steps=1",
            "optim.warmup_steps=0",
            f"checkpoint.dir={root / 'ck'}",
        )
    )
    return root / "ck"


def _export_counting(checkpoint, out, monkeypatch, **options):
    """Export; the report, the bytes read, and the bound for reading each stored chunk of
    the model once (its stored bytes, and what `torch.load` reads again of its records)."""
    with _count_chunk_reads(monkeypatch) as read:
        report = export_checkpoint(checkpoint, out, max_shard_bytes=400_000, **options)
    stored = [
        info.length
        for index, info in CachedReader(report.folder).read_metadata().storage_data.items()
        if index.fqn.startswith("model.")
    ]
    assert len(stored) > report.shards
    return report, read[0], sum(stored) + TORCH_LOAD_REREAD * len(stored)


def test_export_reads_each_stored_chunk_once(qwen_checkpoint, tmp_path, monkeypatch):
    report, read, once = _export_counting(qwen_checkpoint, tmp_path / "hf", monkeypatch)
    assert report.shards >= 3
    assert report.total_bytes <= read <= min(once, READ_OVER_WRITTEN * report.total_bytes), (
        read, report.total_bytes,
    )  # fmt: skip
    _assert_equal_to_checkpoint(report, tmp_path / "hf", torch.float32)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_export_of_a_sharded_checkpoint_reads_each_chunk_once(tmp_path, monkeypatch):
    """PP1 DP2 EP2 with FSDP2: every stored expert chunk holds 4 experts and every dense
    weight is two chunks of rows, assembled; exported in bfloat16 (a cast of each piece)."""
    ck = tmp_path / "ck"
    steps = ("steps=1", "optim.warmup_steps=0")
    train(config("model.name=tiny-qwen3-moe", *steps, "parallel.dp=2", "parallel.ep=2",
                 f"checkpoint.dir={ck}"))  # fmt: skip
    report, read, once = _export_counting(ck, tmp_path / "hf", monkeypatch, dtype="bfloat16")
    assert 2 * report.total_bytes <= read <= once, (read, once)  # float32 read, bf16 written
    _assert_equal_to_checkpoint(report, tmp_path / "hf", torch.bfloat16)
