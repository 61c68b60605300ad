"""What Megatron-LM's own estimator prints for the same layout, reproduced term for term.

Users size jobs with Megatron's ``megatron/training/theoretical_memory_usage.py``
(the MoE-aware version of Megatron-LM PR #4687, commit a7c9e8c, ported to
Megatron-Bridge's ``theoretical_memory_utils``). To hold twinpipe's estimate beside
what Megatron prints, this module computes Megatron's formulas from the fields Megatron
reads (`MegatronArgs`), omissions included:

- weights and optimizer: three parameter buckets per layer (TP-sharded attention,
  dense MLP and shared experts; replicated norms, router and shared-expert gate; routed
  experts sharded by ETP x EP), on the most loaded pipeline stage: ``1 / PP`` of the
  transformer block (the final norm included), the whole MTP block and the embedding,
  plus the output layer when it is untied and PP = 1. 18 bytes per parameter (bf16
  weight, fp32 gradient, fp32 master, two fp32 Adam moments), or ``6 + 12 / DP`` with
  the distributed optimizer, where routed experts use the expert data-parallel group
  ``world / (ETP x EP x PP)``;
- activations: Korthikanti et al.'s selective-recompute formula with sequence
  parallelism (``s b h (18 + 4 ffn / h)`` per layer, first stage holding ``PP``
  micro-batches), or the formula without sequence parallelism (``s b h (10 + 24 / TP)``
  per layer, 5% overhead), chosen as Megatron's ``report_theoretical_memory`` chooses.

What Megatron's formula leaves out and twinpipe's own counts include (so the two differ
there on purpose): attention biases and GPT-OSS's sinks and expert biases, Qwen3's q/k
norms, MLA's lora norms undivided by TP (Megatron counts them in the TP-sharded attention
term), MTP's input norms and ``[2H -> H]`` projection. The functions keep Megatron's names
and meaning; `megatron_args` maps an `EstimateConfig` onto Megatron's fields (twinpipe
does not pad the vocabulary, runs no sequence parallelism at TP = 1, and its optimized
stack recomputes the attention block: "selective" recomputation).

Nor does it count the routing controls (`optimized.estimator.balancing`): its activation
formula has no router term, so the tensors a load-balancing loss or the z-loss keep (the
z-loss's float32 ``[T, E]`` logits, GPT-OSS's all-expert softmax, DeepSeek's load shares)
and the pooled loss's per-micro-batch counts are not in it, and its parameter count leaves
out the expert bias, a float32 ``[E]`` buffer per MoE layer (Megatron's own
``expert_bias`` and ``local_tokens_per_expert`` buffers too). `megatron_figures` lists
what applies to the run under ``not_counted``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from optimized.estimator.config import EstimateConfig

NUM_BYTES_IN_MEGABYTE = 1024 * 1024


@dataclass(slots=True)
class MegatronArgs:
    """The fields of Megatron-LM's ``args`` that its memory formulas read (Megatron's names)."""

    num_layers: int
    """Decoder layers."""
    hidden_size: int
    """Width of the residual stream."""
    ffn_hidden_size: int
    """Hidden width of a dense MLP."""
    num_attention_heads: int
    """Query heads."""
    kv_channels: int
    """Per-head width of q/k/v (non-MLA attention)."""
    padded_vocab_size: int
    """Rows of the embedding (Megatron pads the vocabulary; this is after padding)."""
    group_query_attention: bool = False
    """GQA: ``num_query_groups`` key/value heads; else as many as query heads."""
    num_query_groups: int | None = None
    """Key/value heads under GQA."""
    num_experts: int | None = None
    """Routed experts per MoE layer; None: a dense model."""
    moe_ffn_hidden_size: int | None = None
    """Hidden width of one routed expert."""
    moe_layer_freq: int | list[int] = 1
    """Which layers are MoE: every n-th from layer 0, or a 0/1 list per layer."""
    moe_router_topk: int = 2
    """Experts per token."""
    moe_shared_expert_intermediate_size: int | None = None
    """Total hidden width of the shared experts; None: no shared experts."""
    moe_shared_expert_gate: bool = False
    """A sigmoid gate (``hidden_size`` weights) on the shared experts."""
    mtp_num_layers: int | None = None
    """Multi-token-prediction layers; None: none."""
    multi_latent_attention: bool = False
    """DeepSeek's MLA instead of (grouped) multi-head attention."""
    q_lora_rank: int | None = None
    """MLA: query compression rank; None projects queries directly."""
    kv_lora_rank: int = 0
    """MLA: joint key/value compression rank."""
    qk_head_dim: int = 0
    """MLA: per-head query/key width without rotary."""
    qk_pos_emb_head_dim: int = 0
    """MLA: per-head rotary width."""
    v_head_dim: int = 0
    """MLA: per-head value width."""
    normalization: str = "LayerNorm"
    """``RMSNorm`` (a weight) or ``LayerNorm`` (a weight and a bias)."""
    swiglu: bool = False
    """Gated linear units: three matrices per MLP instead of two."""
    add_bias_linear: bool = True
    """Biases on linear layers (the formula counts only the router's)."""
    untie_embeddings_and_output_weights: bool = False
    """A separate output layer (counted on the most loaded shard only at PP = 1)."""
    tensor_model_parallel_size: int = 1
    """TP."""
    pipeline_model_parallel_size: int = 1
    """PP."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Interleaved stages per rank; None: not interleaved."""
    expert_model_parallel_size: int = 1
    """EP: ranks that divide the routed experts."""
    expert_tensor_parallel_size: int = 1
    """ETP: ranks that split each routed expert's FFN width."""
    data_parallel_size: int = 1
    """DP."""
    world_size: int = 1
    """All ranks (``TP x CP x PP x DP``)."""
    use_distributed_optimizer: bool = False
    """Shard the fp32 masters and Adam moments over DP (routed experts over expert-DP)."""
    seq_length: int = 4096
    """Tokens per sequence."""
    micro_batch_size: int = 1
    """Sequences per micro-batch."""
    sequence_parallel: bool = False
    """Sequence parallelism (Megatron turns it off at TP = 1)."""
    recompute_granularity: str | None = None
    """``selective``, ``full`` or None."""
    moe_pattern: list[int] = field(default_factory=list, init=False, repr=False)
    """Resolved 0/1 per layer (filled in at construction)."""

    def __post_init__(self) -> None:
        if self.num_experts is None:
            self.moe_pattern = [0] * self.num_layers
            return
        freq = self.moe_layer_freq
        if isinstance(freq, bool) or not isinstance(freq, (int, list)):
            raise TypeError(
                f"MegatronArgs.moe_layer_freq must be an int or a list of 0/1, "
                f"got {type(freq).__name__}"
            )
        if isinstance(freq, int):
            self.moe_pattern = [1 if i % freq == 0 else 0 for i in range(self.num_layers)]
        else:
            if len(freq) != self.num_layers:
                raise ValueError(
                    f"MegatronArgs.moe_layer_freq has {len(freq)} entries; "
                    f"expected one per layer ({self.num_layers})"
                )
            self.moe_pattern = list(freq)


