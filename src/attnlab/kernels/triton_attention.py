"""Triton kernels for scaled dot-product attention: the output with each row's log-sum-exp, and
the attention weights from them, tile by tile.

Math, for one query head h of batch b (query row i, key j; G = H // Hkv, kv head ``h // G``)::

    s_ij   = scale * q_i . k_j            where key j may be attended, else -inf
    lse_i  = log sum_j exp(s_ij)          (+inf for a row with no attendable key)
    o_i    = sum_j exp(s_ij - lse_i) v_j  (0 for such a row)
    w_ij   = exp(s_ij - lse_i)            (the weights: pass 2, only when asked)

Pass 1 (:func:`attention_forward`) is the flash-attention forward (Dao et al. 2022; Triton's
fused-attention tutorial): one program per (BLOCK_M query rows, b, h) walks the key blocks
with an online softmax (running max ``m``, running sum ``l``, rescaled accumulator), so no
(L, S) tile is ever stored. Key blocks that no row of the program may see are never visited:
outside the rows' key ranges and outside the band (below); key blocks that every row sees whole
(the middle of a band, keys inside every row's range) are walked by a loop that computes no
mask, as FlashAttention splits the causal diagonal from the blocks below it. Pass 2
(:func:`attention_weights`) recomputes ``s`` tile by tile and writes ``exp(s - lse)``: per
head (B, H, L, S), one program per (BLOCK_M rows, b, h) walking the key blocks with its query
block held, as the forward; or averaged over heads (B, L, S), one program per (rows, keys)
tile summing the H heads, so the per-head tensor never exists. A
tile that no row of it may see (the far side of the causal triangle, padding, off a band) is
written without computing a score: zeros (NaN in a row the NaN rule made NaN).

Which keys may be attended (all conditions at once)::

    start[b, i] <= j < end[b, i]               key ranges (optional): padding kept as lengths,
                                                one range per batch row; packed sequences, one
                                                per query row
    lo <= j - (i + offset) <= hi               a band: causal is (-inf, 0] with offset 0
                                                (top-left) or S - L (bottom-right); a causal
                                                sliding window w is [-(w - 1), 0]
    mask[b, h, i, j]                            a bool mask, True = may attend (optional)
    s_ij += bias[b, h, i, j]                    or a float mask added to the scores

Offsets: each program's base offset into a tensor (``b * stride_b + h * stride_h``) is int64,
since large tensors pass 2**31 elements (a bool mask of 8 x 32 x 4096 x 4096); offsets within
a tile (``i * stride_i + e``) stay int32, which keeps registers free, and :func:`supports`
refuses inputs whose offsets within one head would not fit (the existing paths serve them).

Masks are read through their strides, so a broadcast (B, 1, 1, S) key-padding mask costs one
row per key block, never an (L, S) tensor. Matrix products take the inputs' dtype (fp16, bf16;
fp32 with IEEE precision, not TF32) and accumulate in fp32; softmax statistics are fp32.

The readable reference these kernels must equal is :func:`reference`, and the float64 NumPy
oracle :func:`attnlab.reference.scaled_dot_product_attention`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from attnlab.kernels import _triton
from attnlab.kernels._triton import INT32_MAX, INTERPRET, offsets_unfit

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


@triton.jit
def _program(inner):
    """(index along the inner axis, outer index as int64) of this program in a 1-D grid of
    ``inner * outer`` programs, the inner index running fastest.

    CUDA caps a grid's y and z at 65,535 blocks (x at 2**31 - 1): B * H on axis 1 would refuse
    65,536 heads in all (windows folded into the batch), so every kernel's grid is 1-D.
    """
    pid = tl.program_id(0)
    return pid % inner, (pid // inner).to(tl.int64)


@triton.jit
def _tile(P, base, rows, cols, s_row, s_col, n_rows, n_cols):
    """The (len(rows), len(cols)) tile ``P[base + rows * s_row + cols * s_col]``, 0 outside
    ``n_rows`` x ``n_cols``."""
    return tl.load(
        P + base + rows[:, None] * s_row + cols[None, :] * s_col,
        mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols),
        other=0.0,
    )


@triton.jit
def _dot(a, b, DOT: tl.constexpr):
    """a @ b accumulated in fp32. DOT: 0 the inputs' dtype (fp16/bf16 tensor cores), 1 fp32 in
    IEEE precision (not TF32), 2 16-bit inputs upcast first: the interpreter's NumPy has no
    bfloat16, and the products of 16-bit numbers are exact in fp32, so this is the same sum."""
    if DOT == 1:
        return tl.dot(a, b, input_precision="ieee")
    if DOT == 2:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _scores(q, K, kv_base, offs_n, offs_e, ske, sks, S, E, DOT: tl.constexpr):
    """(BLOCK_M, BLOCK_E) queries . (BLOCK_N keys) -> (BLOCK_M, BLOCK_N) fp32 scores."""
    k = tl.load(
        K + kv_base + offs_n[None, :] * sks + offs_e[:, None] * ske,
        mask=(offs_n[None, :] < S) & (offs_e[:, None] < E),
        other=0.0,
    )  # (BLOCK_E, BLOCK_N): K transposed by its strides
    return _dot(q, k, DOT)


@triton.jit
def _rows(KSTART, KEND, srb, srl, b, offs_m, L, S, HAS_RANGE: tl.constexpr):
    """Each row's key range [r_lo, r_hi), (BLOCK,) int32 each; rows past L see no key."""
    if HAS_RANGE:
        at = offs_m * srl
        r_lo = tl.load(KSTART + b * srb + at, mask=offs_m < L, other=S)
        r_hi = tl.minimum(tl.load(KEND + b * srb + at, mask=offs_m < L, other=0), S)
    else:
        r_lo = tl.where(offs_m < L, 0, S)
        r_hi = tl.where(offs_m < L, S, 0)
    return r_lo, r_hi


