"""Fused additive (Bahdanau) attention in Triton: forward and backward, tiled over (L, S).

Math (per batch row; ``a = W_q q + bias`` (L, A) and ``b = W_k k`` (S, A) come from torch GEMMs)::

    t_ijk = tanh(a_ik + b_jk)        s_ij = sum_k w_k t_ijk        (+ mask: -inf, or a float bias)
    lse_i = log sum_j exp(s_ij)      P = exp(s - lse)               O = P V

    backward, with D_i = sum_e dO_ie O_ie (= sum_j P_ij dP_ij):
    dV = P^T dO      dP = dO V^T      dS = P * (dP - D)
    da_ik = sum_j dS_ij w_k (1 - t_ijk^2)     db_jk = sum_i dS_ij w_k (1 - t_ijk^2)
    dw_k  = sum_ij dS_ij t_ijk

Nothing of size (B, L, S, A) is ever formed. The forward keeps the row log-sum-exp ``lse``
(B, L) and the output; in training it also keeps the masked (B, L, S) scores in float32 when they
take at most :data:`STORED_SCORES_BYTES` (32 MiB at B=8, L=S=1024), as the chunked CPU path does.
Past that the backward recomputes each tile's scores.

Cost. Unlike dot-product attention this is not a matrix multiply: every (i, j, k) costs one tanh, a
few adds and one multiply-add, so the bound is the GPU's special-function units (SFU). Here
``tanh(x) = 1 - 2 r`` with ``r = 1 / (exp2(2 log2(e) x) + 1)``: one ``exp2`` and one reciprocal, two
SFU operations (Triton has no portable ``tanh``; this form also runs in the interpreter), and the
backward's slope ``1 - tanh^2 = 4 e r^2`` (``e`` the exp2) costs two multiplies, no SFU. In bfloat16
on CUDA it is the SFU's own ``tanh.approx.f32``, one operation (:data:`HARDWARE_TANH_ON`). ``a`` and
``b`` are stored pre-scaled by ``2 log2(e)``, so the argument is one add. The forward evaluates B L
S A tanh, the backward B L S A for the gradients, and B L S A more to rebuild the scores where they
were not kept; about half of each when causal. P V, dO V^T and P^T dO are ``tl.dot`` s, a small
share of the time (at A = Dv they are 3 of the ~9 B L S A-sized operations of the backward).

Bound: an H100 SXM has 132 SMs x 16 SFU results per clock (compute capability 9.0) x ~1.98 GHz =
4.2e12 SFU operations/s, so 2.1e12 tanh/s with two operations per tanh: at B=8, L=S=1024, A=256
the 2 B L S A = 4.3e9 tanh of forward + backward take >= 2.0 ms (3.1 ms with the scores rebuilt;
1.0 ms at one operation per tanh, bfloat16).

Tiling::

                       keys  j0 ........ j0+BLOCK_S            aT (B, A, L), bT (B, A, S): the
    forward program ->  rows  [ s tile, fp32 registers ]        column k of a tile is one
    (one BLOCK_L row   i0     for k in 0..A-1:                  contiguous load of each
     block, all keys) ...       s += w_k tanh(aT[k, rows] +     (a "rank-1 tanh" update of the
                                              bT[k, cols])       whole tile, no reduction)

* **Forward**: a program owns ``BLOCK_L`` query rows of one batch row and walks the key blocks
  with an online softmax (running max ``m``, sum ``l`` and output ``acc`` (BLOCK_L, Dv) in
  registers), as Triton's fused-attention tutorial. The score tile is built by a loop over the
  A columns, one tanh plane per column. Causal rows stop at their last visible key block.
* **Backward**: a program owns ``BLOCK_S`` keys of one batch row and walks the query blocks that can
  see them (FlashAttention-2's order). Per tile: pass 1 loads the kept ``s`` (or rebuilds it over
  A), then ``P`` from ``lse``; ``dP = dO V^T`` and ``dV += P^T dO`` walk Dv in chunks of
  ``BACKWARD_VALUE_CHUNK`` columns (few registers for any Dv), then ``dS``. Pass 2 over A recomputes
  ``t`` and reduces ``g = dS w_k (1 - t^2)`` along both axes, and ``dS t`` to one number. ``db``,
  ``dV`` (float32) and the program's row of ``dw`` partials belong to this program alone; ``da``
  rows are shared by every key block, so they are added with atomics, and each program starts its
  walk at a different query block (rotated by its key block) so that concurrent programs rarely add
  to the same rows. The alternatives cost more tanh: a second kernel per query block for ``da`` (a
  fourth pass), or storing ``dS`` (B, L, S). Atomics make the float32 summation order, not the
  result, vary between runs. ``db``, ``dV`` and ``dw`` are added with (relaxed) atomics too, without
  contention: a program only revisits its own addresses, and an atomic read-modify-write needs no
  barrier between the threads of a program (a plain load-add-store would).

Dtypes: ``a``, ``b``, ``w``, the scores, softmax statistics and accumulators are float32; V, the
output and dO stay in the inputs' dtype (float32, bfloat16, float16), and P is cast to it for the
products. Float32 products run as three TF32 products on CUDA (``tf32x3``: float32 accuracy on
tensor cores; a single TF32 product would miss float32 tolerances, and IEEE products on the FMA
units spilled registers), exactly in float32 in the interpreter.

A row with no attendable key (mask or causal) gets ``lse = +inf``: P = 0, output 0, gradients 0.
(The forward keeps ``lse`` as the row max and the log of the sum, apart: see
:func:`attnlab.kernels.triton_attention._row_stats`.)

The readable spec of the same computation is :func:`reference` below (it materialises the
(N, L, S, A) tanh: small inputs only), itself tested against the float64 NumPy oracle
:func:`attnlab.reference.additive_attention`. Tile sizes are :data:`TILINGS`, to be measured
with ``benchmarks/bench_gpu_additive.py --sweep``.

References: Bahdanau, Cho, Bengio, ICLR 2015 (the score); Dao, "FlashAttention-2", 2023 (the
tiling and the backward's order).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attnlab._checks import broadcast_shapes
from attnlab._derivatives import first_derivatives_only
from attnlab.kernels import _triton
from attnlab.kernels.triton_attention import _program, _row_stats, _store_row_stats

TWO_LOG2E = 2.0 / math.log(2.0)  # tanh(x) = 1 - 2 / (exp2(TWO_LOG2E * x) + 1)
EXP2_CAP = tl.constexpr(64.0)  # exp2's argument is capped (tanh is 1.0 in float32 from 26 on)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_VALUE_DIM = 256  # the forward's output tile (BLOCK_L, Dv) lives in registers
# Training keeps the forward's (N, L, S) float32 scores for the backward up to this size: one
# tanh pass of three saved (the chunked CPU path keeps them too); past it they are recomputed
STORED_SCORES_BYTES = 256 * 2**20
# Dtypes whose tanh is the SFU's tanh.approx.f32 (relative error <= ~2^-11, below bfloat16's
# rounding of 2^-9, not float32's). The interpreter cannot run PTX: there the instruction alone
# is emulated (by exp2 and a reciprocal, from the same x), so that the path around it (the
# argument's scale, the slope 1 - t^2) is what the tests check. Compiled for sm_90
# (benchmarks/gpu_compile.py), the forward's loop over A takes 45 instructions per step instead
# of 75 and the backward's gradient loop 478 instead of 735, one MUFU operation per tanh instead
# of two. Untimed on a GPU so far: bench_gpu_additive.py times both tanh and gpu_check.py checks
# both against float64.
HARDWARE_TANH_ON: tuple = (torch.bfloat16,)
HALF_LN2 = tl.constexpr(math.log(2.0) / 2)  # x from x2 = 2 log2(e) x
INTERPRETED = tl.constexpr(_triton.INTERPRET)
TWO_LOG2E_JIT = tl.constexpr(TWO_LOG2E)


@dataclass(frozen=True)
class Blocks:
    """Tile sizes: query rows and keys per tile (powers of two >= 16, for ``tl.dot``), warps."""

    rows: int
    keys: int
    warps: int


@dataclass(frozen=True)
class Tiling:
    """The forward's and the backward's tiles (their register needs differ)."""

    forward: Blocks
    backward: Blocks


# CUDA: compiled ahead of time for sm_90 (Triton 3.9's ptxas), float32 and bfloat16, Dv = 256,
# every mask kind, then timed on an H200 (``bench_gpu_additive.py --sweep``, 2026-11-26, B=8,
# L=S=1024, D=A=256; benchmarks/results/h200-2026-11-26b). The forward: 32 or 64 rows; its output
# tile (rows, Dv) is why wide values (Dv > WIDE_VALUE) get 32 rows; the tiles timed within the
# run's noise of each other. The backward walks Dv in chunks of BACKWARD_VALUE_CHUNK; 128 x 32
# with 4 warps was the fastest of 20 tilings in both dtypes (forward+backward: bfloat16 7.9 ms
# against 15.9 at the 64 x 64 x 8 before it; float32 11.4 against 18.5), although in float32 it
# spills registers (~850 B of stores per thread with Triton 3.6 and 3.9), as
# every float32 tiling of 128 rows does; the tiles that spill nothing were 1.5-2.5x slower.
# The interpreter: the smallest tiles, so that small test shapes span several tiles.
WIDE_VALUE = 64
BACKWARD_VALUE_CHUNK = 16
TILINGS = {
    "cuda": Tiling(Blocks(64, 32, 4), Blocks(128, 32, 4)),
    "cuda, wide values": Tiling(Blocks(32, 32, 8), Blocks(128, 32, 4)),
    "interpreter": Tiling(Blocks(16, 16, 1), Blocks(16, 16, 1)),
}
# (so its float32 backward is in attnlab.kernels._triton.SPILLS_TIMED: a tile allowed to spill)


def tiling_for(value_dim: int) -> Tiling:
    """The tiles of a call: the interpreter's whenever it runs the kernels (CPU tensors, or CUDA
    tensors under ``TRITON_INTERPRET=1``), else CUDA's for values this wide."""
    if _triton.INTERPRET:
        return TILINGS["interpreter"]
    return TILINGS["cuda, wide values"] if value_dim > WIDE_VALUE else TILINGS["cuda"]


# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _hardware_tanh(x2):
    """tanh(x) from x2 = 2 log2(e) x by the SFU's tanh.approx.f32 (CUDA, sm_75 on; emulated in
    the interpreter, which cannot run PTX)."""
    x = x2 * HALF_LN2
    if INTERPRETED:  # tanh(x) from x itself (a wrong HALF_LN2 fails the tests)
        return _exp2_tanh(x * TWO_LOG2E_JIT)
    return tl.inline_asm_elementwise(
        "tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def _tanh(x2, HW: tl.constexpr):
    """tanh(x) from x2 = 2 log2(e) x: one exp2 and one reciprocal (two SFU operations); HW:
    :func:`_hardware_tanh` (one)."""
    if HW:
        return _hardware_tanh(x2)
    return _exp2_tanh(x2)


@triton.jit
def _exp2_tanh(x2):
    """tanh(x) = 1 - 2 / (exp2(x2) + 1), x2 = 2 log2(e) x."""
    r = 1.0 / (tl.exp2(tl.minimum(x2, EXP2_CAP, propagate_nan=tl.PropagateNan.ALL)) + 1.0)
    return 1.0 - 2.0 * r


@triton.jit
def _tanh_and_slope(x2, HW: tl.constexpr):
    """tanh(x) and 1 - tanh(x)^2 from x2 = 2 log2(e) x.

    With e = exp2(x2) and r = 1 / (e + 1): tanh = 1 - 2r and 1 - tanh^2 = 4 e r^2, a product
    accurate to a few ulps even where it is tiny (1 - t*t would cancel there). HW: t from
    :func:`_hardware_tanh` and 1 - t*t (absolute error ~1e-3 where t nears 1: 16-bit values).
    """
    if HW:
        t = _hardware_tanh(x2)
        return t, 1.0 - t * t
    e = tl.exp2(tl.minimum(x2, EXP2_CAP, propagate_nan=tl.PropagateNan.ALL))
    r = 1.0 / (e + 1.0)
    return 1.0 - 2.0 * r, 4.0 * (e * r) * r


@triton.jit
def _dot(x, y, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    """x @ y, float32 accumulation. PRECISION applies to float32 operands ("tf32x3" on CUDA:
    three TF32 products, float32 accuracy on tensor cores). WIDEN: float32 operands (exact for
    16-bit inputs), set for bfloat16 in the interpreter, whose ``tl.dot`` multiplies bfloat16's
    raw bits (Triton 3.9)."""
    if WIDEN:
        x, y = x.to(tl.float32), y.to(tl.float32)
    return tl.dot(x, y, input_precision=PRECISION)


@triton.jit
def _score_tile(
    a_ptr, b_ptr, w_ptr, rows, cols, L, S, A,
    BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    """s[i, j] = sum_k w_k tanh(a_ik + b_jk) for one tile; a_ptr (A, L), b_ptr (A, S)."""
    s = tl.zeros((BLOCK_L, BLOCK_S), dtype=tl.float32)
    for k in range(0, A):
        a_k = tl.load(a_ptr + k * L + rows, mask=rows < L, other=0.0)  # (BLOCK_L,)
        b_k = tl.load(b_ptr + k * S + cols, mask=cols < S, other=0.0)  # (BLOCK_S,)
        s += tl.load(w_ptr + k) * _tanh(a_k[:, None] + b_k[None, :], HW)
    return s


@triton.jit
def _visible(
    s, m_ptr, rows, cols, L, S, offset, smn, sml, sms,
    MASK: tl.constexpr, CAUSAL: tl.constexpr,
):  # fmt: skip
    """The scores with the mask applied: -inf where a key may not be attended (or is padding).

    MASK: 0 none, 1 bool (stored as uint8, nonzero = may attend), 2 float (added).
    CAUSAL: key j is visible to row i iff j <= i + offset (0 top-left, S - L bottom-right).
    A NaN or +inf score stays where the mask forbids its key, as under a -inf bias (NaN + -inf
    and inf - inf are NaN): its row is NaN, not dead (a NaN in W_q, W_k or w reaches every
    score), as on the chunked path.
    """
    inside = (rows[:, None] < L) & (cols[None, :] < S)
    ok = inside
    if CAUSAL:
        ok = ok & (cols[None, :] <= rows[:, None] + offset)
    if MASK != 0:
        m = tl.load(m_ptr + rows[:, None] * sml + cols[None, :] * sms, mask=ok, other=0)
        if MASK == 1:
            ok = ok & (m != 0)
        else:
            s = s + m.to(tl.float32)
    return tl.where(ok | (inside & ((s != s) | (s == float("inf")))), s, float("-inf"))


@triton.jit
def _fwd_kernel(
    AT, BT, W, V, M, O, LSE, SC, SKIP,
    L, S, A, DV, offset,
    svn, svs, svd, smn, sml, sms,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr,
    STORE: tl.constexpr, HW: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    pid_l, n = _program(tl.cdiv(L, BLOCK_L))  # n int64: base offsets
    i0 = pid_l * BLOCK_L
    rows = i0 + tl.arange(0, BLOCK_L)
    dv = tl.arange(0, BLOCK_DV)
    a_ptr, b_ptr = AT + n * A * L, BT + n * A * S
    v_ptr, m_ptr = V + n * svn, M + n * smn

    m_i = tl.full((BLOCK_L,), float("-inf"), dtype=tl.float32)  # running row max
    l_i = tl.zeros((BLOCK_L,), dtype=tl.float32)  # running sum of exp(s - m_i)
    acc = tl.zeros((BLOCK_L, BLOCK_DV), dtype=tl.float32)  # running sum of exp(s - m_i) v_j
    hi = S
    if CAUSAL:  # the block's last row sees keys up to i0 + BLOCK_L - 1 + offset
        # (SKIP 0: a, b or w holds a NaN or inf, which may put a NaN or +inf score where
        # causality forbids its key: every tile is visited, so that the row turns NaN)
        hi = tl.where(tl.load(SKIP) != 0, tl.maximum(0, tl.minimum(S, i0 + BLOCK_L + offset)), S)
    for j0 in range(0, hi, BLOCK_S):
        cols = j0 + tl.arange(0, BLOCK_S)
        s = _score_tile(a_ptr, b_ptr, W, rows, cols, L, S, A, BLOCK_L, BLOCK_S, HW)
        s = _visible(s, m_ptr, rows, cols, L, S, offset, smn, sml, sms, MASK, CAUSAL)
        if STORE:  # the masked scores, kept for the backward (SC: (N, L, S) float32)
            inside = (rows[:, None] < L) & (cols[None, :] < S)
            tl.store(SC + n * L * S + rows[:, None] * S + cols[None, :], s, mask=inside)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row seeing nothing yet: p = 0
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])  # (BLOCK_L, BLOCK_S)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + cols[:, None] * svs + dv[None, :] * svd,
            mask=(cols[:, None] < S) & (dv[None, :] < DV),
            other=0.0,
        )  # (BLOCK_S, BLOCK_DV)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, WIDEN)
        m_i = m_new

    alive = (l_i > 0) | (l_i != l_i)  # dead rows (no attendable key): output 0, lse = +inf;
    l_safe = tl.where(alive, l_i, 1.0)  # a NaN row stays NaN (lse too: its gradients are NaN)
    out = acc / l_safe[:, None]
    row_ok = rows < L
    o_ptrs = O + n * L * DV + rows[:, None] * DV + dv[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < DV))
    # the row max and the log of the sum apart (_row_stats): m + log(l) rounds log(l) away in
    # a row a huge bias covers entirely (finfo.min), and its backward P came out 1, not 1/S
    _store_row_stats(LSE + 2 * n * L, rows, row_ok, alive, m_i, l_safe)


