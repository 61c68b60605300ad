"""Both DualPipeV schedules under NCCL's matching rule: the k-th send from one rank to
another on one communicator is the k-th receive there, tags ignored (`models.runtime.p2p`).

gloo matches by tag, so the multi-process tests cannot see a schedule that relies on
tags. Here the PP ranks of one pipeline run as threads of this process, each with its
own part and its schedule's real ``step()``, and the schedules' `models.runtime.PointToPoint`
seam is an in-process network that matches as NCCL does: per (group, sender, receiver),
in posting order, whatever the tags; a send's ``wait`` returns once the receiver has
taken it; the first operation of a pair of ranks on a group waits for the other rank's
first one there (NCCL creates the pair's communicator on first use, both ranks in it).
The receiver gets a copy of the exact tensor sent. One rank computes at a time (the
network's lock is the baton: a rank lets go of it only while it waits for the network),
since the Triton interpreter is not thread-safe; the matching does not depend on the
interleaving, only on each rank's own order.

Checks, for PP 2, 3, 4, 5 and 8 and M = 2 PP and 2 PP + 1 (past PP 4, M = 2 PP + 1 only): no
deadlock (the network sees every live rank blocked and fails at once, naming what each waits for; a
timeout backs it up); every message taken (none left over); the reference's loss and every gradient
equal, bit for bit in float32, to the whole model run one micro-batch at a time in one process (in
the DualPipeV order, in ``sequential`` mode and forward-only); the optimized stack's within the
float32 bounds of DESIGN.md of that same truth. A message received into a buffer of another shape,
dtype or device fails at once; with the reference's parts on the meta device, every receive buffer
and loss must be made there (the part's device).

Run on the schedules as they were before `models.runtime.p2p` (every stream on the default group,
told apart by tags only), PP 2 passes and PP 3 fails: pp-rank 0's F0 activation and B1
gradient to pp-rank 1 trade places, and the loss differs from the truth.

The pipelines are CPU ranks (more ranks than a machine's GPUs, and bit-exact truths in
float32 on the CPU), so they run on a CPU rank (`tests._ranks.on_cpu_rank`: in place where
this process interprets Triton, in one spawned CPU rank on a GPU machine).
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import pytest
import torch

from models.network import (
    BalancedRouting,
    SeededWeights,
    StateDictWeights,
    attach_routing_tape,
    build_part,
    preset,
)
from models.runtime import (
    Layout,
    StreamGroups,
    even_partition,
    modelled_syncs,
    rank_chunks,
    token_count,
)
from optimized.ops import OptimizedOps
from optimized.pipeline.dualpipev import OptimizedDualPipeV
from reference.dualpipev import ReferenceDualPipeV
from reference.ops import ReferenceOps
from tests._ranks import on_cpu_rank

TIMEOUT_S = 60.0
"""Backstop only: a deadlock is detected as soon as every live rank is blocked."""
LOSS_REL, GRAD_COS, GRAD_REL = 1e-5, 1e-8, 1e-5  # DESIGN.md: optimized vs reference, fp32
FULL_PP = 4
"""Both Ms up to this PP; past it (a run costs as PP squared) only M = 2 PP + 1, the uneven
one. The even M = 2 PP is held at PP 2 to 4 (odd PP with FIFO matching at PP 3, even at 2
and 4)."""
PPS = (2, 3, 4, 5, 8)
"""PP 6 and 7 are not run (docs/testing.md, "Merged or cut elsewhere"): each phase's length
in the DualPipeV order is linear in PP and the rank, so a middle PP meets no case the PPs
of its parity around it do not: odd PP past 3 at the uneven M is PP 5, even PP past 4 is
PP 8 (the most middle ranks)."""


class P2PFailure(AssertionError):
    """The network saw a deadlock, a mismatched message, or another rank's failure."""


@dataclass
class _Sent:
    tensor: torch.Tensor
    taken: bool = False


