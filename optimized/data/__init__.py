"""Training data as the ecosystem ships and stores it: readers of what corpora ship as,
tokenization, Megatron-Core's indexed dataset on disk, weighted blends, splits, and the
loader that turns them into each step's batch.

- `tokenizers`: UTF-8 bytes, or a Hugging Face ``tokenizer.json``.
- `indexed`: Megatron-Core's indexed dataset (``.bin`` + ``.idx``), written and read
  memory-mapped; its docstring holds the layout of a prepared folder.
- `readers`: JSON lines (plain, gz, zst), parquet and text files, streamed; folders, globs
  and ``--shard`` parts.
- `encoding`: batched tokenization on worker processes, results in input order.
- `preparation`: `prepare_data` (readers -> encoding -> indexed), the sidecar
  (`read_sidecar`, `open_prepared`), and the default data set every machine has.
- `convert`: folders of the old format (``tokens.bin`` + ``index.json``) into today's.
- `data_cli`: ``twinpipe prepare-data``.
- `sources`: a blend's paths opened (a prepared folder, a bare Megatron prefix) and
  `Windows`, a token range's samples of ``seq_len + 1``.
- `splits`: ``--split``, each source's documents cut into training and held-out parts.
- `blend`: ``--data "0.7 web/ 0.3 code/"`` parsed, the order every rank computes alike
  (Tijdeman's rule), each source's epochs, and `BlendLoader`, each step's batch with the
  position a checkpoint keeps.
- `corpus`: a run's training and held-out blends opened and checked against each other
  and the model.
- `loader`: the single-folder `TokenDataset` and `TokenLoader`, and `BatchToDevice`, each
  step's batch on the rank's device.

May import `models` only; never `reference` or `harness`.
"""

from optimized.data.convert import convert_old_folder
from optimized.data.encoding import default_workers, encode_ordered
from optimized.data.indexed import (
    DEFAULT_PREFIX,
    HEADER_BYTES,
    MAGIC,
    SIDECAR_FILE,
    IndexedReader,
    IndexedWriter,
    dtype_code,
    token_dtype,
)
from optimized.data.preparation import (
    MEGATRON_FORMAT,
    PrepareSummary,
    default_dataset,
    open_prepared,
    prepare_data,
    read_sidecar,
)
from optimized.data.readers import BadRecord, parse_shard, resolve_inputs, shard_files
from optimized.data.tokenizers import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "DEFAULT_PREFIX",
    "HEADER_BYTES",
    "MAGIC",
    "MEGATRON_FORMAT",
    "SIDECAR_FILE",
    "BadRecord",
    "ByteTokenizer",
    "HFTokenizer",
    "IndexedReader",
    "IndexedWriter",
    "PrepareSummary",
    "convert_old_folder",
    "default_dataset",
    "default_workers",
    "dtype_code",
    "encode_ordered",
    "load_tokenizer",
    "open_prepared",
    "parse_shard",
    "prepare_data",
    "read_sidecar",
    "resolve_inputs",
    "shard_files",
    "token_dtype",
]
