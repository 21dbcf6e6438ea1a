"""The backward pass of :mod:`attnlab.kernels.triton_attention`, and the autograd function.

From the forward's output ``O`` and row log-sum-exp ``lse`` (FlashAttention-2's backward,
Dao 2023; Triton's fused-attention tutorial)::

    p_ij    = exp(s_ij - lse_i)                     recomputed tile by tile, never stored
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
whose ranges reach its keys. Rows with no attendable key have ``lse = +inf``: ``p = 0``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from attnlab.kernels import _triton
from attnlab.kernels.triton_attention import (
    _allowed,
    _blocks,
    _dot,
    _dot_mode,
    _mask_args,
    _program,
    _range_args,
    _rows,
    _span,
    attention_forward,
    band_args,
)


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
    k = tl.load(
        K + b * skb + hk * skh + offs_n[:, None] * sks + offs_e[None, :] * ske,
        mask=key_ok[:, None] & (offs_e[None, :] < E),
        other=0.0,
    )  # (BLOCK_N, BLOCK_E)
    v = tl.load(
        V + b * svb + hk * svh + offs_n[:, None] * svs + offs_ev[None, :] * sve,
        mask=key_ok[:, None] & (offs_ev[None, :] < EV),
        other=0.0,
    )  # (BLOCK_N, BLOCK_EV)
    dk = tl.zeros([BLOCK_N, BLOCK_E], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_EV], tl.float32)
    n0 = pid_n * BLOCK_N
    first = 0
    end = L
    if BAND:  # rows i that may see a key of [n0, n0 + BLOCK_N): n0 - hi <= i + offset
        first = tl.maximum(n0 - offset - band_hi, 0) // BLOCK_M * BLOCK_M
        end = tl.minimum(n0 + BLOCK_N - 1 - offset - band_lo + 1, L)
    for h in range(hk * G, hk * G + G):  # h int64, as hk
        for start in range(first, end, BLOCK_M):
            offs_m = start + tl.arange(0, BLOCK_M)
            row_ok = offs_m < L
            r_lo, r_hi = _rows(KSTART, KEND, srb, srl, b, offs_m, L, S, HAS_RANGE)
            # a query block whose key ranges miss these keys (padding) adds nothing: skip it
            if (tl.min(r_lo, 0) < n0 + BLOCK_N) & (tl.max(r_hi, 0) > n0):
                q = tl.load(
                    Q + b * sqb + h * sqh + offs_m[:, None] * sql + offs_e[None, :] * sqe,
                    mask=row_ok[:, None] & (offs_e[None, :] < E),
                    other=0.0,
                )  # (BLOCK_M, BLOCK_E)
                s = _dot(q, tl.trans(k), DOT) * scale  # (BLOCK_M, BLOCK_N)
                s = _allowed(
                    s, M, b * smb + h * smh, offs_m, offs_n, sml, sms, r_lo, r_hi, offset, band_lo,
                    band_hi, BAND, MASK,
                )  # fmt: skip
                row0 = (b * H + h) * L  # this head's first row, int64
                lse = tl.load(LSE + row0 + offs_m, mask=row_ok, other=float("inf"))
                delta = tl.load(DELTA + row0 + offs_m, mask=row_ok, other=0.0)
                p = tl.exp(s - lse[:, None])  # (BLOCK_M, BLOCK_N), 0 where masked or dead
                do = tl.load(
                    DO + row0 * EV + offs_m[:, None] * EV + offs_ev[None, :],
                    mask=row_ok[:, None] & (offs_ev[None, :] < EV),
                    other=0.0,
                )  # (BLOCK_M, BLOCK_EV): dO is made contiguous by the launcher
                dv += _dot(tl.trans(p.to(do.dtype)), do, DOT)
                dp = _dot(do, tl.trans(v), DOT)  # (BLOCK_M, BLOCK_N)
                ds = p * (dp - delta[:, None])
                dk += _dot(tl.trans(ds.to(q.dtype)), q, DOT)
    n = offs_n[:, None]  # dK, dV contiguous (B, Hkv, S, *)
    tl.store(DK + bk * S * E + n * E + offs_e[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=key_ok[:, None] & (offs_e[None, :] < E))  # fmt: skip
    tl.store(DV + bk * S * EV + n * EV + offs_ev[None, :], dv.to(DV.dtype.element_ty),
             mask=key_ok[:, None] & (offs_ev[None, :] < EV))  # fmt: skip


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
    q = tl.load(
        Q + b * sqb + h * sqh + offs_m[:, None] * sql + offs_e[None, :] * sqe,
        mask=row_ok[:, None] & (offs_e[None, :] < E),
        other=0.0,
    )
    do = tl.load(
        DO + bh * L * EV + offs_m[:, None] * EV + offs_ev[None, :],
        mask=row_ok[:, None] & (offs_ev[None, :] < EV),
        other=0.0,
    )
    lse = tl.load(LSE + bh * L + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + bh * L + offs_m, mask=row_ok, other=0.0)
    r_lo, r_hi = _rows(KSTART, KEND, srb, srl, b, offs_m, L, S, HAS_RANGE)
    last = tl.minimum(pid_m * BLOCK_M + BLOCK_M, L) - 1
    lo, hi = _span(r_lo, r_hi, pid_m * BLOCK_M, last, offset, band_lo, band_hi, BAND)
    dq = tl.zeros([BLOCK_M, BLOCK_E], tl.float32)
    for start in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        k = tl.load(
            K + b * skb + hk * skh + offs_n[:, None] * sks + offs_e[None, :] * ske,
            mask=(offs_n[:, None] < S) & (offs_e[None, :] < E),
            other=0.0,
        )  # (BLOCK_N, BLOCK_E)
        v = tl.load(
            V + b * svb + hk * svh + offs_n[:, None] * svs + offs_ev[None, :] * sve,
            mask=(offs_n[:, None] < S) & (offs_ev[None, :] < EV),
            other=0.0,
        )
        s = _dot(q, tl.trans(k), DOT) * scale
        s = _allowed(
            s, M, b * smb + h * smh, offs_m, offs_n, sml, sms, r_lo, r_hi, offset, band_lo,
            band_hi, BAND, MASK,
        )  # fmt: skip
        p = tl.exp(s - lse[:, None])
        dp = _dot(do, tl.trans(v), DOT)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, DOT)
    tl.store(
        DQ + bh * L * E + offs_m[:, None] * E + offs_e[None, :],
        (dq * scale).to(DQ.dtype.element_ty),
        mask=row_ok[:, None] & (offs_e[None, :] < E),
    )


def attention_backward(q, k, v, out, lse, grad_out, mask, alignment, scale, key_range, band):
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
            q, k, v, m, start, end, do, lse, delta, dk, dv, *strides,
            H, Hkv, H // Hkv, L, S, E, Ev, scale, offset, band_lo, band_hi, **common,
        )  # fmt: skip
        _dq_kernel[(triton.cdiv(L, BM) * B * H,)](
            q, k, v, m, start, end, do, lse, delta, dq, *strides,
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
        out, lse = attention_forward(
            q, k, v, mask, alignment, scale, key_range, band, out_dtype=torch.float32
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (mask, alignment, scale, key_range, band)
        return out.to(q.dtype)

    @staticmethod
    @once_differentiable  # the kernels' gradients carry no graph: a second derivative raises
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(q, k, v, out, lse, grad_out, *ctx.args)
        return dq, dk, dv, None, None, None, None, None
