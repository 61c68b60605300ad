"""GPT-OSS's attention in the optimized stack, tensor by tensor: sinks as a virtual key.

`optimized.ops.attention.flash_attention` gives GPT-OSS's per-head sinks to the fused
kernel as one extra feature column (queries ``[B, h, S, D + 1]`` with the sink, keys and
values padded to ``D + 1``) and one virtual key (and a zero query row) in front: the
kernel attends over ``S + 1`` positions and saves its inputs, output and log-sum-exp.
A sliding layer whose window ``w`` is shorter than the sequence runs banded: the first
block of ``w`` queries as above, the other ``n - 1`` blocks (``n = ceil(S / w)``) against
``2 w`` keys each plus the sink (keys and values copied twice over, a ``[w, 2w + 1]``
mask and its float form), and the two outputs concatenated.

`sink_tensors` lists, for one layer, what the kernels save (kept by the recompute for
the backward) and what the function holds beside them at its two high points: the
concatenation of the banded outputs (inside the banded helper, its padded ``q``, ``k``,
``v`` alive) and the copy of the output into the output projection's layout. Views (a
reshape that needs no copy: one block, or one batch) cost nothing. The sinks' own
gradient (`optimized.ops.attention._SinkGradient`) keeps the kernels' saved tensors, no
others; below float32 its backward reruns the kernel in float32 one KV head's group at a
time, a transient under the kernel backward's gradients (``backward_grads``), so it adds
nothing here (measured: the tiny layer's attention backward rose by under 1 KiB).
"""

from __future__ import annotations

from optimized.estimator.activations import F32, Saved
from optimized.estimator.config import EstimateConfig


def sliding(config: EstimateConfig, layer: int) -> bool:
    """Whether ``layer`` attends through a window shorter than the sequence (banded)."""
    m = config.model
    window = m.sliding_window
    return (
        m.layer_type(layer) == "sliding_attention" and window is not None
        and window < config.seq_len
    )  # fmt: skip


def sink_tensors(config: EstimateConfig, layer: int) -> dict[str, list[Saved]]:
    """``saved`` (the kernels'), ``locals`` (flash_attention's own: the sink-column ``q``,
    the column-padded ``k`` and ``v``, the virtual key), ``banded`` (the banded helper's,
    alive at its concatenation) and ``output`` (the concatenated output, banded only)."""
    m, b = config.model, config.param_bytes
    batch, seq = config.micro_batch_size, config.seq_len
    heads, kv_heads = m.num_attention_heads // config.tp, m.num_key_value_heads // config.tp
    width = max(m.head_dim + 1, m.head_dim)  # the sink column (values are padded to it)

    def t(name: str, rows: int, head_count: int, per_batch: int = batch, dtype: int = b):
        return Saved(name, per_batch * head_count * rows * width * dtype)

    out = {
        "locals": [t("q_sink", seq, heads), t("k_padded", seq, kv_heads),
                   t("v_padded", seq, kv_heads), t("sink_key", 1, kv_heads)],
        "banded": [],
        "output": [],
    }  # fmt: skip
    if not sliding(config, layer):
        out["saved"] = [
            t("q", seq + 1, heads), t("k", seq + 1, kv_heads), t("v", seq + 1, kv_heads),
            t("out", seq + 1, heads),
            Saved("logsumexp", batch * heads * (seq + 1) * F32),
        ]  # fmt: skip
        return out
    window = m.sliding_window
    blocks = -(-seq // window)
    rest = blocks - 1
    padded = blocks * window
    saved = [
        t("first.q", window + 1, heads),
        t("first.k", window + 1, kv_heads),
        t("first.v", window + 1, kv_heads),
        t("first.out", window + 1, heads),
        Saved("first.logsumexp", batch * heads * (window + 1) * F32),
        t("rest.k", 2 * window + 1, kv_heads, batch * rest),
        t("rest.v", 2 * window + 1, kv_heads, batch * rest),
        t("rest.out", window, heads, batch * rest),
        Saved("rest.logsumexp", batch * rest * heads * window * F32),
        Saved("rest.mask", window * (2 * window + 1) * (1 + F32)),  # bool and its float form
    ]
    # The query blocks are a view of the row-padded queries (which the kernel then keeps)
    # unless there are several blocks and several sequences.
    banded = [t("k_rows", padded, kv_heads), t("v_rows", padded, kv_heads)]
    if rest > 1 and batch > 1:
        saved.append(t("rest.q", window, heads, batch * rest))
        banded.append(t("q_rows", padded, heads))
    else:
        saved.append(t("q_rows", padded, heads))
    if rest > 1:  # the output blocks' transpose back is a copy
        banded.append(t("rest.out_copy", window, heads, batch * rest))
    out["saved"] = saved
    out["banded"] = banded
    out["output"] = [t("out", padded, heads)]
    return out


def _sum(items: list[Saved]) -> int:
    return sum(item.nbytes for item in items)


def forward_peak(config: EstimateConfig, layer: int) -> int:
    """The attention function's high point beyond its inputs (``q``, ``k``, ``v`` after the
    rotary) and the output projection's input: the larger of the banded concatenation and
    the copy into ``[T, h * D]``."""
    m, b = config.model, config.param_bytes
    parts = sink_tensors(config, layer)
    common = _sum(parts["saved"]) + _sum(parts["locals"]) + _sum(parts["output"])
    copy = config.tokens * (m.num_attention_heads // config.tp) * m.head_dim * b
    return common + max(_sum(parts["banded"]), copy)


def backward_grads(config: EstimateConfig, layer: int) -> int:
    """Gradients alive at the fused backward of the largest kernel: the output's gradient
    (padded back to the kernel's rows and width) and its ``q``, ``k``, ``v`` gradients."""
    parts = sink_tensors(config, layer)
    saved = {item.name: item.nbytes for item in parts["saved"]}
    if "out" in saved:
        return 2 * saved["q"] + saved["k"] + saved["v"]
    output = parts["output"][0].nbytes
    queries = saved.get("rest.q", saved.get("q_rows", 0))
    kernels = (
        saved["first.q"] + saved["first.k"] + saved["first.v"] + saved["first.out"],
        queries + saved["rest.k"] + saved["rest.v"] + saved["rest.out"],
    )
    return output + max(kernels)


__all__ = ["backward_grads", "forward_peak", "sink_tensors", "sliding"]
