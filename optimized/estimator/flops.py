"""FLOPs of a training step from the model config alone, and the peak rates of known GPUs.

MFU (model FLOPs utilisation, PaLM appendix B) is the FLOPs a step *needs* divided by what
the devices could have done in its time. Both halves live here, from configs alone:

**Counting.** Every matrix product of the network, at 2 FLOPs per multiply-add, per token:

- the attention's input projections: q, k and v for GQA; for MLA (DeepSeek-V2) q (or
  the low-rank ``q_a`` then ``q_b``), ``kv_a_proj_with_mqa`` and ``kv_b_proj``; and its
  output projection o;
- the attention's own products, ``Q K^T`` and ``P V``, per query head over the keys a
  query *sees*: ``(S + 1) / 2`` on average under the causal mask, ``min(i + 1, w)`` for
  query ``i`` in a sliding window of ``w`` (`attended_keys`). A kernel that skips masked
  blocks (flash, cuDNN) does about that much; an unfused kernel computes every key
  (``dense_attention=True`` counts that, which is what the tests instrument);
- the router (``H x E``), the shared experts and each token's ``top_k`` routed experts
  (``3 H I`` each: gate, up, down), the dense MLP of dense layers, and the output layer
  (``H x V``). Norms, rotary, softmax, activations, the loss and the embedding lookup do
  no matrix product and are not counted (a few per cent of a step at real widths).

A training step runs every product three times: the forward, then the backward's input
gradient and weight gradient (``model = 3 x forward``: PaLM's and Megatron-LM's ``6N`` plus
their attention term, with the attention counted over the keys a query sees rather than
PaLM's whole sequence). With attention recomputation on (the optimized stack's default)
the backward also reruns each layer's attention block: ``hardware = model + recomputed``.
torch's non-reentrant checkpoint stops recomputing once every tensor the block saved is
back, so the rerun ends before the output projection (whose output nothing saved): the
input projections and the attention products, no o (measured by the tests). MFU divides
``model``; HFU (hardware FLOPs utilisation) ``hardware``. A fused attention kernel's backward
recomputes the scores (FlashAttention's is 2.5x its forward, not 2x); like PaLM and
Megatron-LM, the count keeps 2x.
Multi-token prediction (`models.network.mtp`) adds, per depth, one decoder layer of the
model's kind, its ``eh_proj`` (``2H x H``) and one more output layer (``H x V``): it is
part of the objective, so of the model FLOPs. (The optimized stack's top-1 accuracy
figure reruns each depth's output layer without gradients; it is not counted.)

**Peaks.** `GPU_PEAKS` holds the dense (no 2:4 sparsity) tensor-core peaks of NVIDIA's
datasheets, in TFLOP/s: bf16, TF32 (float32 matmuls when torch allows TF32), and the
float32 peak of the CUDA cores (float32 matmuls at torch's default ``highest`` precision).
`peak_tflops` matches a device name (``torch.cuda.get_device_name``) against them. A CPU
has no entry: MFU is reported only where a peak is known or given.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from models.network import ModelConfig


def attended_keys(seq_len: int, window: int | None = None) -> float:
    """Keys a query sees on average under the causal mask (``(S + 1) / 2``), or in a sliding
    window of ``window`` keys where query ``i`` sees ``min(i + 1, window)``."""
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} is invalid: expected a positive integer")
    if window is None or window >= seq_len:
        return (seq_len + 1) / 2
    if window < 1:
        raise ValueError(f"window={window} is invalid: expected None or a positive integer")
    seen = window * (window + 1) // 2 + (seq_len - window) * window
    return seen / seq_len


@dataclass(frozen=True, slots=True)
class ForwardFlops:
    """Matrix-product FLOPs of one token's forward, by part (2 per multiply-add)."""

    attention_projections: float = 0.0
    """The input projections: q, k, v (GQA) or MLA's q (or q_a, q_b), kv_a and kv_b."""
    attention_output: float = 0.0
    """The output projection o."""
    attention_scores: float = 0.0
    """``Q K^T`` and ``P V`` over the keys a query sees (`attended_keys`)."""
    router: float = 0.0
    routed_experts: float = 0.0
    """``top_k`` experts of ``3 H I`` multiply-adds each."""
    shared_experts: float = 0.0
    dense_mlp: float = 0.0
    """The MLP of dense layers (DeepSeek-V2's first layers, Qwen3's ``mlp_only_layers``)."""
    head: float = 0.0
    """The output layer, ``H x V`` (once more per MTP depth)."""
    mtp_projection: float = 0.0
    """Each MTP depth's ``eh_proj``, ``2H x H``."""

    @property
    def recomputed(self) -> float:
        """What attention recomputation reruns: the input projections and the products
        (the rerun stops before the output projection, see the module docstring)."""
        return self.attention_projections + self.attention_scores

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    def __add__(self, other: ForwardFlops) -> ForwardFlops:
        return ForwardFlops(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


@dataclass(frozen=True, slots=True)
class TrainingFlops:
    """FLOPs per token of one training step (forward and backward)."""

    forward: ForwardFlops
    """The forward's matrix products, summed over the layers and the head."""
    recompute: bool
    """Whether the backward reruns each attention block's forward."""

    @property
    def model(self) -> float:
        """The step's FLOPs per token: ``3 x forward`` (MFU's numerator)."""
        return 3 * self.forward.total

    @property
    def recomputed(self) -> float:
        """FLOPs per token that attention recomputation adds (0 when off)."""
        return self.forward.recomputed if self.recompute else 0.0

    @property
    def hardware(self) -> float:
        """What the devices compute per token: ``model`` plus the recomputation (HFU's)."""
        return self.model + self.recomputed


def layer_flops(
    model: ModelConfig, layer: int, seq_len: int, dense_attention: bool = False
) -> ForwardFlops:
    """One decoder layer's forward FLOPs per token (see the module docstring)."""
    c, hidden, heads = model, model.hidden_size, model.num_attention_heads
    if c.is_deepseek:
        qk, v_dim = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
        if c.q_lora_rank is None:
            query = hidden * heads * qk
        else:
            query = hidden * c.q_lora_rank + c.q_lora_rank * heads * qk
        key_value = (hidden * (c.kv_lora_rank + c.qk_rope_head_dim)
                     + c.kv_lora_rank * heads * (c.qk_nope_head_dim + v_dim))  # fmt: skip
        projections = query + key_value
        window = None
    else:
        qk = v_dim = c.head_dim
        kv_heads = c.num_key_value_heads
        projections = hidden * c.head_dim * (heads + 2 * kv_heads)
        window = c.sliding_window if c.layer_type(layer) == "sliding_attention" else None
    keys = seq_len if dense_attention else attended_keys(seq_len, window)
    scores = heads * (qk + v_dim) * keys
    mlp: dict[str, float] = {}
    if c.is_moe_layer(layer):
        mlp["router"] = hidden * c.num_experts
        mlp["routed_experts"] = c.num_experts_per_tok * 3 * hidden * c.moe_intermediate_size
        mlp["shared_experts"] = 3 * hidden * c.n_shared_experts * c.moe_intermediate_size
    else:
        mlp["dense_mlp"] = 3 * hidden * c.intermediate_size
    return ForwardFlops(
        attention_projections=2 * projections,
        attention_output=2 * heads * v_dim * hidden,
        attention_scores=2 * scores,
        **{name: 2 * value for name, value in mlp.items()},
    )


def forward_flops(model: ModelConfig, seq_len: int, dense_attention: bool = False) -> ForwardFlops:
    """The whole model's forward FLOPs per token: every layer and the output layer, and each
    MTP depth's layer, projection and output layer."""
    hidden, depths = model.hidden_size, model.num_mtp_layers
    total = ForwardFlops(
        head=2 * hidden * model.vocab_size * (1 + depths),
        mtp_projection=2 * 2 * hidden * hidden * depths,
    )
    for layer in range(model.num_hidden_layers + depths):
        total = total + layer_flops(model, layer, seq_len, dense_attention)
    return total


def training_flops(
    model: ModelConfig, seq_len: int, recompute: bool = True, dense_attention: bool = False
) -> TrainingFlops:
    """FLOPs per token of a training step at ``seq_len`` (``recompute``: the attention
    blocks rerun in backward, as the optimized stack does by default)."""
    return TrainingFlops(forward_flops(model, seq_len, dense_attention), recompute)


# ------------------------------------------------------------------------------- peaks
@dataclass(frozen=True, slots=True)
class GpuPeak:
    """Dense peak rates of one GPU model, TFLOP/s (NVIDIA's datasheets, no sparsity)."""

    name: str
    """The model, as reported in the logs."""
    pattern: str
    """Regular expression matched against ``torch.cuda.get_device_name`` (first match wins)."""
    bfloat16: float
    tf32: float
    float32: float
    """CUDA-core float32 (a float32 matmul at torch's default ``highest`` precision)."""


GPU_PEAKS: tuple[GpuPeak, ...] = (
    GpuPeak("GH200", r"GH200", 989.4, 494.7, 66.9),
    GpuPeak("H200 NVL", r"H200 NVL", 835.5, 417.5, 60.0),
    GpuPeak("H200 SXM", r"H200", 989.4, 494.7, 66.9),
    GpuPeak("H100 NVL", r"H100 NVL", 835.5, 417.5, 60.0),
    GpuPeak("H100 PCIe", r"H100 PCIe", 756.0, 378.0, 51.2),
    GpuPeak("H100 SXM", r"H100", 989.4, 494.7, 66.9),
    GpuPeak("A100", r"A100", 312.0, 156.0, 19.5),
    GpuPeak("B200", r"B200", 2250.0, 1100.0, 80.0),  # HGX B200 at 1,000 W
    GpuPeak("L40S", r"L40S", 362.05, 183.0, 91.6),
    GpuPeak("L4", r"\bL4\b", 121.0, 60.0, 30.3),
    GpuPeak("A10", r"\bA10\b", 125.0, 62.5, 31.2),
)
"""Dense tensor-core peaks per GPU (NVIDIA datasheets: H100/H200/GH200 SXM 989.4 bf16,
H100 PCIe 756, NVL 835.5, A100 312, HGX B200 2,250, L40S 362; sparsity doubles each)."""

PRECISIONS = ("bfloat16", "tf32", "float32")


def known_gpu(device_name: str) -> GpuPeak | None:
    """The table's entry for a device name (``NVIDIA H100 80GB HBM3``), or None."""
    for peak in GPU_PEAKS:
        if re.search(peak.pattern, device_name, flags=re.IGNORECASE):
            return peak
    return None


def peak_tflops(device_name: str, precision: str) -> float | None:
    """The device's dense peak in TFLOP/s for ``precision`` (``bfloat16``, ``tf32`` or
    ``float32``), or None when the device is not in `GPU_PEAKS`."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is invalid: expected one of {PRECISIONS}")
    peak = known_gpu(device_name)
    return None if peak is None else getattr(peak, precision)


__all__ = [
    "GPU_PEAKS",
    "ForwardFlops",
    "GpuPeak",
    "TrainingFlops",
    "attended_keys",
    "forward_flops",
    "known_gpu",
    "layer_flops",
    "peak_tflops",
    "training_flops",
]