@triton.jit
def _bwd_kernel(
    AT, BT, W, V, M, DO, LSE, DELTA, DAT, DBT, DWP, DV32, SC, SKIP,
    L, S, A, DV, offset,
    svn, svs, svd, smn, sml, sms,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr,
    STORED: tl.constexpr, HW: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    key_blocks = tl.cdiv(S, BLOCK_S)
    pid_s, n = _program(key_blocks)  # n int64: base offsets
    j0 = pid_s * BLOCK_S
    cols = j0 + tl.arange(0, BLOCK_S)
    col_ok = cols < S
    a_ptr, b_ptr = AT + n * A * L, BT + n * A * S
    da_ptr, db_ptr = DAT + n * A * L, DBT + n * A * S
    dw_ptr = DWP + (n * key_blocks + pid_s) * A  # this program's row of dw partials
    v_ptr, m_ptr = V + n * svn, M + n * smn

    first = 0
    if CAUSAL:  # rows before j0 - offset see none of these keys (SKIP: as the forward)
        first = tl.where(tl.load(SKIP) != 0, tl.maximum(0, j0 - offset) // BLOCK_L, 0)
    count = tl.cdiv(L, BLOCK_L) - first
    for it in range(0, count):
        i0 = (first + (it + pid_s) % count) * BLOCK_L  # rotated start: fewer colliding atomics
        rows = i0 + tl.arange(0, BLOCK_L)
        row_ok = rows < L
        # pass 1: the scores (kept by the forward, or again), P, and dP = dO V^T with
        # dV += P^T dO, BLOCK_DV columns at a time (dV in float32, added by this program alone:
        # few registers for any Dv)
        if STORED:  # (where the causal forward never went, SC was filled with -inf)
            s = tl.load(
                SC + n * L * S + rows[:, None] * S + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :],
                other=float("-inf"),
            )
        else:
            s = _score_tile(a_ptr, b_ptr, W, rows, cols, L, S, A, BLOCK_L, BLOCK_S, HW)
            s = _visible(s, m_ptr, rows, cols, L, S, offset, smn, sml, sms, MASK, CAUSAL)
        rmax, logl = _row_stats(LSE, n * L + rows, row_ok)
        p = tl.where(s == float("-inf"), 0.0, tl.exp((s - rmax[:, None]) - logl[:, None]))
        p_t = tl.trans(p.to(DO.dtype.element_ty))  # (BLOCK_S, BLOCK_L)
        dp = tl.zeros((BLOCK_L, BLOCK_S), dtype=tl.float32)
        for d0 in range(0, DV, BLOCK_DV):
            dcols = d0 + tl.arange(0, BLOCK_DV)
            do = tl.load(
                DO + n * L * DV + rows[:, None] * DV + dcols[None, :],
                mask=row_ok[:, None] & (dcols[None, :] < DV),
                other=0.0,
            )  # (BLOCK_L, BLOCK_DV)
            v = tl.load(
                v_ptr + cols[:, None] * svs + dcols[None, :] * svd,
                mask=col_ok[:, None] & (dcols[None, :] < DV),
                other=0.0,
            )  # (BLOCK_S, BLOCK_DV)
            dp += _dot(do, tl.trans(v), PRECISION, WIDEN)
            tl.atomic_add(
                DV32 + n * S * DV + cols[:, None] * DV + dcols[None, :],
                _dot(p_t, do, PRECISION, WIDEN),
                mask=col_ok[:, None] & (dcols[None, :] < DV),
                sem="relaxed",
            )
        delta = tl.load(DELTA + n * L + rows, mask=row_ok, other=0.0)
        ds = p * (dp - delta[:, None])
        # pass 2: t again; reduce g = dS w_k (1 - t^2) over keys (da) and rows (db)
        for k in range(0, A):
            a_k = tl.load(a_ptr + k * L + rows, mask=row_ok, other=0.0)
            b_k = tl.load(b_ptr + k * S + cols, mask=col_ok, other=0.0)
            t, slope = _tanh_and_slope(a_k[:, None] + b_k[None, :], HW)
            g = ds * (tl.load(W + k) * slope)
            tl.atomic_add(da_ptr + k * L + rows, tl.sum(g, 1), mask=row_ok, sem="relaxed")
            tl.atomic_add(db_ptr + k * S + cols, tl.sum(g, 0), mask=col_ok, sem="relaxed")
            tl.atomic_add(dw_ptr + k, tl.sum(tl.sum(ds * t, 1), 0), sem="relaxed")


# ---------------------------------------------------------------------------------------------
# Launchers


def _mask_args(mask: torch.Tensor | None, device):
    """(kind, tensor, strides (N, L, S)) for the kernels; bool masks are read as uint8."""
    if mask is None:
        return 0, torch.empty(1, device=device), (0, 0, 0)
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)  # same bytes; Triton reads them as integers
        return 1, mask, mask.stride()
    return 2, mask, mask.stride()


