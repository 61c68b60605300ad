"""The float32 truth's gradients spilled to a file (`harness.compare.spill`): exact, compared as if
held, one tensor resident at a time, the file gone when done."""

from __future__ import annotations

import os

import torch
from torch import nn

from harness.compare.inplace import Comparer, RankPlace, pieces
from harness.compare.spill import LoadedPieces, ParkedTensors, SpilledGradients


def _grads() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(7, 5, generator=g),
        "scalar": torch.randn((), generator=g),
        "half": torch.randn(3, 4, generator=g).to(torch.bfloat16),
        "strided": torch.randn(6, 8, generator=g)[:, ::2],
    }


def test_every_tensor_reads_back_bit_for_bit_and_the_file_goes():
    grads = _grads()
    expected = {name: t.clone() for name, t in grads.items()}
    spilled = SpilledGradients(grads)
    assert grads == {}  # each tensor released as it was written
    assert spilled.nbytes == sum(t.numel() * t.element_size() for t in expected.values())
    assert os.path.getsize(spilled.path) == spilled.nbytes
    assert set(spilled) == set(expected)
    for name, tensor in expected.items():
        back = spilled[name]
        assert back.dtype == tensor.dtype and back.shape == tensor.shape, name
        assert torch.equal(back, tensor), name
    assert spilled.placeholder("w").device.type == "meta"
    assert spilled.placeholder("missing") is None
    spilled.close()
    assert not os.path.exists(spilled.path)
    spilled.close()  # twice is fine


def test_the_file_goes_when_the_object_does():
    spilled = SpilledGradients(_grads())
    path = spilled.path
    del spilled
    assert not os.path.exists(path)


def test_compared_from_the_file_as_if_held():
    torch.manual_seed(0)
    part = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 3))
    truth = {name: torch.randn_like(p) for name, p in part.named_parameters()}
    bf16 = {name: (t + 1e-2 * torch.randn_like(t)).to(torch.bfloat16) for name, t in truth.items()}
    place = RankPlace(dp_rank=0, ep=1, whole=False)
    held = pieces(part, place, lambda name, p: truth[name])
    candidate = pieces(part, place, lambda name, p: bf16[name])
    spilled = SpilledGradients({name: t.clone() for name, t in truth.items()})
    shapes = pieces(part, place, lambda name, p: spilled.placeholder(name))
    loaded = LoadedPieces(shapes, spilled)
    assert set(loaded) == set(held) and len(loaded) == len(held)
    comparer = Comparer()
    assert comparer.compare(candidate, loaded) == comparer.compare(candidate, held)
    spilled.close()


def test_parked_optimizer_state_comes_back_bit_for_bit():
    """AdamW's moments leave the optimizer while parked (nothing holds them) and return
    equal, in their places, dtypes and shapes."""
    torch.manual_seed(0)
    part = nn.Linear(8, 5).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(part.parameters(), lr=1e-2)
    part(torch.randn(3, 8, dtype=torch.bfloat16)).sum().backward()
    optimizer.step()
    before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    slots = [(s, k) for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    parked = ParkedTensors(slots)
    assert parked.nbytes == 2 * sum(p.numel() * 2 for p in part.parameters())
    assert all(set(s) == {"step"} for s in optimizer.state.values())
    parked.restore()
    assert not os.path.exists(parked.path)
    for p, state in optimizer.state.items():
        for key, value in before[id(p)].items():
            assert state[key].dtype == value.dtype and torch.equal(state[key], value), key
    part(torch.randn(3, 8, dtype=torch.bfloat16)).sum().backward()
    optimizer.step()  # the optimizer goes on with them
