"""The production stack, in four subpackages that import one way (each may use the ones
above it, and `models`; none imports `reference` or `harness`):

- `optimized.ops`: kernels and their autograd Functions, one unit per op;
- `optimized.estimator`: the memory model from the configs alone, its schedule walk,
  Megatron's formulas, ``twinpipe estimate``;
- `optimized.pipeline`: the overlapped DualPipeV, its execution context (early frees,
  exchanges), layer profiles, the estimator-chosen partition, FSDP2 sharding;
- `optimized.train`: the product around the engine -- trainer, config, data, optimizer,
  checkpoints, export, and the ``train`` / ``prepare-data`` / ``export`` commands.
"""
