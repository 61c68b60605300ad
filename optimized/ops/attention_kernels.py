"""The Triton kernels of `optimized.ops.attention`: FlashAttention-2 with sinks and a band.

Causal attention of query head ``h`` over key/value head ``h // groups``: scores
``s_ij = scaling * q_i . k_j`` for ``i - window < j <= i`` and, with sinks, one more logit
``sink[h]`` in every row's softmax denominator that carries no value. The forward runs an
online softmax in base 2 and keeps only the output and the row log-sum-exp (natural log,
float32); the backward recomputes the probabilities from them in two kernels, as
FlashAttention-2 splits it: one program per key block for dK and dV (summed over the
group's query heads, so GQA needs no atomics and no expanded K/V), one per query block for
dQ. A preprocess kernel first forms ``delta_i = dO_i . O_i`` (the softmax gradient's row
term) in float32, from which the sinks' gradient follows without a rerun of the attention
(`optimized.ops.attention.FlashAttention.sink_gradient`).

The sink enters the forward as the online softmax's starting state: running maximum
``sink``, running sum ``exp(sink - sink) = 1``, accumulator zero. Every logit that follows
is normalised against it, and the log-sum-exp includes it.

Bands: a query block ``[m0, m0 + BLOCK_M)`` visits only the key blocks that meet
``[m0 - window + 1, m0 + BLOCK_M)``, and a key block ``[n0, n0 + BLOCK_N)`` only the
query blocks that meet ``[n0, n0 + BLOCK_N + window - 1)``: work ``O(S * window)``. Each
loop runs in three ranges: the blocks the window's lower edge crosses and the blocks on the
diagonal are masked (causal, window, sequence end); the whole blocks between them skip
the mask and the bounds checks. Rows past the sequence end load zeros and a log-sum-exp of
``+inf``, so their probabilities are exactly 0 in the backward. "No window" is a window of
the sequence length.

Addresses: a row's offset (row index times row stride) is formed in 64 bits, as are the
batch and head offsets and the statistics' indices: ``rows * stride`` passes 2^31 at 262 K
tokens of 8192-wide rows, where 32-bit arithmetic would wrap to a wrong address. The grid
is one axis, (query or key blocks) x (programs of pairs), folded (`_grid_position`), so no
batch x heads count meets CUDA's 65 535 limit on a grid's other axes
(`optimized.ops.attention_blocks.attention_grid` refuses, with the shape, what even one
axis cannot hold).

Packing: a program normally serves one (batch x head) pair (``PACK = 1``, scalar base
addresses: the GPU path). With ``PACK > 1`` it serves ``PACK`` consecutive pairs at once,
its tiles ``PACK`` times as tall, each row carrying its pair's base address, and every
block is masked so that pairs only see their own keys: the interpreter, where a program's
cost is Python's and not the tile's, runs a tiny preset's micro-batch in one program.

Dtypes: loads keep the input dtype on GPUs, where ``tl.dot`` takes bfloat16 operands and
accumulates in float32; the probabilities and their gradients are rounded to the input
dtype before their products, as FlashAttention does. The interpreter's bfloat16 ``tl.dot``
is wrong, so there (``UPCAST``) everything is float32 after the load and those operands are
rounded to bfloat16 in float32 (to nearest even, `round_to_bfloat16`): the CPU computes
what the GPU computes, up to the order of the sums. Float32 products run as IEEE float32 (no TF32).
Outputs are stored rounded to nearest even (`cast_rne`).

On the interpreter every call of a ``@triton.jit`` function re-patches
``triton.language`` (milliseconds), so the helpers here are plain Python functions there
and jit functions on GPUs, like `cast_rne`, and they avoid Triton's own jit helpers
(``tl.zeros``, ``tl.max``, ``tl.sum``).
"""

from __future__ import annotations

from optimized.ops._triton import INTERPRETED, cast_rne, round_to_bfloat16, tl, triton

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
NO_MAX = tl.constexpr(-1.0e30)
"""The running maximum before any logit: finite, so a row whose first block is all masked
gives ``exp2(NO_MAX - NO_MAX) = 1``, not NaN."""


