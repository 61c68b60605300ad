"""Local ranks: spawn them, forward the launcher's signals to them, and name the one that
failed first.

`launch` runs a function on N local processes joined by gloo (or NCCL, one GPU each, when
the caller's `models.runtime.DevicePlan` says CUDA); `torchrun` is the other way in
(`init_process_group` joins its rendezvous). Two things a launcher must get
right, and `torch.multiprocessing`'s own join does not:

- **Signals.** ``kill PID``, ``docker stop`` and systemd send SIGTERM to the launcher
  only. It forwards SIGTERM and SIGINT to every live rank, so a trainer saves and stops
  instead of being orphaned or ignored; `RankFailed.signal` and the caller's exit code
  (128 + the signal) say the work stopped early.
- **The root cause.** Once one rank dies, its peers fail too (gloo: "Connection reset by
  peer"), often before the launcher notices the first. A rank that raised writes its
  traceback with a time stamp, and the earliest is the root cause; but a rank killed by a
  signal (``kill -9``, the out-of-memory killer) writes nothing. So every rank's exit
  status is kept, and a rank that died by a signal the launcher did not send, without a
  traceback, is named first, with the signal.

One thing the ranks need on a CPU host: glibc's malloc raises its mmap threshold each time
a large block is freed, so later large tensors come from the heap, whose freed pages stay
resident. A rank's RSS then keeps the high-water mark of every transient it ever made: at
mid-qwen3-moe width (`twinpipe compare`, PP2 DP2 EP2, 128 tokens) 5.4 GiB against 2.2 GB
of live tensors, and four ranks did not fit in 24 GiB. `MALLOC_ENV` fixes the threshold
(and the trim threshold) for the ranks, so large blocks are mapped and returned on free:
3.1 GiB. A value the user set is kept.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from models.runtime.device import DevicePlan, rank_device, resolve_device
from models.runtime.device_sync import guard_torch_syncs

DEFAULT_TIMEOUT_S = 120.0
"""The collective timeout a launch gives its ranks; a run that compiles, tunes or loads
before its first step launches with its longest phase limit and tightens the groups to the
steps' own after the warm-up (`models.runtime.warmup`)."""
PEER_GRACE_S = 20.0
"""After the first rank fails, how long its peers get to fail on their own (and write
their tracebacks) before they are killed."""
FORWARDED = (signal.SIGTERM, signal.SIGINT)


def init_process_group(timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.device:
    """Join the job from the environment (torchrun or `launch`); return this rank's device.

    A rank on a GPU takes ``cuda:LOCAL_RANK`` and joins with NCCL for CUDA tensors and gloo
    for CPU ones (one group serves both: host-side scalars and objects need no group of
    their own); a CPU rank joins with gloo."""
    device = rank_device()
    if dist.is_initialized():
        return device
    guard_torch_syncs()  # no device-wide sync inside a scheduled step (models.runtime.device_sync)
    backend, bound = "gloo", {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
        bound = {"device_id": device}  # NCCL's communicator made now, bound to this GPU
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **bound)
    return device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


START_METHOD = "forkserver"
"""How ranks start: forked from a server process that has imported torch once
(`PRELOADED`), rather than spawned afresh, each importing torch itself (seconds per rank on
a small host: the whole test suite launches ranks some hundreds of times). The server is
started by the first launch of a process and serves every later one. The `twinpipe` command
forks its ranks from itself instead, where that is sound (`fork_is_safe`): it has imported
all of that already, and would wait seconds for a server to import it again."""
_FORK_ALLOWED = False
"""Set by `allow_forked_ranks`: this process is the `twinpipe` command."""


def allow_forked_ranks() -> None:
    """Let this process's launches fork their ranks from it where that is sound
    (`fork_is_safe`). The `twinpipe` command's entry point calls it; a process that calls
    `harness.cli.main` itself (a test) does not: its patches and threads are its own, and
    its ranks come from the rank server."""
    global _FORK_ALLOWED
    _FORK_ALLOWED = True


PRELOADED = ["torch", "torch.distributed", "numpy", "models.runtime"]
"""What the rank server imports once: torch and this package (FSDP2 and DTensor included),
nothing that reads the environment at import time. ``triton`` (whose interpreter switch a
rank's environment sets) and the stacks' kernels are imported by each rank after it takes
its launcher's environment at the start of `_worker`. (`models.choose_triton_mode` runs in
the server too, on the server's own environment, which no rank keeps.)"""


def fork_is_safe(rank_environment: dict[str, str]) -> tuple[bool, str]:
    """(whether this process may fork its ranks, why not). The `twinpipe` command has
    imported torch and the stacks already; forked from it, the ranks skip the rank server's
    start (its own imports: about 4 s of a 2-core machine's CPU per command). Only where
    forking is sound: this process asked for it (`allow_forked_ranks`), it runs one Python
    thread (another one's locks would be copied held) and no process group, no CUDA context
    exists (CUDA does not survive a fork), and ``triton``, if imported, was imported in the
    ranks' own Triton mode. An OpenMP pool the launcher's own torch work started is left
    behind, as for torch's DataLoader workers: a rank sets one intra-op thread before its
    first op, and one thread runs no parallel region."""
    if not _FORK_ALLOWED:
        return False, "this process is not the twinpipe command"
    if threading.active_count() != 1:
        return False, f"this process runs {threading.active_count()} Python threads"
    if dist.is_available() and dist.is_initialized():
        return False, "this process is in a process group (its threads and sockets)"
    if torch.cuda.is_initialized():
        return False, "this process holds a CUDA context"
    wanted = rank_environment.get("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET"))
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != wanted:
        return False, "triton was imported in another mode than the ranks'"
    return True, ""