@dataclass(slots=True)
class MegatronParams:
    """Megatron's parameter counts of one layer of each kind, by bucket."""

    attention: float
    dense_mlp: float
    shared_experts: float
    routed_experts: float
    active_routed_experts: float
    layernorms: float
    router: float
    shared_expert_gate: float
    embedding: float
    final_layernorm: float

    def dense_layer(self) -> float:
        return self.attention + self.dense_mlp + self.layernorms

    def moe_layer(self, routed: float | None = None) -> float:
        routed = self.routed_experts if routed is None else routed
        return (
            self.attention + self.shared_experts + routed + self.layernorms + self.router
            + self.shared_expert_gate
        )  # fmt: skip

    def tensor_sharded(self, moe: bool) -> float:
        return self.attention + (self.shared_experts if moe else self.dense_mlp)

    def replicated(self, moe: bool) -> float:
        if moe:
            return self.layernorms + self.router + self.shared_expert_gate
        return self.layernorms


def _attention_params(args: MegatronArgs, norm_size: int) -> float:
    h, heads = args.hidden_size, args.num_attention_heads
    if args.multi_latent_attention:
        rope, nope = args.qk_pos_emb_head_dim, args.qk_head_dim
        if args.q_lora_rank is None:
            q_term = h * heads * (nope + rope)
        else:  # down-projection, up-projection and the q norm, per lora channel
            q_term = args.q_lora_rank * (h + heads * (nope + rope) + norm_size)
        kv_term = args.kv_lora_rank * (h + heads * (nope + args.v_head_dim) + norm_size)
        return q_term + kv_term + h * rope + heads * args.v_head_dim * h
    groups = args.num_query_groups if args.group_query_attention else heads
    query = args.kv_channels * heads
    # q and o projections, and k and v at groups / heads of the query width.
    return 2 * h * h * (1 + groups / heads) * (query / h)


