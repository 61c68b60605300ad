"""Building blocks of the four families: norms, rotary tables, attention, MLPs (the routers
are `models.network.router`).

Parameter names and shapes are those of Hugging Face transformers 5's modules
(in memory), so that a state dict maps onto ours by name; `models.hf.checkpoint`
converts between that and the on-disk layout.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.network.config import ModelConfig


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as HF does. DeepSeek-V2 and Qwen3-MoE (Llama's way)
    cast back to the input dtype before the weight; GPT-OSS (``float_weight``) multiplies
    by the weight in float32 and casts after, which rounds differently in bfloat16."""

    def __init__(self, size: int, eps: float, float_weight: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.float_weight = float_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.float_weight:
            return (self.weight * x).to(dtype)
        return self.weight * x.to(dtype)


# ---------------------------------------------------------------------- rotary
def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(config: ModelConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[dim / 2]`` and the attention factor that scales cos/sin."""
    base = config.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    scaling = config.rope_scaling
    if scaling is None:
        return 1.0 / pos_freqs, 1.0
    factor = scaling["factor"]
    original = scaling.get("original_max_position_embeddings") or config.max_position_embeddings
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    interpolation = 1.0 / (factor * pos_freqs)
    inv_freq = interpolation * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope_angles(inv_freq: torch.Tensor, seq_len: int, device: torch.device) -> torch.Tensor:
    """Angles ``[seq, dim / 2]`` in float32 for positions 0..seq-1."""
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    return positions[:, None] * inv_freq.to(device)[None, :]


def apply_rotary_half(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """Rotate-half RoPE (Qwen3, GPT-OSS) on ``x [B, heads, S, D]``; cos/sin ``[S, D/2]``.

    ``interleaved`` (DeepSeek-V3's ``rope_interleave``): the pairs are ``x``'s even and odd
    entries, and the result holds the rotated evens, then the rotated odds, as transformers
    computes it (a fixed permutation of the rotary width, the same for queries and keys)."""
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rotary_interleaved(x: torch.Tensor, angles: torch.Tensor, scale: float) -> torch.Tensor:
    """DeepSeek's RoPE on interleaved pairs (complex view) of ``x [B, heads, S, D]``."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotation = torch.polar(torch.ones_like(angles), angles) * scale
    return torch.view_as_real(pairs * rotation).flatten(-2).type_as(x)


def causal_mask(seq_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """Additive mask ``[S, S]``: 0 where query i may see key j, -inf elsewhere."""
    i = torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    allowed = j <= i
    if window is not None:
        allowed = allowed & (i - j < window)
    mask = torch.zeros(seq_len, seq_len, device=device)
    return mask.masked_fill(~allowed, float("-inf"))


def eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention in float32 on ``q [B, h, S, D]``, ``k/v [B, h_kv, S, D]``.

    ``sinks [h]`` adds one extra logit column per head that takes probability
    mass and is dropped after the softmax (GPT-OSS). Returns ``[B, S, h * Dv]``.
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scaling + mask.to(q.dtype)
    if sinks is None:
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        sink = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1).to(scores.dtype)
        scores = torch.cat([scores, sink], dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
        probs = F.softmax(scores, dim=-1, dtype=scores.dtype)[..., :-1].to(q.dtype)
    out = torch.matmul(probs, v)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


# ------------------------------------------------------------------- attention
def _init_rope_buffer(attention: nn.Module, dim: int) -> None:
    """Recompute the rotary table (a meta-device module has none), in float32 whatever the
    model's dtype, as transformers keeps it (``from_pretrained`` in bfloat16 leaves the
    rotary ``inv_freq`` in float32). Rounded to bfloat16, each frequency moves by up to
    2**-8 of itself and the angle of position p by p times that: at GPT-OSS-20B's rotary
    width, 0.2 rad by position 127 and cos/sin 2.4e-2 from float32 (1.9e-3 when rounded
    once, after the float32 cos/sin), which made our bfloat16 logits 2.0-2.2 times as far
    from float32 as transformers' (1-2 real-width layers, 128 tokens; DeepSeek-V2 1.12);
    1.0 with this."""
    inv_freq = rope_frequencies(attention.config, dim)[0]
    attention.inv_freq = inv_freq.to(attention.inv_freq.device)


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek MLA: low-rank joint KV, optional low-rank Q, one shared rotary key.

    The rotary differs by family as in transformers: V2 rotates interleaved pairs as complex
    numbers in float32; V3 rotates in the model's dtype with cos/sin cast to it, on the
    even/odd slices (``rope_interleave``) or the two halves."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.num_heads = c.num_attention_heads
        self.q_lora_rank = c.q_lora_rank
        self.kv_lora_rank = c.kv_lora_rank
        self.nope, self.rope, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        qk_dim = self.nope + self.rope
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.hidden_size, self.num_heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=c.attention_bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(c.q_lora_rank, self.num_heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=c.attention_bias
        )
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(
            c.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, c.hidden_size, bias=c.attention_bias)
        self.config = c
        self.complex_rotary = c.model_type == "deepseek_v2"
        inv_freq, self.rope_scale = rope_frequencies(c, self.rope)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scaling = qk_dim**-0.5
        if c.rope_scaling is not None and c.rope_scaling.get("mscale_all_dim"):
            m = _yarn_mscale(c.rope_scaling["factor"], c.rope_scaling["mscale_all_dim"])
            self.scaling *= m * m

    def init_buffers(self) -> None:
        _init_rope_buffer(self, self.rope)

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        batch, seq, _ = x.shape
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(batch, seq, self.num_heads, -1).transpose(1, 2)
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        kv_latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_latent))
        kv = kv.view(batch, seq, self.num_heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rot = k_rot.view(batch, 1, seq, self.rope)
        angles = rope_angles(self.inv_freq, seq, x.device)
        if self.complex_rotary:
            q_rot = apply_rotary_interleaved(q_rot, angles, self.rope_scale)
            k_rot = apply_rotary_interleaved(k_rot, angles, self.rope_scale)
        else:
            cos, sin = angles.cos() * self.rope_scale, angles.sin() * self.rope_scale
            interleaved = self.config.rope_interleave
            q_rot = apply_rotary_half(q_rot, cos, sin, interleaved)
            k_rot = apply_rotary_half(k_rot, cos, sin, interleaved)
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, self.num_heads, -1, -1)], dim=-1)
        return self.o_proj(ops.attention(q, k, v, self.scaling))


