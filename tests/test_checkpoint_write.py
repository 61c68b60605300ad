"""The streaming safetensors writer (#15): shards written one tensor at a time, read back
bit for bit by the safetensors library, and nothing that looks whole after a crash."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from models.hf import (
    INDEX_NAME,
    WEIGHTS_NAME,
    Planned,
    ShardWriter,
    plan_shards,
    safetensors_header,
    shard_file_name,
)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(7, 5, generator=g),
        "b.weight": torch.randn(3, 4, 2, generator=g).bfloat16(),
        "c.bias": torch.randn(9, generator=g).half(),
        "d.blocks": torch.randint(0, 256, (2, 3, 16), generator=g, dtype=torch.uint8),
        "e.scalar": torch.tensor(1.5),
        "f.empty": torch.empty(0, 4, dtype=torch.bfloat16),
        "g.weight": torch.randn(6, 6, generator=g).double()[:, ::2],  # not contiguous
    }


def _plan(tensors):
    return [Planned(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]


@pytest.mark.parametrize("max_shard_bytes", [None, 64])
def test_written_shards_read_back_bit_for_bit(tmp_path, max_shard_bytes):
    tensors = _tensors()
    shards = plan_shards(_plan(tensors), max_shard_bytes)
    writer = ShardWriter(tmp_path, shards, single=max_shard_bytes is None)
    for name, tensor in tensors.items():
        writer.write(name, tensor)
    writer.close()
    largest = max(t.numel() * t.element_size() for t in tensors.values())
    assert writer.largest_tensor_bytes == largest
    if max_shard_bytes is None:
        files = [tmp_path / WEIGHTS_NAME]
    else:
        assert len(shards) > 2
        index = json.loads((tmp_path / INDEX_NAME).read_text())
        assert index["metadata"]["total_size"] == writer.total_bytes
        files = [tmp_path / shard_file_name(i, len(shards)) for i in range(len(shards))]
        assert sorted(set(index["weight_map"].values())) == sorted(f.name for f in files)
    read = {}
    for file in files:
        read.update(load_file(file))
        with safe_open(file, "pt") as handle:
            assert handle.metadata() == {"format": "pt"}
    assert sorted(read) == sorted(tensors)
    for name, tensor in tensors.items():
        assert read[name].dtype == tensor.dtype and read[name].shape == tensor.shape, name
        assert torch.equal(read[name], tensor), name  # no NaN here: equal values, equal bits
    assert not list(tmp_path.glob("*.partial"))


def test_header_is_padded_to_eight_bytes_and_offsets_are_contiguous():
    plan = _plan(_tensors())
    raw = safetensors_header(plan)
    length = int.from_bytes(raw[:8], "little")
    assert len(raw) == 8 + length and length % 8 == 0
    header = json.loads(raw[8:])
    offsets = [header[p.name]["data_offsets"] for p in plan]
    assert offsets[0][0] == 0 and all(a[1] == b[0] for a, b in zip(offsets, offsets[1:]))
    assert [e - b for b, e in offsets] == [p.nbytes for p in plan]


def test_a_tensor_out_of_plan_is_refused_naming_both(tmp_path):
    tensors = _tensors()
    writer = ShardWriter(tmp_path, plan_shards(_plan(tensors), None), single=True)
    with pytest.raises(ValueError, match="b.weight arrived where the plan writes a.weight"):
        writer.write("b.weight", tensors["b.weight"])
    with pytest.raises(ValueError, match=r"a.weight: planned \(7, 5\) torch.float32, got \(5, 7\)"):
        writer.write("a.weight", tensors["a.weight"].t())
    with pytest.raises(ValueError, match="torch.bfloat16"):
        writer.write("a.weight", tensors["a.weight"].bfloat16())


def test_an_unfinished_shard_never_looks_whole(tmp_path):
    tensors = _tensors()
    writer = ShardWriter(tmp_path, plan_shards(_plan(tensors), None), single=True)
    writer.write("a.weight", tensors["a.weight"])
    with pytest.raises(ValueError, match=r"shard 1 never received \['b.weight'"):
        writer.close()
    writer.handle.close()
    assert not (tmp_path / WEIGHTS_NAME).exists()
    assert (tmp_path / f"{WEIGHTS_NAME}.partial").exists()