def _offset(alignment: str | None, L: int, S: int) -> int:
    return S - L if alignment == "bottom_right" else 0


def _tanh_name(dtype: torch.dtype) -> str:
    if not hardware_tanh(dtype):
        return "exp2 and a reciprocal"
    return "tanh.approx.f32" + (
        ", emulated by exp2 in the interpreter" if _triton.INTERPRET else ""
    )


def hardware_tanh(dtype: torch.dtype) -> bool:
    """Whether the kernels' tanh is the SFU's tanh.approx.f32 (:data:`HARDWARE_TANH_ON`;
    emulated under the interpreter)."""
    return dtype in HARDWARE_TANH_ON


def products(dtype: torch.dtype) -> dict:
    """The kernels' matrix-product settings (see ``_dot``): compiled, TF32x3 (float32 accuracy on
    tensor cores); interpreted, IEEE, with bfloat16 widened to float32. Decided by
    ``TRITON_INTERPRET``, not by the tensors' device: the interpreter runs CUDA tensors too."""
    interpret = _triton.INTERPRET
    return dict(
        PRECISION="ieee" if interpret else "tf32x3", WIDEN=interpret and dtype == torch.bfloat16
    )


class _AdditiveAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, w, value, mask, alignment, tiling, keep, finite):
        N, L, A = a.shape
        S, DV = b.shape[1], value.shape[2]
        at = (a * TWO_LOG2E).transpose(1, 2).contiguous()  # (N, L, A) -> (N, A, L), pre-scaled
        bt = (b * TWO_LOG2E).transpose(1, 2).contiguous()  # (N, S, A) -> (N, A, S)
        w = w.contiguous()
        kind, m, m_strides = _mask_args(mask, a.device)
        # the output in float32, kept for the backward: its row term delta = rowsum(dO * O)
        # from a bf16-rounded output biased every dS, and the tanh chain summed that bias
        # over A (gradients of a, b, w 3-10x worse than the naive bf16 formula)
        out = value.new_empty(N, L, DV, dtype=torch.float32)
        stats = a.new_empty(N, L, 2)  # each row's max and log of its sum (_row_stats)
        scores = None  # kept: -inf where a causal forward skips a tile (its keys are masked)
        if keep:
            causal = alignment is not None
            scores = a.new_full((N, L, S), float("-inf")) if causal else a.new_empty(N, L, S)
        meta = dict(
            MASK=kind, CAUSAL=alignment is not None, HW=hardware_tanh(value.dtype),
            **products(value.dtype),
        )  # fmt: skip
        skip = _causal_skip(a, b, w, finite) if alignment is not None else stats
        blk = tiling.forward
        with _triton.on_device(value):
            _fwd_kernel[(triton.cdiv(L, blk.rows) * N,)](
                at, bt, w, value, m, out, stats, stats if scores is None else scores, skip,
                L, S, A, DV, _offset(alignment, L, S),
                *value.stride(), *m_strides,
                **meta, STORE=keep, BLOCK_L=blk.rows, BLOCK_S=blk.keys,
                BLOCK_DV=max(16, triton.next_power_of_2(DV)), num_warps=blk.warps,
            )  # fmt: skip
        ctx.save_for_backward(at, bt, w, value, m, out, stats, scores, skip)
        ctx.meta, ctx.tiling = meta, tiling
        ctx.m_strides, ctx.offset = m_strides, _offset(alignment, L, S)
        return out.to(value.dtype)

    @staticmethod
    @first_derivatives_only("attnlab's Triton additive kernel")
    def backward(ctx, grad_out):
        at, bt, w, value, m, out, stats, scores, skip = ctx.saved_tensors
        N, A, L = at.shape
        S, DV = bt.shape[2], value.shape[2]
        grad_out = grad_out.contiguous()
        delta = (grad_out.float() * out.float()).sum(-1)  # (N, L): D_i = sum_e dO_ie O_ie
        dat, dbt = torch.zeros_like(at), torch.zeros_like(bt)
        blk = ctx.tiling.backward
        key_blocks = triton.cdiv(S, blk.keys)
        dw_parts = w.new_zeros(N, key_blocks, A)
        dvalue = value.new_zeros(N, S, DV, dtype=torch.float32)
        with _triton.on_device(value):
            _bwd_kernel[(key_blocks * N,)](
                at, bt, w, value, m, grad_out, stats, delta, dat, dbt, dw_parts, dvalue,
                stats if scores is None else scores, skip,
                L, S, A, DV, ctx.offset,
                *value.stride(), *ctx.m_strides,
                **ctx.meta, STORED=scores is not None, BLOCK_L=blk.rows, BLOCK_S=blk.keys,
                BLOCK_DV=min(max(16, triton.next_power_of_2(DV)), BACKWARD_VALUE_CHUNK),
                num_warps=blk.warps,
            )  # fmt: skip
        da = dat.transpose(1, 2)  # (N, A, L) -> (N, L, A)
        db = dbt.transpose(1, 2)  # (N, A, S) -> (N, S, A)
        return da, db, dw_parts.sum((0, 1)), dvalue.to(value.dtype), None, None, None, None, None


