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

May import `models` only; never `reference` or `harness`.
"""