_MALLOPT = {"MALLOC_MMAP_THRESHOLD_": -3, "MALLOC_TRIM_THRESHOLD_": -1}
"""glibc's ``mallopt`` parameter of each `MALLOC_ENV` setting (M_MMAP_THRESHOLD,
M_TRIM_THRESHOLD)."""


def _apply_malloc_settings() -> None:
    """`MALLOC_ENV` (as the rank's environment has it) set through ``mallopt``, as glibc
    sets it from the environment at a process's start: a forked rank started long ago, in
    its launcher. No-op where glibc is not the allocator."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    for key in MALLOC_ENV:
        value = os.environ.get(key)
        if value is not None and value.isdigit():
            libc.mallopt(_MALLOPT[key], int(value))


def _worker(
    local_rank: int,
    payload: bytes,
    environment: dict[str, str],
    world_size: int,
    port: int,
    result_dir: str,
    timeout_s: float,
) -> None:
    # The launcher's environment as it was at the launch (the rank server's is its own from
    # when it started), then the function and its arguments: unpickling them imports their
    # modules, which may read it.
    torch.set_num_threads(1)  # first: a forked rank must run no parallel region (fork_is_safe)
    os.environ.clear()
    os.environ.update(environment)
    _apply_malloc_settings()  # a forked rank's glibc read its environment long ago
    fn, args = pickle.loads(payload)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
    )
    # What the imports made lives as long as the rank: moved out of the cyclic collector's
    # reach, each collection (the memory tracker runs one per measured step) walks only what
    # the work made since, not the ~300,000 objects of torch, triton and the project (about
    # 0.25 s a collection, 10-15% of a measured compare on CPU). Garbage is still freed as
    # soon as it is made.
    gc.freeze()
    try:
        # Inside the try: a rank that cannot take its GPU reports why, with its traceback.
        init_process_group(timeout_s)
        result = fn(*args)
    except BaseException:
        # Note when and how this rank failed: once one rank dies, its peers fail too
        # (their connections close), and the launcher reports the first failure, the
        # root cause, rather than whichever secondary failure it happens to see first.
        with open(os.path.join(result_dir, f"error{local_rank}.txt"), "w") as f:
            f.write(f"{time.time()!r}\n{traceback.format_exc()}")
        # This rank ends through the interpreter's finalization, which collects only what
        # is not frozen: left frozen, triton's bindings report their objects as leaked.
        gc.unfreeze()
        raise
    torch.save(result, os.path.join(result_dir, f"rank{local_rank}.pt"))
    dist.destroy_process_group()
    # The rank's work is done and written. End the process here rather than through the
    # interpreter's finalization: there the process groups' C++ objects, still referenced
    # by the layout, are destroyed after the interpreter is gone, and a gloo worker thread
    # that is still joinable then aborts the process ("terminate called without an active
    # exception", SIGABRT; seen once in a CI run of tests/test_checkpoint_peaks.py after
    # both ranks had finished). Nothing a rank writes relies on finalization: files are
    # closed where they are written, and the standard streams are flushed here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class RankFailed(RuntimeError):
    """A rank of a launched job failed; the message names it, how, and its traceback.

    ``signal`` is the signal the launcher received and forwarded (0: none): the job was
    stopped rather than broken."""

    def __init__(self, message: str, signal: int = 0) -> None:
        super().__init__(message)
        self.signal = signal


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _tracebacks(result_dir: str) -> dict[int, tuple[float, str]]:
    found = {}
    for name in os.listdir(result_dir):
        if name.startswith("error") and name.endswith(".txt"):
            with open(os.path.join(result_dir, name)) as f:
                stamp, _, trace = f.read().partition("\n")
            found[int(name[5:-4])] = (float(stamp), trace)
    return found


def _last_line(trace: str) -> str:
    lines = [line for line in trace.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no message)"


def describe_failure(
    exit_codes: dict[int, int], tracebacks: dict[int, tuple[float, str]], killed_here: set[int]
) -> str:
    """Which rank failed first and how, from every rank's exit code and traceback.

    A rank that died by a signal the launcher did not send, leaving no traceback, is the
    root cause; else the earliest traceback; else the first non-zero exit code."""
    killed = sorted(
        r
        for r, code in exit_codes.items()
        if code < 0 and r not in killed_here and r not in tracebacks
    )
    if killed:
        first = killed[0]
        name = _signal_name(-exit_codes[first])
        text = f"rank {first} was killed by {name} (signal {-exit_codes[first]})"
        if name == "SIGKILL":
            text += "; the kernel's out-of-memory killer sends SIGKILL too (see dmesg)"
        if killed[1:]:
            text += f"; ranks {killed[1:]} were killed too"
        after = sorted(tracebacks, key=lambda r: tracebacks[r][0])
        for rank in after:
            text += f"\n  rank {rank} failed after it: {_last_line(tracebacks[rank][1])}"
        return text
    if tracebacks:
        rank = min(tracebacks, key=lambda r: tracebacks[r][0])
        others = sorted(r for r in tracebacks if r != rank)
        also = f" (ranks {others} failed after it)" if others else ""
        return f"rank {rank} failed first{also}:\n{tracebacks[rank][1]}"
    failed = sorted(r for r, code in exit_codes.items() if code != 0 and r not in killed_here)
    if failed:
        rank = failed[0]
        return f"rank {rank} exited with code {exit_codes[rank]} and left no traceback"
    return "a rank ended without a result"


MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "4194304", "MALLOC_TRIM_THRESHOLD_": "4194304"}
"""glibc settings the ranks start with (4 MiB: tensors past it are mapped, so freed ones
are returned to the system; smaller blocks keep the fast heap)."""


def launch(
    fn: Callable,
    world_size: int,
    args: tuple = (),
    timeout_s: float = DEFAULT_TIMEOUT_S,
    device: DevicePlan | str = "cpu",
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` local processes; return each rank's result.

    ``device`` is where the ranks compute (`models.runtime.resolve_device`'s plan, or
    ``cpu`` / ``cuda`` / ``auto`` resolved here): each rank starts with it and its Triton
    mode in its environment, and a CUDA rank ``i`` takes GPU ``i``. The default is the CPU,
    so that a caller gets a GPU only by asking for one.

    A rank that fails ends every rank: its peers get `PEER_GRACE_S` to fail on their
    own, then are killed, and `RankFailed` names the root cause. SIGTERM and SIGINT sent
    to this process are forwarded to every rank; a job that then does not return on
    every rank raises `RankFailed` with ``signal`` set. A rank stuck in a collective
    times out after ``timeout_s``.
    """
    if isinstance(device, str):
        device = resolve_device(device, world_size)
    for key, value in MALLOC_ENV.items():  # read by each spawned rank's glibc at start
        os.environ.setdefault(key, value)
    with tempfile.TemporaryDirectory(prefix="twinpipe-") as result_dir:
        payload = pickle.dumps((fn, args))
        rank_environment = device.rank_environment()
        forked, _ = fork_is_safe(rank_environment)
        if not forked:
            multiprocessing.set_forkserver_preload(PRELOADED)
        with _environment(rank_environment):  # each rank's, before it imports
            environment = dict(os.environ)
            context = mp.start_processes(
                _worker,
                args=(payload, environment, world_size, _free_port(), result_dir, timeout_s),
                nprocs=world_size,
                join=False,
                start_method="fork" if forked else START_METHOD,
            )
        processes = context.processes
        received: list[int] = []

        def forward(signum: int, frame: Any) -> None:
            received.append(signum)
            for process in processes:
                if process.exitcode is None:
                    os.kill(process.pid, signum)

        previous = {}
        for signum in FORWARDED:
            try:
                previous[signum] = signal.signal(signum, forward)
            except ValueError:  # not the main thread: signals reach this thread's owner
                pass
        try:
            killed_here = _join(processes)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            for file in context.error_files:
                if file and os.path.exists(file):
                    os.unlink(file)
        exit_codes = {rank: process.exitcode for rank, process in enumerate(processes)}
        results = [os.path.join(result_dir, f"rank{r}.pt") for r in range(world_size)]
        if any(exit_codes.values()) or not all(os.path.exists(r) for r in results):
            message = describe_failure(exit_codes, _tracebacks(result_dir), killed_here)
            if received:
                message = f"stopped by {_signal_name(received[0])}: {message}"
            raise RankFailed(message, received[0] if received else 0)
        return [torch.load(r, weights_only=False) for r in results]


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` while the block runs (spawned children inherit it)."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _join(processes: list) -> set[int]:
    """Wait for every process; after the first failure give the rest `PEER_GRACE_S`, then
    kill them. Returns the ranks killed here."""
    failed_at = None
    killed_here: set[int] = set()
    while True:
        alive = {p.sentinel: r for r, p in enumerate(processes) if p.exitcode is None}
        if not alive:
            return killed_here
        wait(list(alive), timeout=1.0)
        for rank in alive.values():
            processes[rank].join(timeout=0)
            if processes[rank].exitcode not in (None, 0) and failed_at is None:
                failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > PEER_GRACE_S:
            for rank, process in enumerate(processes):
                if process.exitcode is None:
                    process.kill()
                    killed_here.add(rank)
            for process in processes:
                process.join()