def _causal_skip(a, b, w, finite: bool) -> torch.Tensor:
    """A one-element int32 flag on the device, 1 where the causal kernels may skip the tiles
    causality forbids: a, b and w hold no NaN and no inf (their sum is finite; a sum that
    overflows only costs the skip), or the caller says so (``finite``). Else a forbidden key's
    score may be NaN or +inf, which makes its row NaN (the NaN rule; a NaN in W_q, W_k, the
    bias or w reaches every score), and a skipped tile would miss it. No host
    synchronisation: the kernels read the flag."""
    if finite:
        return torch.ones(1, dtype=torch.int32, device=a.device)
    total = a.sum(dtype=torch.float32) + b.sum(dtype=torch.float32) + w.sum(dtype=torch.float32)
    return torch.isfinite(total).to(torch.int32).reshape(1)


def additive_attention(
    a: torch.Tensor,
    b: torch.Tensor,
    w: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None = None,
    alignment: str | None = None,
    tiling: Tiling | None = None,
    keep_scores: bool | None = None,
    finite: bool = False,
) -> torch.Tensor:
    """softmax(w . tanh(a_i + b_j) + M) V, fused: (N,L,A), (N,S,A), (A,), (N,S,Dv) -> (N,L,Dv).

    Args:
        a: float32 (N, L, A), the projected queries ``W_q q + bias``.
        b: float32 (N, S, A), the projected keys ``W_k k``.
        w: float32 (A,), the score vector.
        value: (N, S, Dv) in float32, bfloat16 or float16; the output has its dtype.
        mask: None, bool (True = may attend) or a float bias without gradient, of shape
            (N, L, S) -- an expanded view is read in place through its (zero) strides.
        alignment: None, "top_left" or "bottom_right" causal (see :mod:`attnlab.masks`).
        tiling: tile sizes; :func:`tiling_for` Dv by default.
        keep_scores: keep the (N, L, S) float32 scores for the backward (saving it one of its
            two tanh passes) or recompute them there; :func:`keeps_scores` by default.
        finite: the caller vouches that a, b and w hold no NaN and no inf (``assume_finite``):
            the causal kernels skip the tiles causality forbids without asking.

    Differentiable in ``a``, ``b``, ``w`` and ``value``. Call :func:`supports` first.
    """
    tiling = tiling or tiling_for(value.shape[-1])
    N, L, S = a.shape[0], a.shape[1], b.shape[1]
    if keep_scores is None:
        keep_scores = keeps_scores(N, L, S, (a, b, w, value))
    return _AdditiveAttention.apply(
        a.contiguous(), b.contiguous(), w, value.contiguous(), mask, alignment, tiling,
        keep_scores, finite,
    )  # fmt: skip


