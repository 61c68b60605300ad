"""`twinpipe train`: the config from TOML, ``--set`` and flags; ranks from torchrun or here.

Before any process group starts, `optimized.train.preflight.plan_run` checks the config
against every file it names (model, weights, data, outputs, the checkpoint folder's
owner); a problem exits 2 naming the key, the value and what would be valid, and a run
already trained as far as asked exits 0 saying so.

Under ``torchrun`` (``RANK``/``WORLD_SIZE`` in the environment) every process checks, then
joins the environment's rendezvous (NCCL on GPUs, gloo on CPU). Otherwise the ranks are
spawned on this machine with `models.runtime.launch`, on the device ``device`` resolves
to (`models.runtime.device`: one GPU per rank, else the CPU), and it forwards SIGTERM and SIGINT to
them: they save and stop at the end of the step.

Exit codes: 0 trained to ``steps`` (or nothing to do); 2 bad input; 3 a rank failed (its
traceback, or the signal that killed it), a non-finite loss stopped the run, or a
checkpoint had to be saved somewhere other than ``checkpoint.dir``; 128 + N when signal N
stopped the run early (143 for SIGTERM, 130 for Ctrl-C), after saving.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from models.runtime import BadInput
from optimized.train.config_io import add_config_arguments, config_from_args, print_config

EXIT_BAD_INPUT, EXIT_CRASH = 2, 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config as TOML and exit"
    )
    add_config_arguments(parser)


def _rank_main(cfg, plan=None) -> dict:
    import torch  # noqa: PLC0415

    from models.runtime import bf16_gemm, float32_products, rank_device  # noqa: PLC0415
    from optimized.train.trainer import train  # noqa: PLC0415

    dtype, device = getattr(torch, cfg.dtype), rank_device()
    widened, why = float32_products(dtype, device)
    if widened and os.environ.get("RANK", "0") == "0":
        print(f"note: {why}", file=sys.stderr, flush=True)
    with bf16_gemm(dtype, device):  # CPUs without native bfloat16 GEMM (models.runtime.cpu_gemm)
        return train(cfg, plan)


def _error(message: str) -> int:
    print(f"twinpipe train: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _outcome(result: dict, steps: int) -> int:
    """The exit code of a run whose ranks all returned."""
    if result.get("rescued"):
        print(
            f"twinpipe train: error: checkpoint.dir could not be written; the checkpoints "
            f"are in {result['rescued']}",
            file=sys.stderr,
        )
        return EXIT_CRASH
    if result.get("signal"):
        name = signal.Signals(result["signal"]).name
        print(
            f"twinpipe train: stopped by {name} after step {result['stopped_at']} of {steps}",
            file=sys.stderr,
        )
        return 128 + int(result["signal"])
    return 0


def _resolve_device(cfg, nproc: int, under_torchrun: bool):
    """The ranks' device (`models.runtime.resolve_device`), before any rank starts. Under
    torchrun this process is a rank: its device goes into its environment, where
    `models.runtime.init_process_group` reads it, and must match the Triton mode this
    process already chose (``TWINPIPE_DEVICE=cpu`` in torchrun's environment chooses the
    CPU from the start)."""
    from models.runtime import DEVICE_ENV, DeviceError, resolve_device  # noqa: PLC0415

    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if under_torchrun else nproc
    layout = f"PP {cfg.parallel.pp} x DP {cfg.parallel.dp}"
    device = resolve_device(cfg.device, local, layout)
    if under_torchrun:
        interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
        if interpreted != device.interpreted:
            raise DeviceError(
                f"device: this rank computes on {device.kind} but started with "
                f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}; start torchrun "
                f"with {DEVICE_ENV}={device.kind} in its environment"
            )
        os.environ[DEVICE_ENV] = device.kind
    return device


def run(args: argparse.Namespace) -> int:
    from optimized.train.preflight import NothingToDo, plan_run  # noqa: PLC0415

    try:
        cfg = config_from_args(args)
    except ValueError as error:
        return _error(str(error))
    if args.print_config:
        print_config(cfg)
        return 0
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = cfg.parallel.world_size
    if under_torchrun and int(os.environ["WORLD_SIZE"]) != world:
        return _error(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} does not match "
            f"parallel.pp * parallel.dp = {world}"
        )
    nproc = cfg.parallel.nproc or world
    if not under_torchrun and nproc != world:
        return _error(
            f"parallel.nproc = {nproc} is less than the world size {world}; use torchrun "
            "to run on several machines"
        )
    speaks = not under_torchrun or os.environ["RANK"] == "0"
    try:
        plan = plan_run(cfg)
    except BadInput as error:
        return _error(str(error)) if speaks else EXIT_BAD_INPUT
    except NothingToDo as done:
        if speaks:
            print(f"twinpipe train: {done}")
        return 0
    try:
        device = _resolve_device(cfg, nproc, under_torchrun)
    except ValueError as error:
        return _error(str(error)) if speaks else EXIT_BAD_INPUT
    if speaks:
        for note in plan.notes:
            print(f"warning: {note}", file=sys.stderr, flush=True)
        if device.note:
            print(device.note, file=sys.stderr, flush=True)
    from models.runtime import RankFailed, init_process_group, launch  # noqa: PLC0415

    limit = max(cfg.timeout, cfg.setup_timeout)  # tightened to cfg.timeout after the warm-up
    if under_torchrun:
        init_process_group(limit)
        result = _rank_main(cfg, plan)
        import torch.distributed as dist  # noqa: PLC0415

        dist.destroy_process_group()
        return _outcome(result, cfg.steps)
    try:
        results = launch(_rank_main, world, (cfg, plan), timeout_s=limit, device=device)
    except RankFailed as error:
        print(f"twinpipe train: a rank failed:\n{error}", file=sys.stderr)
        return 128 + error.signal if error.signal else EXIT_CRASH
    return _outcome(results[0], cfg.steps)