@triton.jit
def _span(r_lo, r_hi, first, last, offset, band_lo, band_hi, BAND: tl.constexpr):
    """The keys [lo, hi) that some row ``first..last`` of a tile may see: key blocks outside
    are never visited (padding, the causal triangle, a sliding window)."""
    lo = tl.maximum(tl.min(r_lo, 0), 0)
    hi = tl.max(r_hi, 0)
    if BAND:
        lo = tl.maximum(lo, first + offset + band_lo)
        hi = tl.minimum(hi, last + offset + band_hi + 1)
    return lo, hi


@triton.jit
def _interior(lo, hi, r_lo, r_hi, offs_m, L, first, last, offset, band_lo, band_hi,
              BAND: tl.constexpr, MASK: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """(begin, in_lo, in_hi): the key blocks a tile visits run from ``begin`` (a block start) up
    to ``hi``; those of [in_lo, in_hi) lie whole in the keys that *every* row of the tile may
    see, so they need no mask (FlashAttention's causal split, for key ranges and bands too): a
    loop over them computes none. Empty (in_lo = in_hi = begin) with a mask tensor, which is
    read in every block."""
    begin = (lo // BLOCK_N) * BLOCK_N
    real = offs_m < L  # rows past L see no key: they must not narrow the keys all rows see
    f_lo = tl.max(tl.where(real, r_lo, 0), 0)
    f_hi = tl.min(tl.where(real, r_hi, hi), 0)
    if BAND:
        f_lo = tl.maximum(f_lo, last + offset + band_lo)
        f_hi = tl.minimum(f_hi, first + offset + band_hi + 1)
    in_lo = tl.maximum(tl.cdiv(tl.maximum(f_lo, 0), BLOCK_N) * BLOCK_N, begin)
    in_hi = (tl.maximum(f_hi, 0) // BLOCK_N) * BLOCK_N
    if MASK != 0:
        in_hi = in_lo
    empty = in_hi <= in_lo
    return begin, tl.where(empty, begin, in_lo), tl.where(empty, begin, in_hi)


@triton.jit
def _allowed(
    s, M, m_base, offs_m, offs_n, sml, sms, r_lo, r_hi, offset, band_lo, band_hi,
    BAND: tl.constexpr, MASK: tl.constexpr,
):  # fmt: skip
    """Scores with every key a row may not attend set to -inf (MASK: 0 none, 1 bool, 2 bias).

    Key j may be attended by row i iff ``r_lo[i] <= j < r_hi[i]``, and with BAND iff
    ``band_lo <= j - (i + offset) <= band_hi`` (causal: (-inf, 0]; a causal window w:
    [-(w - 1), 0]), and the mask allows it.
    """
    n = offs_n[None, :]
    ok = (n >= r_lo[:, None]) & (n < r_hi[:, None])
    if BAND:
        d = n - (offs_m[:, None] + offset)
        ok = ok & (d >= band_lo) & (d <= band_hi)
    if MASK == 1:
        keep = tl.load(M + m_base + offs_m[:, None] * sml + n * sms, mask=ok, other=0)
        ok = ok & (keep != 0)
    if MASK == 2:
        bias = tl.load(M + m_base + offs_m[:, None] * sml + n * sms, mask=ok, other=0.0)
        s = s + bias.to(tl.float32)
    return tl.where(ok, s, float("-inf"))


@triton.jit
def _forward_blocks(
    acc, m_i, l_i, q, K, V, M, k_base, v_base, m_base, offs_m, offs_e, offs_ev, begin, end,
    ske, sks, svs, sve, sml, sms, r_lo, r_hi, S, E, EV, scale, offset, band_lo, band_hi,
    BAND: tl.constexpr, MASK: tl.constexpr, DOT: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
):  # fmt: skip
    """The online softmax over the key blocks [begin, end): running max ``m_i``, running sum
    ``l_i``, accumulator ``acc``; MASKED False for blocks every row sees whole (no mask)."""
    for start in range(begin, end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        s = _scores(q, K, k_base, offs_n, offs_e, ske, sks, S, E, DOT) * scale
        if MASKED:
            s = _allowed(
                s, M, m_base, offs_m, offs_n, sml, sms, r_lo, r_hi, offset, band_lo, band_hi,
                BAND, MASK,
            )  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _tile(V, v_base, offs_n, offs_ev, svs, sve, S, EV)  # (BLOCK_N, BLOCK_EV)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _row_stats(LSE, rows, ok):
    """Rows' softmax statistics, from (B, H, L, 2) at flat row indices ``rows`` (int64): the
    max score ``m`` (+inf for a row with no key, NaN where the NaN rule put it) and ``log l``,
    the log of the row's sum of ``exp(s - m)``. ``P = exp((s - m) - log l)``: kept apart, not
    as ``lse = m + log l``, for a row whose scores a huge bias absorbed (``finfo.min`` on every
    key) has ``m + log l == m`` in float32, and ``exp(s - lse)`` gave its weights 1, not 1/S."""
    m = tl.load(LSE + 2 * rows, mask=ok, other=float("inf"))
    logl = tl.load(LSE + 2 * rows + 1, mask=ok, other=0.0)
    return m, logl


@triton.jit
def _store_row_stats(base, offs, ok, alive, m_i, l_safe):
    """What :func:`_row_stats` reads, from a forward's running max ``m_i`` and sum ``l_safe``
    (1 where not ``alive``): a row with no key gets max +inf and log-sum 0, so P = 0. ``base``
    points at the program's first row's pair, ``offs`` are rows from it (not int64 row indices:
    their registers made the float32 E = 128 forward spill)."""
    tl.store(base + 2 * offs, tl.where(alive, m_i, float("inf")), mask=ok)
    tl.store(base + 2 * offs + 1, tl.where(alive, tl.log(l_safe), 0.0), mask=ok)


@triton.jit
def _forward_kernel(
    Q, K, V, M, KSTART, KEND, O, LSE,
    sqb, sqh, sql, sqe, skb, skh, sks, ske, svb, svh, svs, sve,
    smb, smh, sml, sms, srb, srl, sob, soh, sol, soe,
    H, G, L, S, E, EV, scale, offset, band_lo, band_hi,
    BAND: tl.constexpr, MASK: tl.constexpr, HAS_RANGE: tl.constexpr, DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
):  # fmt: skip
    pid_m, bh = _program(tl.cdiv(L, BLOCK_M))  # bh int64: base offsets (see "Offsets" above)
    b = bh // H
    h = bh % H
    hk = h // G  # the GQA mapping: query head h reads kv head h // G
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)
    q = _tile(Q, b * sqb + h * sqh, offs_m, offs_e, sql, sqe, L, E)  # (BLOCK_M, BLOCK_E)
    k_base = b * skb + hk * skh
    v_base = b * svb + hk * svh
    m_base = b * smb + h * smh
    r_lo, r_hi = _rows(KSTART, KEND, srb, srl, b, offs_m, L, S, HAS_RANGE)
    last = tl.minimum(pid_m * BLOCK_M + BLOCK_M, L) - 1
    lo, hi = _span(r_lo, r_hi, pid_m * BLOCK_M, last, offset, band_lo, band_hi, BAND)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp(s - m)
    acc = tl.zeros([BLOCK_M, BLOCK_EV], tl.float32)
    begin, in_lo, in_hi = _interior(
        lo, hi, r_lo, r_hi, offs_m, L, pid_m * BLOCK_M, last, offset, band_lo, band_hi, BAND,
        MASK, BLOCK_N,
    )  # fmt: skip
    for part in tl.static_range(3):  # the masked blocks before the interior, it, those after
        acc, m_i, l_i = _forward_blocks(
            acc, m_i, l_i, q, K, V, M, k_base, v_base, m_base, offs_m, offs_e, offs_ev,
            begin if part == 0 else (in_lo if part == 1 else in_hi),
            in_lo if part == 0 else (in_hi if part == 1 else hi),
            ske, sks, svs, sve, sml, sms, r_lo, r_hi, S, E, EV, scale, offset, band_lo, band_hi,
            BAND, MASK, DOT, BLOCK_N, part != 1,
        )  # fmt: skip

    alive = (l_i > 0) | (l_i != l_i)  # a row with a key, or NaN (a NaN or +inf bias): not dead
    row_ok = offs_m < L
    l_safe = tl.where(alive, l_i, 1.0)
    # the row statistics before the output (after it, a 4-byte spill at fp32 E = 128)
    _store_row_stats(LSE + 2 * bh * L, offs_m, row_ok, alive, m_i, l_safe)
    out = tl.where(alive[:, None], acc / l_safe[:, None], 0.0)
    tl.store(
        O + b * sob + h * soh + offs_m[:, None] * sol + offs_ev[None, :] * soe,
        out.to(O.dtype.element_ty),
        mask=row_ok[:, None] & (offs_ev[None, :] < EV),
    )


@triton.jit
def _weights_kernel(
    Q, K, M, KSTART, KEND, LSE, W,
    sqb, sqh, sql, sqe, skb, skh, sks, ske, smb, smh, sml, sms, srb, srl,
    H, G, L, S, E, scale, offset, band_lo, band_hi,
    BAND: tl.constexpr, MASK: tl.constexpr, HAS_RANGE: tl.constexpr, DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """One (BLOCK_M, BLOCK_N) tile of the weights averaged over the H heads of batch row b
    (the per-head weights take :func:`_head_weights_kernel`)."""
    blocks_m, blocks_n = tl.cdiv(L, BLOCK_M), tl.cdiv(S, BLOCK_N)
    pid_mn, b = _program(blocks_m * blocks_n)  # b int64
    pid_m, pid_n = pid_mn % blocks_m, pid_mn // blocks_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_e = tl.arange(0, BLOCK_E)
    r_lo, r_hi = _rows(KSTART, KEND, srb, srl, b, offs_m, L, S, HAS_RANGE)
    last = tl.minimum(pid_m * BLOCK_M + BLOCK_M, L) - 1
    lo, hi = _span(r_lo, r_hi, pid_m * BLOCK_M, last, offset, band_lo, band_hi, BAND)
    # a tile outside every row's keys (the causal triangle's far side, padding, off a window)
    # is exp(-inf - lse): 0, or NaN in a row whose lse the NaN rule made NaN; no scores needed
    seen = (pid_n * BLOCK_N < hi) & (pid_n * BLOCK_N + BLOCK_N > lo)
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # the condition stands outside the loops over heads: a loop free of branches is one Triton
    # can pipeline (the next head's q and k tiles load while this head's scores are computed)
    if seen:
        for hh in range(0, H):
            h = tl.cast(hh, tl.int64)  # int64 base offsets
            rmax, logl = _row_stats(LSE, (b * H + h) * L + offs_m, offs_m < L)
            q = _tile(Q, b * sqb + h * sqh, offs_m, offs_e, sql, sqe, L, E)
            s = _scores(q, K, b * skb + (h // G) * skh, offs_n, offs_e, ske, sks, S, E, DOT)
            s = _allowed(
                s * scale, M, b * smb + h * smh, offs_m, offs_n, sml, sms, r_lo, r_hi, offset,
                band_lo, band_hi, BAND, MASK,
            )  # fmt: skip
            total += tl.exp((s - rmax[:, None]) - logl[:, None])  # -inf - m, s - inf: exp(-inf) = 0
    else:
        for hh in range(0, H):
            h = tl.cast(hh, tl.int64)
            rmax, logl = _row_stats(LSE, (b * H + h) * L + offs_m, offs_m < L)
            total += tl.where((rmax == rmax) & (logl == logl), 0.0, float("nan"))[:, None]
    tl.store(
        W + b * L * S + offs_m[:, None] * S + offs_n[None, :],
        (total / H).to(W.dtype.element_ty),
        mask=(offs_m[:, None] < L) & (offs_n[None, :] < S),
    )


@triton.jit
def _head_weights_kernel(
    Q, K, M, KSTART, KEND, LSE, W,
    sqb, sqh, sql, sqe, skb, skh, sks, ske, smb, smh, sml, sms, srb, srl,
    H, G, L, S, E, scale, offset, band_lo, band_hi,
    BAND: tl.constexpr, MASK: tl.constexpr, HAS_RANGE: tl.constexpr, DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """Per-head weights, one program per (BLOCK_M query rows, b, h), as the forward: its query
    block is read once and each key block's (BLOCK_M, BLOCK_N) tile of ``exp(s - lse)`` is
    written in turn (a program per tile would read the query block once per key block)."""
    pid_m, bh = _program(tl.cdiv(L, BLOCK_M))  # bh = b * H + h, int64
    b = bh // H
    h = bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_e = tl.arange(0, BLOCK_E)
    q = _tile(Q, b * sqb + h * sqh, offs_m, offs_e, sql, sqe, L, E)  # (BLOCK_M, BLOCK_E)
    r_lo, r_hi = _rows(KSTART, KEND, srb, srl, b, offs_m, L, S, HAS_RANGE)
    last = tl.minimum(pid_m * BLOCK_M + BLOCK_M, L) - 1
    lo, hi = _span(r_lo, r_hi, pid_m * BLOCK_M, last, offset, band_lo, band_hi, BAND)
    rmax, logl = _row_stats(LSE, bh * L + offs_m, offs_m < L)
    # a key block outside every row's keys: exp(-inf - m), 0 (NaN in a NaN-rule row)
    unseen = tl.where((rmax == rmax) & (logl == logl), 0.0, float("nan"))[:, None] + tl.zeros(
        [BLOCK_M, BLOCK_N], tl.float32
    )
    rows_ok = offs_m[:, None] < L
    w_base = W + bh * L * S + offs_m[:, None] * S
    # three loops, each free of branches so that Triton can pipeline it: the key blocks before
    # the span, those in it (scores), those after it
    first = (tl.minimum(lo, S) // BLOCK_N) * BLOCK_N
    after = tl.maximum(first, tl.cdiv(tl.maximum(hi, 0), BLOCK_N) * BLOCK_N)
    for start in range(0, first, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        tl.store(w_base + offs_n[None, :], unseen.to(W.dtype.element_ty), mask=rows_ok)
    for start in range(first, after, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        s = _scores(q, K, b * skb + (h // G) * skh, offs_n, offs_e, ske, sks, S, E, DOT)
        s = _allowed(
            s * scale, M, b * smb + h * smh, offs_m, offs_n, sml, sms, r_lo, r_hi, offset,
            band_lo, band_hi, BAND, MASK,
        )  # fmt: skip
        tl.store(
            w_base + offs_n[None, :],
            tl.exp((s - rmax[:, None]) - logl[:, None]).to(W.dtype.element_ty),
            mask=rows_ok & (offs_n[None, :] < S),
        )
    for start in range(after, S, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        tl.store(
            w_base + offs_n[None, :],
            unseen.to(W.dtype.element_ty),
            mask=rows_ok & (offs_n[None, :] < S),
        )


def _dot_mode(dtype: torch.dtype) -> int:
    """The ``DOT`` constant of the kernels for inputs of this dtype (see ``_dot``)."""
    if dtype == torch.float32:
        return 1
    return 2 if INTERPRET else 0


# GPU tiles per kernel: (16-bit inputs?, head dim class) -> (BLOCK_M, BLOCK_N, warps, stages).
# Chosen by compiling every kernel ahead of time for sm_90 (benchmarks/gpu_compile.py: Triton
# 3.9 and its ptxas, no GPU at hand) with a bool mask, key ranges and a band on, the heaviest
# case: the largest tiles that do not spill registers and fit the H100's 227 KiB of shared
# memory. float32 products are IEEE (no tensor cores): its tiles are smaller, with 8 warps to
# spread the registers (4 warps spilled 0.2-17 KiB per thread at 32 x 32). A test compiles them
# all and fails on a spill. Triton 3.6 (torch 2.11's, on the H200 that gave the first figures)
# spilled where 3.9 did not with float32 at E = 128 (forward 16 x 64: ~330 B; decode 4 warps:
# 312 B) and for the weights at E = 64: those take tiles that spill in neither. With 3.6 some
# still spill: the 16-bit dK/dV kernel at E = 128 with a mask, ranges and a band (4 B) and
# float32 decode at E = 256 (~2 KB): to be settled by timing (benchmarks/bench_gpu.py --only
# padding --sweep) under the Triton the GPU machine has. The backward's unmasked interior loops
# (one more loop per kernel) made dK/dV spill at its former tiles (float32: 32 x 32 at E = 64,
# 24 B; 16 x 32 with 2 stages at E = 128, ~600 B; 16-bit at E = 128, 64 x 32: 28 B): the
# backward took tiles that spill in neither Triton; an H100 then timed the 16-bit dK/dV at
# 64 x 64 (which spills 16-352 B) 1.1-1.6x faster than those (SPILLS_TIMED in _triton.py).
TILES = {
    "forward": {(True, 64): (128, 32, 8, 3), (True, 128): (128, 32, 8, 3),
                (True, 256): (64, 32, 8, 2), (False, 64): (32, 32, 8, 2),
                (False, 128): (16, 32, 8, 1), (False, 256): (32, 16, 8, 1)},
    "weights": {(True, 64): (128, 32, 8, 3), (True, 128): (128, 32, 8, 3),
                (True, 256): (128, 32, 8, 1), (False, 64): (32, 64, 8, 1),
                (False, 128): (32, 32, 8, 2), (False, 256): (32, 32, 8, 2)},
    "backward": {(True, 64): (64, 64, 4, 2), (True, 128): (64, 64, 4, 2),
                 (True, 256): (16, 32, 8, 2), (False, 64): (16, 16, 4, 1),
                 (False, 128): (16, 32, 8, 1), (False, 256): (32, 16, 8, 1)},
    "decode": {(True, 64): (0, 64, 4, 2), (True, 128): (0, 32, 4, 2), (False, 64): (0, 32, 4, 2),
               (False, 128): (0, 32, 8, 2)},
}  # fmt: skip
# the averaged weights' kernel (a program per (rows, keys) tile, a loop over heads): the
# per-head kernel's tiles but at E = 128, where 64 x 64 x 4 warps ran 2.3x faster on an H100
# (4.1 vs 9.5 ms at (4, 32, 4096, 128) causal; at E = 64 the per-head tiles stay the faster)
TILES["average"] = {**TILES["weights"], (True, 128): (64, 64, 4, 3)}
SMALLEST = (32, 32, 4, 1)


def _blocks(E: int, Ev: int, dtype: torch.dtype = torch.bfloat16, kernel: str = "forward"):
    """BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EV, num_warps, num_stages for a kernel and head dims.

    On a GPU: :data:`TILES`. The interpreter runs each program in NumPy: 32 x 32 tiles keep
    small test shapes quick while still crossing several tiles.
    """
    BE = max(16, triton.next_power_of_2(E))
    BEV = max(16, triton.next_power_of_2(Ev))
    if INTERPRET:
        return 32, 32, BE, BEV, 4, 1
    width = max(BE, BEV)
    key = (dtype != torch.float32, 64 if width <= 64 else width)
    BM, BN, warps, stages = TILES[kernel].get(key, SMALLEST)
    return BM, BN, BE, BEV, warps, stages


def _mask_args(mask: torch.Tensor | None, q: torch.Tensor, S: int):
    """(kind, tensor, strides) of a mask broadcast to (B, H, L, S) without copying it."""
    B, H, L, _ = q.shape
    if mask is None:
        return 0, q, (0, 0, 0, 0)
    mask = mask.expand(B, H, L, S)  # strides 0 where the mask broadcasts
    if mask.dtype == torch.bool:
        return 1, mask.view(torch.uint8), mask.stride()
    return 2, mask, mask.stride()


def _range_args(key_range, q: torch.Tensor):
    """(has_range, start, end, row strides): ranges (B,) per batch row or (B | 1, L) per query
    row, read through broadcast strides."""
    if key_range is None:
        return False, q, q, 0, 0
    B, L = q.shape[0], q.shape[2]
    start, end = (
        (t[:, None] if t.dim() == 1 else t).to(q.device, torch.int32).expand(B, L)
        for t in key_range
    )  # (B, L), stride 0 where broadcast
    if start.stride() != end.stride():
        start, end = start.contiguous(), end.contiguous()
    return True, start, end, *start.stride()


def band_args(alignment: str | None, band, L: int, S: int) -> tuple[bool, int, int, int]:
    """(BAND, offset, band_lo, band_hi): the causal alignment and a sliding-window band
    ``(offset, lo, hi)`` (keys j with ``lo <= j - (i + offset) <= hi``) as one band."""
    # |j - (i + offset)| <= L + S here: limits past +-(L + S + 1) say "no limit", and are cut to
    # it, so that the kernels' int32 sums (last + offset + hi + 1) cannot wrap (a window of
    # 2**31 - 1 did: wrong rows)
    none = -(L + S + 1)  # no lower limit
    bands = []
    if alignment is not None:
        bands.append(((S - L) if alignment == "bottom_right" else 0, none, 0))
    if band is not None:
        bands.append(band)
    if not bands:
        return False, 0, 0, 0
    offset = bands[0][0]
    lo = min(max(max(b_lo + b_off - offset, none) for b_off, b_lo, _ in bands), -none)
    hi = max(min(min(b_hi + b_off - offset for b_off, _, b_hi in bands), -none), none)
    return True, offset, lo, hi


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    alignment: str | None = None,
    scale: float | None = None,
    key_range: tuple[torch.Tensor, torch.Tensor] | None = None,
    band: tuple[int, int, int] | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, L, E), (B, Hkv, S, E), (B, Hkv, S, Ev) -> out (B, H, L, Ev), stats (B, H, L, 2).

    ``stats``: each row's max score and the log of its sum of exponentials, float32, apart
    (:func:`row_lse` adds them: the row log-sum-exp); see :func:`_row_stats`.

    ``mask``: None, bool (True = may attend) or a float bias, broadcastable to (B, H, L, S).
    ``alignment``: None, ``"top_left"`` or ``"bottom_right"`` causal. ``key_range``: optional
    ``(start, end)`` int tensors of shape (B,) (padding: batch row b may attend keys
    ``start[b] <= j < end[b]``) or (B | 1, L) (one range per query row: packed sequences).
    ``band``: optional ``(offset, lo, hi)``: query i may attend keys j with
    ``lo <= j - (i + offset) <= hi`` (a sliding window). Key blocks outside the ranges, the
    causal triangle and the band are skipped, not read.
    Rows with no attendable key: output 0, max +inf, log-sum 0. ``out_dtype``: the output's dtype
    (default q's; float32 keeps the unrounded output, for the backward).
    """
    B, H, L, E = q.shape
    Hkv, S, Ev = k.shape[1], k.shape[2], v.shape[-1]
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    out = q.new_empty(B, H, L, Ev, dtype=out_dtype or q.dtype)
    stats = torch.empty(B, H, L, 2, device=q.device, dtype=torch.float32)  # (_row_stats)
    kind, m, ms = _mask_args(mask, q, S)
    has_range, start, end, srb, srl = _range_args(key_range, q)
    has_band, offset, band_lo, band_hi = band_args(alignment, band, L, S)
    BM, BN, BE, BEV, warps, stages = _blocks(E, Ev, q.dtype, "forward")
    grid = (triton.cdiv(L, BM) * B * H,)  # 1-D (see _program)
    with _triton.on_device(q):
        _forward_kernel[grid](
            q, k, v, m, start, end, out, stats,
            *q.stride(), *k.stride(), *v.stride(), *ms, srb, srl, *out.stride(),
            H, H // Hkv, L, S, E, Ev, scale, offset, band_lo, band_hi,
            BAND=has_band, MASK=kind, HAS_RANGE=has_range,
            DOT=_dot_mode(q.dtype),
            BLOCK_M=BM, BLOCK_N=BN, BLOCK_E=BE, BLOCK_EV=BEV, num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return out, stats


# Devices on which the weights' first pass (the output and each row's log-sum-exp) is torch's
# own fused flash kernel instead of attnlab's Triton forward, where that kernel serves the call
# (:func:`torch_pass1_unfit`). An estimate from other rows: SDPA's fused call without a mask
# took 0.3-0.5x the time of the Triton forward with a padding mask (which skips about a quarter
# of the keys) on an H200 (benchmarks/results/h200-2026-11-28), and the first pass is half or
# more of the weights' time. Empty until a GPU has timed the weights through it and checked
# them: ``benchmarks/bench_gpu.py --only weights`` prints both first passes and
# ``benchmarks/gpu_check.py`` checks this one. The tests run it on CPU tensors under the
# interpreter, through torch's CPU flash kernel (which returns the log-sum-exp too).
TORCH_PASS1_ON: tuple[str, ...] = ()


def torch_pass1_unfit(q, k, v, mask, alignment, key_range, band) -> str | None:
    """None when torch's flash kernel gives this call's first pass (:func:`torch_forward`),
    else why not."""
    B, H, L, E = q.shape
    if q.device.type not in TORCH_PASS1_ON:
        return f"torch's flash kernel is not the first pass on {q.device.type} (TORCH_PASS1_ON)"
    if mask is not None or key_range is not None or band is not None:
        return "a mask (torch's flash kernel takes none)"
    if alignment is not None and L != k.shape[2]:
        return "causal with L != S (torch's flash kernel aligns it its own way)"
    if q.is_cuda and q.dtype not in (torch.float16, torch.bfloat16):
        return f"{q.dtype} on CUDA (torch's flash kernel takes float16 and bfloat16)"
    if E != v.shape[-1] or E % 8 or E > 256 or k.shape[1] != H:
        return "head dims, or grouped kv heads, that torch's flash kernel is not given here"
    return None


def torch_forward(q, k, v, alignment, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_forward` by torch's fused flash kernel, which returns each row's
    log-sum-exp ``lse`` (B, H, L): out, stats (B, H, L, 2) as (lse, 0), so that the weights
    kernels' ``exp((s - m) - log l)`` is ``exp(s - lse)`` (no mask: no row without a key, and no
    bias absorbing the scores; the lse rounds at 2^-24 of itself, under 16-bit weights' own
    rounding while |lse| < 2^10). Only where :func:`torch_pass1_unfit` says None."""
    L = q.shape[2]
    causal = alignment is not None
    if q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
    lse = lse[..., :L].float()  # (a kernel that pads its rows keeps them apart)
    return out, torch.stack((lse, torch.zeros_like(lse)), -1)


def row_lse(stats: torch.Tensor) -> torch.Tensor:
    """The row log-sum-exp (B, H, L) of :func:`attention_forward`'s statistics (+inf: no key)."""
    return stats[..., 0] + stats[..., 1]


def attention_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    stats: torch.Tensor,
    mask: torch.Tensor | None = None,
    alignment: str | None = None,
    scale: float | None = None,
    key_range: tuple[torch.Tensor, torch.Tensor] | None = None,
    average: bool = False,
    out: torch.Tensor | None = None,
    band: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """The weights ``exp(s - m - log l)``: (B, H, L, S), or (B, 1, L, S) averaged over heads.

    ``stats`` is :func:`attention_forward`'s (B, H, L, 2); the other arguments are the same as
    there. ``out``: an optional contiguous buffer of that shape and q's dtype to write into.
    """
    B, H, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    shape = (B, 1 if average else H, L, S)
    if out is None:
        out = q.new_empty(shape)
    kind, m, ms = _mask_args(mask, q, S)
    has_range, start, end, srb, srl = _range_args(key_range, q)
    has_band, offset, band_lo, band_hi = band_args(alignment, band, L, S)
    BM, BN, BE, _, warps, stages = _blocks(E, E, q.dtype, "average" if average else "weights")
    args = (
        q, k, m, start, end, stats, out, *q.stride(), *k.stride(), *ms, srb, srl,
        H, H // Hkv, L, S, E, scale, offset, band_lo, band_hi,
    )  # fmt: skip
    consts = dict(
        BAND=has_band, MASK=kind, HAS_RANGE=has_range, DOT=_dot_mode(q.dtype),
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_E=BE, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    with _triton.on_device(q):
        if average:  # a program per (rows, keys) tile sums the H heads
            grid = (triton.cdiv(L, BM) * triton.cdiv(S, BN) * B,)
            _weights_kernel[grid](*args, **consts)
        else:  # a program per (rows, head) walks the key blocks
            _head_weights_kernel[(triton.cdiv(L, BM) * B * H,)](*args, **consts)
    return out


def supports(q, k, v, mask) -> str | None:
    """None when the kernels take these inputs, else why not (for ``explain()``)."""
    if q.dtype not in DTYPES:
        return f"{q.dtype} (the Triton kernels take float16, bfloat16 and float32)"
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        return f"head dim {max(q.shape[-1], v.shape[-1])} > {MAX_HEAD_DIM}"
    if mask is not None and mask.is_floating_point() and mask.dtype not in DTYPES:
        return f"a {mask.dtype} bias mask"
    rows, width = max(q.shape[-2], k.shape[-2]), max(q.shape[-1], v.shape[-1])
    if rows * width > INT32_MAX + 1:  # the contiguous out, dO, dQ, dK, dV of one head
        return f"{rows} x {width} elements per head: past the kernels' 32-bit offsets (2**31)"
    return offsets_unfit(query=q, key=k, value=v, mask=mask)


def reference(q, k, v, mask=None, alignment=None, scale=None, key_range=None, band=None):
    """The readable torch computation the kernels must equal: out, lse (fp32), weights."""
    B, H, L, E = q.shape
    S = k.shape[2]
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    G = H // k.shape[1]
    kf = k.float().repeat_interleave(G, 1)  # (B, H, S, E): the GQA mapping, materialised
    vf = v.float().repeat_interleave(G, 1)
    s = (q.float() @ kf.transpose(-2, -1)) * scale  # (B, H, L, S)
    j = torch.arange(S, device=q.device)
    ok = torch.ones(B, H, L, S, dtype=torch.bool, device=q.device)
    i = torch.arange(L, device=q.device)[:, None]
    if key_range is not None:  # (B,) per batch row -> (B, 1, 1, 1); (B | 1, L) -> (B | 1, 1, L, 1)
        start, end = (
            t[:, None, None, None] if t.dim() == 1 else t[:, None, :, None]
            for t in (r.to(q.device) for r in key_range)
        )
        ok &= (j >= start) & (j < end)
    if alignment is not None:
        ok &= j <= i + ((S - L) if alignment == "bottom_right" else 0)
    if band is not None:
        offset, lo, hi = band
        ok &= (j - (i + offset) >= lo) & (j - (i + offset) <= hi)
    if mask is not None and mask.dtype == torch.bool:
        ok &= mask
    elif mask is not None:
        s = s + mask.float()
    s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, -1)  # -inf for rows with no key
    w = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    return (w @ vf).to(q.dtype), lse, w
