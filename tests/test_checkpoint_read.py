"""Reading stored rows straight into a parameter (`models.hf.read_rows`, #15): the
same values as safetensors' own slices, in any dtype, into contiguous or strided rows."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.hf import CheckpointError, read_header, read_rows


@pytest.fixture
def stored(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randn(12, 5, 3, generator=g),
        "b": torch.randn(7, generator=g).bfloat16(),
        "h": torch.randn(9, 4, generator=g).half(),
        "s": torch.tensor(2.5),
    }
    file = tmp_path / "model.safetensors"
    save_file(tensors, file)
    return file, read_header(str(file))


@pytest.mark.parametrize("name", ["w", "b", "h", "s"])
@pytest.mark.parametrize("dtype", [None, torch.float32, torch.bfloat16, torch.float64])
def test_rows_equal_safetensors_slices_in_any_dtype(stored, name, dtype):
    file, header = stored
    with safe_open(file, "pt") as handle:
        whole = handle.get_tensor(name)
        dtype = dtype or whole.dtype
        out = torch.empty(whole.shape, dtype=dtype)
        read_rows(header[name], out)
        assert torch.equal(out, whole.to(dtype))
        if whole.dim():
            start, stop = 2, whole.shape[0] - 1
            part = torch.full((stop - start, *whole.shape[1:]), float("nan"), dtype=dtype)
            read_rows(header[name], part, start)
            assert torch.equal(part, handle.get_slice(name)[start:stop].to(dtype))


def test_into_strided_rows_and_through_a_small_buffer(stored, monkeypatch):
    import models.hf.checkpoint as checkpoint

    file, header = stored
    with safe_open(file, "pt") as handle:
        w = handle.get_tensor("w")
    target = torch.zeros(12, 5, 6)
    read_rows(header["w"], target[:, :, 3:])  # strided: the second half of each row
    assert torch.equal(target[:, :, 3:], w) and not target[:, :, :3].any()
    monkeypatch.setattr(checkpoint, "READ_BUFFER_BYTES", 8)  # 4 bf16 elements at a time
    converted = torch.empty(12, 5, 3, dtype=torch.bfloat16)
    read_rows(header["w"], converted)
    assert torch.equal(converted, w.bfloat16())


def test_rows_that_do_not_fit_and_a_short_file_are_named(stored):
    file, header = stored
    with pytest.raises(ValueError, match=r"rows of \[12, 5, 3\] do not fill \[2, 5, 4\]"):
        read_rows(header["w"], torch.empty(2, 5, 4))
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 8])  # the last tensor's data cut short
    last = max(header.values(), key=lambda t: t.end)
    with pytest.raises(CheckpointError, match="ended while reading a tensor"):
        read_rows(last, torch.empty(last.shape, dtype=torch.float64))
