"""A Triton decode-attention kernel: a few new query rows against a long KV cache (Flash-Decoding).

At decode time L is 1 (or a few rows, for speculative steps) and S is the whole cache: one
program per (batch, head) would leave most of a GPU idle and read the cache serially. So the
keys are split into chunks, each chunk reduced by its own program, and the partial results
merged with their log-sum-exp (Dao et al., "Flash-Decoding for long-context inference", 2023)::

    split c:  m_c = max_j s_ij,  l_c = sum_j exp(s_ij - m_c),  a_c = sum_j exp(s_ij - m_c) v_j
    merge:    m = max_c m_c,  l = sum_c l_c exp(m_c - m),  o = sum_c a_c exp(m_c - m) / l

GQA-aware: one program serves the G query heads of a kv group together: their G * L rows are
stacked into one (G*L, E) tile, so each key block is read once for the whole group::

    rows r = 0 .. G*L-1  ->  query head hk*G + r // L, query row r % L;  kv head hk

Which keys a row may attend: as in :mod:`attnlab.kernels.triton_attention` -- key ranges (the
cache's filled part, or padding, per batch row; or per query row), a band (bottom-right
causal: the cache holds the past; a sliding window), a bool mask (True = may attend) or a
float bias read through its strides. A row with no key gets output 0 (and weights 0).

Weights at decode are one row per head: when asked, the kernel also writes the raw scores
(B, H, L, S) in fp32, and the merge (``_merge_kernel``, one launch: the torch ops it replaced
were ~15 launches, ~0.35 ms of host time a call on an H100) writes the output and the weights
``exp(s - max) / sum``. This serves cache-eviction methods (H2O, SnapKV) that need them.

The readable reference is :func:`attnlab.kernels.triton_attention.reference` (the same math);
the oracle is :func:`attnlab.reference.scaled_dot_product_attention`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from attnlab.kernels import _triton
from attnlab.kernels._triton import INTERPRET
from attnlab.kernels.triton_attention import (
    _blocks,
    _dot,
    _dot_mode,
    _mask_args,
    _program,
    _range_args,
    band_args,
)

MAX_ROWS = 64  # G * L rows in one tile; more: the prefill kernel serves


@triton.jit
def _decode_kernel(
    Q, K, V, M, KSTART, KEND, ACC, MAX, SUM, SC,
    sqb, sqh, sql, sqe, skb, skh, sks, ske, svb, svh, svs, sve, smb, smh, sml, sms, srb, srl,
    H, Hkv, G, L, S, E, EV, scale, offset, band_lo, band_hi, chunk, NSPLIT,
    BAND: tl.constexpr, MASK: tl.constexpr, HAS_RANGE: tl.constexpr, SCORES: tl.constexpr,
    DOT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
):  # fmt: skip
    split, bk = _program(NSPLIT)  # bk = b * Hkv + hk, int64: base offsets
    b = bk // Hkv
    hk = bk % Hkv
    offs_r = tl.arange(0, BLOCK_R)
    R = G * L
    row_ok = offs_r < R
    h = hk * G + offs_r // L  # (BLOCK_R,) int64: query head of each row
    i = offs_r % L  # (BLOCK_R,) query position of each row
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)
    q = tl.load(
        Q + b * sqb + h[:, None] * sqh + i[:, None] * sql + offs_e[None, :] * sqe,
        mask=row_ok[:, None] & (offs_e[None, :] < E),
        other=0.0,
    )  # (BLOCK_R, BLOCK_E)
    if HAS_RANGE:  # each row's key range [r_lo, r_hi)
        r_lo = tl.load(KSTART + b * srb + i * srl, mask=row_ok, other=S)
        r_hi = tl.minimum(tl.load(KEND + b * srb + i * srl, mask=row_ok, other=0), S)
    else:
        r_lo = tl.where(row_ok, 0, S)
        r_hi = tl.where(row_ok, S, 0)
    lo = tl.maximum(split * chunk, tl.min(r_lo, 0))
    hi = tl.minimum(tl.minimum(split * chunk + chunk, S), tl.max(r_hi, 0))
    if BAND:  # rows i = 0 .. L-1: keys [offset + band_lo, L - 1 + offset + band_hi]
        lo = tl.maximum(lo, offset + band_lo)
        hi = tl.minimum(hi, L + offset + band_hi)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_EV], tl.float32)
    for start in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        k = tl.load(
            K + b * skb + hk * skh + offs_n[None, :] * sks + offs_e[:, None] * ske,
            mask=(offs_n[None, :] < S) & (offs_e[:, None] < E),
            other=0.0,
        )  # (BLOCK_E, BLOCK_N)
        s = _dot(q, k, DOT) * scale  # (BLOCK_R, BLOCK_N)
        ok = (offs_n[None, :] >= r_lo[:, None]) & (offs_n[None, :] < r_hi[:, None])
        if BAND:
            d = offs_n[None, :] - (i[:, None] + offset)
            ok = ok & (d >= band_lo) & (d <= band_hi)
        if MASK != 0:
            at = M + b * smb + h[:, None] * smh + i[:, None] * sml + offs_n[None, :] * sms
            if MASK == 1:
                ok = ok & (tl.load(at, mask=ok, other=0) != 0)
            else:
                s = s + tl.load(at, mask=ok, other=0.0).to(tl.float32)
        s = tl.where(ok, s, float("-inf"))
        if SCORES:
            tl.store(
                SC + ((b * H + h[:, None]) * L + i[:, None]) * S + offs_n[None, :],
                s,
                mask=row_ok[:, None] & (offs_n[None, :] >= lo) & (offs_n[None, :] < hi),
            )
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V + b * svb + hk * svh + offs_n[:, None] * svs + offs_ev[None, :] * sve,
            mask=(offs_n[:, None] < S) & (offs_ev[None, :] < EV),
            other=0.0,
        )
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT)
        m_i = m_new
    part = (bk * NSPLIT + split) * R  # (B, Hkv, NSPLIT, R) partials: this program's first row
    tl.store(MAX + part + offs_r, m_i, mask=row_ok)
    tl.store(SUM + part + offs_r, l_i, mask=row_ok)
    tl.store(
        ACC + part * EV + offs_r[:, None] * EV + offs_ev[None, :],
        acc,
        mask=row_ok[:, None] & (offs_ev[None, :] < EV),
    )


@triton.jit
def _merge_kernel(
    ACC, MAX, SUM, SC, OUT, W, H, Hkv, G, L, S, EV, NSPLIT, NBLOCKS,
    WEIGHTS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_EV: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """The splits of one (batch row, kv head) merged: program (j, bk) writes the weights of
    key block j (with ``WEIGHTS``) from the raw scores, and for j = 0 the output rows."""
    sblock, bk = _program(NBLOCKS)  # bk = b * Hkv + hk, int64
    b = bk // Hkv
    hk = bk % Hkv
    R = G * L
    offs_r = tl.arange(0, BLOCK_R)
    row_ok = offs_r < R
    offs_p = tl.arange(0, BLOCK_P)
    part = (bk * NSPLIT + offs_p[:, None]) * R + offs_r[None, :]  # (BLOCK_P, BLOCK_R)
    ok = (offs_p[:, None] < NSPLIT) & row_ok[None, :]
    mx = tl.load(MAX + part, mask=ok, other=float("-inf"))
    top = tl.max(mx, 0)  # (BLOCK_R,): the rows' maxima over all splits
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.load(SUM + part, mask=ok, other=0.0) * tl.exp(mx - top[None, :]), 0)
    h = hk * G + offs_r // L  # (BLOCK_R,) query head and position of each row
    i = offs_r % L
    dead = total == 0  # no key (NaN stays NaN: it is not 0)
    if sblock == 0:
        offs_ev = tl.arange(0, BLOCK_EV)
        ev_ok = row_ok[:, None] & (offs_ev[None, :] < EV)
        out = tl.zeros([BLOCK_R, BLOCK_EV], tl.float32)
        for p in range(0, NSPLIT):
            first = (bk * NSPLIT + p) * R  # this split's rows
            m_p = tl.load(MAX + first + offs_r, mask=row_ok, other=float("-inf"))
            a = tl.load(
                ACC + (first + offs_r[:, None]) * EV + offs_ev[None, :], mask=ev_ok, other=0.0
            )
            out += a * tl.exp(m_p - top)[:, None]
        out = tl.where(dead[:, None], 0.0, out / tl.where(dead, 1.0, total)[:, None])
        at = ((b * H + h[:, None]) * L + i[:, None]) * EV + offs_ev[None, :]
        tl.store(OUT + at, out.to(OUT.dtype.element_ty), mask=ev_ok)
    if WEIGHTS:  # exp(s - top) / total, not exp(s - lse): a row whose scores a huge bias
        # absorbed (finfo.min on every key) has top + log(total) == top, which gave weights 1
        inv = 1.0 / tl.where(dead, 1.0, total)
        offs_s = sblock * BLOCK_S + tl.arange(0, BLOCK_S)
        at = ((b * H + h[:, None]) * L + i[:, None]) * S + offs_s[None, :]
        s_ok = row_ok[:, None] & (offs_s[None, :] < S)
        sc = tl.load(SC + at, mask=s_ok, other=float("-inf"))
        w = tl.where(dead[:, None], 0.0, tl.exp(sc - top[:, None]) * inv[:, None])
        tl.store(W + at, w.to(W.dtype.element_ty), mask=s_ok)


MERGE_BLOCK_S = 256  # keys per program of the weights' merge


def _splits(B: int, Hkv: int, S: int, block_n: int, device: torch.device) -> int:
    """How many chunks the keys are cut into: enough programs to fill the device (about two
    per streaming multiprocessor), never a chunk smaller than one key block."""
    if INTERPRET:
        return min(3, triton.cdiv(S, block_n))  # several splits, so tests cross the merge
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = triton.cdiv(2 * sms, B * Hkv)
    return max(1, min(wanted, triton.cdiv(S, block_n)))


def supports(q, k, v, mask) -> str | None:
    """None when the decode kernel takes these inputs, else why not."""
    G = q.shape[1] // k.shape[1]
    if G * q.shape[2] > MAX_ROWS:
        return f"G * L = {G * q.shape[2]} query rows per kv head > {MAX_ROWS} (not a decode step)"
    return None


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    alignment: str | None = "bottom_right",
    scale: float | None = None,
    key_range: tuple[torch.Tensor, torch.Tensor] | None = None,
    return_weights: bool | str = False,
    band: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, H, L, E) queries against a (B, Hkv, S, E) cache -> out (B, H, L, Ev), weights.

    ``weights``: None unless asked; (B, H, L, S) per head or (B, 1, L, S) with ``"average"``.
    Arguments as :func:`attnlab.kernels.triton_attention.attention_forward`; ``alignment``
    is ``"bottom_right"`` (the new rows are the last ones) or None.
    """
    B, H, L, E = q.shape
    Hkv, S, Ev = k.shape[1], k.shape[2], v.shape[-1]
    G = H // Hkv
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    BR = max(16, triton.next_power_of_2(G * L))
    _, BN, BE, BEV, warps, stages = _blocks(E, Ev, q.dtype, "decode")
    nsplit = _splits(B, Hkv, S, BN, q.device)
    chunk = triton.cdiv(triton.cdiv(S, nsplit), BN) * BN
    nsplit = triton.cdiv(S, chunk)
    f32 = dict(device=q.device, dtype=torch.float32)
    acc = torch.empty(B, Hkv, nsplit, G * L, Ev, **f32)
    mx = torch.empty(B, Hkv, nsplit, G * L, **f32)
    sm = torch.empty(B, Hkv, nsplit, G * L, **f32)
    scores = torch.full((B, H, L, S), float("-inf"), **f32) if return_weights else mx
    kind, m, ms = _mask_args(mask, q, S)
    has_range, start, end, srb, srl = _range_args(key_range, q)
    has_band, offset, band_lo, band_hi = band_args(alignment, band, L, S)
    with _triton.on_device(q):
        _decode_kernel[(nsplit * B * Hkv,)](
            q, k, v, m, start, end, acc, mx, sm, scores,
            *q.stride(), *k.stride(), *v.stride(), *ms, srb, srl,
            H, Hkv, G, L, S, E, Ev, scale, offset, band_lo, band_hi, chunk, nsplit,
            BAND=has_band, MASK=kind, HAS_RANGE=has_range,
            SCORES=bool(return_weights), DOT=_dot_mode(q.dtype),
            BLOCK_R=BR, BLOCK_N=BN, BLOCK_E=BE, BLOCK_EV=BEV, num_warps=warps, num_stages=stages,
        )  # fmt: skip
    # merge the splits by their log-sum-exp (the readable form: merge_splits)
    out = torch.empty(B, H, L, Ev, device=q.device, dtype=q.dtype)
    each = return_weights and return_weights != "average"
    # per head: the weights in q's dtype; averaged: in place of the fp32 scores, then the mean
    weights = torch.empty(B, H, L, S, device=q.device, dtype=q.dtype) if each else scores
    blocks = triton.cdiv(S, MERGE_BLOCK_S) if return_weights else 1
    with _triton.on_device(q):
        _merge_kernel[(blocks * B * Hkv,)](
            acc, mx, sm, scores, out, weights, H, Hkv, G, L, S, Ev, nsplit, blocks,
            WEIGHTS=bool(return_weights), BLOCK_R=BR, BLOCK_P=triton.next_power_of_2(nsplit),
            BLOCK_EV=BEV, BLOCK_S=MERGE_BLOCK_S,
        )  # fmt: skip
    if not return_weights:
        return out, None
    if return_weights == "average":
        return out, weights.mean(1, keepdim=True).to(q.dtype)
    return out, weights