class GroupedQueryAttention(nn.Module):
    """GQA with rotate-half RoPE; per-head q/k RMSNorm (Qwen3) or sinks, biases and a
    sliding window (GPT-OSS)."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        bias = c.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, c.hidden_size, bias=bias)
        self.qk_norm = c.model_type == "qwen3_moe"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.has_sinks = c.model_type == "gpt_oss"
        if self.has_sinks:
            self.sinks = nn.Parameter(torch.zeros(self.num_heads))
        self.window = c.sliding_window if c.layer_type(layer) == "sliding_attention" else None
        self.config = c
        inv_freq, self.rope_scale = rope_frequencies(c, self.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scaling = self.head_dim**-0.5

    def init_buffers(self) -> None:
        _init_rope_buffer(self, self.head_dim)

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        angles = rope_angles(self.inv_freq, seq, x.device)
        cos, sin = angles.cos() * self.rope_scale, angles.sin() * self.rope_scale
        q, k = apply_rotary_half(q, cos, sin), apply_rotary_half(k, cos, sin)
        sinks = self.sinks if self.has_sinks else None
        return self.o_proj(ops.attention(q, k, v, self.scaling, self.window, sinks))


def build_attention(config: ModelConfig, layer: int) -> nn.Module:
    if config.is_deepseek:
        return MultiHeadLatentAttention(config)
    return GroupedQueryAttention(config, layer)


# ------------------------------------------------------------------------ MLPs
class DenseMLP(nn.Module):
    """SwiGLU MLP with separate gate/up/down projections (dense layers, shared experts)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """Routed experts, fused per layer, holding only this rank's expert shard.

    DeepSeek / Qwen3-MoE: ``gate_up_proj [E, 2I, H]`` (gate first), ``down_proj [E, H, I]``,
    applied as ``x @ W.T``. GPT-OSS: ``gate_up_proj [E, H, 2I]`` (gate/up interleaved),
    ``down_proj [E, I, H]`` with biases, applied as ``x @ W``.
    """

    def __init__(self, config: ModelConfig, first_expert: int, num_local: int) -> None:
        super().__init__()
        c = config
        self.first_expert, self.num_local = first_expert, num_local
        self.num_experts = c.num_experts
        hidden, inner = c.hidden_size, c.moe_intermediate_size
        self.transposed = c.model_type == "gpt_oss"
        if self.transposed:
            self.gate_up_proj = nn.Parameter(torch.empty(num_local, hidden, 2 * inner))
            self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_local, 2 * inner))
            self.down_proj = nn.Parameter(torch.empty(num_local, inner, hidden))
            self.down_proj_bias = nn.Parameter(torch.zeros(num_local, hidden))
            self.alpha, self.limit = c.swiglu_alpha, c.swiglu_limit
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(num_local, 2 * inner, hidden))
            self.down_proj = nn.Parameter(torch.empty(num_local, hidden, inner))

    def forward(self, grouped: torch.Tensor, offsets: torch.Tensor, ops, ends=None) -> torch.Tensor:
        """The expert MLP on rows already grouped by local expert (``offsets`` as in
        grouped_mm; ``ends``: the same on the host, when known)."""
        if self.transposed:
            h = ops.grouped_linear(
                grouped, self.gate_up_proj, offsets, self.gate_up_proj_bias, ends=ends
            )
            h = ops.clamped_swiglu(h, self.alpha, self.limit)
            return ops.grouped_linear(h, self.down_proj, offsets, self.down_proj_bias, ends=ends)
        h = ops.grouped_linear(grouped, self.gate_up_proj.transpose(1, 2), offsets, ends=ends)
        h = ops.silu_and_mul(h)
        return ops.grouped_linear(h, self.down_proj.transpose(1, 2), offsets, ends=ends)


class OutputLayer(nn.Linear):
    """The output layer (``lm_head``): a bias-free linear to the vocabulary.

    `fused_loss` lets a stack fuse this layer with its cross-entropy and still call it
    through the module (not by reading ``weight`` from outside), so whatever wraps the
    module's methods sees the call: FSDP2 registers it as a forward method
    (`register_fsdp_forward_method`) and gathers the sharded weight around it.
    """

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__(hidden_size, vocab_size, bias=False)

    def fused_loss(self, hidden: torch.Tensor, labels: torch.Tensor, fused) -> torch.Tensor:
        """``fused(hidden, weight, labels)``: the stack's linear + cross-entropy on this weight."""
        return fused(hidden, self.weight, labels)
