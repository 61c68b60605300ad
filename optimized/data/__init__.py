"""Training data as the ecosystem ships and stores it: readers of what corpora ship as,
tokenization, Megatron-Core's indexed dataset on disk, weighted blends, splits, and the
loader that turns them into each step's batch.

- `tokenizers`: UTF-8 bytes, or a Hugging Face ``tokenizer.json``.
- `indexed`: Megatron-Core's indexed dataset (``.bin`` + ``.idx``), written and read
  memory-mapped; its docstring holds the layout of a prepared folder.

May import `models` only; never `reference` or `harness`.
"""
