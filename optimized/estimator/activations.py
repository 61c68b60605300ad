"""Bytes autograd keeps for backward, per layer and micro-batch, read off twinpipe's model code.

Each entry below names the op in `models.network.layers` / `models.network.decoder` whose
``ctx`` holds the tensor (``nn.Linear`` saves its input, ``RMSNorm`` its
float32 input, the rsqrt and the normalised value, softmax its result,
``index_select`` only its index, ...). Tensors are counted once per storage:
a norm's output that the next linear saves is one entry. Parameters (and views
of them) are not activations. ``tests/test_estimator_activations.py`` holds
these sums against `torch.autograd.graph.saved_tensors_hooks` on real forwards.

Routed rows use their balanced expectation: ``N = tokens * top_k`` copies leave
a rank and, with EP ranks sharing the load evenly, ``N`` arrive (real routing
varies a few percent around it). The optimized stack's per-expert padding uses
the expected padded count of a binomial load (`routed_rows`).

``stack="optimized"`` differs where `optimized.ops` and the overlapped
pipeline differ: the padded gather rounds the expert rows up to a multiple of
``GATHER_ALIGNMENT``, the fused cross-entropy keeps one logits-sized buffer
instead of a float32 log-softmax, and the stage records keep each MoE
layer's stage boundaries only as storage-less roots: the attention residual,
the sorted, received and expert-output buffers are freed right after their last
reader.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from optimized.estimator.balancing import balancing
from optimized.estimator.config import EstimateConfig

F32, I64, COMPLEX64 = 4, 8, 8
GATHER_ALIGNMENT = 1024
"""Rows of the optimized stack's padded gather buffers are a multiple of this."""
GROUPED_GEMM_ROW_ALIGNMENT = 128
"""Each local expert's group of rows in the optimized grouped GEMM is padded to this."""


@dataclass(frozen=True, slots=True)
class Saved:
    """One tensor kept for backward."""

    name: str
    nbytes: int
    weight_input: bool = False
    """Needed only by a weight gradient (kept until W when weight gradients are deferred)."""


def _norm(
    name: str, rows: int, width: int, b: int, consumer_saves_output: bool, float_weight=False
) -> list[Saved]:
    """RMSNorm: float32 input (a copy when the run dtype is 16-bit), rsqrt, the normalised
    value saved by ``weight * x`` (in the run dtype, or in float32 for GPT-OSS's
    ``float_weight`` norm), and its output if a linear reads it."""
    out = [
        Saved(f"{name}.float_input", rows * width * F32),
        Saved(f"{name}.rsqrt", rows * F32),
        Saved(f"{name}.normalized", rows * width * (F32 if float_weight else b)),
    ]
    if consumer_saves_output:
        out.append(Saved(f"{name}.output", rows * width * b, weight_input=True))
    return out


