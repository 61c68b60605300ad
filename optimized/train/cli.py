"""`twinpipe train`: the config from TOML, ``--set`` and flags; ranks from torchrun or here.

Under ``torchrun`` (``RANK``/``WORLD_SIZE`` in the environment) every process joins the
environment's rendezvous (NCCL on GPUs, gloo on CPU). Otherwise the ranks are spawned on
this machine with `models.distributed.launch` (gloo on CPU); a rank that raises ends
every rank with its traceback. No other launcher.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from optimized.train.config_io import add_config_arguments, config_from_args, print_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config as TOML and exit"
    )
    add_config_arguments(parser)


def _rank_main(cfg) -> dict:
    from optimized.train.trainer import train  # noqa: PLC0415

    return train(cfg)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except ValueError as error:
        print(f"twinpipe train: error: {error}", file=sys.stderr)
        return 2
    if args.print_config:
        print_config(cfg)
        return 0
    from models.distributed import RankFailed, init_process_group, launch  # noqa: PLC0415
    from optimized.train.trainer import check_weights  # noqa: PLC0415

    try:  # a checkpoint that does not fit is refused here, before any rank starts
        check_weights(cfg)
    except (ValueError, FileNotFoundError) as error:
        print(f"twinpipe train: error: {error}", file=sys.stderr)
        return 2

    world = cfg.parallel.world_size
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        if int(os.environ["WORLD_SIZE"]) != world:
            print(
                f"twinpipe train: error: WORLD_SIZE={os.environ['WORLD_SIZE']} does not match "
                f"parallel.pp * parallel.dp = {world}",
                file=sys.stderr,
            )
            return 2
        init_process_group()
        _rank_main(cfg)
        import torch.distributed as dist  # noqa: PLC0415

        dist.destroy_process_group()
        return 0
    nproc = cfg.parallel.nproc or world
    if nproc != world:
        print(
            f"twinpipe train: error: parallel.nproc = {nproc} is less than the world size "
            f"{world}; use torchrun to run on several machines",
            file=sys.stderr,
        )
        return 2
    # The ranks handle SIGTERM (save, then exit); the launcher waits for them.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        launch(_rank_main, world, (cfg,))
    except RankFailed as error:
        print(f"twinpipe train: a rank failed:\n{error}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0
