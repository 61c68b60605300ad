"""The communication counter (`models.runtime.communication`): every kind, its bytes by the direct
model (never a rank's own slice), groups by name, only the outermost entry point, and
nothing counted outside `counting` or after the counter is removed."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from models.runtime import (
    CommunicationCounter,
    ParallelConfig,
    Traffic,
    by_kind,
    group_names,
    launch,
    make_layout,
)


def _every_kind() -> dict:
    """On 4 ranks (pp 2 x dp 2): one call of each kind, counted; then one uncounted."""
    layout = make_layout(ParallelConfig(pp=2, dp=2, ep=2, micro_batches=4))
    rank = dist.get_rank()
    x = torch.arange(6, dtype=torch.float32) + rank  # 24 bytes
    with CommunicationCounter(group_names(layout)) as counter:
        with counter.counting():
            dist.all_reduce(x.clone(), group=layout.dp_group)
            dist.broadcast(x.clone(), src=layout.global_rank(0), group=layout.pp_group)
            out = torch.empty(12)
            with warnings.catch_warnings():  # deprecated, and calls all_gather_single
                warnings.simplefilter("ignore", FutureWarning)
                dist.all_gather_into_tensor(out, x, group=layout.dp_group)
            pieces = [torch.empty(6) for _ in range(4)]
            dist.all_gather(pieces, x)
            dist.reduce_scatter_single(torch.empty(3), x.clone(), group=layout.ep_group)
            # Uneven all-to-all on dp: rank d sends d + 1 rows to each peer, rows of 2 floats.
            rows = torch.ones(2 * (layout.dp_rank + 1), 2)
            receive = [d + 1 for d in range(2)]
            dist.all_to_all_single(
                torch.empty(sum(receive), 2), rows, receive, [layout.dp_rank + 1] * 2,
                group=layout.dp_group,
            )  # fmt: skip
            peer = layout.global_rank(1 - layout.pp_rank)
            if layout.pp_rank == 0:
                dist.isend(x, peer, tag=5).wait()
                dist.isend(x[:2], peer, group=layout.streams.forward0).wait()
            else:
                dist.irecv(torch.empty(6), peer, tag=5).wait()
                dist.irecv(torch.empty(2), peer, group=layout.streams.forward0).wait()
            dist.barrier()
        counted = counter.take()
        dist.all_reduce(x.clone())  # installed, not counting
        uncounted = counter.take()
    dist.all_reduce(x.clone())  # removed
    return {
        "coords": (layout.pp_rank, layout.dp_rank),
        "counted": by_kind(counted),
        "uncounted": uncounted,
        "restored": not hasattr(dist.all_reduce, "counted_by"),
    }


@pytest.mark.slow
@pytest.mark.multiprocess
def test_every_kind_counted_by_the_direct_model():
    results = launch(_every_kind, 4, timeout_s=120)
    for result in results:
        pp_rank, dp_rank = result["coords"]
        c = result["counted"]
        assert result["uncounted"] == {}
        assert result["restored"]
        assert c["all_reduce"]["groups"]["dp"] == {
            "calls": 1, "bytes_sent": 24, "bytes_received": 24, "bytes": 48,
        }  # fmt: skip
        root = pp_rank == 0
        assert c["broadcast"]["groups"]["pp"]["bytes_sent"] == (24 if root else 0)
        assert c["broadcast"]["groups"]["pp"]["bytes_received"] == (0 if root else 24)
        # all_gather_into_tensor counted once (not again as the all_gather_single it calls).
        assert c["all_gather"]["groups"]["dp"]["calls"] == 1
        assert c["all_gather"]["groups"]["dp"]["bytes_sent"] == 24
        assert c["all_gather"]["groups"]["dp"]["bytes_received"] == 24
        assert c["all_gather"]["groups"]["world"] == {
            "calls": 1, "bytes_sent": 72, "bytes_received": 72, "bytes": 144,
        }  # fmt: skip
        assert c["reduce_scatter"]["groups"]["ep"]["bytes_sent"] == 12
        assert c["reduce_scatter"]["groups"]["ep"]["bytes_received"] == 12
        # All-to-all: sends its d+1 rows to the other dp rank, receives the other's rows.
        a2a = c["all_to_all"]["groups"]["dp"]
        assert a2a["bytes_sent"] == (dp_rank + 1) * 8
        assert a2a["bytes_received"] == (2 - dp_rank) * 8
        kind = "send" if root else "recv"
        assert c[kind]["calls"] == 2 and c[kind]["bytes"] == 32
        # A p2p stream's group is named after the stream (`models.runtime.p2p`).
        assert c[kind]["groups"]["world"]["bytes"] == 24
        assert c[kind]["groups"]["forward0"]["bytes"] == 8
        assert "recv" not in c if root else "send" not in c
        assert c["barrier"]["calls"] == 1 and c["barrier"]["bytes"] == 0


def test_counter_refuses_a_second_install_and_counting_before_install():
    counter = CommunicationCounter()
    with pytest.raises(RuntimeError, match="install the counter first"):
        with counter.counting():
            pass
    with counter:
        with pytest.raises(RuntimeError, match="already installed"):
            with CommunicationCounter():
                pass
    assert not hasattr(dist.all_reduce, "counted_by")


def test_traffic_sums():
    a, b = Traffic(1, 10, 20), Traffic(2, 1, 2)
    a.add(b)
    assert (a.calls, a.sent, a.received, a.bytes) == (3, 11, 22, 33)