def megatron_params(args: MegatronArgs) -> MegatronParams:
    """Per-layer counts as Megatron's ``compute_weight_and_optimizer_memory`` forms them."""
    h = args.hidden_size
    norm_size = 1 if args.normalization == "RMSNorm" else 2
    gated = 3 / 2 if args.swiglu else 1
    moe = args.num_experts is not None
    experts = args.num_experts if moe else 1
    moe_ffn = args.moe_ffn_hidden_size if moe else 0
    shared = args.moe_shared_expert_intermediate_size or 0
    return MegatronParams(
        attention=_attention_params(args, norm_size),
        dense_mlp=2 * h * args.ffn_hidden_size * gated,
        shared_experts=2 * h * shared * gated,
        routed_experts=2 * h * moe_ffn * experts * gated,
        active_routed_experts=2 * h * moe_ffn * args.moe_router_topk * gated if moe else 0,
        layernorms=2 * h * norm_size,
        router=h * experts + (experts if args.add_bias_linear else 0) if moe else 0,
        shared_expert_gate=h if shared > 0 and args.moe_shared_expert_gate else 0,
        embedding=h * args.padded_vocab_size,
        final_layernorm=norm_size * h,
    )


@dataclass(slots=True)
class MegatronShard:
    """Megatron's parameters on the most loaded shard, by bucket, and the totals it prints."""

    tensor_sharded: float
    replicated: float
    routed_experts: float
    total_parameters: float
    active_parameters: float
    transformer_block: float
    mtp_block: float
    embedding_layers: float
    other_shards: float | None

    @property
    def most_loaded(self) -> float:
        return self.tensor_sharded + self.replicated + self.routed_experts


def megatron_shard(args: MegatronArgs) -> MegatronShard:
    """The most loaded shard's parameters (stage 0: ``1 / PP`` of the block, the whole MTP
    block, the embedding; the output layer too when untied at PP = 1)."""
    p = megatron_params(args)
    pattern = args.moe_pattern
    moe_layers = sum(pattern)
    dense_layers = args.num_layers - moe_layers
    mtp = args.mtp_num_layers or 0
    mtp_moe = mtp * pattern[-1]  # the MTP block takes the last layer's spec
    mtp_dense = mtp - mtp_moe
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    expert_split = args.expert_tensor_parallel_size * args.expert_model_parallel_size

    def buckets(dense: int, moe: int) -> tuple[float, float, float]:
        return (
            p.tensor_sharded(False) * dense + p.tensor_sharded(True) * moe,
            p.replicated(False) * dense + p.replicated(True) * moe,
            p.routed_experts * moe,
        )

    block_tp, block_rep, block_routed = buckets(dense_layers, moe_layers)
    block_rep += p.final_layernorm
    mtp_tp, mtp_rep, mtp_routed = buckets(mtp_dense, mtp_moe)
    tensor_sharded = (block_tp / pp + mtp_tp + p.embedding) / tp
    if args.untie_embeddings_and_output_weights and pp == 1:
        tensor_sharded += p.embedding / tp
    block = p.dense_layer() * dense_layers + p.moe_layer() * moe_layers + p.final_layernorm
    active_block = (
        p.dense_layer() * dense_layers
        + p.moe_layer(p.active_routed_experts) * moe_layers
        + p.final_layernorm
    )
    mtp_block = p.dense_layer() * mtp_dense + p.moe_layer() * mtp_moe
    embedding_layers = p.embedding * (2 if args.untie_embeddings_and_output_weights else 1)
    other = None
    if pp > 1:
        other = block_tp / (pp * tp) + block_rep / pp + block_routed / (pp * expert_split)
    return MegatronShard(
        tensor_sharded=tensor_sharded,
        replicated=block_rep / pp + mtp_rep,
        routed_experts=(block_routed / pp + mtp_routed) / expert_split,
        total_parameters=block + mtp_block + embedding_layers,
        active_parameters=active_block + mtp_block + embedding_layers,
        transformer_block=block,
        mtp_block=mtp_block,
        embedding_layers=embedding_layers,
        other_shards=other,
    )


def _bytes_per_parameter(args: MegatronArgs, data_parallel_size: int) -> float:
    """bf16 weight, fp32 gradient, fp32 master and two fp32 Adam moments: 18 bytes, of which
    the 12 of master and moments are split over DP by the distributed optimizer."""
    return 6 + 12 / data_parallel_size if args.use_distributed_optimizer else 18