@dataclass
class FifoNetwork:
    """In-process point-to-point with NCCL's matching (see the module docstring)."""

    ranks: int
    sends: dict = field(default_factory=lambda: defaultdict(list))
    """(group, src, dst) -> every send posted, in order."""
    receives: dict = field(default_factory=lambda: defaultdict(int))
    """(group, src, dst) -> how many receives were posted."""
    joined: dict = field(default_factory=lambda: defaultdict(set))
    """(group, pair) -> the ranks that have used the pair's communicator."""
    blocked: dict = field(default_factory=dict)
    """rank -> (what it waits for, a predicate that says whether it may go on)."""
    done: set = field(default_factory=set)
    failure: str | None = None
    lock: threading.Condition = field(default_factory=threading.Condition)
    actions: dict = field(default_factory=dict)
    """rank -> the schedule action it is in (the schedules' ``observer``)."""
    syncs: list = field(default_factory=list)
    """(rank, action, reason) of every device-wide sync a step asked for."""
    connected: bool = False
    """Every pair's communicators made before the step (`models.runtime.warmup`): a pair's
    first operation waits for nobody. False: NCCL's lazy creation, inside the step."""

    def endpoint(self, rank: int) -> _Endpoint:
        return _Endpoint(self, rank)

    def finish(self, rank: int, error: BaseException | None = None, trace: str = "") -> None:
        with self.lock:
            self.done.add(rank)
            if error is not None and self.failure is None:
                self.failure = f"rank {rank} failed: {type(error).__name__}: {error}\n{trace}"
            self.lock.notify_all()

    def leftovers(self) -> list[str]:
        """Sends never received, and receives that never found a send."""
        out = []
        for key, sent in self.sends.items():
            if self.receives[key] != len(sent):
                out.append(f"{_name(key)}: {len(sent)} sent, {self.receives[key]} received")
        out += [
            f"{_name(key)}: {n} received, 0 sent"
            for key, n in self.receives.items()
            if n and key not in self.sends
        ]
        return out

    def wait_until(self, rank: int, what: str, ready) -> None:
        """Block ``rank`` (the lock held) until ``ready()``; fail on a deadlock."""
        deadline = time.monotonic() + TIMEOUT_S
        while not ready():
            if self.failure is not None:
                raise P2PFailure(f"rank {rank} stopped ({what}): {self.failure}")
            self.blocked[rank] = (what, ready)
            live = set(range(self.ranks)) - self.done
            if live <= set(self.blocked) and not any(r() for _, r in self.blocked.values()):
                waits = "; ".join(f"rank {r} {w}" for r, (w, _) in sorted(self.blocked.items()))
                self.failure = f"deadlock: {waits}"
                self.lock.notify_all()
                raise P2PFailure(self.failure)
            if time.monotonic() > deadline:
                self.failure = f"timed out after {TIMEOUT_S} s: rank {rank} {what}"
                self.lock.notify_all()
                raise P2PFailure(self.failure)
            self.lock.wait(0.5)
            self.blocked.pop(rank, None)
        self.blocked.pop(rank, None)

    def device_sync(self, rank: int, reason: str) -> None:
        """NCCL's second rule: a device-wide sync waits for every send and receive ``rank``
        has posted; a send completes only once the peer has posted its receive (the receive
        runs when posted), a receive once its send exists."""
        with self.lock:
            action = self.actions.get(rank, "?")
            self.syncs.append((rank, action, reason))

            def open_ops() -> list[str]:
                out = []
                for key, sent in self.sends.items():
                    if key[1] == rank and self.receives[key] < len(sent):
                        out.append(f"send #{self.receives[key]} on {_name(key)}")
                for key, n in self.receives.items():
                    if key[2] == rank and len(self.sends[key]) < n:
                        out.append(f"receive #{len(self.sends[key])} on {_name(key)}")
                return out

            what = _Lazy(
                lambda: f"device sync ({reason}) at {action} waits {', '.join(open_ops())}"
            )
            self.wait_until(rank, what, lambda: not open_ops())

    def join(self, rank: int, peer: int, group) -> None:
        """A pair's first operation on ``group`` waits for the peer's (NCCL's lazy init)."""
        if self.connected:
            return
        key = (group, frozenset((rank, peer)))
        self.joined[key].add(rank)
        self.lock.notify_all()
        self.wait_until(
            rank, f"creates the {group} communicator with rank {peer}",
            lambda: peer in self.joined[key],
        )  # fmt: skip


class _Lazy:
    """A description made when printed (what a rank waits for changes while it waits)."""

    def __init__(self, make) -> None:
        self.make = make

    def __str__(self) -> str:
        return self.make()


def _name(key) -> str:
    group, src, dst = key
    return f"{group} {src}->{dst}"


