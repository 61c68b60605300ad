"""What every stack and the harness share to run the network: devices, ranks, the parallel
layout, the streams between stages, and the counters that hold a step to its rules.

Modules:

- `device`: where ranks compute, resolved once before any rank starts (``--device``), the
  Triton mode handed to each rank;
- `spawn`: local ranks spawned, signals forwarded, the rank that failed first named;
  ``init_process_group`` for torchrun's ranks too;
- `distributed`: `ParallelConfig`, the layout (PP x DP, EP inside DP) and its groups, the
  differentiable all-to-all;
- `p2p`: one process group per pipeline stream (direction and chunk), so that no
  correctness rests on tags NCCL ignores;
- `communication`: every collective and point-to-point call counted per rank and step;
- `host_sync`: every host synchronisation a step makes, counted;
- `device_sync`: no device-wide synchronisation inside a scheduled step (the guard, the
  one way to sync);
- `warmup`: every communicator up, and the collective limits, before the first step;
- `cpu_gemm`: bfloat16 matrix products on CPUs without native bf16 GEMM;
- `determinism`: deterministic mode (sums over repeated indices by sort and segment sum,
  torch's deterministic algorithms, the flag a tuning cache reads);
- `progress`: one progress line on a terminal for long reads and writes;
- `inputs`: bad input caught before work (outputs checked first), rescue folders;
- `training`: the step rules both stacks share (the optimizer config, synthetic batches,
  token counts, the loss shared over DP, gradient reduction, the even partition).

May import `models.network`; never `models.hf`, `reference`, `optimized` or `harness`.
"""

from models.runtime.communication import (
    KINDS,
    CommunicationCounter,
    Counts,
    Traffic,
    by_kind,
    counted_step,
    group_names,
)
from models.runtime.cpu_gemm import (
    GEMM_ENV,
    Bf16Gemm,
    bf16_gemm,
    float32_products,
    native_bf16_gemm,
)
from models.runtime.determinism import (
    deterministic,
    deterministic_mode,
    index_add,
    index_add_,
    set_deterministic,
)
from models.runtime.device import (
    DEVICE_ENV,
    CudaSupport,
    DeviceError,
    DevicePlan,
    choose_triton_mode,
    cuda_support,
    rank_device,
    resolve_device,
    triton_device,
)
from models.runtime.device_sync import (
    SyncInStep,
    device_sync,
    guard_torch_syncs,
    in_scheduled_step,
    modelled_syncs,
    refuse_in_step,
    scheduled_step,
)
from models.runtime.distributed import (
    DTYPES,
    GRAD_SYNC,
    Layout,
    ParallelConfig,
    all_to_all,
    make_layout,
)
from models.runtime.host_sync import SYNC_KINDS, HostSyncCounter, count_by_kind, describe_syncs
from models.runtime.inputs import (
    BadInput,
    check_output_dir,
    check_output_file,
    read_json,
    read_text,
    rescue_folder,
    respect_umask,
    write_or_rescue,
)
from models.runtime.p2p import (
    BACKWARD,
    FORWARD,
    PointToPoint,
    StreamGroups,
    TorchPointToPoint,
    stream_name,
)
from models.runtime.progress import ProgressLine
from models.runtime.spawn import (
    RankFailed,
    allow_forked_ranks,
    describe_failure,
    init_process_group,
    launch,
)
from models.runtime.training import (
    OptimizerConfig,
    PipelineRunner,
    even_partition,
    micro_batches_of,
    moe_routers,
    rank_chunks,
    reduce_gradients,
    shared_balancing,
    shared_loss,
    step_balance,
    step_load,
    synthetic_batch,
    token_count,
    update_expert_biases,
)
from models.runtime.warmup import (
    SETUP_TIMEOUT_S,
    STEP_TIMEOUT_S,
    PhaseTimeout,
    phase_limit,
    tighten,
    warm_up,
)

__all__ = [
    "PhaseTimeout",
    "SETUP_TIMEOUT_S",
    "STEP_TIMEOUT_S",
    "phase_limit",
    "tighten",
    "warm_up",
    "SyncInStep",
    "device_sync",
    "guard_torch_syncs",
    "in_scheduled_step",
    "modelled_syncs",
    "refuse_in_step",
    "scheduled_step",
    "BACKWARD",
    "BadInput",
    "Bf16Gemm",
    "CommunicationCounter",
    "Counts",
    "CudaSupport",
    "DEVICE_ENV",
    "DTYPES",
    "DeviceError",
    "DevicePlan",
    "FORWARD",
    "GEMM_ENV",
    "GRAD_SYNC",
    "HostSyncCounter",
    "KINDS",
    "Layout",
    "OptimizerConfig",
    "ParallelConfig",
    "PipelineRunner",
    "PointToPoint",
    "ProgressLine",
    "RankFailed",
    "allow_forked_ranks",
    "SYNC_KINDS",
    "StreamGroups",
    "TorchPointToPoint",
    "Traffic",
    "all_to_all",
    "bf16_gemm",
    "by_kind",
    "check_output_dir",
    "check_output_file",
    "choose_triton_mode",
    "count_by_kind",
    "counted_step",
    "cuda_support",
    "deterministic",
    "deterministic_mode",
    "describe_failure",
    "describe_syncs",
    "index_add",
    "index_add_",
    "set_deterministic",
    "even_partition",
    "float32_products",
    "group_names",
    "init_process_group",
    "launch",
    "make_layout",
    "micro_batches_of",
    "moe_routers",
    "native_bf16_gemm",
    "rank_chunks",
    "rank_device",
    "read_json",
    "read_text",
    "reduce_gradients",
    "rescue_folder",
    "resolve_device",
    "respect_umask",
    "shared_balancing",
    "shared_loss",
    "step_balance",
    "step_load",
    "stream_name",
    "synthetic_batch",
    "token_count",
    "triton_device",
    "update_expert_biases",
    "write_or_rescue",
]
