"""The production stack, in five subpackages that import one way (each may use the ones
above it, and `models`; none imports `reference` or `harness`):

- `optimized.ops`: kernels and their autograd Functions, one unit per op;
- `optimized.estimator`: the memory model from the configs alone, its schedule walk,
  Megatron's formulas, ``twinpipe estimate``;
- `optimized.pipeline`: the overlapped DualPipeV, its execution context (early frees,
  exchanges), layer profiles, the estimator-chosen partition, FSDP2 sharding;
- `optimized.data`: training data: corpus readers, tokenization, Megatron-Core's indexed
  dataset, blends, splits and the loader (``twinpipe prepare-data``);
- `optimized.train`: the product around the engine -- trainer, config, data, optimizer,
  checkpoints, export, and the ``train`` / ``prepare-data`` / ``export`` commands.

Two edges point the other way, and only at call time. The estimator imports
`optimized.pipeline.partition` inside the functions that need the partition a run would
use (`stage_layers`, `partition_report`), while `optimized.pipeline.partition` imports the
estimator at module level to choose that partition. Importing the estimator loads nothing
of `optimized.pipeline`; calling `optimized.estimator.estimate` (and the communication
estimate and the planner) loads the whole of it. The partition stays in the engine because
choosing the layers each rank runs is the engine's decision; the estimator only prices it.
And ``twinpipe estimate`` and ``twinpipe plan`` import `optimized.train.sizing` when they
run, to size what `twinpipe train` would run: their defaults are the trainer's config's,
which lives with the trainer (one source), and the trainer's reading of it (FSDP2 at DP > 1,
its AdamW's precision) is the trainer's to state.

Each subpackage's ``__init__`` names its modules and what it may import;
``tests/test_structure.py`` holds every import, function-level ones included, to those
edges.
"""
