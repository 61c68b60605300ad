"""`twinpipe prepare-data`: text files in, one memory-mapped token file out.

Every input is checked before any tokenizing starts, so a typo in the tenth path
fails in a second with exit code 2 and a message naming the argument, not after an
hour of work; so is ``--out`` (a folder that can be created and written). Nothing is
changed silently: invalid UTF-8 is replaced by U+FFFD and counted per file, binary and
empty files are skipped with a warning each, and files under ``--out`` (when it lies
inside an ``--input`` folder) are never read as input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from models.runtime import BadInput, check_output_dir
from optimized.data.tokenizers import load_tokenizer
from optimized.train.preparation import prepare_data, resolve_inputs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--input",
        nargs="+",
        action="extend",
        required=True,
        metavar="PATH",
        help="text files, folders (every non-hidden file below) or glob patterns; "
        "each file is one document",
    )
    parser.add_argument(
        "--tokenizer",
        default="byte",
        metavar="byte|TOKENIZER_JSON",
        help="'byte' (UTF-8 bytes, vocab 257) or a Hugging Face tokenizer.json (default: byte)",
    )
    parser.add_argument(
        "--eod-token",
        default=None,
        help="end-of-document token of a tokenizer.json (default: the first of "
        "<|endoftext|>, </s>, <eos>, ... that it has)",
    )
    parser.add_argument(
        "--out", required=True, metavar="DIR", help="folder for tokens.bin and index.json"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def _bad(argument: str, value: object, why: str) -> int:
    print(f"twinpipe prepare-data: error: {argument} {value!r}: {why}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    try:
        files = resolve_inputs(args.input, exclude=args.out)
    except FileNotFoundError as error:
        bad = next((item for item in args.input if str(item) in str(error)), args.input)
        return _bad("--input", bad, str(error))
    out = Path(args.out)
    try:
        check_output_dir(out, "--out")
    except BadInput as error:
        print(f"twinpipe prepare-data: error: {error}", file=sys.stderr)
        return 2
    if args.tokenizer == "byte" and args.eod_token is not None:
        return _bad("--eod-token", args.eod_token, "applies only to a tokenizer.json")
    try:
        tokenizer = load_tokenizer(args.tokenizer, eod_token=args.eod_token)
    except (OSError, ValueError, ImportError) as error:
        return _bad("--tokenizer", args.tokenizer, str(error))
    try:
        summary = prepare_data(files, tokenizer, out, progress=not args.quiet)
    except ValueError as error:
        if not str(error).startswith("no text to prepare"):
            raise
        return _bad("--input", " ".join(map(str, args.input)), str(error))
    for path, why in summary.skipped:
        print(f"twinpipe prepare-data: warning: skipped {path}: {why}", file=sys.stderr)
    for path, count in summary.replaced.items():
        print(
            f"twinpipe prepare-data: warning: {path}: {count} bytes of invalid UTF-8 became U+FFFD",
            file=sys.stderr,
        )
    print(
        f"wrote {summary.num_tokens:,} tokens ({summary.dtype}) from {summary.num_files} "
        f"files, {summary.bytes_read / 1e6:.1f} MB, to {summary.out_dir} "
        f"in {summary.seconds:.1f}s"
    )
    return 0