def expert_data_parallel_size(args: MegatronArgs) -> int:
    split = (
        args.expert_tensor_parallel_size
        * args.expert_model_parallel_size
        * args.pipeline_model_parallel_size
    )
    return args.world_size // split


def compute_weight_and_optimizer_memory(args: MegatronArgs, verbose: bool = False) -> float:
    """Megatron's bytes of weights, gradients and optimizer state on the most loaded shard."""
    shard = megatron_shard(args)
    if verbose:
        print(f"Number of parameters in transformer block in billions: "
              f"{shard.transformer_block / 1e9: .2f}")  # fmt: skip
        if args.mtp_num_layers is not None:
            print(f"Number of parameters in mtp block in billions: {shard.mtp_block / 1e9: .2f}")
        print(f"Number of parameters in embedding layers in billions: "
              f"{shard.embedding_layers / 1e9:.2f}")  # fmt: skip
        print(f"Total number of parameters in billions: {shard.total_parameters / 1e9:.2f}")
        print(f"Total number of active parameters in billions: "
              f"{shard.active_parameters / 1e9:.2f}")  # fmt: skip
        print(f"Number of parameters in most loaded shard in billions: "
              f"{shard.most_loaded / 1e9:.4f}")  # fmt: skip
        if shard.other_shards is not None:
            print(f"Number of parameters in other shards in billions: "
                  f"{shard.other_shards / 1e9:.4f}")  # fmt: skip
    dense = shard.tensor_sharded + shard.replicated
    return dense * _bytes_per_parameter(
        args, args.data_parallel_size
    ) + shard.routed_experts * _bytes_per_parameter(args, expert_data_parallel_size(args))


def _in_flight_factor(args: MegatronArgs, num_microbatches: int | None) -> float:
    """Interleaving's penalty, or the discount when fewer than PP micro-batches run."""
    pp, vpp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    if vpp is not None:
        return 1 + (pp - 1) / (pp * vpp)
    if pp > 1 and num_microbatches is not None:
        return min(1, num_microbatches / pp)
    return 1


def _embedding_activations(args: MegatronArgs) -> float:
    """The embedding's input ids (8 bytes a token) and dropout mask, PP micro-batches."""
    s, b, pp = args.seq_length, args.micro_batch_size, args.pipeline_model_parallel_size
    return 8 * s * b * pp + s * b * args.hidden_size * pp


def compute_activation_memory(
    args: MegatronArgs, num_microbatches: int | None, verbose: bool = False
) -> float:
    """Megatron's first-stage activations with sequence parallelism and selective recompute."""
    s, b, h = args.seq_length, args.micro_batch_size, args.hidden_size
    per_layer = s * b * h * (18 + 4 * args.ffn_hidden_size / h)
    if verbose:
        per_rank = per_layer / NUM_BYTES_IN_MEGABYTE / args.tensor_model_parallel_size
        print(f"Activation memory footprint per transformer layer: {per_rank:.1f} MB")
    memory = per_layer * args.num_layers + _embedding_activations(args)
    memory *= _in_flight_factor(args, num_microbatches)
    if args.pipeline_model_parallel_size == 1:  # inputs of the output layer and the loss
        memory += s * b * h * 4 * (1 + args.padded_vocab_size / h)
    return memory / args.tensor_model_parallel_size


def compute_activation_memory_without_sp(
    args: MegatronArgs, num_microbatches: int | None, verbose: bool = False
) -> float:
    """Megatron's first-stage activations without sequence parallelism (5% overhead)."""
    s, b, h = args.seq_length, args.micro_batch_size, args.hidden_size
    tp = args.tensor_model_parallel_size
    per_layer = s * b * h * (10 + 24 / tp)
    if verbose:
        print(f"Activation memory footprint per transformer layer (precise, without SP): "
              f"{per_layer / NUM_BYTES_IN_MEGABYTE:.1f} MB")  # fmt: skip
    memory = per_layer * args.num_layers + _embedding_activations(args)
    memory *= _in_flight_factor(args, num_microbatches)
    if args.pipeline_model_parallel_size == 1:  # logits (TP-split) and the final norm's output
        memory += (s * b * args.padded_vocab_size / tp + s * b * h) * 2
    return memory * 1.05


def megatron_activation_memory(args: MegatronArgs, num_microbatches: int | None) -> float:
    """The activation formula Megatron's report picks for these args."""
    if args.sequence_parallel and args.recompute_granularity == "selective":
        return compute_activation_memory(args, num_microbatches)
    return compute_activation_memory_without_sp(args, num_microbatches)


