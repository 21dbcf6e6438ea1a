"""The backward pass of :mod:`attnlab.kernels.triton_attention`, and the autograd function.

From the forward's output ``O`` and row statistics (FlashAttention-2's backward,
Dao 2023; Triton's fused-attention tutorial)::

    p_ij    = exp((s_ij - m_i) - log l_i)           recomputed tile by tile, never stored
    delta_i = sum_e dO_ie O_ie                      (= sum_j p_ij dp_ij)
    dp_ij   = dO_i . v_j
    ds_ij   = p_ij (dp_ij - delta_i)
    dV_j    = sum_i p_ij dO_i
    dK_j    = scale * sum_i ds_ij q_i
    dQ_i    = scale * sum_j ds_ij k_j

Two kernels, so that no two programs add into the same memory (no atomics):

* ``_dkdv_kernel``: one program per (key block, batch, kv head) walks the query blocks that may
  see its keys -- of all G query heads of its group (GQA: the group's gradients are summed in
  the program) -- and writes dK, dV once;
* ``_dq_kernel``: one program per (query block, batch, head) walks the key blocks, as the
  forward does, and writes dQ once.

Key blocks outside the rows' key ranges and outside the band (causal, sliding window) are
skipped in the dQ kernel; the dK/dV kernel visits only the query blocks the band allows and
whose ranges reach its keys. Blocks seen whole by every row of the other side (the middle of a
band; inside ranges shared by a batch row's queries) take a loop that computes no mask and has
no branch, so Triton pipelines it. Rows with no attendable key have ``m = +inf``: ``p = 0``.
(``m``, the row max, and ``log l`` are kept apart, not summed into the log-sum-exp:
:func:`attnlab.kernels.triton_attention._row_stats`.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnlab._derivatives import first_derivatives_only
from attnlab.kernels import _triton
from attnlab.kernels.triton_attention import (
    _allowed,
    _blocks,
    _dot,
    _dot_mode,
    _interior,
    _mask_args,
    _program,
    _range_args,
    _row_stats,
    _rows,
    _span,
    _tile,
    attention_forward,
    band_args,
)


@triton.jit
def _dkdv_blocks(
    dk, dv, k, v, Q, M, KSTART, KEND, DO, LSE, DELTA, b, h, H, offs_n, offs_e, offs_ev, begin,
    end, n0, sqb, sqh, sql, sqe, smb, smh, sml, sms, srb, srl, L, S, E, EV, scale, offset,
    band_lo, band_hi, BAND: tl.constexpr, MASK: tl.constexpr, HAS_RANGE: tl.constexpr,
    DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """dK's and dV's sums over query head h's row blocks [begin, end) for one key block;
    MASKED False for row blocks whose every row sees the whole key block (no mask, no skip
    test: a loop free of branches, which Triton pipelines)."""
    row0 = (b * H + h) * L  # this head's first row, int64
    for start in range(begin, end, BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        row_ok = offs_m < L
        go = True
        if MASKED:
            r_lo, r_hi = _rows(KSTART, KEND, srb, srl, b, offs_m, L, S, HAS_RANGE)
            # a query block whose key ranges miss these keys (padding) adds nothing: skip it
            go = (tl.min(r_lo, 0) < n0 + BLOCK_N) & (tl.max(r_hi, 0) > n0)
        if go:
            q = _tile(Q, b * sqb + h * sqh, offs_m, offs_e, sql, sqe, L, E)  # (BLOCK_M, BLOCK_E)
            s = _dot(q, tl.trans(k), DOT) * scale  # (BLOCK_M, BLOCK_N)
            if MASKED:
                s = _allowed(
                    s, M, b * smb + h * smh, offs_m, offs_n, sml, sms, r_lo, r_hi, offset,
                    band_lo, band_hi, BAND, MASK,
                )  # fmt: skip
            rmax, logl = _row_stats(LSE, row0 + offs_m, row_ok)
            delta = tl.load(DELTA + row0 + offs_m, mask=row_ok, other=0.0)
            p = tl.exp((s - rmax[:, None]) - logl[:, None])  # (BLOCK_M, BLOCK_N), 0: masked, dead
            do = tl.load(
                DO + row0 * EV + offs_m[:, None] * EV + offs_ev[None, :],
                mask=row_ok[:, None] & (offs_ev[None, :] < EV),
                other=0.0,
            )  # (BLOCK_M, BLOCK_EV): dO is made contiguous by the launcher
            dv += _dot(tl.trans(p.to(do.dtype)), do, DOT)
            dp = _dot(do, tl.trans(v), DOT)  # (BLOCK_M, BLOCK_N)
            ds = p * (dp - delta[:, None])
            dk += _dot(tl.trans(ds.to(q.dtype)), q, DOT)
    return dk, dv


@triton.jit
def _dkdv_kernel(
    Q, K, V, M, KSTART, KEND, DO, LSE, DELTA, DK, DV,
    sqb, sqh, sql, sqe, skb, skh, sks, ske, svb, svh, svs, sve, smb, smh, sml, sms, srb, srl,
    H, Hkv, G, L, S, E, EV, scale, offset, band_lo, band_hi,
    BAND: tl.constexpr, MASK: tl.constexpr, HAS_RANGE: tl.constexpr, DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
):  # fmt: skip
    pid_n, bk = _program(tl.cdiv(S, BLOCK_N))  # bk = b * Hkv + hk, int64: base offsets
    b = bk // Hkv
    hk = bk % Hkv
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)
    key_ok = offs_n < S
    k = _tile(K, b * skb + hk * skh, offs_n, offs_e, sks, ske, S, E)  # (BLOCK_N, BLOCK_E)
    v = _tile(V, b * svb + hk * svh, offs_n, offs_ev, svs, sve, S, EV)  # (BLOCK_N, BLOCK_EV)
    dk = tl.zeros([BLOCK_N, BLOCK_E], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_EV], tl.float32)
    n0 = pid_n * BLOCK_N
    first = 0
    end = L
    if BAND:  # rows i that may see a key of [n0, n0 + BLOCK_N): n0 - hi <= i + offset
        first = tl.maximum(n0 - offset - band_hi, 0) // BLOCK_M * BLOCK_M
        end = tl.minimum(n0 + BLOCK_N - 1 - offset - band_lo + 1, L)
    # the query blocks whose every row may see every key of this block need no mask: those of
    # the band's middle, unless ranges differ by row (packed documents) or a mask tensor is read
    n_last = tl.minimum(n0 + BLOCK_N, S) - 1
    # a partial last row block takes the mask: its rows past L read q = 0, and a key holding
    # +inf would give them 0 * inf = NaN scores where the mask gives -inf
    whole = L // BLOCK_M * BLOCK_M  # the row blocks with no row past L end here
    in_first = first
    in_end = whole
    if BAND:  # rows i with i + offset + band_lo <= n0 and n_last <= i + offset + band_hi
        in_first = tl.maximum(tl.cdiv(tl.maximum(n_last - offset - band_hi, 0), BLOCK_M) * BLOCK_M,
                              first)  # fmt: skip
        in_end = tl.minimum(tl.maximum(n0 - offset - band_lo + 1, 0) // BLOCK_M * BLOCK_M, whole)
    if HAS_RANGE:  # ranges per batch row (stride 0 along rows): the block inside, or nothing
        r_lo, r_hi = _rows(KSTART, KEND, srb, srl, b, tl.arange(0, 1), L, S, HAS_RANGE)
        inside = (srl == 0) & (tl.max(r_lo, 0) <= n0) & (n_last < tl.min(r_hi, 0))
        in_end = tl.where(inside, in_end, in_first)
    if MASK != 0:
        in_end = in_first
    empty = in_end <= in_first
    in_first = tl.where(empty, first, in_first)
    in_end = tl.where(empty, first, in_end)
    for h in range(hk * G, hk * G + G):  # h int64, as hk
        for part in tl.static_range(3):  # masked query blocks before the interior, it, after
            dk, dv = _dkdv_blocks(
                dk, dv, k, v, Q, M, KSTART, KEND, DO, LSE, DELTA, b, h, H, offs_n, offs_e,
                offs_ev, first if part == 0 else (in_first if part == 1 else in_end),
                in_first if part == 0 else (in_end if part == 1 else end), n0,
                sqb, sqh, sql, sqe, smb, smh, sml, sms, srb, srl, L, S, E, EV, scale, offset,
                band_lo, band_hi, BAND, MASK, HAS_RANGE, DOT, BLOCK_M, BLOCK_N, part != 1,
            )  # fmt: skip
    n = offs_n[:, None]  # dK, dV contiguous (B, Hkv, S, *)
    tl.store(DK + bk * S * E + n * E + offs_e[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=key_ok[:, None] & (offs_e[None, :] < E))  # fmt: skip
    tl.store(DV + bk * S * EV + n * EV + offs_ev[None, :], dv.to(DV.dtype.element_ty),
             mask=key_ok[:, None] & (offs_ev[None, :] < EV))  # fmt: skip


@triton.jit
def _dq_blocks(
    dq, q, do, rmax, logl, delta, K, V, M, k_base, v_base, m_base, offs_m, offs_e, offs_ev,
    begin, end, sks, ske, svs, sve, sml, sms, r_lo, r_hi, S, E, EV, scale, offset, band_lo, band_hi,
    BAND: tl.constexpr, MASK: tl.constexpr, DOT: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
):  # fmt: skip
    """dQ's sum over the key blocks [begin, end); MASKED False for blocks every row sees whole."""
    for start in range(begin, end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        k = _tile(K, k_base, offs_n, offs_e, sks, ske, S, E)  # (BLOCK_N, BLOCK_E)
        v = _tile(V, v_base, offs_n, offs_ev, svs, sve, S, EV)  # (BLOCK_N, BLOCK_EV)
        s = _dot(q, tl.trans(k), DOT) * scale
        if MASKED:
            s = _allowed(
                s, M, m_base, offs_m, offs_n, sml, sms, r_lo, r_hi, offset, band_lo, band_hi,
                BAND, MASK,
            )  # fmt: skip
        p = tl.exp((s - rmax[:, None]) - logl[:, None])  # (see _row_stats)
        dp = _dot(do, tl.trans(v), DOT)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, DOT)
    return dq


