"""The optimized stack's attention backward, read off its code: the recomputed block.

The optimized stack keeps only the attention block's input and reruns the block in
backward (`models.network.DecoderLayer.attention` under non-reentrant checkpoint with
`optimized.ops.OptimizedOps`). Its ``attention_backward`` step therefore holds, at its
high point, the recomputed block's saved tensors beside the gradients of its backward.
Each moment below lists those tensors (``tests/test_estimator_layers.py`` holds them
against a storage tracker on real layers), relative to the level when the step starts
(the layer's kept tensors, the gradients the earlier stages passed on):

- freed first: the stage's own saved tensors past the attention block (post-attention
  norm, router, shared experts, a dense layer's MLP) as their backward runs; the
  post-attention norm's float input stays when it is the residual (float32, no shared
  experts), which is kept to the step's end;
- the recomputed block: the input norm (its float copy in 16-bit; in float32 the block's
  input itself), the q / kv projections' norms, the rotary tables, ``q``, ``k``, ``v``
  as the fused attention saves them (views: MLA's values keep the whole key/value
  projection they are a slice of), the fused attention's output (which is also the
  output projection's input) and its float32 log-sum-exp;
- the fused attention's backward: the output's gradient, the float32 ``delta`` (``dO .
  O`` per row), and the gradients of ``q``, ``k``, ``v``; beside them the gradient of the
  block's output (``[T, H]``). GPT-OSS's sinks add one more float32 ``[B, h, S]`` before
  the gradients exist (the sink's probabilities for its gradient), below this;
- Qwen3's q norm backward, after the key branch (k norm, rotary) is done: five float32
  ``[T, heads, head_dim]`` temporaries of the RMSNorm's backward (the gradient through
  the normalised value, through the rsqrt, the mean's expand and pow's two factors)
  beside its float input;
- the window and the sinks change nothing here: the same kernel, no mask, no copies.
  (On CUDA, MLA's wide heads go to SDPA instead, `optimized.ops.attention.sdpa_attention`,
  which keeps zero-padded values and a padded output and copies the output once more: not
  modelled here, where the estimate is held to the CPU's measurements.)

With recompute off (`EstimateConfig.recompute`, `OptimizedOps.recompute_attention`) the
forward keeps the block's saved tensors (`kept_block`: those the recompute would make;
the output projection's input is the attention's output) from the forward to the
backward, and the step's high point is the highest of
(`kept_attention_backward`):

- each moment above less the block's kept tensors (they exist from the step's start);
- the post-attention norm's backward, before any of the block's: five float32 ``[T, H]``
  temporaries of the RMSNorm's backward (the gradient through the normalised value,
  through the rsqrt, the mean's expand, pow's two factors), its float input and the
  normalised value's ``rsqrt`` gone with the router's, shared experts' and dispatch's
  saved tensors and the norm's output;
- the SwiGLU backward of the shared experts (or a dense layer's MLP), which runs first
  (`mlp_backward_moments`).
"""

from __future__ import annotations

from optimized.estimator.activations import F32, Saved, attention_saved, layer_saved
from optimized.estimator.config import EstimateConfig


def _sum(items: list[Saved], *prefixes: str) -> int:
    """Bytes of the items whose names start with one of ``prefixes`` (all without)."""
    return sum(item.nbytes for item in items if not prefixes or item.name.startswith(prefixes))


def _shapes(config: EstimateConfig) -> tuple[int, int, int, int]:
    """(query heads, key/value heads, query/key width, value width) of the fused attention."""
    m = config.model
    heads = m.num_attention_heads // config.tp
    if m.is_deepseek:
        return heads, heads, m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    return heads, m.num_key_value_heads // config.tp, m.head_dim, m.head_dim


def freed_before(config: EstimateConfig, layer: int, is_moe: bool) -> int:
    """The stage's saved tensors past the attention block, freed before it is recomputed."""
    b = config.param_bytes
    items = layer_saved(config.replace(stack="reference"), layer)
    freed = _sum(items, "post_attention_layernorm.", "router.", "shared_experts.", "mlp.")
    freed += _sum(items, "dispatch.weight_order")
    residual_is_h = is_moe and b == F32 and not config.shared_expert_width
    if residual_is_h:
        freed -= _sum(items, "post_attention_layernorm.float_input")
    return freed