class _Work:
    def __init__(self, network: FifoNetwork, rank: int, what: str, ready, then=None) -> None:
        self.network, self.rank, self.what, self.ready, self.then = network, rank, what, ready, then

    def wait(self) -> bool:
        with self.network.lock:
            self.network.wait_until(self.rank, self.what, self.ready)
            if self.then is not None:
                self.then()
                self.network.lock.notify_all()
        return True


class _Endpoint:
    """One rank's `models.runtime.PointToPoint` on the network. A ``tag`` is accepted and
    ignored, as NCCL ignores it (the schedules pass none; the network's own test does)."""

    def __init__(self, network: FifoNetwork, rank: int) -> None:
        self.network, self.rank = network, rank

    def isend(self, tensor: torch.Tensor, peer: int, group, tag: int = 0) -> _Work:
        net = self.network
        with net.lock:
            net.join(self.rank, peer, group)
            key = (group, self.rank, peer)
            sent = _Sent(tensor)
            net.sends[key].append(sent)
            index = len(net.sends[key]) - 1
            net.lock.notify_all()
        return _Work(net, self.rank, f"waits send #{index} on {_name(key)}", lambda: sent.taken)

    def irecv(self, tensor: torch.Tensor, peer: int, group, tag: int = 0) -> _Work:
        net = self.network
        with net.lock:
            net.join(self.rank, peer, group)
            key = (group, peer, self.rank)
            index = net.receives[key]
            net.receives[key] += 1

        def take() -> None:
            sent = net.sends[key][index]
            a, b = sent.tensor, tensor
            if (a.shape, a.dtype, a.device) != (b.shape, b.dtype, b.device):
                net.failure = (
                    f"{_name(key)} #{index}: sent {tuple(a.shape)} {a.dtype} on {a.device}, "
                    f"received into {tuple(b.shape)} {b.dtype} on {b.device}"
                )
                raise P2PFailure(net.failure)
            tensor.copy_(sent.tensor)
            sent.taken = True

        return _Work(
            net, self.rank, f"waits receive #{index} on {_name(key)}",
            lambda: len(net.sends[key]) > index, take,
        )  # fmt: skip


# ------------------------------------------------------------------ the runs
def _config(pp: int):
    """A tiny Qwen3-MoE with one layer per stage (2 PP stages). One layer is MoE, layer PP
    (the last rank's chunk 1, after its local hand-off), the others dense: the optimized
    stack's expert kernels are the slow part through the Triton interpreter, and the
    schedules' messages do not depend on a layer's kind."""
    return preset(
        "tiny-qwen3-moe", num_hidden_layers=2 * pp, hidden_size=32, vocab_size=128,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=32,
        moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        mlp_only_layers=[i for i in range(2 * pp) if i != pp],
    )  # fmt: skip


def _batches(config, m: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed + m)
    ids = torch.randint(0, config.vocab_size, (m, 1, 9), generator=generator)
    return [(row[:, :-1], row[:, 1:]) for row in ids]


def _layout(pp_rank: int, pp: int) -> Layout:
    """Pipeline rank ``pp_rank`` of a PP x 1 x 1 layout; stream groups named, not created."""
    streams = StreamGroups(*StreamGroups._fields)
    return Layout(pp_rank, pp_rank, 0, 0, pp, 1, 1, None, None, None, None, streams, None)


def build_schedules(stack: str, config, pp: int, weights: dict) -> list:
    """Each pp-rank's part (its slices of ``weights``) and schedule, as the stack's runner
    builds them (even stages)."""
    stages = even_partition(config.num_hidden_layers, 2 * pp)
    schedules = []
    for pp_rank in range(pp):
        chunks = rank_chunks(stages, pp_rank)
        ops = ReferenceOps() if stack == "reference" else OptimizedOps()
        part = build_part(
            config, StateDictWeights(weights), chunks[0] + chunks[1],
            embedding=pp_rank == 0, head=pp_rank == 0, ops=ops,
        )  # fmt: skip
        attach_routing_tape(part, BalancedRouting())
        layout = _layout(pp_rank, pp)
        if stack == "reference":
            schedules.append(ReferenceDualPipeV(part, chunks, layout, ops))
        else:
            schedules.append(OptimizedDualPipeV(part, chunks, layout))
    return schedules


