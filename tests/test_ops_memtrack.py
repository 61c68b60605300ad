"""The test-local storage tracker counts live bytes exactly on a planted pattern."""

from __future__ import annotations

import torch

from tests._memtrack import StorageTracker

MIB = 1 << 20


def test_planted_allocations_frees_views_and_resize():
    existing = torch.empty(4 * MIB, dtype=torch.uint8)
    with StorageTracker() as tracker:
        a = torch.empty(MIB, dtype=torch.uint8)
        b = torch.empty(2 * MIB, dtype=torch.uint8)
        view = b[10:]
        temporary = existing[1:] + 0  # one byte smaller than `existing`
        del temporary
        assert tracker.current == 3 * MIB
        assert tracker.peak == 3 * MIB + 4 * MIB - 1
        del a
        assert tracker.current == 2 * MIB
        c = torch.empty(MIB // 2, dtype=torch.uint8)
        b.untyped_storage().resize_(0)  # a free that bypasses the dispatcher
        assert tracker.current == MIB // 2
        del b, view
        assert tracker.current == MIB // 2
        existing.add_(1)  # in place on storage from before: not an allocation
        assert tracker.current == MIB // 2
        del c
        assert tracker.current == 0


def test_autograd_backward_is_seen():
    x = torch.randn(100, 100, requires_grad=True)
    with StorageTracker() as tracker:
        y = (x * 2).sum()
        y.backward()
        assert tracker.current == x.grad.nbytes + y.nbytes
        # x * 2 is freed after the sum; backward holds the 4-byte ones and the new grad.
        assert tracker.peak == x.grad.nbytes + 2 * y.nbytes
