"""MXFP4, the format GPT-OSS publishes its routed experts in, and its dequantisation.

The OCP microscaling format: blocks of 32 values share one scale. Each value is an
e2m1 float (4 bits: sign, 2 exponent bits, 1 mantissa bit; the 16 codes are
`FP4_VALUES`), two to a byte, the low nibble first; each block's scale is an e8m0
power of two stored as ``exponent + 127`` in one byte. On disk (GPT-OSS,
transformers 5) an expert tensor ``W [E, rows, K]`` -- ``rows`` the output features,
``K`` the input features, the transpose of the ``[E, K, rows]`` GPT-OSS multiplies
with -- is stored as

- ``*_blocks [E, rows, K / 32, 16]`` uint8 (32 e2m1 values per block),
- ``*_scales [E, rows, K / 32]`` uint8.

`dequantize` turns any slice of those (an expert-parallel rank's experts, one expert)
into values of the requested dtype exactly as transformers does
(``transformers.integrations.mxfp4.convert_moe_packed_tensors``: look up the e2m1
value in the target dtype, then ``ldexp`` by the scale), so a model loaded here and one
loaded by transformers hold the same bits. `quantize` writes the format (tests and
benchmarks build GPT-OSS checkpoints the way they are published).
"""

from __future__ import annotations

import torch

BLOCK = 32
"""Values per block (one shared scale)."""

FP4_VALUES = (
    +0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip
"""The e2m1 value of each 4-bit code."""

SCALE_BIAS = 127
"""e8m0: a stored scale byte ``s`` means ``2 ** (s - 127)``."""


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[..., G, 16]`` blocks and ``[..., G]`` scales as ``[..., G * 32]`` values in ``dtype``
    (the disk layout's last dimension, un-transposed: ``[E, rows, K]`` for a whole tensor)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match: "
            f"expected blocks [..., G, {BLOCK // 2}] with scales [..., G]"
        )
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    blocks = blocks.to(torch.uint8)
    values = torch.empty(blocks.shape[:-1] + (BLOCK,), dtype=dtype, device=blocks.device)
    values[..., 0::2] = lut[(blocks & 0x0F).to(torch.int)]
    values[..., 1::2] = lut[(blocks >> 4).to(torch.int)]
    exponents = (scales.to(torch.int32) - SCALE_BIAS).unsqueeze(-1)
    torch.ldexp(values, exponents, out=values)
    return values.flatten(-2)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., K]`` values (K a multiple of 32) as MXFP4 ``(blocks, scales)``.

    Each block's scale is the power of two that brings its largest magnitude to at most
    6 (the largest e2m1 value); each value is rounded to the nearest e2m1 code. A NaN or an
    infinity is refused (ValueError): the format has no code for one.
    """
    if weight.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs the last dimension to be a multiple of {BLOCK}, "
                         f"got {list(weight.shape)}")  # fmt: skip
    values = weight.float().contiguous().reshape(*weight.shape[:-1], -1, BLOCK)
    finite = torch.isfinite(values)
    if not bool(finite.all()):  # e2m1 and e8m0 have no NaN or infinity to write
        where = tuple(int(i) for i in (~finite).nonzero()[0])
        raise ValueError(
            f"MXFP4 cannot hold {values[where].item()} (weight {list(weight.shape)}, block "
            f"element {list(where)}): only finite values quantise; the codes would silently "
            f"turn it into a number"
        )
    largest = values.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(largest / 6.0)).clamp(-SCALE_BIAS, 127)
    scaled = values / torch.exp2(exponent).unsqueeze(-1)
    magnitudes = torch.tensor(FP4_VALUES[:8])
    midpoints = (magnitudes[1:] + magnitudes[:-1]) / 2  # nearest code, ties to the smaller
    codes = torch.bucketize(scaled.abs(), midpoints).to(torch.uint8)
    codes |= (scaled < 0).to(torch.uint8) << 3
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exponent + SCALE_BIAS).to(torch.uint8)
    return blocks, scales
