"""The network's math, written once: what a MoE decoder computes, and nothing about where
it runs or where its weights are stored.

Modules:

- `config`: `ModelConfig`, the one dataclass every family's shape is (checked on creation);
- `presets`: the published shapes and the tiny and mid test shapes, by name;
- `layers`: norms, RoPE, attention (MLA, GQA with q/k norms, sinks and windows), the
  dense and expert MLPs, the output layer;
- `router`: each family's router (softmax, sigmoid with a corrected bias, group-limited
  top-k), its `Routing`;
- `decoder`: a decoder layer as the five stages DualPipeV overlaps (attention, dispatch,
  experts, combine, aggregate), and expert parallelism's layout of them;
- `model`: `CausalLM` and the part of it one rank builds (`build_part`);
- `mtp`: DeepSeek-V3's multi-token prediction: its layers, targets and loss;
- `balancing`: the routing controls (load-balancing losses, router z-loss, the expert
  bias) and the per-step and per-micro-batch objects that hold them to one value at every
  layout;
- `routing`: routing tapes (a baseline's expert choices replayed by a candidate), the
  near-tie rule, balanced routing for models of traffic;
- `ops`: the `Ops` protocol the stages call, which `reference` and `optimized` implement;
- `weights`: weight sources (seeded initialisation that any layout draws alike, a state
  dict) and `materialise`, which fills a meta-device part from one;
- `host_copy`: device values read on the host on purpose (split sizes, logged scalars).

May import only `models` itself (the Triton switch); never `models.hf`, `models.runtime`,
`reference`, `optimized` or `harness`.
"""

from models.network.balancing import (
    AUX_FORMS,
    BalanceGradient,
    Balancing,
    MicroBatchBalance,
    RouterRecord,
    StepBalance,
    expert_bias_update,
    layer_aux,
    pooled_aux,
    sequence_aux,
    z_loss,
)
from models.network.config import FAMILIES, ModelConfig
from models.network.decoder import (
    SINGLE,
    AttentionOut,
    CombineOut,
    DecoderLayer,
    DispatchOut,
    ExpertParallel,
    ExpertsOut,
    SplitSizes,
)
from models.network.host_copy import HostCopy, host_side, host_side_depth
from models.network.layers import (
    Experts,
    GroupedQueryAttention,
    MultiHeadLatentAttention,
    RMSNorm,
    causal_mask,
    eager_attention,
)
from models.network.model import (
    IGNORE_INDEX,
    CausalLM,
    build_model,
    build_part,
    is_expert_parameter,
    shift_labels,
)
from models.network.mtp import (
    MTPLayer,
    MtpOut,
    MtpStep,
    mtp_input_ids,
    mtp_labels,
    mtp_loss,
    mtp_step,
    top1_correct,
    top1_rows,
)
from models.network.ops import ExpertLayout, Ops
from models.network.presets import PRESET_NAMES, preset
from models.network.router import Router, Routing, max_group_scores, top2_group_scores
from models.network.routing import (
    BalancedRouting,
    RoutingTape,
    attach_routing_tape,
    router_keys,
)
from models.network.weights import (
    Progress,
    Reporting,
    SeededWeights,
    StateDictWeights,
    WeightSource,
    chunk_rows,
    keep_float32,
    state_buffers,
)

__all__ = [
    "GroupedQueryAttention",
    "MultiHeadLatentAttention",
    "AUX_FORMS",
    "AttentionOut",
    "BalanceGradient",
    "BalancedRouting",
    "Balancing",
    "CausalLM",
    "CombineOut",
    "DecoderLayer",
    "DispatchOut",
    "ExpertLayout",
    "ExpertParallel",
    "Experts",
    "ExpertsOut",
    "FAMILIES",
    "HostCopy",
    "IGNORE_INDEX",
    "MTPLayer",
    "MicroBatchBalance",
    "ModelConfig",
    "MtpOut",
    "MtpStep",
    "Ops",
    "PRESET_NAMES",
    "Progress",
    "RMSNorm",
    "Reporting",
    "Router",
    "RouterRecord",
    "Routing",
    "RoutingTape",
    "SINGLE",
    "SeededWeights",
    "SplitSizes",
    "StateDictWeights",
    "StepBalance",
    "WeightSource",
    "attach_routing_tape",
    "router_keys",
    "build_model",
    "build_part",
    "causal_mask",
    "chunk_rows",
    "eager_attention",
    "expert_bias_update",
    "host_side",
    "host_side_depth",
    "is_expert_parameter",
    "keep_float32",
    "layer_aux",
    "max_group_scores",
    "mtp_input_ids",
    "mtp_labels",
    "mtp_loss",
    "mtp_step",
    "pooled_aux",
    "preset",
    "sequence_aux",
    "shift_labels",
    "state_buffers",
    "top1_correct",
    "top1_rows",
    "top2_group_scores",
    "z_loss",
]
