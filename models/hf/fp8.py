"""DeepSeek-V3's FP8 weights: block-quantised float8 e4m3, dequantised per slice.

DeepSeek-V3 is published with every linear weight of its layers (attention projections,
dense MLPs, shared and routed experts) stored as ``X.weight [rows, cols]`` in float8 e4m3
beside ``X.weight_scale_inv [ceil(rows / 128), ceil(cols / 128)]`` in float32: each 128 x
128 block of the weight shares one scale, and the value is ``weight * scale_inv``. The
embedding, the output layer, the norms and the router (``mlp.gate.weight``, its
``e_score_correction_bias``) stay in bfloat16 / float32. ``config.json`` says so with
``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128,
128], "activation_scheme": "dynamic"}``.

`dequantize` computes what transformers computes when it loads such a checkpoint without a
GPU (``transformers.integrations.finegrained_fp8.Fp8Dequantize``): the float8 value and
its block's scale, both in float32, multiplied, then cast to the parameter's dtype once --
bit for bit. It takes any row range: a rank that holds rows ``[a, b)`` of a weight reads
those rows and the rows ``[a // 128, (b - 1) // 128]`` of the scale grid, nothing else.

Where a dimension is not a multiple of the block (DeepSeek-V3's ``kv_a_proj_with_mqa``, 576
rows), the last block is partial and the grid has ``ceil`` entries, as DeepSeek's own
``weight_dequant`` reads it; transformers 5 instead derives the block from the grid
(``rows // grid_rows``), which refuses such a weight (or, when the division happens to be
exact, assigns the rows to the wrong scales). The block size here is always the
``weight_block_size`` of ``config.json``.

`quantize` and `write_fp8` write the format (tests and benchmarks build published-style
checkpoints with them).
"""

from __future__ import annotations

import json
import os
import re

import torch

FP8 = "fp8"
"""``quantization_config.quant_method`` of DeepSeek-V3's published checkpoints."""
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
"""The largest float8 e4m3 magnitude."""
SCALE_SUFFIX = "_scale_inv"
PUBLISHED_BLOCK = (128, 128)
PUBLISHED_FP8 = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.\w+_proj|self_attn\.kv_a_proj_with_mqa"
    r"|mlp\.(experts\.\d+\.|shared_experts\.)?(gate|up|down)_proj)\.weight$"
)
"""The tensors DeepSeek-V3 publishes in FP8: its layers' linear weights, not the router."""


def scale_name(name: str) -> str:
    """``X.weight`` -> ``X.weight_scale_inv``: the scales of an FP8 weight."""
    return name + SCALE_SUFFIX