def attention_saved(config: EstimateConfig, layer: int) -> list[Saved]:
    """Input norm and attention of one layer (the layer's input is the norm's float input)."""
    m, b = config.model, config.param_bytes
    batch, seq, tokens = config.micro_batch_size, config.seq_len, config.tokens
    heads = m.num_attention_heads // config.tp
    hidden = m.hidden_size
    saved = _norm("input_layernorm", tokens, hidden, b, True, m.model_type == "gpt_oss")
    if m.is_deepseek:
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank is not None:
            saved += _norm("q_a_layernorm", tokens, m.q_lora_rank, b, True)
        # kv_a output: in float32 the norm's input is a slice of it, so the whole
        # [T, kv_lora_rank + rope] storage stays; in 16-bit the float copy is of the slice.
        kv_width = m.kv_lora_rank + (m.qk_rope_head_dim if b == F32 else 0)
        saved += [
            Saved("kv_a_layernorm.float_input", tokens * kv_width * F32),
            Saved("kv_a_layernorm.rsqrt", tokens * F32),
            Saved("kv_a_layernorm.normalized", tokens * m.kv_lora_rank * b),
            Saved("kv_a_layernorm.output", tokens * m.kv_lora_rank * b, weight_input=True),
        ]
        if m.model_type == "deepseek_v2":  # complex rotation in float32
            saved.append(Saved("rotary.rotation", 2 * seq * (m.qk_rope_head_dim // 2) * COMPLEX64))
        else:  # V3: cos/sin cast to the run dtype per call: shared by q and k only in float32
            tables = 2 if b == F32 else 4
            saved.append(Saved("rotary.cos_sin", tables * seq * (m.qk_rope_head_dim // 2) * b))
        saved += [
            Saved("attention.q", tokens * heads * qk * b),
            Saved("attention.k", tokens * heads * qk * b),
        ]
        v_dim = m.v_head_dim
        # With one sequence v stays a view of kv_b's output (whose storage holds k_nope
        # too); with more, matmul saves a contiguous copy of v.
        v_saved = v_dim + (m.qk_nope_head_dim if batch == 1 else 0)
    else:
        dim, kv_heads = m.head_dim, m.num_key_value_heads // config.tp
        if m.model_type == "qwen3_moe":
            for name, width in (("q_norm", heads), ("k_norm", kv_heads)):
                saved += [
                    Saved(f"{name}.float_input", tokens * width * dim * F32),
                    Saved(f"{name}.rsqrt", tokens * width * F32),
                    Saved(f"{name}.normalized", tokens * width * dim * b),
                ]
        # cos/sin cast to the run dtype per call: shared by q and k only in float32.
        tables = 2 if b == F32 else 4
        saved += [
            Saved("rotary.cos_sin", tables * seq * (dim // 2) * b),
            Saved("attention.q", tokens * heads * dim * b),
            Saved("attention.k", tokens * heads * dim * b),
        ]
        v_dim = v_saved = dim
    if m.model_type == "gpt_oss":
        # Sinks: max for stability (indices), softmax in the run dtype over S + 1 columns.
        saved += [
            Saved("attention.max_indices", batch * heads * seq * I64),
            Saved("attention.probs", batch * heads * seq * (seq + 1) * b),
        ]
    else:
        saved.append(Saved("attention.softmax", batch * heads * seq * seq * F32))
        if b != F32:
            saved.append(Saved("attention.probs", batch * heads * seq * seq * b))
    saved += [
        Saved("attention.v", tokens * heads * v_saved * b),
        Saved("o_proj.input", tokens * heads * v_dim * b, weight_input=True),
    ]
    return saved


def dense_mlp_saved(tokens: int, inner: int, b: int, name: str = "mlp") -> list[Saved]:
    """SwiGLU MLP: gate and up outputs, silu(gate), and the product read by down_proj."""
    return [
        Saved(f"{name}.gate", tokens * inner * b),
        Saved(f"{name}.silu", tokens * inner * b),
        Saved(f"{name}.up", tokens * inner * b),
        Saved(f"{name}.down_input", tokens * inner * b, weight_input=True),
    ]


@dataclass(frozen=True, slots=True)
class Routed:
    """One MoE layer's routed rows on one rank, for one micro-batch."""

    sent: int
    """Copies of this rank's tokens sent to experts (tokens x top-k)."""
    received: int
    """Rows this rank's local experts receive."""
    grouped: int
    """Rows of the grouped buffer (the optimized stack pads each expert's group)."""
    largest: int
    """Rows of the local expert that receives most."""


def routed(config: EstimateConfig) -> Routed:
    """The rows routed in one layer and micro-batch: observed (``config.expert_load``) or
    balanced (every rank receives what it sends, split evenly over its experts)."""
    sent = config.tokens * config.model.num_experts_per_tok
    load = config.expert_load
    if load is not None:
        received = sum(load)
        if config.stack == "optimized":
            grouped = sum(-(-count // GROUPED_GEMM_ROW_ALIGNMENT) for count in load)
            grouped *= GROUPED_GEMM_ROW_ALIGNMENT
        else:
            grouped = received
        return Routed(sent, received, grouped, max(load, default=0))
    local = max(config.model.num_experts // config.ep, 1)
    return Routed(sent, sent, routed_rows(config)[1], -(-sent // local))


def routed_rows(config: EstimateConfig) -> tuple[int, int]:
    """(copies sent, rows grouped by expert on the receiving rank) per micro-batch."""
    sent = config.tokens * config.model.num_experts_per_tok
    if config.expert_load is not None:
        return sent, routed(config).grouped
    if config.stack == "optimized":
        # Each local expert's group is padded up to GROUPED_GEMM_ROW_ALIGNMENT rows. The
        # padding depends on each expert's count, not on the total: near a multiple of
        # the alignment, an expert a few rows over the balanced share pays a whole extra
        # block. So use the expected padded count under routing that picks each expert
        # with equal probability: the EP group's ``sent * ep`` copies land on one expert
        # as Binomial(sent * ep, 1 / num_experts).
        local = max(config.model.num_experts // config.ep, 1)
        copies = sent * config.ep
        per_expert = expected_padded_count(
            copies, 1 / config.model.num_experts, GROUPED_GEMM_ROW_ALIGNMENT
        )
        return sent, round(local * per_expert)
    return sent, sent


@functools.lru_cache(maxsize=256)
def expected_padded_count(trials: int, p: float, alignment: int) -> float:
    """E[round_up(X, alignment)] for X ~ Binomial(trials, p) (an empty group takes no
    rows), summed over the pmf within 12 standard deviations of the mean (the rest
    weighs under 1e-30). Cached: the partition search asks the same figure for every layer
    of every candidate."""
    if p >= 1:
        return -(-trials // alignment) * alignment
    mean = trials * p
    spread = 12 * math.sqrt(max(mean * (1 - p), 1.0))
    low, high = max(0, int(mean - spread)), min(trials, int(mean + spread) + 1)
    log_norm = math.lgamma(trials + 1)
    total = weight = 0.0
    for k in range(low, high + 1):
        log_pmf = (
            log_norm - math.lgamma(k + 1) - math.lgamma(trials - k + 1)
            + (k * math.log(p) if k else 0.0) + (trials - k) * math.log1p(-p)
        )  # fmt: skip
        pmf = math.exp(log_pmf)
        weight += pmf
        total += pmf * (-(-k // alignment) * alignment)
    return total / weight


def moe_saved(config: EstimateConfig) -> list[Saved]:
    """Router, dispatch bookkeeping, routed experts, shared experts, aggregation."""
    m, b, tokens = config.model, config.param_bytes, config.tokens
    hidden, inner, experts, top_k = (
        m.hidden_size,
        m.moe_intermediate_size // config.etp,
        m.num_experts,
        m.num_experts_per_tok,
    )
    rows = routed(config)
    sent, grouped, received = rows.sent, rows.grouped, rows.received
    saved: list[Saved] = []
    # The weights are the scores indexed at the chosen experts (models.network.router._at): the
    # ``[T, k]`` expert index and a ``[T, 1]`` row index are saved; the selection is detached.
    routed_index = [
        Saved("router.topk_indices", tokens * top_k * I64),
        Saved("router.row_index", tokens * I64),
    ]
    if m.model_type == "gpt_oss":
        saved += routed_index + [Saved("router.softmax", tokens * top_k * b)]
    else:
        if b != F32 and m.is_deepseek:
            # linear(x.float(), weight.float()): both copies are saved. Qwen3-MoE's router
            # runs in the model dtype (as HF's) and saves the norm's output itself.
            saved += [
                Saved("router.float_input", tokens * hidden * F32, weight_input=True),
                Saved("router.float_weight", experts * hidden * F32),
            ]
        # The softmax (DeepSeek-V3: the sigmoid) keeps its float32 result.
        saved += [Saved("router.softmax", tokens * experts * F32)] + routed_index
        if m.model_type in ("qwen3_moe", "deepseek_v3") and m.norm_topk_prob:
            saved += [
                Saved("router.topk_weights", tokens * top_k * F32),
                Saved("router.topk_sum", tokens * F32),
            ]
    saved += balancing_saved(config)
    saved += [
        Saved("dispatch.token_index", sent * I64),
        Saved("dispatch.weight_order", sent * I64),
    ]
    if config.shared_expert_width:
        shared = config.shared_expert_width // config.tp
        saved += dense_mlp_saved(tokens, shared, b, "shared_experts")
    # Routed experts on the received rows (grouped by local expert).
    if config.stack == "reference":
        saved.append(Saved("experts.order", received * I64))
    else:
        saved.append(Saved("experts.gather_index", received * I64))
    saved.append(Saved("experts.grouped_input", grouped * hidden * b, weight_input=True))
    saved.append(Saved("experts.gate_up", grouped * 2 * inner * b))
    if m.model_type == "gpt_oss":
        for name in ("up_plus_one", "gate_clamped", "sigmoid", "gated"):
            saved.append(Saved(f"experts.{name}", grouped * inner * b))
    else:
        saved.append(Saved("experts.silu", grouped * inner * b))
    saved.append(Saved("experts.down_input", grouped * inner * b, weight_input=True))
    saved.append(Saved("experts.positions", received * I64))
    saved += [
        Saved("aggregate.expert_output", sent * hidden * b),
        Saved("aggregate.weights", sent * b),
        Saved("aggregate.weighted", sent * hidden * b),
    ]
    return saved


def balancing_saved(config: EstimateConfig) -> list[Saved]:
    """What the routing controls' terms save in a MoE layer (`models.network.balancing`), named
    as the router's (made with it, freed with it): GPT-OSS's float32 softmax over every
    expert when a load-balancing loss is on (the other families' router saves its own;
    DeepSeek-V3's loss divides the saved sigmoid scores by their sum, which it saves);
    the z-loss's ``logsumexp`` input (float32 logits, or their float copy) and output;
    the ``layer`` form's ``[E]`` load share, the ``sequence`` form's ``[B, E]``. The pooled
    form saves nothing (`optimized.estimator.balancing`)."""
    m, tokens, experts = config.model, config.tokens, config.model.num_experts
    controls = balancing(config)
    saved = []
    if controls.aux and m.model_type == "gpt_oss":
        saved.append(Saved("router.balance.probs", tokens * experts * F32))
    if controls.aux and m.model_type == "deepseek_v3":  # scores / their sum: the [T, 1] sum
        saved.append(Saved("router.balance.score_sum", tokens * F32))
    if controls.aux and controls.aux_form == "layer":
        saved.append(Saved("router.balance.layer_share", experts * F32))
    if controls.aux and controls.aux_form == "sequence":
        share = config.micro_batch_size * experts * F32
        saved.append(Saved("router.balance.sequence_share", share))
    if controls.z_coef > 0:
        saved += [
            Saved("router.balance.z_logits", tokens * experts * F32),
            Saved("router.balance.z_logsumexp", tokens * F32),
        ]
    return saved


def layer_saved(config: EstimateConfig, layer: int, is_moe: bool | None = None) -> list[Saved]:
    """Everything one decoder layer keeps for backward, for one micro-batch."""
    m, b, tokens = config.model, config.param_bytes, config.tokens
    if is_moe is None:
        is_moe = config.moe_layers()[layer]
    saved = attention_saved(config, layer)
    # The post-attention norm's output is saved by the dense MLP, the shared experts or a
    # router in the model dtype (GPT-OSS, Qwen3-MoE); DeepSeek's float32 router saves its
    # own float copy in 16-bit runs.
    output_saved = b == F32 or not is_moe or not m.is_deepseek or bool(config.shared_expert_width)
    saved += _norm(
        "post_attention_layernorm",
        tokens,
        m.hidden_size,
        b,
        output_saved,
        m.model_type == "gpt_oss",
    )
    if is_moe:
        saved += moe_saved(config)
    else:
        saved += dense_mlp_saved(tokens, m.intermediate_size // config.tp, b)
    return saved


def layer_bytes(config: EstimateConfig, layer: int, is_moe: bool | None = None) -> int:
    return sum(item.nbytes for item in layer_saved(config, layer, is_moe))


def embedding_saved(config: EstimateConfig) -> list[Saved]:
    """The embedding keeps its indices (the input ids)."""
    return [Saved("embedding.indices", config.tokens * I64)]


def head_saved(config: EstimateConfig) -> list[Saved]:
    """Final norm, output layer input and the loss's saved state."""
    m, b, tokens = config.model, config.param_bytes, config.tokens
    vocab = m.vocab_size // config.tp
    saved = _norm("norm", tokens, m.hidden_size, b, True, m.model_type == "gpt_oss")
    if config.stack == "reference":
        # F.cross_entropy(logits.float()): log_softmax keeps its float32 result.
        saved.append(Saved("loss.log_softmax", tokens * vocab * F32))
    else:
        # Fused cross-entropy: the gradient is written over the logits; that one buffer stays.
        saved.append(Saved("loss.logits_grad", tokens * vocab * b))
    saved.append(Saved("loss.target", tokens * I64))
    return saved


def mtp_depth_saved(config: EstimateConfig) -> list[Saved]:
    """What one multi-token-prediction depth (`models.network.mtp`, in the loss stage) keeps
    for one micro-batch before its head: its shifted ids (the embedding's indices), the two
    input norms, the ``eh_proj`` input (``[tokens, 2H]``), a decoder layer of the last
    layer's kind, and the shared head's norm."""
    m, b, tokens = config.model, config.param_bytes, config.tokens
    hidden, gpt_oss = m.hidden_size, m.model_type == "gpt_oss"
    depth = [Saved("mtp.embedding.indices", tokens * I64)]
    depth += _norm("mtp.enorm", tokens, hidden, b, False, gpt_oss)
    depth += _norm("mtp.hnorm", tokens, hidden, b, False, gpt_oss)
    depth.append(Saved("mtp.eh_proj.input", tokens * 2 * hidden * b, weight_input=True))
    depth += layer_saved(config, m.num_hidden_layers - 1, config.moe_layers()[-1])
    depth += _norm("mtp.shared_head.norm", tokens, hidden, b, True, gpt_oss)
    return depth


def mtp_final_norm_saved(config: EstimateConfig) -> list[Saved]:
    """The main model's final norm run once more on the head's input for the MTP's ``h^0``
    (both stacks' loss stage do, `models.network.mtp`): its rsqrt and normalised value,
    and in 16-bit its own float copy of the input (in float32 that is the input itself,
    kept by the main head's norm); its output is depth 1's ``hnorm`` float input."""
    m, b = config.model, config.param_bytes
    items = _norm("mtp.final_norm", config.tokens, m.hidden_size, b, False,
                  m.model_type == "gpt_oss")  # fmt: skip
    return [item for item in items if not (b == F32 and item.name.endswith(".float_input"))]


def mtp_saved(config: EstimateConfig) -> list[Saved]:
    """Every MTP depth's `mtp_depth_saved` and its own logits' loss state, as `head_saved`
    keeps the main head's, after the final norm's rerun (`mtp_final_norm_saved`). In
    float32 a depth's ``hnorm`` float input is the previous depth's normed output, which
    that depth's head already saves: counted once."""
    head = [item for item in head_saved(config) if item.name.startswith("loss.")]
    head = [item for item in head if item.name != "loss.target"]
    depths = config.mtp_layers
    if not depths:
        return []
    depth = mtp_depth_saved(config)
    later = depth
    if config.param_bytes == F32:
        later = [item for item in depth if item.name != "mtp.hnorm.float_input"]
    return mtp_final_norm_saved(config) + depth + head + (later + head) * (depths - 1)


def chunk_boundary_bytes(config: EstimateConfig) -> int:
    """The stage's input a pipeline holds beyond what autograd saves: in float32 the first
    norm saves the input itself; in 16-bit it saves a float copy, so the input is extra."""
    b = config.param_bytes
    return 0 if b == F32 else config.tokens * config.model.hidden_size * b
