"""What the routing controls (`models.network.balancing`) add to a step, read off their code.

A run's controls are its model config's (`models.network.ModelConfig.balancing`: the HF
fields and the ``[moe]`` section's choices), so an `EstimateConfig` carries them in
``model``. Each of them costs memory or traffic in one of five places:

- **what a MoE layer saves for backward** (`optimized.estimator.activations.balancing_saved`,
  counted with the router's tensors: made in the attention stage, freed before the recomputed
  attention block's backward). Qwen3-MoE's and DeepSeek-V2's softmax over all experts is
  saved by the router already; GPT-OSS's router takes a softmax over its top k only, so a
  load-balancing loss saves a new float32 ``[T, E]`` softmax there. The z-loss's
  ``logsumexp`` saves its float32 ``[T, E]`` input (the logits, or their float copy) and
  its ``[T]`` output. DeepSeek's ``layer`` form saves its ``[E]`` load share, the
  ``sequence`` form its ``[B, E]`` per-sequence share; the pooled form and
  `BalanceGradient` save nothing;
- **what a micro-batch holds on a chunk** (pooled form, `pooled_stats_bytes`,
  `pooled_totals_bytes`): its ``[2, E]`` float32 counts and probability sums from the chunk's
  forward to the end of its backward, and the ``[E]`` totals from the loss stage (or the
  gradient that brings them) to the end of the backward, or, sent on, until the send is
  known complete (the reference: the step's end);
- **what a step holds** (`step_state_bytes`): the rank's `StepBalance` (an int64 ``[E]`` load
  per local MoE layer, the aux and z shares), made by every training step whatever the
  controls (the load is counted for the bias and the metrics). The DP-reduced load
  (`models.runtime.PipelineRunner.step_load`, asked at the bias update after the optimizer's
  own temporaries are gone) lives with it and is dropped with it at the next step's start;
- **weights** (`bias_buffer_bytes`): the expert bias is a float32 ``[E]`` buffer of each MoE
  router, state like a parameter (FSDP2 leaves buffers whole);
- **traffic** (`optimized.estimator.communication`): with the pooled form each p2p message
  is followed by its ``[2, E]`` sums (forward) or ``[E]`` totals (backward) on the same
  stream; with the expert bias, one all-reduce of the step's ``[layers, E]`` int64 load over
  DP (a rank holding MoE layers, DP > 1); `balancing_values` (the step's aux and z values
  for the log) one ``[2]`` float32 all-reduce over DP and one over PP.

Not modelled: the temporaries of the terms themselves (``[T, E]`` gradients in the
router's backward, the biased scores top-k ranks, the ``[2, E]`` stack), each below the
high points of the steps they run in.
"""

from __future__ import annotations

from models.network import Balancing
from optimized.estimator.config import EstimateConfig

F32, I64 = 4, 8


def balancing(config: EstimateConfig) -> Balancing:
    """The run's routing controls (the model config's)."""
    key = "balancing"
    if key not in config.cache:
        config.cache[key] = config.model.balancing()
    return config.cache[key]


def moe_layer_count(config: EstimateConfig, layers) -> int:
    """How many of ``layers`` (decoder layer indices) are MoE."""
    pattern = config.moe_layers()
    return sum(1 for layer in layers if pattern[layer])


def pooled_stats_bytes(config: EstimateConfig) -> int:
    """The pooled form's ``[2, E]`` float32 counts and probability sums of a micro-batch on
    a chunk (0 when the form is off)."""
    return 2 * config.model.num_experts * F32 if balancing(config).pooled else 0


def pooled_totals_bytes(config: EstimateConfig) -> int:
    """The pooled form's ``[E]`` float32 totals of a micro-batch (0 when off)."""
    return config.model.num_experts * F32 if balancing(config).pooled else 0


def step_state_bytes(config: EstimateConfig, layers) -> int:
    """Bytes a training step's `StepBalance` holds on a rank holding ``layers``: an int64 load
    per local MoE layer, the float32 aux and z shares."""
    moe = moe_layer_count(config, layers)
    return moe * config.model.num_experts * I64 + 2 * F32


def bias_buffer_bytes(config: EstimateConfig, layers) -> int:
    """The float32 expert-bias buffers of the MoE routers among ``layers`` (0 when off)."""
    if not balancing(config).expert_bias:
        return 0
    return moe_layer_count(config, layers) * config.model.num_experts * F32


__all__ = [
    "balancing",
    "bias_buffer_bytes",
    "moe_layer_count",
    "pooled_stats_bytes",
    "pooled_totals_bytes",
    "step_state_bytes",
]