def block_size(quantization: dict) -> tuple[int, int] | None:
    """``weight_block_size`` of a ``quantization_config`` (None: one scale per tensor);
    ``ValueError`` naming it when it is not two positive integers."""
    block = quantization.get("weight_block_size")
    if block is None:
        return None
    if not (
        isinstance(block, list | tuple)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(
            f"quantization_config.weight_block_size={block!r} is invalid: expected two "
            "positive integers, e.g. [128, 128]"
        )
    return int(block[0]), int(block[1])


def grid_shape(shape: tuple[int, ...], block: tuple[int, int] | None) -> tuple[int, int]:
    """The scale grid of a ``[rows, cols]`` weight: one entry per (partial) block."""
    rows, cols = shape
    block = block or (rows, cols)
    return -(-rows // block[0]), -(-cols // block[1])


def dequantize(
    weight: torch.Tensor,
    scales: torch.Tensor,
    block: tuple[int, int],
    dtype: torch.dtype,
    offset: int = 0,
) -> torch.Tensor:
    """Rows of an FP8 weight (``weight [n, cols]``) as ``dtype``, each value times its block's
    scale in float32, then cast once (transformers' ``Fp8Dequantize``). ``scales [r, C]``
    are the grid rows that cover them; ``offset`` is the first row's position in the first
    of those block rows (``first_row % block[0]``)."""
    rows, cols = weight.shape
    if offset + rows > scales.shape[0] * block[0] or scales.shape[1] != -(-cols // block[1]):
        raise ValueError(
            f"FP8 rows {list(weight.shape)} (from row {offset} of a block) do not match "
            f"scales {list(scales.shape)} of {list(block)} blocks"
        )
    which = torch.div(torch.arange(offset, offset + rows), block[0], rounding_mode="floor")
    grid = scales.float()[which.to(scales.device)]
    grid = grid.repeat_interleave(block[1], dim=1)[:, :cols]
    return (weight.float() * grid).to(dtype)


CHUNK_ELEMENTS = 1 << 22
"""Values dequantised at a time (whole block rows): a few times this in float32 is all a
read holds beside its destination."""


def dequantize_rows(
    weight, scales, block: tuple[int, int] | None, out: torch.Tensor, start: int, read
) -> None:
    """Rows ``[start, start + len(out))`` of an FP8 weight on disk into ``out``, dequantised:
    ``weight`` and ``scales`` are the stored tensors (`models.hf.checkpoint.StoredTensor`),
    ``read(stored, buffer, first_row)`` reads rows into a buffer. A chunk of whole block
    rows at a time, each with only the scale rows that cover it."""
    rows, cols = weight.shape
    block = block or (rows, cols)
    per_chunk = max(1, CHUNK_ELEMENTS // (cols * block[0])) * block[0]
    stop = start + out.shape[0]
    first = start
    while first < stop:
        last = min(stop, (first // per_chunk + 1) * per_chunk)
        values = torch.empty((last - first, cols), dtype=FP8_DTYPE)
        read(weight, values, first)
        top, bottom = first // block[0], (last - 1) // block[0]
        grid = torch.empty((bottom - top + 1, scales.shape[1]), dtype=torch.float32)
        read(scales, grid, top)
        part = dequantize(values, grid, block, out.dtype, first - top * block[0])
        out[first - start : last - start].copy_(part)
        first = last


def quantize(
    weight: torch.Tensor, block: tuple[int, int] = PUBLISHED_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[rows, cols]`` values as float8 e4m3 ``(weight, scale_inv)``: each block scaled so its
    largest magnitude is 448 (``scale_inv = amax / 448``, 1 for an all-zero block), rounded
    to the nearest e4m3 value. Partial blocks at the edges take their own scale."""
    rows, cols = weight.shape
    grid_rows, grid_cols = grid_shape((rows, cols), block)
    padded = torch.zeros(grid_rows * block[0], grid_cols * block[1])
    padded[:rows, :cols] = weight.float()
    tiles = padded.view(grid_rows, block[0], grid_cols, block[1])
    largest = tiles.abs().amax(dim=(1, 3))
    scale_inv = torch.where(largest > 0, largest / FP8_MAX, torch.ones_like(largest))
    values = tiles / scale_inv[:, None, :, None]
    values = values.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(padded.shape)
    return values[:rows, :cols].contiguous(), scale_inv


def write_fp8(
    source: str | os.PathLike,
    out: str | os.PathLike,
    max_shard_bytes: int | None,
    block: tuple[int, int] = PUBLISHED_BLOCK,
) -> None:
    """Re-write an unquantised DeepSeek-V3 checkpoint folder as DeepSeek-V3 is published: its
    layers' linear weights (`PUBLISHED_FP8`) in FP8 with their ``weight_scale_inv``, the rest
    as stored, ``quantization_config`` in config.json. One tensor at a time."""
    from safetensors import safe_open  # noqa: PLC0415

    from models.hf.checkpoint_write import (  # noqa: PLC0415
        SAFETENSORS_DTYPES,
        Planned,
        ShardWriter,
        plan_shards,
        write_config,
    )
    from models.hf.hf_layout import CONFIG_NAME, INDEX_NAME, WEIGHTS_NAME  # noqa: PLC0415

    source = os.fspath(source)
    with open(os.path.join(source, CONFIG_NAME)) as f:
        hf_config = json.load(f)
    files = [os.path.join(source, WEIGHTS_NAME)]
    if not os.path.exists(files[0]):
        with open(os.path.join(source, INDEX_NAME)) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(source, name) for name in names]
    dtypes = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}
    entries = []  # (file, name as stored in the source, what is written)
    for file in files:
        with safe_open(file, "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - a safetensors handle is no mapping
                view = handle.get_slice(name)
                shape, dtype = tuple(view.get_shape()), dtypes[view.get_dtype()]
                if PUBLISHED_FP8.match(name) and len(shape) == 2 and all(shape):
                    entries.append((file, name, Planned(name, shape, FP8_DTYPE)))
                    grid = grid_shape(shape, block)
                    entries.append((file, name, Planned(scale_name(name), grid, torch.float32)))
                else:
                    entries.append((file, name, Planned(name, shape, dtype)))
    writer = ShardWriter(out, plan_shards([e[2] for e in entries], max_shard_bytes), True)
    hf_config["quantization_config"] = {
        "quant_method": FP8, "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }  # fmt: skip
    write_config(os.fspath(out), hf_config)
    scales: dict[str, torch.Tensor] = {}
    for file, name, planned in entries:
        if planned.name in scales:
            writer.write(planned.name, scales.pop(planned.name))
            continue
        with safe_open(file, "pt") as handle:
            tensor = handle.get_tensor(name)
        if planned.dtype == FP8_DTYPE:
            tensor, scales[scale_name(name)] = quantize(tensor, block)
        writer.write(planned.name, tensor)
    writer.close()