def recomputed_block(config: EstimateConfig, layer: int) -> tuple[list[Saved], list[Saved]]:
    """(norm and rotary tensors, fused attention's tensors) the recompute saves."""
    b = config.param_bytes
    items = attention_saved(config.replace(stack="reference"), layer)
    keep = ("input_layernorm.", "q_a_layernorm.", "kv_a_layernorm.", "q_norm.", "k_norm.",
            "rotary.")  # fmt: skip
    norms = [
        item for item in items
        if item.name.startswith(keep)
        # In float32 the input norm's float input is the block's input itself.
        and not (b == F32 and item.name == "input_layernorm.float_input")
    ]  # fmt: skip
    heads, kv_heads, qk_dim, v_dim = _shapes(config)
    m, rows = config.model, config.tokens
    # The values are a view of their projection: MLA's holds the keys' no-rope part too.
    v_storage = m.qk_nope_head_dim + v_dim if m.is_deepseek else v_dim
    fused = [
        Saved("q", rows * heads * qk_dim * b),
        Saved("k", rows * kv_heads * qk_dim * b),
        Saved("v", rows * kv_heads * v_storage * b),
        Saved("out", rows * heads * v_dim * b),
        Saved("logsumexp", rows * heads * F32),
    ]
    return norms, fused


def attention_backward_rise(config: EstimateConfig, layer: int, is_moe: bool) -> int:
    """The ``attention_backward`` step's high point above its start (flash path)."""
    m, b = config.model, config.param_bytes
    rows = config.tokens
    th = rows * m.hidden_size * b
    heads, kv_heads, qk_dim, v_dim = _shapes(config)
    norms, fused = recomputed_block(config, layer)
    freed = freed_before(config, layer, is_moe)
    # The output's gradient, delta, and the q, k, v gradients (dense, the inputs' sizes).
    grads = rows * (heads * (v_dim + qk_dim) + kv_heads * (qk_dim + v_dim)) * b
    grads += rows * heads * F32
    fused_moment = _sum(norms) + _sum(fused) + grads + th - freed
    moments = [fused_moment]
    if m.model_type == "qwen3_moe":
        # q norm's backward: the fused attention's tensors, the key branch and the q norm's
        # normalised value and rsqrt are gone; the keys' and values' gradients wait.
        q_norm = _sum(norms, "q_norm.float_input")
        others = _sum(norms) - _sum(norms, "q_norm.", "k_norm.", "rotary.")
        temporaries = 5 * rows * heads * qk_dim * F32
        waiting = 2 * rows * kv_heads * qk_dim * b
        moments.append(others + q_norm + temporaries + th + waiting - freed)
    return max(moments)


def kept_block(config: EstimateConfig, layer: int) -> int:
    """Bytes the attention block keeps from forward to backward without recompute: what the
    recompute would save (the attention's output is the output projection's input)."""
    norms, fused = recomputed_block(config, layer)
    return _sum(norms) + _sum(fused)


def mlp_backward_moments(config: EstimateConfig, width: int) -> list[tuple[int, int]]:
    """A SwiGLU MLP's backward (`models.network.layers.DenseMLP`: ``down(silu(gate(x)) * up(x))``),
    above the level it starts from, as (rise, weight-gradient bytes made before it):
    the down projection's input gradient beside its weight gradient; the product's two
    input gradients once its saved input is gone; the gate projection's, with the input
    gradients of both projections and their sum, the gradients' and saved tensors of the
    product and the activation freed."""
    m, b = config.model, config.param_bytes
    rows, hidden = config.tokens, m.hidden_size
    ti, th = rows * width * b, rows * hidden * b
    weight = width * hidden * b
    grads = width * hidden * config.grad_bytes
    return [(ti + weight, 0), (2 * ti, grads), (3 * th + weight - 4 * ti, 2 * grads)]


def kept_attention_backward(
    config: EstimateConfig, layer: int, is_moe: bool
) -> list[tuple[int, str]]:
    """The ``attention_backward`` step's moments without recompute (see the module
    docstring), as (rise above the step's start, which dense gradients are made before it:
    ``mlp:<bytes>``, ``post_norm`` or ``block``)."""
    m = config.model
    kept = kept_block(config, layer)
    freed = freed_before(config, layer, is_moe)
    residual_is_h = is_moe and config.param_bytes == F32 and not config.shared_expert_width
    float_input = 0
    if not residual_is_h:
        items = layer_saved(config.replace(stack="reference"), layer)
        float_input = _sum(items, "post_attention_layernorm.float_input")
    rows = config.tokens
    moments = [(5 * rows * m.hidden_size * F32 - freed + float_input, "post_norm")]
    moments.append((attention_backward_rise(config, layer, is_moe) - kept, "block"))
    width = config.shared_expert_width if is_moe else m.intermediate_size
    width //= config.tp
    if width:
        moments += [(rise, f"mlp:{made}") for rise, made in mlp_backward_moments(config, width)]
    return moments


__all__ = [
    "attention_backward_rise", "freed_before", "kept_attention_backward", "kept_block",
    "mlp_backward_moments", "recomputed_block",
]  # fmt: skip