@triton.jit
def _dq_kernel(
    Q, K, V, M, KSTART, KEND, DO, LSE, DELTA, DQ,
    sqb, sqh, sql, sqe, skb, skh, sks, ske, svb, svh, svs, sve, smb, smh, sml, sms, srb, srl,
    H, G, L, S, E, EV, scale, offset, band_lo, band_hi,
    BAND: tl.constexpr, MASK: tl.constexpr, HAS_RANGE: tl.constexpr, DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
):  # fmt: skip
    pid_m, bh = _program(tl.cdiv(L, BLOCK_M))  # bh int64: base offsets
    b = bh // H
    h = bh % H
    hk = h // G
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)
    row_ok = offs_m < L
    q = _tile(Q, b * sqb + h * sqh, offs_m, offs_e, sql, sqe, L, E)  # (BLOCK_M, BLOCK_E)
    do = tl.load(
        DO + bh * L * EV + offs_m[:, None] * EV + offs_ev[None, :],
        mask=row_ok[:, None] & (offs_ev[None, :] < EV),
        other=0.0,
    )
    rmax, logl = _row_stats(LSE, bh * L + offs_m, row_ok)
    delta = tl.load(DELTA + bh * L + offs_m, mask=row_ok, other=0.0)
    r_lo, r_hi = _rows(KSTART, KEND, srb, srl, b, offs_m, L, S, HAS_RANGE)
    last = tl.minimum(pid_m * BLOCK_M + BLOCK_M, L) - 1
    lo, hi = _span(r_lo, r_hi, pid_m * BLOCK_M, last, offset, band_lo, band_hi, BAND)
    dq = tl.zeros([BLOCK_M, BLOCK_E], tl.float32)
    begin, in_lo, in_hi = _interior(
        lo, hi, r_lo, r_hi, offs_m, L, pid_m * BLOCK_M, last, offset, band_lo, band_hi, BAND,
        MASK, BLOCK_N,
    )  # fmt: skip
    for part in tl.static_range(3):  # the masked blocks before the interior, it, those after
        dq = _dq_blocks(
            dq, q, do, rmax, logl, delta, K, V, M, b * skb + hk * skh, b * svb + hk * svh,
            b * smb + h * smh, offs_m, offs_e, offs_ev,
            begin if part == 0 else (in_lo if part == 1 else in_hi),
            in_lo if part == 0 else (in_hi if part == 1 else hi),
            sks, ske, svs, sve, sml, sms, r_lo, r_hi, S, E, EV, scale, offset, band_lo, band_hi,
            BAND, MASK, DOT, BLOCK_N, part != 1,
        )  # fmt: skip
    tl.store(
        DQ + bh * L * E + offs_m[:, None] * E + offs_e[None, :],
        (dq * scale).to(DQ.dtype.element_ty),
        mask=row_ok[:, None] & (offs_e[None, :] < E),
    )


