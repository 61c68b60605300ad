"""`twinpipe export`: a training checkpoint as a Hugging Face checkpoint transformers loads.

The checkpoint is layout-free (whole-model tensors under whole-model names), so export
runs in one process at any training layout: read the model tensors, build the whole
`CausalLM`, and write it with `models.checkpoint.save_pretrained`.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

from models.config import ModelConfig
from models.distributed import DTYPES
from models.inputs import respect_umask


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint", required=True,
        help="a checkpoint folder (step-*) or a checkpoint dir (its newest complete one)",
    )  # fmt: skip
    parser.add_argument("--out", required=True, help="folder to write the HF checkpoint to")
    parser.add_argument(
        "--dtype", choices=tuple(DTYPES), default=None, help="cast (default: as trained)"
    )
    parser.add_argument(
        "--max-shard-bytes", type=int, default=None, help="shard above this (default: one file)"
    )


def export(checkpoint: str | Path, out: str | Path, dtype: str | None = None,
           max_shard_bytes: int | None = None) -> Path:  # fmt: skip
    """Write the newest complete checkpoint under ``checkpoint`` to ``out``; return its folder."""
    from models.checkpoint import save_pretrained  # noqa: PLC0415
    from models.model import CausalLM  # noqa: PLC0415
    from optimized.train.checkpointing import load_model_state, newest_valid  # noqa: PLC0415

    folder = newest_valid(checkpoint)
    if folder is None:
        raise ValueError(f"no complete checkpoint in {checkpoint}")
    config = ModelConfig.from_hf(str(folder / "config.json"))
    state = load_model_state(folder, config)
    stored = state["model.embed_tokens.weight"].dtype
    with torch.device("meta"):
        model = CausalLM(config, ops=object())
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.to(DTYPES[dtype] if dtype else stored)
    save_pretrained(model, out, max_shard_bytes)
    # safetensors creates its files 0600; an export is meant to be shared like any file.
    respect_umask(p for p in Path(out).iterdir() if p.name.endswith((".safetensors", ".json")))
    return folder


def _check(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, found before any tensor is read."""
    from models.inputs import BadInput, check_output_dir  # noqa: PLC0415
    from optimized.train.checkpointing import list_checkpoints, newest_valid  # noqa: PLC0415

    source = Path(args.checkpoint)
    if not source.is_dir():
        return f"--checkpoint {args.checkpoint!r}: no such checkpoint folder"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        folder = newest_valid(source)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    if folder is None:
        what = (
            "every checkpoint in it is incomplete or corrupt"
            if list_checkpoints(source)
            else "it holds no twinpipe checkpoint (step-* folders with a manifest.json)"
        )
        return f"--checkpoint {args.checkpoint!r}: {what}"
    try:
        ModelConfig.from_hf(folder / "config.json")
    except (ValueError, OSError) as error:
        return f"--checkpoint {args.checkpoint!r}: {error}"
    if args.max_shard_bytes is not None and args.max_shard_bytes < 1:
        return f"--max-shard-bytes={args.max_shard_bytes} is invalid: expected >= 1 or unset"
    if Path(args.out).resolve().is_relative_to(source.resolve()):
        return (
            f"--out {args.out!r} lies in --checkpoint {args.checkpoint!r}: the export would write "
            "into the checkpoints; choose a folder outside it"
        )
    try:
        check_output_dir(args.out, "--out")
    except BadInput as error:
        return str(error)
    return None


def run(args: argparse.Namespace) -> int:
    problem = _check(args)
    if problem:
        print(f"twinpipe export: error: {problem}", file=sys.stderr)
        return 2
    folder = export(args.checkpoint, args.out, args.dtype, args.max_shard_bytes)
    print(f"exported {folder} to {args.out}")
    return 0