def merge_splits(acc, mx, sm, scores, H: int, L: int, dtype: torch.dtype, return_weights=False):
    """The readable merge ``_merge_kernel`` must equal: partials (B, Hkv, nsplit, G*L, Ev),
    maxima and sums (B, Hkv, nsplit, G*L), raw scores (B, H, L, S) -> out, weights."""
    B, Hkv, _, R, Ev = acc.shape
    top = mx.amax(2, keepdim=True)
    top = top.masked_fill(top == float("-inf"), 0.0)
    rescale = torch.exp(mx - top)  # 0 for a split that saw no key
    total = (sm * rescale).sum(2)  # (B, Hkv, G*L)
    out = (acc * rescale[..., None]).sum(2) / total.clamp_min(1e-38)[..., None]
    out = out.masked_fill((total == 0)[..., None], 0.0)
    out = out.view(B, Hkv, R // L, L, Ev).reshape(B, H, L, Ev).to(dtype)
    if not return_weights:
        return out, None
    # exp(s - top) / total: top + log(total) would round log(total) away in a row whose scores
    # a huge bias absorbed (weights 1, not 1 / S); a row with no key: total 0 -> weights 0
    top, total = top.squeeze(2).view(B, H, L, 1), total.view(B, H, L, 1)
    weights = torch.exp(scores - top) / total.masked_fill(total == 0, float("inf"))
    if return_weights == "average":
        weights = weights.mean(1, keepdim=True)
    return out, weights.to(dtype)
