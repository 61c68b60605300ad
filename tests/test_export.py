"""`twinpipe export` from a training checkpoint: each stored DCP chunk read once (the bytes
read, counted at the checkpoint's files, stay near the bytes written), every tensor equal
to the checkpoint's, the command's message true to what it wrote, and progress lines."""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest
import torch
from safetensors import safe_open
from torch.distributed.checkpoint.filesystem import FileSystem

from harness.cli import main
from models.hf import (
    INDEX_NAME,
    config_from_hf,
    from_pretrained,
    save_pretrained,
    to_hf_state_dict,
    write_mxfp4,
)
from models.network import build_model, preset
from models.runtime import ProgressLine
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
    model_config = config_from_hf(str(report.folder / "config.json"))
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


@pytest.mark.slow
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


PROGRESS = re.compile(
    r"\r\033\[K(?P<label>[^\r\n]*): (?P<tensors>\d+)(?:/(?P<total>\d+))? tensors, "
    r"(?P<gb>\d+\.\d\d)(?:/(?P<total_gb>\d+\.\d\d))? GB, \d+\.\d\d GB/s, \d+ s\n$"
)
"""The last line a `ProgressLine` draws: label, tensors and GB done (of the total)."""


def test_progress_line_counts_tensors_and_gigabytes():
    stream = io.StringIO()  # no terminal: drawn only when enabled
    line = ProgressLine("reading x", total_tensors=3, total_bytes=4_500_000_000, stream=stream,
                        enabled=True)  # fmt: skip
    line("a", 1_000_000_000)
    line("b", 500_000_000)
    line.close()
    drawn = stream.getvalue()
    assert drawn.startswith("\r\033[Kreading x: 1/3 tensors, 1.00/4.50 GB, ")
    last = PROGRESS.search(drawn)
    assert last is not None and drawn.count("\n") == 1, drawn
    assert (last["tensors"], last["total"]) == ("2", "3")
    assert (last["gb"], last["total_gb"]) == ("1.50", "4.50")
    quiet = io.StringIO()
    line = ProgressLine("reading x", stream=quiet)  # not a terminal: nothing
    line("a", 1)
    line.close()
    assert quiet.getvalue() == ""


@pytest.mark.slow
def test_export_prints_its_progress_when_asked(qwen_checkpoint, tmp_path, capsys):
    report = export_checkpoint(qwen_checkpoint, tmp_path / "hf", progress=True)
    captured = capsys.readouterr()
    last = PROGRESS.search(captured.err)
    assert captured.out == "" and last is not None, captured.err
    assert last["label"] == f"exporting {report.folder}"
    assert last["tensors"] == last["total"] == str(report.tensors)
    export_checkpoint(qwen_checkpoint, tmp_path / "quiet", progress=False)
    assert capsys.readouterr().err == ""


def test_load_prints_its_progress_when_asked(tmp_path, capsys):
    model = build_model(preset("tiny-qwen3-moe"))
    save_pretrained(model, tmp_path / "hf")
    from_pretrained(tmp_path / "hf", progress=True)
    last = PROGRESS.search(capsys.readouterr().err)
    assert last is not None and last["label"] == f"loading {tmp_path / 'hf'}"
    assert last["total"] is None and int(last["tensors"]) == len(dict(model.named_parameters()))
    from_pretrained(tmp_path / "hf")  # stderr is no terminal here: nothing drawn
    assert capsys.readouterr().err == ""


def _export_command(checkpoint, out, capsys) -> tuple[str, dict[str, torch.Tensor]]:
    argv = ["export", "--checkpoint", str(checkpoint), "--out", str(out), "--dtype", "bfloat16"]
    assert main([*argv, "--max-shard-bytes", "400000"]) == 0
    return capsys.readouterr().out, _exported(out)


@pytest.mark.slow
def test_export_command_says_what_it_wrote(qwen_checkpoint, tmp_path, capsys):
    """The message names the tensors, shards and dtype that the files hold."""
    out = tmp_path / "hf"
    message, exported = _export_command(qwen_checkpoint, out, capsys)
    said = re.fullmatch(
        rf"exported \S+step-00000001 to {re.escape(str(out))}: (\d+) tensors in (\d+) shard\(s\), "
        r"\d+\.\d\d GB, every weight in bfloat16 \(unquantised: GPT-OSS's MXFP4 experts and "
        r"DeepSeek-V3's FP8 weights are written in bfloat16; expert biases in float32\); "
        r"largest tensor \d+\.\d\d GB\n",
        message,
    )
    assert said is not None, message
    assert int(said[1]) == len(exported) and int(said[2]) == len(list(out.glob("model-*")))
    assert {t.dtype for t in exported.values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.slow
def test_gpt_oss_trained_from_mxfp4_is_exported_unquantised(tmp_path, capsys):
    """A GPT-OSS run started from MXFP4 experts: the export says it writes them unquantised
    in the dtype asked for, and that is what its files and config.json hold."""
    name = "tiny-gpt-oss"
    save_pretrained(build_model(preset(name), dtype=torch.bfloat16, seed=3), tmp_path / "bf16")
    write_mxfp4(tmp_path / "bf16", tmp_path / "mxfp4", max_shard_bytes=60_000)
    steps = ("steps=1", "optim.warmup_steps=0")
    train(config(f"model.name={name}", *steps, f"model.init_from={tmp_path / 'mxfp4'}",
                 f"checkpoint.dir={tmp_path / 'ck'}"))  # fmt: skip
    message, exported = _export_command(tmp_path / "ck", tmp_path / "hf", capsys)
    assert "every weight in bfloat16 (unquantised: GPT-OSS's MXFP4 experts" in message
    assert {t.dtype for t in exported.values()} == {torch.bfloat16}
    assert "model.layers.0.mlp.experts.gate_up_proj" in exported
    assert not [n for n in exported if n.endswith(("_blocks", "_scales"))]
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["dtype"] == "bfloat16" and "quantization_config" not in written