def _jit(fn):
    return fn if INTERPRETED else triton.jit(fn)


if INTERPRETED:
    # tl.max and tl.sum are jit functions, which the interpreter re-patches triton.language
    # for on every call; tl.reduce with their own combine functions takes its numpy path.
    def _row_max(x):
        return tl.reduce(x, 1, tl.standard._elementwise_max)

    def _row_sum(x):
        return tl.reduce(x, 1, tl.standard._sum_combine)

else:

    def _row_max(x):
        return tl.max(x, 1)

    def _row_sum(x):
        return tl.sum(x, 1)


def _operand(x, DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """``x`` (float32) rounded to the input dtype for a ``tl.dot`` (float32 again when
    ``UPCAST``: the interpreter multiplies in float32, on the same rounded values)."""
    if UPCAST:
        if DTYPE == tl.bfloat16:
            x = round_to_bfloat16(x)
    else:
        x = x.to(DTYPE)
    return x


def _grid_position(seq_len, BLOCK: tl.constexpr):
    """(block of the sequence, program of pairs) of this program. The grid is one axis
    (CUDA lets only the first pass 65 535 programs): each program of pairs takes the
    sequence's blocks in a row, as a two-axis grid's first axis would."""
    blocks = (seq_len + BLOCK - 1) // BLOCK
    program = tl.program_id(0)
    return program % blocks, program // blocks


def _pairs(program, BLOCK: tl.constexpr, PACK: tl.constexpr):
    """(pair, position in the block) of each row of a program's tile: one (batch x head)
    pair for ``PACK == 1``, else ``PACK`` consecutive pairs of ``BLOCK`` rows each."""
    if PACK == 1:
        pairs = program
        local = tl.arange(0, BLOCK)
    else:
        tile = tl.arange(0, PACK * BLOCK)
        pairs = program * PACK + tile // BLOCK
        local = tile % BLOCK
    return pairs, local


def _base(ptr, pairs, per_batch, groups, stride_b, stride_h, PACK: tl.constexpr):
    """The address of pair ``pairs``'s ``[S, width]`` matrix (head ``pair % per_batch //
    groups`` of batch ``pair // per_batch``): a scalar, or ``[rows, 1]`` when packed."""
    batch = (pairs // per_batch).to(tl.int64)
    head = (pairs % per_batch // groups).to(tl.int64)
    base = ptr + batch * stride_b + head * stride_h
    if PACK > 1:
        base = base[:, None]
    return base


def _load_tile(
    base, index, stride, dims, bound,
    DIM: tl.constexpr, BLOCK_DIM: tl.constexpr, CHECK: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """``[len(index), BLOCK_DIM]``: rows ``index`` of the ``[rows, DIM]`` matrix at ``base``;
    with ``CHECK`` rows at or past ``bound`` (and always columns past ``DIM``) read 0."""
    pointers = base + index.to(tl.int64)[:, None] * stride + dims[None, :]
    if CHECK:
        if DIM == BLOCK_DIM:
            x = tl.load(pointers, mask=(index < bound)[:, None], other=0.0)
        else:
            mask = (index < bound)[:, None] & (dims < DIM)[None, :]
            x = tl.load(pointers, mask=mask, other=0.0)
    elif DIM == BLOCK_DIM:
        x = tl.load(pointers)
    else:
        x = tl.load(pointers, mask=(dims < DIM)[None, :], other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


def _store_tile(base, index, stride, dims, bound, value, DIM: tl.constexpr):
    """Rows ``index`` below ``bound`` of the ``[rows, DIM]`` matrix at ``base``, rounded to
    nearest even."""
    pointers = base + index.to(tl.int64)[:, None] * stride + dims[None, :]
    mask = (index < bound)[:, None] & (dims < DIM)[None, :]
    tl.store(pointers, cast_rne(value, pointers.dtype.element_ty), mask=mask)


def _visible(rows, row_pairs, cols, col_pairs, window, PACK: tl.constexpr):
    """``[len(rows), len(cols)]``: key ``j`` is visible from query ``i`` (causal, within
    the window, and of the same pair when packed)."""
    visible = (cols[None, :] <= rows[:, None]) & (rows[:, None] - cols[None, :] < window)
    if PACK > 1:
        visible = visible & (row_pairs[:, None] == col_pairs[None, :])
    return visible


def _visible_t(cols, col_pairs, rows, row_pairs, window, PACK: tl.constexpr):
    """`_visible` transposed: ``[len(cols), len(rows)]``."""
    visible = (cols[:, None] <= rows[None, :]) & (rows[None, :] - cols[:, None] < window)
    if PACK > 1:
        visible = visible & (col_pairs[:, None] == row_pairs[None, :])
    return visible


(
    _row_max, _row_sum, _operand, _grid_position, _pairs, _base, _load_tile, _store_tile,
    _visible, _visible_t,
) = map(_jit, (
    _row_max, _row_sum, _operand, _grid_position, _pairs, _base, _load_tile, _store_tile,
    _visible, _visible_t,
))  # fmt: skip


# ----------------------------------------------------------------------------- forward
def _forward_range(
    acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_vs, rows, row_pairs, col_local,
    col_pairs, qk_dims, v_dims, start, end, seq_len, window, scale,
    QK_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_QK: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_N: tl.constexpr, PACK: tl.constexpr, MASKED: tl.constexpr, DTYPE: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """The online softmax over the key blocks in ``[start, end)`` (``scale``: base 2)."""
    for block in range(start, end, BLOCK_N):
        cols = block + col_local
        key = _load_tile(k_base, cols, stride_ks, qk_dims, seq_len, QK_DIM, BLOCK_QK, MASKED,
                         UPCAST)  # fmt: skip
        s = tl.dot(q, tl.trans(key), input_precision="ieee") * scale
        if MASKED:
            visible = _visible(rows, row_pairs, cols, col_pairs, window, PACK)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, _row_max(s))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + _row_sum(p)
        value = _load_tile(v_base, cols, stride_vs, v_dims, seq_len, V_DIM, BLOCK_V, MASKED,
                           UPCAST)  # fmt: skip
        acc = tl.dot(_operand(p, DTYPE, UPCAST), value, acc * alpha[:, None],
                     input_precision="ieee")  # fmt: skip
        m_i = m_new
    return acc, m_i, l_i


_forward_range = _jit(_forward_range)


@triton.jit
def attention_forward_kernel(
    q_ptr, k_ptr, v_ptr, sinks_ptr, out_ptr, lse_ptr,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os,
    heads, groups, seq_len, window, scale,
    QK_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_QK: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PACK: tl.constexpr,
    HAS_SINKS: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """One program per (query block, ``PACK`` batch x head pairs): the output and the
    log-sum-exp of its rows. ``scale`` is ``scaling * log2(e)``; ``BLOCK_M`` is a multiple
    of ``BLOCK_N``."""
    block, pair_program = _grid_position(seq_len, BLOCK_M)
    start_m = block * BLOCK_M
    row_pairs, row_local = _pairs(pair_program, BLOCK_M, PACK)
    col_pairs, col_local = _pairs(pair_program, BLOCK_N, PACK)
    rows = start_m + row_local
    qk_dims, v_dims = tl.arange(0, BLOCK_QK), tl.arange(0, BLOCK_V)
    dtype = q_ptr.dtype.element_ty
    q_base = _base(q_ptr, row_pairs, heads, 1, stride_qb, stride_qh, PACK)
    q = _load_tile(q_base, rows, stride_qs, qk_dims, seq_len, QK_DIM, BLOCK_QK, True, UPCAST)
    k_base = _base(k_ptr, col_pairs, heads, groups, stride_kb, stride_kh, PACK)
    v_base = _base(v_ptr, col_pairs, heads, groups, stride_vb, stride_vh, PACK)
    acc = tl.full([PACK * BLOCK_M, BLOCK_V], 0.0, tl.float32)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + row_pairs % heads).to(tl.float32) * LOG2E
        m_i = tl.full([PACK * BLOCK_M], 0.0, tl.float32) + sink
        l_i = tl.full([PACK * BLOCK_M], 0.0, tl.float32) + 1.0
    else:
        m_i = tl.full([PACK * BLOCK_M], 0.0, tl.float32) + NO_MAX
        l_i = tl.full([PACK * BLOCK_M], 0.0, tl.float32)
    # Key blocks: [low, whole) crossed by the window's edge, [whole, start_m) whole (masked
    # only to keep packed pairs apart), [start_m, end) on the diagonal.
    low = tl.maximum(start_m - window + 1, 0) // BLOCK_N * BLOCK_N
    whole = tl.maximum(start_m + BLOCK_M - window, 0)
    whole = tl.minimum((whole + BLOCK_N - 1) // BLOCK_N * BLOCK_N, start_m)
    end = tl.minimum(start_m + BLOCK_M, seq_len)
    acc, m_i, l_i = _forward_range(
        acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_vs, rows, row_pairs, col_local,
        col_pairs, qk_dims, v_dims, low, whole, seq_len, window, scale,
        QK_DIM, V_DIM, BLOCK_QK, BLOCK_V, BLOCK_N, PACK, True, dtype, UPCAST,
    )  # fmt: skip
    acc, m_i, l_i = _forward_range(
        acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_vs, rows, row_pairs, col_local,
        col_pairs, qk_dims, v_dims, whole, start_m, seq_len, window, scale,
        QK_DIM, V_DIM, BLOCK_QK, BLOCK_V, BLOCK_N, PACK, PACK > 1, dtype, UPCAST,
    )  # fmt: skip
    acc, m_i, l_i = _forward_range(
        acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_vs, rows, row_pairs, col_local,
        col_pairs, qk_dims, v_dims, start_m, end, seq_len, window, scale,
        QK_DIM, V_DIM, BLOCK_QK, BLOCK_V, BLOCK_N, PACK, True, dtype, UPCAST,
    )  # fmt: skip
    # Rows past the sequence end may have seen nothing; they are not stored.
    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # a NaN stays NaN: the log-sum-exp carries it
    out_base = _base(out_ptr, row_pairs, heads, 1, stride_ob, stride_oh, PACK)
    _store_tile(out_base, rows, stride_os, v_dims, seq_len, acc / l_i[:, None], V_DIM)
    lse = (m_i + tl.math.log2(l_i)) * LN2
    lse_rows = lse_ptr + row_pairs.to(tl.int64) * seq_len + rows
    tl.store(lse_rows, lse, mask=rows < seq_len)


# ---------------------------------------------------------------------------- backward
@triton.jit
def attention_backward_preprocess_kernel(
    out_ptr, grad_ptr, delta_ptr, stride_ob, stride_oh, stride_os, stride_gb, stride_gh,
    stride_gs, heads, seq_len, total_rows,
    V_DIM: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """``delta = rowsum(dO * O)`` in float32, ``[B, h, S]``: one program per ``BLOCK_R``
    rows of all pairs' rows in a row."""
    flat = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    pairs, rows = flat // seq_len, flat % seq_len
    batch, head = pairs // heads, pairs % heads
    dims = tl.arange(0, BLOCK_V)
    mask = (flat < total_rows)[:, None] & (dims < V_DIM)[None, :]
    out_rows = out_ptr + batch * stride_ob + head * stride_oh + rows * stride_os
    grad_rows = grad_ptr + batch * stride_gb + head * stride_gh + rows * stride_gs
    out = tl.load(out_rows[:, None] + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    grad = tl.load(grad_rows[:, None] + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(delta_ptr + flat, _row_sum(out * grad), mask=flat < total_rows)


def _backward_kv_range(
    dk, dv, key, value, q_base, grad_base, stats, lse_ptr, delta_ptr, stride_qs, stride_gs,
    cols, key_pairs, row_local, row_pairs, qk_dims, v_dims, start, end, seq_len, window,
    scale,
    QK_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_QK: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_M: tl.constexpr, PACK: tl.constexpr, MASKED: tl.constexpr, DTYPE: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """dK and dV of one key block from the query blocks in ``[start, end)`` of one query
    head, in the transposed frame (``[keys, queries]``) so that both come out as rows.
    ``stats``: the offset of the head's rows in ``lse`` and ``delta``."""
    for block in range(start, end, BLOCK_M):
        rows = block + row_local
        q = _load_tile(q_base, rows, stride_qs, qk_dims, seq_len, QK_DIM, BLOCK_QK, MASKED,
                       UPCAST)  # fmt: skip
        if MASKED:
            lse = tl.load(lse_ptr + stats + rows, mask=rows < seq_len, other=float("inf"))
            delta = tl.load(delta_ptr + stats + rows, mask=rows < seq_len, other=0.0)
        else:
            lse = tl.load(lse_ptr + stats + rows)
            delta = tl.load(delta_ptr + stats + rows)
        s_t = tl.dot(key, tl.trans(q), input_precision="ieee") * scale
        p_t = tl.math.exp2(s_t - lse[None, :] * LOG2E)
        if MASKED:
            visible = _visible_t(cols, key_pairs, rows, row_pairs, window, PACK)
            p_t = tl.where(visible, p_t, 0.0)
        grad = _load_tile(grad_base, rows, stride_gs, v_dims, seq_len, V_DIM, BLOCK_V, MASKED,
                          UPCAST)  # fmt: skip
        dv = tl.dot(_operand(p_t, DTYPE, UPCAST), grad, dv, input_precision="ieee")
        dp_t = tl.dot(value, tl.trans(grad), input_precision="ieee")
        ds_t = p_t * (dp_t - delta[None, :])
        if MASKED:  # 0 * NaN: a NaN row must not reach keys it cannot see
            ds_t = tl.where(visible, ds_t, 0.0)
        dk = tl.dot(_operand(ds_t, DTYPE, UPCAST), q, dk, input_precision="ieee")
    return dk, dv


_backward_kv_range = _jit(_backward_kv_range)


@triton.jit
def attention_backward_kv_kernel(
    q_ptr, k_ptr, v_ptr, grad_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_gb, stride_gh, stride_gs,
    stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs,
    heads, groups, seq_len, window, scale, scaling,
    QK_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_QK: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PACK: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """One program per (key block, ``PACK`` batch x KV-head pairs): dK and dV of its keys,
    summed over the ``groups`` query heads that share them. ``BLOCK_N`` is a multiple of
    ``BLOCK_M``."""
    block, pair_program = _grid_position(seq_len, BLOCK_N)
    start_n = block * BLOCK_N
    kv_heads = heads // groups
    key_pairs, key_local = _pairs(pair_program, BLOCK_N, PACK)
    row_pairs, row_local = _pairs(pair_program, BLOCK_M, PACK)  # KV pairs of the rows
    cols = start_n + key_local
    qk_dims, v_dims = tl.arange(0, BLOCK_QK), tl.arange(0, BLOCK_V)
    dtype = q_ptr.dtype.element_ty
    k_base = _base(k_ptr, key_pairs, kv_heads, 1, stride_kb, stride_kh, PACK)
    key = _load_tile(k_base, cols, stride_ks, qk_dims, seq_len, QK_DIM, BLOCK_QK, True, UPCAST)
    v_base = _base(v_ptr, key_pairs, kv_heads, 1, stride_vb, stride_vh, PACK)
    value = _load_tile(v_base, cols, stride_vs, v_dims, seq_len, V_DIM, BLOCK_V, True, UPCAST)
    dk = tl.full([PACK * BLOCK_N, BLOCK_QK], 0.0, tl.float32)
    dv = tl.full([PACK * BLOCK_N, BLOCK_V], 0.0, tl.float32)
    # Query blocks: [start_n, diagonal) on the diagonal, [diagonal, whole) whole (masked
    # only to keep packed pairs apart), [whole, end) crossed by the window's edge or the
    # sequence end.
    diagonal = start_n + BLOCK_N
    whole = tl.minimum((start_n + window) // BLOCK_M, seq_len // BLOCK_M) * BLOCK_M
    whole = tl.maximum(whole, diagonal)
    end = tl.minimum(start_n + BLOCK_N + window - 1, seq_len)
    for member in range(0, groups):
        query_pairs = row_pairs * groups + member  # batch x query-head pairs
        q_base = _base(q_ptr, query_pairs, heads, 1, stride_qb, stride_qh, PACK)
        grad_base = _base(grad_ptr, query_pairs, heads, 1, stride_gb, stride_gh, PACK)
        stats = query_pairs.to(tl.int64) * seq_len
        dk, dv = _backward_kv_range(
            dk, dv, key, value, q_base, grad_base, stats, lse_ptr, delta_ptr, stride_qs,
            stride_gs, cols, key_pairs, row_local, row_pairs, qk_dims, v_dims, start_n,
            diagonal, seq_len, window, scale,
            QK_DIM, V_DIM, BLOCK_QK, BLOCK_V, BLOCK_M, PACK, True, dtype, UPCAST,
        )  # fmt: skip
        dk, dv = _backward_kv_range(
            dk, dv, key, value, q_base, grad_base, stats, lse_ptr, delta_ptr, stride_qs,
            stride_gs, cols, key_pairs, row_local, row_pairs, qk_dims, v_dims, diagonal,
            whole, seq_len, window, scale,
            QK_DIM, V_DIM, BLOCK_QK, BLOCK_V, BLOCK_M, PACK, PACK > 1, dtype, UPCAST,
        )  # fmt: skip
        dk, dv = _backward_kv_range(
            dk, dv, key, value, q_base, grad_base, stats, lse_ptr, delta_ptr, stride_qs,
            stride_gs, cols, key_pairs, row_local, row_pairs, qk_dims, v_dims, whole, end,
            seq_len, window, scale,
            QK_DIM, V_DIM, BLOCK_QK, BLOCK_V, BLOCK_M, PACK, True, dtype, UPCAST,
        )  # fmt: skip
    dk_base = _base(dk_ptr, key_pairs, kv_heads, 1, stride_dkb, stride_dkh, PACK)
    _store_tile(dk_base, cols, stride_dks, qk_dims, seq_len, dk * scaling, QK_DIM)
    dv_base = _base(dv_ptr, key_pairs, kv_heads, 1, stride_dvb, stride_dvh, PACK)
    _store_tile(dv_base, cols, stride_dvs, v_dims, seq_len, dv, V_DIM)


def _backward_q_range(
    dq, q, grad, lse, delta, k_base, v_base, stride_ks, stride_vs, rows, row_pairs,
    col_local, col_pairs, qk_dims, v_dims, start, end, seq_len, window, scale,
    QK_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_QK: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_N: tl.constexpr, PACK: tl.constexpr, MASKED: tl.constexpr, DTYPE: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """dQ of one query block from the key blocks in ``[start, end)`` (``lse`` in base 2)."""
    for block in range(start, end, BLOCK_N):
        cols = block + col_local
        key = _load_tile(k_base, cols, stride_ks, qk_dims, seq_len, QK_DIM, BLOCK_QK, MASKED,
                         UPCAST)  # fmt: skip
        value = _load_tile(v_base, cols, stride_vs, v_dims, seq_len, V_DIM, BLOCK_V, MASKED,
                           UPCAST)  # fmt: skip
        s = tl.dot(q, tl.trans(key), input_precision="ieee") * scale
        p = tl.math.exp2(s - lse[:, None])
        if MASKED:
            visible = _visible(rows, row_pairs, cols, col_pairs, window, PACK)
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(grad, tl.trans(value), input_precision="ieee")
        ds = p * (dp - delta[:, None])
        if MASKED:
            ds = tl.where(visible, ds, 0.0)
        dq = tl.dot(_operand(ds, DTYPE, UPCAST), key, dq, input_precision="ieee")
    return dq


_backward_q_range = _jit(_backward_q_range)


@triton.jit
def attention_backward_q_kernel(
    q_ptr, k_ptr, v_ptr, grad_ptr, lse_ptr, delta_ptr, dq_ptr,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_gb, stride_gh, stride_gs,
    stride_dqb, stride_dqh, stride_dqs,
    heads, groups, seq_len, window, scale, scaling,
    QK_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_QK: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PACK: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """One program per (query block, ``PACK`` batch x head pairs): dQ of its rows.
    ``BLOCK_M`` is a multiple of ``BLOCK_N``; the key blocks are the forward's."""
    block, pair_program = _grid_position(seq_len, BLOCK_M)
    start_m = block * BLOCK_M
    row_pairs, row_local = _pairs(pair_program, BLOCK_M, PACK)
    col_pairs, col_local = _pairs(pair_program, BLOCK_N, PACK)
    rows = start_m + row_local
    qk_dims, v_dims = tl.arange(0, BLOCK_QK), tl.arange(0, BLOCK_V)
    dtype = q_ptr.dtype.element_ty
    q_base = _base(q_ptr, row_pairs, heads, 1, stride_qb, stride_qh, PACK)
    q = _load_tile(q_base, rows, stride_qs, qk_dims, seq_len, QK_DIM, BLOCK_QK, True, UPCAST)
    grad_base = _base(grad_ptr, row_pairs, heads, 1, stride_gb, stride_gh, PACK)
    grad = _load_tile(grad_base, rows, stride_gs, v_dims, seq_len, V_DIM, BLOCK_V, True, UPCAST)
    stats = row_pairs.to(tl.int64) * seq_len + rows
    lse = tl.load(lse_ptr + stats, mask=rows < seq_len, other=float("inf")) * LOG2E
    delta = tl.load(delta_ptr + stats, mask=rows < seq_len, other=0.0)
    k_base = _base(k_ptr, col_pairs, heads, groups, stride_kb, stride_kh, PACK)
    v_base = _base(v_ptr, col_pairs, heads, groups, stride_vb, stride_vh, PACK)
    dq = tl.full([PACK * BLOCK_M, BLOCK_QK], 0.0, tl.float32)
    low = tl.maximum(start_m - window + 1, 0) // BLOCK_N * BLOCK_N
    whole = tl.maximum(start_m + BLOCK_M - window, 0)
    whole = tl.minimum((whole + BLOCK_N - 1) // BLOCK_N * BLOCK_N, start_m)
    end = tl.minimum(start_m + BLOCK_M, seq_len)
    dq = _backward_q_range(
        dq, q, grad, lse, delta, k_base, v_base, stride_ks, stride_vs, rows, row_pairs,
        col_local, col_pairs, qk_dims, v_dims, low, whole, seq_len, window, scale,
        QK_DIM, V_DIM, BLOCK_QK, BLOCK_V, BLOCK_N, PACK, True, dtype, UPCAST,
    )  # fmt: skip
    dq = _backward_q_range(
        dq, q, grad, lse, delta, k_base, v_base, stride_ks, stride_vs, rows, row_pairs,
        col_local, col_pairs, qk_dims, v_dims, whole, start_m, seq_len, window, scale,
        QK_DIM, V_DIM, BLOCK_QK, BLOCK_V, BLOCK_N, PACK, PACK > 1, dtype, UPCAST,
    )  # fmt: skip
    dq = _backward_q_range(
        dq, q, grad, lse, delta, k_base, v_base, stride_ks, stride_vs, rows, row_pairs,
        col_local, col_pairs, qk_dims, v_dims, start_m, end, seq_len, window, scale,
        QK_DIM, V_DIM, BLOCK_QK, BLOCK_V, BLOCK_N, PACK, True, dtype, UPCAST,
    )  # fmt: skip
    dq_base = _base(dq_ptr, row_pairs, heads, 1, stride_dqb, stride_dqh, PACK)
    _store_tile(dq_base, rows, stride_dqs, qk_dims, seq_len, dq * scaling, QK_DIM)
