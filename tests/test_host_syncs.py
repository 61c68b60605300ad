"""A steady-state `twinpipe train` step does not hold the host back: its host
synchronisations, counted on every rank (`models.runtime.host_sync`), stay within a budget.

On one H100 the optimized stack's step spent 28% of the GPU's busy time in host-device
copies and left the GPU idle a third of the step (`../shared/GPU.md`): every ``.item()``,
``.tolist()``, ``nonzero`` or host copy stops the host until the device catches up. The
CPU cannot time that, but it can count the calls that cause it. The second step of
`twinpipe train` (the optimized stack, FSDP2 and `ShardedAdamW`, as the command runs) is
counted at PP 1 and PP 2 with EP 2, and held on each rank to

    budget = PER_STEP + PER_MICRO_BATCH * M + PER_MOE_LAYER_MICRO_BATCH * L * M

with ``M`` micro-batches and ``L`` MoE layers on the rank:

- ``PER_STEP = 1``: the logged values (loss, gradient norm, z-loss, the expert load of
  every MoE layer: `optimized.train.expert_load`) in one read;
- ``PER_MICRO_BATCH = 0``: nothing per micro-batch (the loss checks its targets on the
  device);
- ``PER_MOE_LAYER_MICRO_BATCH = 1``: the all-to-all split sizes of a MoE layer's forward,
  send and receive counts in one copy (the receive buffers and the grouped expert buffer
  are sized from them; the backward reuses them).

No host copy, data-dependent shape or pinned allocation is allowed at all. Reads of values
that live on the host by construction (the host group's metrics, AdamW's step count, the
pinned buffer the counts were copied into) are noted apart and must come from the sites
listed in `HOST_SIDE_SITES`.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import pytest
import torch

from models.network import host_side
from models.runtime import HostSyncCounter, count_by_kind, describe_syncs, launch
from optimized.ops import cross_entropy, linear_cross_entropy
from optimized.train import TrainConfig, apply_overrides, validate_config

pytestmark = [pytest.mark.multiprocess]

PER_STEP, PER_MICRO_BATCH, PER_MOE_LAYER_MICRO_BATCH = 1, 0, 1
WATCHED_STEP = 2
"""The step counted (1-based): the second, once every lazy first-step allocation is done."""
HOST_SIDE_SITES = {
    "optimized/train/trainer.py",
    "optimized/train/metrics.py",
    "optimized/train/optimizer.py",
    "optimized/ops/grouped_linear.py",
}
"""Files whose reads of host-resident tensors (inside `models.network.host_side`) a step
may make: the metrics' host-group reductions, AdamW's step count, the interpreter-only
tail of the grouped GEMM."""


def budget(micro_batches: int, moe_layers: int) -> int:
    return (
        PER_STEP
        + PER_MICRO_BATCH * micro_batches
        + PER_MOE_LAYER_MICRO_BATCH * moe_layers * micro_batches
    )


def _count_rank(cfg: TrainConfig) -> dict:
    """Train ``cfg``, counting the host synchronisations of `WATCHED_STEP` on this rank."""
    import torch.distributed as dist  # noqa: PLC0415

    from models.network import preset  # noqa: PLC0415
    from models.runtime import HostSyncCounter, rank_chunks
    from optimized.pipeline.runner import default_partition  # noqa: PLC0415
    from optimized.train.trainer import parallel_config, train  # noqa: PLC0415

    counter, seen = HostSyncCounter(), {}

    @contextmanager
    def watch(step: int):
        if step != WATCHED_STEP:
            yield
            return
        with counter, counter.counting():
            yield
        seen["events"], seen["host"] = list(counter.events), list(counter.host_events)

    train(cfg, step_watch=watch)
    model = preset(cfg.model.name)
    parallel = parallel_config(cfg, model)
    pp_rank = dist.get_rank() // parallel.dp  # rank = pp_rank * DP + dp_rank
    chunks = rank_chunks(default_partition(model, parallel), pp_rank)
    moe = sum(model.is_moe_layer(i) for i in chunks[0] + chunks[1])
    return {"moe_layers": moe, **seen}


def _config(*overrides: str) -> TrainConfig:
    base = ["data.seq_len=16", "data.micro_batch_size=1", "steps=2", "optim.warmup_steps=1"]
    return validate_config(apply_overrides(TrainConfig(), base + list(overrides)))


def test_the_counter_sees_each_kind():
    """Every kind is seen once per call; a read inside `host_side` of a CPU tensor is noted
    apart; device-side checks and sizes given by the caller are no events."""
    x = torch.arange(6)
    with HostSyncCounter() as counter:
        x.tolist()  # not counting yet
        with counter.counting():
            x[1].item()
            bool(x[0] > 1)
            x.tolist()
            x.cpu()
            torch.tensor([1, 2], device=x.device)
            x[x > 2]
            torch.repeat_interleave(x, x)
            x.nonzero()
            torch.repeat_interleave(x, x, output_size=15)
            x.repeat_interleave(2)
            torch._assert_async(x.sum() > 0, "never")
            with host_side():
                x.tolist()
        events, host = counter.events, counter.host_events
    assert [e.what for e in events] == [
        "Tensor.item", "Tensor.__bool__", "Tensor.tolist", "Tensor.cpu",
        "torch.tensor(data, device)", "aten.index (boolean mask)",
        "aten.repeat_interleave (no output_size)", "aten.nonzero",
    ]  # fmt: skip
    assert count_by_kind(events) == {"read": 3, "copy": 2, "shape": 3, "pin": 0}
    assert [e.what for e in host] == ["Tensor.tolist"]
    assert all(e.site.startswith(__file__) for e in events + host), events


@pytest.mark.parametrize("fused", ["cross_entropy", "linear_cross_entropy"])
def test_the_loss_makes_no_host_sync(fused, compute_device):
    """The fused losses check their targets on the device: forward and backward make no
    host synchronisation (before: one ``bool()`` per call). On the kernels' device (compiled
    on a GPU, where a host read is a real wait); inputs drawn on the CPU and moved before
    the counting starts."""
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(12, 8, generator=generator).to(compute_device)
    weight = torch.randn(40, 8, generator=generator).to(compute_device).requires_grad_()
    target = torch.randint(0, 40, (12,), generator=generator)
    target[3] = -100
    target = target.to(compute_device)
    with HostSyncCounter() as counter, counter.counting():
        if fused == "cross_entropy":
            loss = cross_entropy(hidden @ weight.t(), target, reduction="sum")
        else:
            loss = linear_cross_entropy(hidden, weight, target, reduction="sum")
        loss.backward()
    assert counter.events == [], describe_syncs(counter.events)
    assert weight.grad is not None and torch.isfinite(weight.grad).all()


LAYOUTS = {
    "pp1-dp1-ep1": ("parallel.pp=1", "parallel.dp=1", "parallel.ep=1", "data.micro_batches=2"),
    "pp1-dp2-ep2": ("parallel.pp=1", "parallel.dp=2", "parallel.ep=2", "data.micro_batches=2"),
    "pp2-dp2-ep2": ("parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "data.micro_batches=4"),
}
BALANCING = ("moe.aux_loss=pooled", "moe.aux_loss_coef=0.01", "moe.z_loss_coef=1e-3",
             "moe.expert_bias=true")  # fmt: skip
"""The pooled loss (its counts travel beside the activations), the router z-loss and the
expert bias (its load all-reduced over DP, the update on the device): no read of their own;
the expert load every MoE step logs is read in the step's one read."""
CASES = [
    ("pp1-dp2-ep2", "tiny-deepseek-v2", ()),
    ("pp2-dp2-ep2", "tiny-gpt-oss", ("loss.z_loss=1e-4",)),  # the z-loss read with the loss
    ("pp1-dp1-ep1", "tiny-qwen3-moe", ()),  # one rank, as the H100 profile (GPU.md) ran
    ("pp1-dp1-ep1", "tiny-qwen3-moe", BALANCING),
    ("pp2-dp2-ep2", "tiny-qwen3-moe", BALANCING),
]
"""Each family once, and balancing at PP 1 and 2 (one launch costs about 10 s here);
gradient clipping is on (1.0)."""


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "model", "options"), CASES)
def test_a_steady_step_syncs_the_host_within_budget(layout, model, options):
    cfg = _config(f"model.name={model}", *LAYOUTS[layout], *options)
    ranks = launch(_count_rank, cfg.parallel.world_size, (cfg,))
    report = []
    for rank, result in enumerate(ranks):
        events, moe = result["events"], result["moe_layers"]
        kinds = count_by_kind(events)
        allowed = budget(cfg.data.micro_batches, moe)
        report.append(
            f"rank {rank}: {len(events)} events {kinds}, budget {allowed} "
            f"({moe} MoE layers x {cfg.data.micro_batches} micro-batches)\n"
            f"{describe_syncs(events)}\n  host-side:\n{describe_syncs(result['host'])}"
        )
    text = "\n".join(report)
    print(text)
    for result in ranks:
        events = result["events"]
        kinds = count_by_kind(events)
        assert kinds["copy"] == kinds["shape"] == kinds["pin"] == 0, text
        assert len(events) <= budget(cfg.data.micro_batches, result["moe_layers"]), text
        files = Counter(e.site.split(":")[0] for e in result["host"])
        assert set(files) <= HOST_SIDE_SITES, text