def keeps_scores(N: int, L: int, S: int, leaves) -> bool:
    """Whether a call keeps its (N, L, S) float32 scores for the backward: when autograd will
    call it (grad mode on, a leaf that requires grad) and they take at most
    :data:`STORED_SCORES_BYTES`."""
    fits = 4 * N * L * S <= STORED_SCORES_BYTES and L * S <= _triton.INT32_MAX + 1
    return fits and _training(leaves)


def _training(leaves) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in leaves)


@contextlib.contextmanager
def settings(**values):
    """Within the block, module settings take these values (``STORED_SCORES_BYTES=0``: every
    backward rebuilds its scores; ``HARDWARE_TANH_ON=()``): for benchmarks and
    checks that time or test both sides. Not thread-safe."""
    unknown = set(values) - {"STORED_SCORES_BYTES", "HARDWARE_TANH_ON"}
    if unknown:
        raise ValueError(f"settings(): unknown {sorted(unknown)}; expected STORED_SCORES_BYTES "
                         "or HARDWARE_TANH_ON")  # fmt: skip
    before = {name: globals()[name] for name in values}
    globals().update(values)
    try:
        yield
    finally:
        globals().update(before)


def supports(query, key, value, attn_mask, A: int = 1) -> str | None:
    """None if the fused kernel serves these (user-facing) inputs, else a one-line reason.

    ``query`` (..., L, Dq), ``key`` (..., S, Dk), ``value`` (..., S, Dv), ``attn_mask``
    broadcastable to (..., L, S), already checked by the caller (one dtype for the three); ``A``
    the attention width.
    """
    if query.dtype not in DTYPES:
        return f"{query.dtype}: the kernel takes float32, bfloat16 and float16"
    if 0 in query.shape or 0 in key.shape[-2:] or 0 in value.shape[-1:]:
        return "an empty dimension: nothing to tile"
    if value.shape[-1] > MAX_VALUE_DIM:
        return f"value width Dv={value.shape[-1]} > {MAX_VALUE_DIM} (the output tile in registers)"
    lead = broadcast_shapes(query.shape[:-2], key.shape[:-2])
    if value.dim() != len(lead) + 2 or any(
        v not in (1, n) for v, n in zip(value.shape[:-2], lead, strict=True)
    ):
        return f"value's leading dims {tuple(value.shape[:-2])} do not broadcast to {tuple(lead)}"
    if attn_mask is not None and attn_mask.requires_grad:
        return "a float mask that requires grad: the kernel gives no gradient for the mask"
    rows = max(query.shape[-2], key.shape[-2])
    if rows * max(A, value.shape[-1]) > _triton.INT32_MAX + 1:  # (A, L), (L, Dv) per batch row
        return f"{rows} rows x {max(A, value.shape[-1])} per batch row: past 32-bit offsets"
    return _triton.offsets_unfit(value=value, attn_mask=attn_mask)


