"""The production engine: the overlapped DualPipeV and what runs it on one rank.

- `dualpipev`: the eight-phase schedule with F&B overlap and zero-bubble W steps;
- `overlap`: a layer's five stages as small forward/backward functions and the
  step list that interleaves two micro-batches;
- `execution`: the per-step context that owns deferred work, exchanges and early frees;
- `profile`: what each stage of a layer saves, measured on a real part;
- `partition`: the layer ranges the memory estimator predicts the lowest peak for;
- `sharding`: FSDP2 over the DP group (experts over their expert-DP group), and
  `ShardedOptimizedPipeline`, whose optimizer (`optimized.train.ShardedAdamW`) the caller
  passes in;
- `gradient_sync`: when FSDP2 reduces gradients and reshards parameters within a step
  (once per unit, at the last backward or W step the schedule gives its chunk);
- `mtp_stage`: DeepSeek-V3's multi-token prediction at the loss stage;
- `runner`: `OptimizedPipeline`, the stack's runner as the harness and trainer drive it.

May import `models`, `optimized.ops` and `optimized.estimator`; never `optimized.train`,
`reference` or `harness`.
"""

from optimized.pipeline.dualpipev import OptimizedDualPipeV
from optimized.pipeline.execution import (
    Exchange,
    ExecutionContext,
    FreedStorageRead,
    free_storage,
    start_exchange,
)
from optimized.pipeline.mtp_stage import MtpStage
from optimized.pipeline.partition import (
    choose_partition,
    even_partition,
    heuristic_partition,
    partition_report,
    stage_layers,
)
from optimized.pipeline.profile import STAGES, LayerProfile, StageProfile, profile_part
from optimized.pipeline.runner import OptimizedPipeline, default_partition
from optimized.pipeline.sharding import ShardedOptimizedPipeline, apply_fsdp, held_rows

__all__ = [
    "MtpStage",
    "STAGES",
    "Exchange",
    "ExecutionContext",
    "FreedStorageRead",
    "LayerProfile",
    "OptimizedDualPipeV",
    "OptimizedPipeline",
    "ShardedOptimizedPipeline",
    "StageProfile",
    "apply_fsdp",
    "choose_partition",
    "default_partition",
    "even_partition",
    "free_storage",
    "heuristic_partition",
    "held_rows",
    "partition_report",
    "profile_part",
    "stage_layers",
    "start_exchange",
]
