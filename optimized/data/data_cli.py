"""`twinpipe prepare-data`: corpora in (JSON lines, parquet, text), a Megatron indexed dataset
out; and ``--convert`` for folders of the format before it.

Everything is checked before any tokenizing starts, so a typo in the tenth path fails in a
second with exit code 2 and a message naming the argument: the inputs, ``--shard``,
``--out`` (a new or empty folder that can be created and written: a user's data is never
overwritten), the tokenizer, and the first record of every JSON-lines file (a wrong
``--text-key`` is named with the file and line). A bad record met later stops the run with
exit 2 naming the file, the line or row and the field, leaving ``--out`` as it was; with
``--skip-bad`` it is skipped and counted instead. Nothing is changed silently: skipped
records, empty documents, binary files and invalid UTF-8 are each reported.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from models.runtime import BadInput, check_output_dir
from optimized.data.convert import convert_old_folder
from optimized.data.encoding import default_workers
from optimized.data.preparation import prepare_data
from optimized.data.readers import BadRecord, parse_shard, resolve_inputs, shard_files
from optimized.data.tokenizers import load_tokenizer

PROG = "twinpipe prepare-data"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--input",
        nargs="+",
        action="extend",
        metavar="PATH",
        help="files, folders (every non-hidden file below) or glob patterns: *.jsonl, "
        "*.jsonl.gz, *.jsonl.zst, *.json.gz (one JSON object per line), *.parquet, and any "
        "other file as one document of plain text",
    )
    parser.add_argument(
        "--text-key",
        default="text",
        metavar="KEY",
        help="the JSON key / parquet column holding the text (default: text)",
    )
    parser.add_argument(
        "--skip-bad",
        action="store_true",
        help="skip (and count) records that are malformed or lack the text key, "
        "instead of stopping at the first",
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
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="processes tokenizing (default: the machine's cores); the output is the same "
        "bytes for any N",
    )
    parser.add_argument(
        "--shard",
        default=None,
        metavar="I/N",
        help="prepare only the I-th of N parts of the sorted input file list (0 <= I < N), "
        "e.g. one job of a scheduler's array",
    )
    parser.add_argument(
        "--convert",
        default=None,
        metavar="OLD_DIR",
        help="convert a folder of the old format (tokens.bin + index.json) into --out; "
        "OLD_DIR is only read",
    )
    parser.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="a new or empty folder for tokens.bin, tokens.idx and twinpipe-data.json",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar on stderr")


def _bad(argument: str, value: object, why: str) -> int:
    print(f"{PROG}: error: {argument} {value!r}: {why}", file=sys.stderr)
    return 2


def _check_out(out: Path) -> int:
    try:
        check_output_dir(out, "--out")
    except BadInput as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    if out.is_dir() and any(out.iterdir()):
        return _bad(
            "--out",
            str(out),
            "exists and is not empty; name a new or empty folder (prepare-data never overwrites)",
        )
    return 0


def _convert(args: argparse.Namespace) -> int:
    if args.input:
        return _bad("--convert", args.convert, "takes no --input (it converts one folder)")
    if _check_out(Path(args.out)):
        return 2
    try:
        sidecar = convert_old_folder(args.convert, args.out)
    except (OSError, ValueError) as error:
        return _bad("--convert", args.convert, str(error))
    print(
        f"converted {sidecar['num_documents']:,} documents, {sidecar['num_tokens']:,} tokens "
        f"({sidecar['dtype']}) from {args.convert} to {args.out}"
    )
    return 0


def run(args: argparse.Namespace) -> int:
    if args.convert is not None:
        return _convert(args)
    if not args.input:
        return _bad("--input", None, "name the files to prepare (or --convert an old folder)")
    try:
        files = resolve_inputs(args.input, exclude=args.out)
    except FileNotFoundError as error:
        bad = next((item for item in args.input if str(item) in str(error)), args.input)
        return _bad("--input", bad, str(error))
    shard = None
    if args.shard is not None:
        try:
            shard = parse_shard(args.shard)
            shard_files(files, *shard)
        except ValueError as error:
            return _bad("--shard", args.shard, str(error))
    workers = default_workers() if args.workers is None else args.workers
    if workers < 1:
        return _bad("--workers", args.workers, "must be >= 1")
    if not args.text_key:
        return _bad("--text-key", args.text_key, "must not be empty")
    out = Path(args.out)
    if _check_out(out):
        return 2
    if args.tokenizer == "byte" and args.eod_token is not None:
        return _bad("--eod-token", args.eod_token, "applies only to a tokenizer.json")
    try:
        tokenizer = load_tokenizer(args.tokenizer, eod_token=args.eod_token)
    except (OSError, ValueError, ImportError) as error:
        return _bad("--tokenizer", args.tokenizer, str(error))
    try:
        summary = prepare_data(
            files,
            tokenizer,
            out,
            progress=not args.quiet,
            workers=workers,
            text_key=args.text_key,
            skip_bad=args.skip_bad,
            shard=shard,
        )
    except BadRecord as error:
        hint = "" if args.skip_bad else " (--skip-bad skips and counts such records)"
        print(f"{PROG}: error: --input: {error}{hint}", file=sys.stderr)
        return 2
    except ImportError as error:
        return _bad("--input", " ".join(map(str, args.input)), str(error))
    except ValueError as error:
        if not str(error).startswith("no text to prepare"):
            raise
        return _bad("--input", " ".join(map(str, args.input)), str(error))
    stats = summary.stats
    for path in stats.binary:
        print(f"{PROG}: warning: skipped {path}: binary (a NUL byte)", file=sys.stderr)
    for path, count in stats.replaced.items():
        print(
            f"{PROG}: warning: {path}: {count} bytes of invalid UTF-8 became U+FFFD",
            file=sys.stderr,
        )
    if stats.bad:
        print(
            f"{PROG}: warning: skipped {stats.bad:,} bad records (--skip-bad), e.g.:",
            file=sys.stderr,
        )
        for example in stats.bad_examples:
            print(f"  {example}", file=sys.stderr)
    print(
        f"wrote {summary.num_documents:,} documents, {summary.num_tokens:,} tokens "
        f"({summary.dtype}) from {summary.num_files} files, {summary.bytes_read / 1e6:.1f} MB, "
        f"to {summary.out_dir} in {summary.seconds:.1f}s; {stats.empty:,} empty documents "
        f"and {stats.bad:,} bad records skipped"
    )
    return 0