def report_theoretical_memory(
    args: MegatronArgs, num_microbatches: int | None = None, verbose: bool = False
) -> tuple[float, float, float]:
    """Print and return Megatron's (weight and optimizer, activation, total) in MB."""
    weights = compute_weight_and_optimizer_memory(args, verbose) / NUM_BYTES_IN_MEGABYTE
    activation = megatron_activation_memory(args, num_microbatches) / NUM_BYTES_IN_MEGABYTE
    total = weights + activation
    print(
        f"Theoretical memory footprints: weight and optimizer={weights:.2f} MB, "
        f"activation={activation:.2f} MB, total={total:.2f} MB"
    )
    return weights, activation, total


def megatron_args(config: EstimateConfig) -> MegatronArgs:
    """Megatron's fields for twinpipe's model and layout (what a user would pass it)."""
    m = config.model
    mla = m.is_deepseek
    has_moe = any(config.moe_layers()) and m.num_experts > 0
    shared = config.shared_expert_width
    return MegatronArgs(
        num_layers=m.num_hidden_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.intermediate_size,
        num_attention_heads=m.num_attention_heads,
        kv_channels=m.v_head_dim if mla else m.head_dim,
        padded_vocab_size=m.vocab_size,
        group_query_attention=not mla and m.num_key_value_heads != m.num_attention_heads,
        num_query_groups=None if mla else m.num_key_value_heads,
        num_experts=m.num_experts if has_moe else None,
        moe_ffn_hidden_size=m.moe_intermediate_size if has_moe else None,
        moe_layer_freq=[int(flag) for flag in config.moe_layers()],
        moe_router_topk=m.num_experts_per_tok,
        moe_shared_expert_intermediate_size=shared or None,
        moe_shared_expert_gate=config.shared_expert_gate,
        mtp_num_layers=config.mtp_layers or None,
        multi_latent_attention=mla,
        q_lora_rank=m.q_lora_rank if mla else None,
        kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_nope_head_dim,
        qk_pos_emb_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        normalization="RMSNorm",
        swiglu=True,  # all three families: gate, up and down matrices
        add_bias_linear=m.model_type == "gpt_oss",  # its router (and linears) carry biases
        untie_embeddings_and_output_weights=not m.tie_word_embeddings,
        tensor_model_parallel_size=config.tp,
        pipeline_model_parallel_size=config.pp,
        expert_model_parallel_size=config.ep,
        expert_tensor_parallel_size=config.etp,
        data_parallel_size=config.dp,
        world_size=config.world_size,
        use_distributed_optimizer=config.shard_optimizer or config.fsdp,
        seq_length=config.seq_len,
        micro_batch_size=config.micro_batch_size,
        sequence_parallel=config.tp > 1,
        recompute_granularity=(
            "selective" if config.stack == "optimized" and config.recompute else None
        ),
    )


def not_counted(config: EstimateConfig) -> list[str]:
    """What of ``config``'s routing controls Megatron's formulas leave out (module docstring)."""
    controls = config.model.balancing()
    missing = []
    if controls.aux or controls.z_coef > 0:
        missing.append("the router tensors the balancing losses keep for backward")
    if controls.pooled:
        missing.append("the pooled loss's per-micro-batch expert counts")
    if controls.expert_bias:
        missing.append("the expert-bias buffers")
    return missing


def megatron_figures(config: EstimateConfig) -> dict:
    """Megatron's figures for ``config`` in bytes, as `estimate`'s ``megatron`` entry."""
    args = megatron_args(config)
    static = compute_weight_and_optimizer_memory(args)
    activation = megatron_activation_memory(args, config.num_microbatches)
    shard = megatron_shard(args)
    return {
        "not_counted": not_counted(config),
        "weight_and_optimizer_bytes": static,
        "activation_bytes": activation,
        "total_bytes": static + activation,
        "parameters_on_most_loaded_shard": shard.most_loaded,
        "total_parameters": shard.total_parameters,
        "activation_formula": "selective recompute with sequence parallelism"
        if args.sequence_parallel and args.recompute_granularity == "selective"
        else "without sequence parallelism",
    }


__all__ = [
    "MegatronArgs",
    "NUM_BYTES_IN_MEGABYTE",
    "compute_activation_memory",
    "compute_activation_memory_without_sp",
    "compute_weight_and_optimizer_memory",
    "expert_data_parallel_size",
    "megatron_args",
    "megatron_figures",
    "megatron_params",
    "not_counted",
    "megatron_shard",
    "report_theoretical_memory",
]