def attention_backward(q, k, v, out, stats, grad_out, mask, alignment, scale, key_range, band):
    """dQ (B, H, L, E), dK (B, Hkv, S, E), dV (B, Hkv, S, Ev) by the two kernels."""
    B, H, L, E = q.shape
    Hkv, S, Ev = k.shape[1], k.shape[2], v.shape[-1]
    do = grad_out.contiguous()
    delta = (do.float() * out.float()).sum(-1)  # (B, H, L)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty(B, Hkv, S, E, device=k.device, dtype=k.dtype)
    dv = torch.empty(B, Hkv, S, Ev, device=v.device, dtype=v.dtype)
    kind, m, ms = _mask_args(mask, q, S)
    has_range, start, end, srb, srl = _range_args(key_range, q)
    has_band, offset, band_lo, band_hi = band_args(alignment, band, L, S)
    BM, BN, BE, BEV, warps, stages = _blocks(E, Ev, q.dtype, "backward")
    common = dict(
        BAND=has_band, MASK=kind, HAS_RANGE=has_range, DOT=_dot_mode(q.dtype),
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_E=BE, BLOCK_EV=BEV, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    strides = (*q.stride(), *k.stride(), *v.stride(), *ms, srb, srl)
    with _triton.on_device(q):
        _dkdv_kernel[(triton.cdiv(S, BN) * B * Hkv,)](
            q, k, v, m, start, end, do, stats, delta, dk, dv, *strides,
            H, Hkv, H // Hkv, L, S, E, Ev, scale, offset, band_lo, band_hi, **common,
        )  # fmt: skip
        _dq_kernel[(triton.cdiv(L, BM) * B * H,)](
            q, k, v, m, start, end, do, stats, delta, dq, *strides,
            H, H // Hkv, L, S, E, Ev, scale, offset, band_lo, band_hi, **common,
        )  # fmt: skip
    return dq, dk, dv


class TritonAttention(torch.autograd.Function):
    """Attention by the Triton kernels, forward and backward: saves Q, K, V, O (float32) and the
    row log-sum-exp (B, H, L) -- never the (B, H, L, S) weights."""

    @staticmethod
    def forward(ctx, q, k, v, mask, alignment, scale, key_range, band=None):
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        # 16-bit inputs: the output is kept in float32 for the backward, whose row term
        # delta = rowsum(dO * O) must cancel against dP where one key takes nearly all the
        # weight; from the rounded output, delta was off by ~2**-9 |dO| |O|, and dQ, dK of such
        # rows by 100-4,000x their own size (the returned output is the same rounding of it)
        out, stats = attention_forward(
            q, k, v, mask, alignment, scale, key_range, band, out_dtype=torch.float32
        )
        ctx.save_for_backward(q, k, v, out, stats)
        ctx.args = (mask, alignment, scale, key_range, band)
        return out.to(q.dtype)

    @staticmethod
    @first_derivatives_only("attnlab's Triton attention kernel")
    def backward(ctx, grad_out):
        q, k, v, out, stats = ctx.saved_tensors
        dq, dk, dv = attention_backward(q, k, v, out, stats, grad_out, *ctx.args)
        return dq, dk, dv, None, None, None, None, None