def run_pipeline(
    schedules: list, batches, mode: str, tokens: int | None = None, plant=None, network=None
) -> list[dict]:
    """Every pp-rank's ``step()`` as a thread on one `FifoNetwork`; per rank its loss share
    and gradients (``mode``: ``dualpipev``, ``sequential`` or ``forward-only``). A device-wide
    sync inside a step (`models.runtime.device_sync`) is modelled as NCCL runs it (it waits
    for the rank's posted sends and receives) and fails the run even where it does not hang.
    ``plant(rank, action)``, when given, is called at every action (a planted sync)."""
    pp = len(schedules)
    network = network or FifoNetwork(pp)
    results: list[dict | None] = [None] * pp
    if tokens is None:
        tokens = token_count(torch.stack([labels for _, labels in batches]))

    def rank_main(r: int) -> None:
        schedule = schedules[r]
        schedule.p2p = network.endpoint(r)
        if isinstance(schedule, ReferenceDualPipeV):  # the optimized stack has no such mode
            schedule.sequential = mode == "sequential"
        schedule.part.zero_grad(set_to_none=True)

        def observe(moment: str, micro_batch) -> None:
            network.actions[r] = f"{moment} micro-batch {micro_batch}"
            if plant is not None:
                plant(r, moment)

        schedule.observer = observe
        model = modelled_syncs(lambda reason: network.device_sync(r, reason))
        with network.lock, model:  # one rank computes at a time; it lets go only to wait
            try:
                loss = schedule.step(batches, tokens, forward_only=mode == "forward-only")
                grads = {n: p.grad.clone() for n, p in schedule.part.named_parameters()
                         if p.grad is not None}  # fmt: skip
                results[r] = {"loss": loss.clone(), "grads": grads}
            except BaseException as error:  # noqa: BLE001 - reported by the network
                network.finish(r, error, traceback.format_exc())
                return
            network.finish(r)

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(pp)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S * 2)
    if network.failure is not None:
        stack = type(schedules[0]).__name__
        raise P2PFailure(f"{stack} {mode} PP={pp} M={len(batches)}: {network.failure}")
    assert not any(t.is_alive() for t in threads), "a rank is still running"
    assert network.leftovers() == [], network.leftovers()
    if network.syncs and plant is None:
        raise P2PFailure(f"device-wide syncs inside the step: {network.syncs}")
    return results