def describe(query, key, value, w_score, *weights) -> str:
    """The kernel and its tiling in one line (for ``explain_additive()``); ``weights``: the
    other tensors a gradient may be asked for (``w_query``, ``w_key``, ``bias`` or None)."""
    fwd = tiling_for(value.shape[-1]).forward
    L, S = query.shape[-2], key.shape[-2]
    N = math.prod(broadcast_shapes(query.shape[:-2], key.shape[:-2]))
    leaves = (query, key, value, w_score, *(t for t in weights if t is not None))
    mib, budget = 4 * N * L * S / 2**20, STORED_SCORES_BYTES >> 20
    if keeps_scores(N, L, S, leaves):
        kept = (
            f"keeps the (..., L, S) float32 scores for the backward ({mib:.3g} MiB <= {budget} "
            "MiB), which recomputes the tanh once"
        )
    elif _training(leaves):
        kept = (
            f"the backward recomputes the scores (they would take {mib:.3g} MiB > {budget} MiB) "
            "and then the tanh once more"
        )
    else:
        kept = "nothing kept for a backward (no gradient needed)"
    return (
        f"fused additive kernel, {_triton.where()}: tiles of {fwd.rows} query rows x {fwd.keys} "
        f"keys, A={w_score.shape[0]} tanh per score ("
        f"{_tanh_name(value.dtype)}), "
        "online softmax; saves the row log-sum-exp, "
        f"never the (..., L, S, A) tanh; {kept}"
    )


# ---------------------------------------------------------------------------------------------
# The readable spec


def reference(a, b, w, value, mask=None, alignment=None):
    """What :func:`additive_attention` computes, in plain torch (forms (N, L, S, A): small only)."""
    L, S = a.shape[1], b.shape[1]
    scores = torch.tanh(a[:, :, None, :] + b[:, None, :, :]) @ w  # (N, L, S, A) @ (A,) -> (N, L, S)
    keep = torch.ones(L, S, dtype=torch.bool, device=a.device)
    if alignment is not None:
        offset = _offset(alignment, L, S)
        pos = torch.arange(max(L, S), device=a.device)
        keep = pos[None, :S] <= pos[:L, None] + offset  # (L, S)
    if mask is not None and mask.dtype == torch.bool:
        keep = keep & mask
    elif mask is not None:
        scores = scores + mask
    scores = scores.masked_fill(~keep, float("-inf"))
    alive = (scores != float("-inf")).any(-1, keepdim=True)  # rows with an attendable key
    weights = torch.softmax(scores.masked_fill(~alive, 0.0), -1).masked_fill(~alive, 0.0)
    return weights.to(value.dtype) @ value  # (N, L, S) @ (N, S, Dv) -> (N, L, Dv)
