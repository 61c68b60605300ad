"""What the estimator is asked about: a model, a parallel layout, a precision, a stack.

`EstimateConfig` bundles the `ModelConfig` with everything else a per-rank
memory figure depends on, and checks the combination before anything is
counted: an impossible layout raises `ValueError` naming the field, its value
and what would be valid (the CLI turns that into exit status 2).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from models.network import ModelConfig
from models.runtime import GRAD_SYNC

STACKS = ("reference", "optimized")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
OPTIMIZER_STATE_DTYPES = ("param", "float32", "bfloat16")


def _bad(name: str, value: Any, valid: str) -> ValueError:
    return ValueError(f"EstimateConfig.{name}={value!r} is invalid: {valid}")


@dataclass(slots=True)
class EstimateConfig:
    """A model, a layout and a precision: everything a per-rank memory estimate needs."""

    model: ModelConfig
    """The network's shapes."""
    pp: int = 1
    """Pipeline ranks; DualPipeV gives each two stages, so ``2 * pp`` stages."""
    dp: int = 1
    """Data-parallel ranks per pipeline rank (world = tp * pp * dp)."""
    ep: int = 1
    """Expert-parallel ranks: they divide the routed experts (``num_experts / ep`` each). With
    ``etp`` they tile the ``tp * dp`` ranks of a pipeline stage (``ep * etp`` divides it);
    twinpipe runs EP inside the DP group."""
    tp: int = 1
    """Tensor-parallel ranks (twinpipe runs 1; accepted for planning)."""
    etp: int = 1
    """Expert tensor-parallel ranks, as Megatron defines them: each splits every local expert's
    FFN width (``moe_intermediate_size / etp``); EP alone divides the experts. twinpipe runs 1;
    accepted for planning."""
    micro_batch_size: int = 1
    """Sequences per micro-batch."""
    seq_len: int = 4096
    """Tokens per sequence."""
    num_microbatches: int = 8
    """Micro-batches per step (DualPipeV needs at least ``2 * pp``)."""
    dtype: str = "float32"
    """Run dtype of parameters and activations: ``float32`` or ``bfloat16``."""
    grad_dtype: str | None = None
    """Gradient dtype; None means the parameters' dtype (what autograd produces)."""
    optimizer_state_dtype: str = "param"
    """AdamW's ``exp_avg``/``exp_avg_sq`` dtype: ``param`` (what `torch.optim.AdamW` creates:
    ``zeros_like(param)``), ``float32`` or ``bfloat16`` (`twinpipe train`'s
    ``--optimizer-state-dtype``)."""
    master_weights: bool = False
    """Keep a float32 master copy of 16-bit parameters in the optimizer (`twinpipe train`'s
    `ShardedAdamW` does by default, ``--no-master-weights`` turns it off; `twinpipe
    compare`'s plain AdamW does not)."""
    shard_optimizer: bool = False
    """Shard optimizer state over the DP group (experts over the expert-DP group), as FSDP2
    / a distributed optimizer does; `twinpipe compare` runs unsharded AdamW."""
    fsdp: bool = False
    """Shard like `twinpipe train` at DP > 1: FSDP2 divides the parameters, gradients and
    optimizer state of every non-expert module by DP, the output layer included, and those
    of the routed experts by the expert-DP group (nothing when it is one rank); an output
    layer tied to the embedding keeps whole parameters and gradients, its optimizer state
    sharded over DP. Implies ``shard_optimizer``. The walk follows FSDP2 unit group by unit
    group (`optimized.estimator.sharded_step`): with ``grad_sync="step"`` gradients unsharded
    until the chunk's last backward (or the W completing them) reduces them, and with
    ``reshard_after_forward`` off parameters gathered from the chunk's first forward to its
    last backward; the optimizer step is `ShardedAdamW`'s (float64 squares and a float32
    update, block by block); with ``reshard_after_forward`` on, each stage step holds its
    largest FSDP2 unit gathered twice over (the all-gather's output beside the parameters
    copied out of it).
    Not counted: with ``grad_sync="micro-batch"``, each backward's unsharded gradients and
    reduce-scatter buffers, and the expert weight gradients a W step leaves unsharded until
    the experts' next backward (tiny-deepseek-v2 (1,2,2) bf16: 2.8% low)."""
    moe_shared_expert_intermediate_size: int | None = None
    """Total hidden width of a MoE layer's shared experts (Megatron's field), independent of
    the routed experts' width; None takes the model's (``n_shared_experts *
    moe_intermediate_size``). twinpipe's models build the model's width; another is
    accepted for planning."""
    shared_expert_gate: bool = False
    """A sigmoid gate (``hidden_size`` weights) on the shared experts (Megatron's
    ``moe_shared_expert_gate``; none of twinpipe's families has one)."""
    moe_layer_pattern: int | list[int] | None = None
    """Which layers are MoE, Megatron style: an int ``n`` (every n-th layer from layer 0) or
    a list of 0/1 per layer; None follows the model's own rule (`ModelConfig.is_moe_layer`)."""
    num_mtp_layers: int | None = None
    """Multi-token-prediction layers on the last stage; None takes the model's field."""
    grad_sync: str = "step"
    """With ``fsdp``: ``step`` (FSDP2 reduces each unit once per step, at its chunk's last
    backward: its gradient is held unsharded from the chunk's first backward) or
    ``micro-batch`` (reduced after every backward, held sharded)."""
    reshard_after_forward: bool = False
    """With ``fsdp``: gathered parameters freed after each forward (on) or held from a unit's
    first forward to its last backward (off: the rank's whole part unsharded meanwhile)."""
    stack: str = "optimized"
    """Which stack's activations: ``reference`` or ``optimized``."""
    recompute: bool = True
    """The optimized stack recomputes each attention block in backward (its default,
    `OptimizedOps.recompute_attention`); False: it keeps the block's activations (more
    memory, one attention forward less per backward). The reference never recomputes."""
    expert_load: tuple[int, ...] | None = None
    """Rows each of this rank's local experts receives in the layer and micro-batch being
    estimated, as a run saw them (`optimized.estimator.routing.ObservedRouting` builds one
    config per layer and micro-batch); None: routing that picks every expert equally often."""
    first_step: bool = False
    """Estimate the first training step: AdamW creates its state in its first ``step()``, so
    the forward and backward run without it and the optimizer step then holds the weights,
    every gradient and the new state (the peak `twinpipe compare --steps 1` measures).
    False: a later step, with the state held throughout."""
    layers_per_stage: list[int] | None = None
    """Layers of each of the ``2 * pp`` stages; None lets the stack choose (see `stage_layers`)."""
    context_parallel_size: int = 1
    """Megatron's context parallelism: refused unless 1 (twinpipe neither runs nor models it)."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Megatron's interleaved (virtual) stages: refused unless None (DualPipeV's two chunks per
    rank are its own fixed V placement)."""
    moe_latent_size: int | None = None
    """Megatron's latent MoE (experts on a projected-down width): refused unless None."""
    cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """Figures derived from this config (MoE pattern, per-kind layer profiles), computed once:
    a config is not changed after it is built (`replace` makes a new one)."""

    def __post_init__(self) -> None:
        self.validate()

    # ----------------------------------------------------------------- derived
    @property
    def num_stages(self) -> int:
        return 2 * self.pp

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same expert shard: ``world / (etp * ep * pp)``."""
        return self.world_size // (self.etp * self.ep * self.pp)

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def grad_bytes(self) -> int:
        return DTYPE_BYTES[self.grad_dtype or self.dtype]

    @property
    def moment_bytes(self) -> int:
        """Bytes of one AdamW moment element (``optimizer_state_dtype``)."""
        if self.optimizer_state_dtype == "param":
            return self.param_bytes
        return DTYPE_BYTES[self.optimizer_state_dtype]

    @property
    def blocked_update(self) -> bool:
        """Whether the AdamW step is `ShardedAdamW`'s (`twinpipe train`'s: torch's update in
        float32 over blocks) rather than torch's AdamW itself (``optimizer_state_dtype``
        ``param``: `twinpipe compare`'s unsharded stacks)."""
        return self.optimizer_state_dtype != "param"

    @property
    def optimizer_bytes_per_param(self) -> int:
        """Bytes of AdamW state per parameter (two moments, plus a float32 master if asked)."""
        return 2 * self.moment_bytes + (4 if self.master_weights and self.param_bytes != 4 else 0)

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch."""
        return self.micro_batch_size * self.seq_len

    def moe_layers(self) -> list[bool]:
        """Per decoder layer, whether it is MoE (see ``moe_layer_pattern``)."""
        cached = self.cache.get("moe_layers")
        if cached is None:
            cached = self.cache["moe_layers"] = self._moe_layers()
        return cached

    def _moe_layers(self) -> list[bool]:
        layers = self.model.num_hidden_layers
        pattern = self.moe_layer_pattern
        if pattern is None:
            return [self.model.is_moe_layer(i) for i in range(layers)]
        if isinstance(pattern, bool) or not isinstance(pattern, (int, list)):
            raise TypeError(
                f"EstimateConfig.moe_layer_pattern must be an int or a list of 0/1, "
                f"got {type(pattern).__name__}"
            )
        if isinstance(pattern, int):
            return [i % pattern == 0 for i in range(layers)]
        return [bool(flag) for flag in pattern]

    @property
    def shared_expert_width(self) -> int:
        """Hidden width of one MoE layer's shared experts together (0: none)."""
        if self.moe_shared_expert_intermediate_size is not None:
            return self.moe_shared_expert_intermediate_size
        return self.model.n_shared_experts * self.model.moe_intermediate_size

    @property
    def mtp_layers(self) -> int:
        return self.model.num_mtp_layers if self.num_mtp_layers is None else self.num_mtp_layers

    def replace(self, **changes: Any) -> EstimateConfig:
        return dataclasses.replace(self, **changes)

    # -------------------------------------------------------------- validation
    def validate(self) -> None:
        refused = (
            ("context_parallel_size", 1, "context parallelism is not modelled; expected 1"),
            ("virtual_pipeline_model_parallel_size", None,
             "interleaved (virtual) pipeline stages are not modelled: DualPipeV places two "
             "chunks per rank itself; expected None"),
            ("moe_latent_size", None, "latent MoE is not modelled; expected None"),
        )  # fmt: skip
        for name, allowed, valid in refused:
            if getattr(self, name) != allowed:
                raise _bad(name, getattr(self, name), valid)
        positive = ("pp", "dp", "ep", "tp", "etp", "micro_batch_size", "seq_len")
        for name in positive + ("num_microbatches",):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise _bad(name, value, "expected a positive integer")
        model = self.model
        if self.dtype not in ("float32", "bfloat16"):
            raise _bad("dtype", self.dtype, "expected 'float32' or 'bfloat16'")
        if self.grad_dtype is not None and self.grad_dtype not in DTYPE_BYTES:
            raise _bad(
                "grad_dtype", self.grad_dtype, f"expected None or one of {list(DTYPE_BYTES)}"
            )
        if self.optimizer_state_dtype not in OPTIMIZER_STATE_DTYPES:
            raise _bad(
                "optimizer_state_dtype",
                self.optimizer_state_dtype,
                f"one of {OPTIMIZER_STATE_DTYPES}",
            )
        if self.num_mtp_layers is not None and self.num_mtp_layers < 0:
            raise _bad("num_mtp_layers", self.num_mtp_layers, "expected None or >= 0")
        if self.grad_sync not in GRAD_SYNC:
            raise _bad("grad_sync", self.grad_sync, f"expected one of {GRAD_SYNC}")
        if not isinstance(self.reshard_after_forward, bool):
            raise _bad("reshard_after_forward", self.reshard_after_forward, "expected a boolean")
        if not isinstance(self.recompute, bool):
            raise _bad("recompute", self.recompute, "expected True or False")
        if self.stack not in STACKS:
            raise _bad("stack", self.stack, f"expected one of {STACKS}")
        if self.num_microbatches < 2 * self.pp:
            raise _bad(
                "num_microbatches",
                self.num_microbatches,
                f"DualPipeV needs at least 2 * pp = {2 * self.pp} micro-batches",
            )
        if model.num_hidden_layers < self.num_stages:
            raise _bad(
                "pp",
                self.pp,
                f"{model.num_hidden_layers} layers cannot fill 2 * pp = {self.num_stages} stages",
            )
        pattern = self.moe_layer_pattern
        if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern < 1:
            raise _bad("moe_layer_pattern", pattern, "an int frequency must be >= 1")
        if isinstance(pattern, list) and (
            len(pattern) != model.num_hidden_layers or any(f not in (0, 1) for f in pattern)
        ):
            raise _bad(
                "moe_layer_pattern",
                pattern,
                f"a list needs one 0/1 entry per layer ({model.num_hidden_layers})",
            )
        has_moe = any(self.moe_layers())
        if has_moe and model.num_experts < 1:
            raise _bad("moe_layer_pattern", pattern, "MoE layers need num_experts >= 1")
        if has_moe and model.num_experts % self.ep:
            raise _bad("ep", self.ep, f"must divide num_experts={model.num_experts}")
        if has_moe and model.moe_intermediate_size % self.etp:
            raise _bad(
                "etp",
                self.etp,
                f"must divide each expert's FFN width moe_intermediate_size="
                f"{model.moe_intermediate_size}",
            )
        stage_ranks = self.tp * self.dp
        if stage_ranks % (self.ep * self.etp):
            field = "ep" if self.etp == 1 else "etp"
            raise _bad(
                field,
                getattr(self, field),
                f"ep * etp = {self.ep * self.etp} must divide the tp * dp = {stage_ranks} ranks "
                f"of a pipeline stage",
            )
        if self.expert_load is not None:
            local = model.num_experts // self.ep
            load = self.expert_load
            if len(load) != local or any(not isinstance(c, int) or c < 0 for c in load):
                raise _bad(
                    "expert_load",
                    load,
                    f"expected {local} non-negative row counts (one per local expert)",
                )
        shared = self.moe_shared_expert_intermediate_size
        if shared is not None and (not isinstance(shared, int) or shared < 0):
            raise _bad("moe_shared_expert_intermediate_size", shared, "expected None or >= 0")
        if shared and shared % self.tp:
            raise _bad(
                "moe_shared_expert_intermediate_size", shared, f"must divide by tp={self.tp}"
            )
        if model.num_attention_heads % self.tp or model.num_key_value_heads % self.tp:
            raise _bad("tp", self.tp, "must divide num_attention_heads and num_key_value_heads")
        if self.layers_per_stage is not None:
            counts = list(self.layers_per_stage)
            if len(counts) != self.num_stages or any(
                not isinstance(c, int) or c < 1 for c in counts
            ):
                raise _bad(
                    "layers_per_stage",
                    self.layers_per_stage,
                    f"expected {self.num_stages} positive integers (one per stage)",
                )
            if sum(counts) != model.num_hidden_layers:
                raise _bad(
                    "layers_per_stage",
                    self.layers_per_stage,
                    f"must sum to num_hidden_layers={model.num_hidden_layers}",
                )