def truth(model, batches) -> dict:
    """The whole model in one process, one micro-batch at a time: loss and gradients."""
    model.zero_grad(set_to_none=True)
    tokens = token_count(torch.stack([labels for _, labels in batches]))
    total = torch.zeros((), dtype=torch.float32)
    for ids, labels in batches:
        hidden = model.embed(ids)
        for index in range(model.config.num_hidden_layers):
            hidden = model.layer(index)(hidden, model.ops)
        loss = model.loss_sum(hidden, labels) / tokens
        total = total + loss.detach()
        loss.backward()
    return {"loss": total, "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def whole_model(config):
    model = build_part(config, SeededWeights(config, seed=5), ops=ReferenceOps())
    attach_routing_tape(model, BalancedRouting())
    return model


def _held(results: list[dict]) -> dict:
    grads = {}
    for rank in results:
        for name, grad in rank["grads"].items():
            assert name not in grads, f"{name} held by two ranks"
            grads[name] = grad
    return grads


def _check_exact(results: list[dict], expected: dict, what: str, forward_only: bool) -> None:
    assert torch.equal(results[0]["loss"], expected["loss"]), (what, results[0]["loss"])
    assert all(float(r["loss"]) == 0.0 for r in results[1:]), what
    grads = _held(results)
    if forward_only:
        assert grads == {}, what
        return
    assert grads.keys() == expected["grads"].keys(), what
    for name, grad in grads.items():
        assert torch.equal(grad, expected["grads"][name]), (what, name)


def _check_close(results: list[dict], expected: dict, what: str, forward_only: bool) -> None:
    loss, want = float(results[0]["loss"]), float(expected["loss"])
    assert abs(loss - want) <= LOSS_REL * abs(want), (what, loss, want)
    grads = _held(results)
    if forward_only:
        assert grads == {}, what
        return
    assert grads.keys() == expected["grads"].keys(), what
    for name, grad in grads.items():
        got, want = grad.double().flatten(), expected["grads"][name].double().flatten()
        cos = float(torch.dot(got, want) / (got.norm() * want.norm()))
        assert 1 - cos <= GRAD_COS, (what, name, 1 - cos)
        assert float((got - want).norm() / want.norm()) <= GRAD_REL, (what, name)


@contextmanager
def _one_thread():
    """One intra-op thread: the ranks take turns anyway, and a tiny step's matmuls are
    several times slower with two OpenMP threads on a loaded 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "pp",
    [pytest.param(pp, marks=[pytest.mark.slow] if pp >= 3 else []) for pp in PPS],
    ids=lambda pp: f"pp{pp}",
)
def test_both_schedules_right_under_fifo_matching(pp):
    """M = 2 PP and 2 PP + 1 (past `FULL_PP`, 2 PP + 1 only). The reference in the DualPipeV order
    and ``sequential``, and forward-only: the loss and every gradient bit for bit the
    single-process model's. The optimized stack (F&B overlap, zero-bubble W steps, early
    frees of sent activations) in its order, and forward-only: within DESIGN.md's float32
    bounds of the same truth (its kernels differ). Forward-only runs at one M: its messages
    (every F0, then every F1) do not depend on M."""
    on_cpu_rank(_check_both_schedules, pp)


@_one_thread()
def _check_both_schedules(pp: int) -> None:
    config = _config(pp)
    model = whole_model(config)
    weights = model.state_dict()
    reference = build_schedules("reference", config, pp, weights)
    optimized = build_schedules("optimized", config, pp, weights)
    for m in (2 * pp, 2 * pp + 1) if pp <= FULL_PP else (2 * pp + 1,):
        batches = _batches(config, m)
        expected = truth(model, batches)
        modes = ("dualpipev", "sequential") + (("forward-only",) if m > 2 * pp else ())
        for mode in modes:
            results = run_pipeline(reference, batches, mode)
            _check_exact(results, expected, f"reference {mode} M={m}", mode == "forward-only")
        for mode in ("dualpipev",) + modes[2:]:
            results = run_pipeline(optimized, batches, mode)
            _check_close(results, expected, f"optimized {mode} M={m}", mode == "forward-only")


@pytest.mark.slow
def test_reference_buffers_and_losses_live_on_the_parts_device():
    """Receive buffers and loss accumulators are made on the part's device, not the CPU:
    the reference's parts on the meta device (a dense model: shapes only, no kernels), where
    a CPU buffer meets a meta tensor and fails (on GPUs NCCL would refuse it)."""
    pp, m = 3, 6
    config = replace(_config(pp), mlp_only_layers=list(range(2 * pp)))
    stages = even_partition(config.num_hidden_layers, 2 * pp)
    schedules = []
    for pp_rank in range(pp):
        chunks = rank_chunks(stages, pp_rank)
        ops = ReferenceOps()
        part = build_part(
            config, SeededWeights(config), chunks[0] + chunks[1], embedding=pp_rank == 0,
            head=pp_rank == 0, ops=ops, device="meta",
        )  # fmt: skip
        schedules.append(ReferenceDualPipeV(part, chunks, _layout(pp_rank, pp), ops))
    batches = [(ids.to("meta"), labels.to("meta")) for ids, labels in _batches(config, m)]
    for mode in ("dualpipev", "forward-only"):
        results = run_pipeline(schedules, batches, mode, tokens=m * 8)
        assert {r["loss"].device.type for r in results} == {"meta"}, mode
        assert {g.device.type for r in results for g in r["grads"].values()} <= {"meta"}, mode


def test_the_network_matches_in_order_per_pair_ignoring_tags():
    """The network itself: two sends with different tags on one group arrive in posting
    order (NCCL's rule, not gloo's); a rank waiting for a message nobody sends is a
    deadlock, reported at once with what each rank waits for."""
    network = FifoNetwork(2)
    a, b = network.endpoint(0), network.endpoint(1)
    first, second = torch.tensor([1.0]), torch.tensor([2.0])
    received = torch.empty(1)

    def sender() -> None:
        a.isend(first, 1, "world", tag=7)
        a.isend(second, 1, "world", tag=3)

    thread = threading.Thread(target=sender)
    thread.start()
    b.irecv(received, 0, "world", tag=3).wait()
    thread.join()
    assert float(received) == 1.0  # the first send, although the receive asked for tag 3
    b.irecv(received, 0, "world", tag=7).wait()
    assert float(received) == 2.0
    network.finish(0)
    with pytest.raises(P2PFailure, match=r"deadlock: rank 1 waits receive #2 on world 0->1"):
        b.irecv(received, 0, "world").wait()
