"""Blocked ("flash") attention on CPU, forward and backward.

Two implementations of one algorithm: the C++ one (``cpu_flash.cpp``, built at first use by
:mod:`attnlab.kernels.cpu_flash_native`), which serves float32 and bfloat16 products wherever
it builds, and the torch-ops one below, which serves float64 (the gradcheck tests) and machines
without a C++ compiler, and is the readable text of the algorithm. They differ in their dropout
draws (the C++ mask is a function of (seed, row, column); here, of the seed and the block) and
in rounding; ``_forward`` and ``_backward`` pick the same one for a call.

Math (per head; ``s`` the scale, ``M`` 0 / -inf from the mask and the causal triangle)::

    S = s Q K^T + M                 lse_i = log sum_j exp(S_ij)     P = exp(S - lse)
    O = (P * Z / rho) V             Z ~ Bernoulli(rho), the dropout keep mask (1 if p = 0)

    backward, with W = P * Z / rho and D_i = sum_e dO_ie O_ie (= sum_j P_ij dP_ij):
    dV = W^T dO     dP = (dO V^T) * Z / rho     dS = P * (dP - D)
    dQ = s dS K     dK = s dS^T Q

``rho`` is the keep rate the draws give, ``1 - p`` rounded (:meth:`_Plan.kept`): survivors are
scaled by exactly its inverse, so the output's expectation is the undropped output.

A row with no attendable key gets ``lse = +inf`` (its max ``m`` is), so its ``P`` row is 0:
output 0, gradients 0. The forward saves each row's max ``m`` and ``log sum_j exp(S_ij - m)``
apart (``lse`` is their sum): a row whose scores a huge bias absorbed (``finfo.min`` on every
key: uniform weights, as the oracle's) has ``|m|`` so large that ``lse`` would round its second
part away.

Tiling. A block is a range of query rows (``BLOCK_ROWS`` per head; fewer past
``LONG_BLOCK_BYTES`` of scores, a long S) of several whole kv heads
(of one batch row, or of several), against **every key the block can see** at once -- no loop
over key blocks with an online softmax: on a CPU a block of scores fits in cache
(``BLOCK_BYTES``), so its softmax is exact in one pass and each product is one large ``bmm``
(Python pays per op; a GEMM pays per call)::

                 keys 0 ..................... kmax ........ S
    rows r0..r1  [ s Q_blk K^T, all at once | triangle ]  skipped     (causal: kmax = r1 + S - L
    G heads of kv head j stacked as G*R rows (GQA folding)              bottom-right, r1 top-left)

Causal blocks stop at ``kmax`` (half the work at L = S); only columns past the block's first
row get the triangle, built from positions (never the (L, S) mask). A mask is sliced per block
from its broadcast shape. The forward saves Q, K, V, O and the row statistics (B, H, L, 2); the
backward recomputes ``P`` block by block from them. Scores are kept in base 2 (``log2(e) s``
folded into Q; ``exp2`` was ~2x faster than ``exp`` on a Zen 4, level with it on a Xeon with
AVX512), except with a float mask: ``log2(e)`` times a bias past +-2.4e38 would overflow.

Threads (:mod:`attnlab.kernels._threads`): ``torch.get_num_threads()`` Python threads each run
whole blocks single-threaded. Forward: a thread takes the next block. Backward: a thread owns a
group of kv heads with all its row blocks, so dK, dV (float32) add up without locks.

Dtypes: softmax statistics in float32 (float64 for float64 inputs, which is how the gradcheck
test runs; :func:`supports` refuses float64 for dispatch). Products run in bfloat16 only where
the CPU has native bf16 GEMMs (AMX / AVX512-BF16), dK and dV accumulating in float32 over row
blocks (with one row block, ``ONE_BLOCK_BYTES_BF16``, their one product is a bf16 GEMM: one
rounding either way); elsewhere (AVX2, where a bf16 ``bmm`` runs at < 1 GFLOP/s) 16-bit
inputs are widened to float32 once.

Dropout: one int64 seed per call (from ``generator`` or torch's default generator); block
``n`` draws its keep mask from a generator seeded with ``(seed, n)`` (:meth:`_Plan.kept`), so
the backward regenerates exactly the forward's mask and nothing of size (B, H, L, S) is stored.
The draws depend on the tiling: the same seed gives the same mask for the same shapes and block
sizes. The backward folds the mask into ``P`` once (``W = P Z``): ``dS = W dP - P D``.

Weights on demand (:func:`forward_with_weights`, the C++ kernel only): the forward's blocks
hold whole rows, so each block's ``W`` is final when it is made, and is written into the
caller's (B, H, L, S) tensor then; :func:`backward_with_weights` adds the weights' gradient to
``dP`` in the backward's blocks, whose row sums ``D = sum_j W_j dP_j`` then include it.

Bound: 7 GEMMs of 2 B H L S E FLOP each (2 forward; backward: S again, dV, dP, dQ, dK) at the
CPU's GEMM rate, plus ~10 passes over each block of scores in cache (exp2, masks, draws).

References: Dao et al., "FlashAttention", 2022; Dao, "FlashAttention-2", 2023.
Oracle: :func:`attnlab.reference.scaled_dot_product_attention`.
"""

from __future__ import annotations

import functools
import math
import operator

import numpy as np
import torch
import torch.nn.functional as F

from attnlab._derivatives import first_derivatives_only
from attnlab.kernels import cpu_flash_native
from attnlab.kernels._threads import in_threads, scratch_view

BLOCK_ROWS = 256  # query rows per head in one block (measured: 64-512 within noise, 256 best)
BLOCK_BYTES = 2 * 2**20  # float32 scores of one block (at least one head x G*BLOCK_ROWS x S)
# bf16 products: all L rows of a kv head's G heads in one block while their float32 scores fit
# this (L = S = 1,448 for G = 1), so that dK and dV are one bf16 GEMM each (backward_group):
# fwd+bwd 11-17% faster at L = 512-1,536 (measured; at 2,048 one block is 20% slower)
ONE_BLOCK_BYTES_BF16 = 8 * 2**20
# the C++ kernel's brgemm path (bf16 and float32 products): query rows of one head per block,
# its float32 scores and dP in L2 beside K, V
BRGEMM_ROWS = 64
# the torch-ops blocks: fewer than BLOCK_ROWS rows once a block's scores pass this (a long S:
# 256 rows x 1M keys were 1 GiB per temporary). Not BLOCK_BYTES, as the C++ kernel: each block
# costs Python here; at S = 16k, 1 thread, fwd+bwd took x1.15 the time at 64 rows, x1.33 at 32
LONG_BLOCK_BYTES = 64 * 2**20
LOG2E = 1.0 / math.log(2.0)
# a row max past this (in the plan's unit) gets P from the max and the sum apart in the backward:
# the lse's rounding (half an ulp of the max, 2^-14 here) would otherwise count against P
HUGE_MAX = 2.0**10
inf = float("inf")


def _products_dtype(dtype: torch.dtype, E: int = 2, Ev: int = 2) -> torch.dtype:
    """The blocks' product dtype for inputs of ``dtype`` and head dims ``E``, ``Ev``: bfloat16
    where the CPU multiplies it natively and the head dims are even, float64 for float64, else
    float32 (16-bit inputs widened once). (torch's bfloat16 products on the CPU, oneDNN's, with
    an odd inner dimension carry a NaN or an inf of one row into the next row: an odd head dim
    made rows beside a NaN row NaN; the brgemm path, which odd head dims cannot take, hides its
    odd key column.)"""
    if dtype == torch.float64:
        return dtype
    if dtype == torch.bfloat16 and native_bf16() and E % 2 == 0 and Ev % 2 == 0:
        return dtype
    return torch.float32


def _brgemm(mm_dtype: torch.dtype, E: int, Ev: int) -> bool:
    """Whether the C++ kernel's products of ``mm_dtype`` go through oneDNN's brgemm: bfloat16
    with even head dims on a CPU it packs for (packed row pairs are 32-bit words), float32 where
    its float32 brgemm runs."""
    if mm_dtype == torch.bfloat16:
        return E % 2 == 0 and Ev % 2 == 0 and cpu_flash_native.brgemm()
    return mm_dtype == torch.float32 and cpu_flash_native.brgemm(torch.float32)


@functools.cache
def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices natively (AMX or AVX512-BF16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def supports(q, k, v, mask, dropout_p) -> str | None:
    """None if :func:`flash_attention` serves this call, else a one-line reason why not."""
    if q.device.type != "cpu":
        return f"device {q.device.type}: the blocked kernel is for CPU"
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"{q.dtype}: kept on the exact paths (the kernel serves float32/bfloat16/float16)"
    if 0 in q.shape or 0 in k.shape[-2:] or 0 in v.shape[-1:]:
        return "an empty dimension: nothing to block"
    if mask is not None and mask.requires_grad:
        return "a float mask that requires grad: the kernel gives no gradient for the mask"
    return None


def describe(q, k, v, alignment, weights=False) -> str:
    """The tiling of a call in one line (for ``explain()``), and which implementation runs it:
    the C++ one, or these blocks in torch ops and why; ``weights`` (True, or ``"average"``): a
    call of :func:`forward_with_weights` (the C++ kernel's, which writes the weights)."""
    plan = _Plan(q, k, v, None, alignment, 1.0, 0.0, 0)
    products = "bfloat16" if plan.mm_dtype == torch.bfloat16 else "float32"
    if q.dtype == torch.bfloat16 and plan.mm_dtype == torch.float32 and native_bf16():
        products += " (bfloat16 inputs widened: odd head dims)"
    # (a trace cannot read the thread count: the graph runs with the caller's)
    threads = "the caller's" if torch.compiler.is_compiling() else torch.get_num_threads()
    if plan.native() is not None and not _under_torch_func():
        if cpu_flash_native.threads() != torch.get_num_threads():
            threads = "1 (a forked child: OpenMP's threads do not survive fork)"
        rows, groups = plan.native_args()[4:6]
        saves = "saves the row log-sum-exp"
        blocks = f"{plan.G}*{rows} query rows of {groups} kv head(s) x every visible key"
        if plan.brgemm():  # (a head's rows per block; the backward's keys in chunks)
            blocks = f"{rows} query rows of one head x every visible key"
            if not weights:  # (the backward's key chunks: not a weights call's)
                blocks += " (backward: 512 keys)"
            products += " (oneDNN brgemm: float32 scores and sums)"
            saves += " (and, for a backward, float32 output)"
        elif plan.mm_dtype == torch.bfloat16:
            products += " (at::bmm; no brgemm for this CPU)"
        saves += ", not the weights"
        if weights == "average":
            saves = "sums each row block's weights over the heads (float32), then writes them"
        elif weights:
            saves = "writes each block's weights as it makes them"
        return (
            f"blocked CPU kernel (C++, cpu_flash.cpp): {blocks} per block, {products} "
            f"products, {threads} thread(s); {saves}"
        )
    if plan.mm_dtype == torch.float64:
        why = "float64"
    elif _under_torch_func():
        why = "under torch.func, whose wrapped tensors C++ cannot read"
    else:
        why = cpu_flash_native.unavailable()
    return (
        f"blocked CPU kernel (torch ops; not the C++ one: {why}): {plan.batches} batch row(s) "
        f"x {plan.heads} kv head(s) x {plan.G}*{plan.rows} query rows x every visible key per "
        f"block, {products} products, {threads} thread(s); saves the row log-sum-exp, not the "
        "weights"
    )


def flash_attention(q, k, v, mask, alignment, scale, dropout_p, generator=None):
    """softmax(Q K^T * scale + M) V in blocks; (B,H,L,E), (B,Hkv,S,E), (B,Hkv,S,Ev) -> (B,H,L,Ev).

    Args:
        q, k, v: 4-D, one dtype, on CPU; Hkv divides H (query head h reads kv head h // G).
        mask: None, bool (True = may attend) or an additive float bias, broadcastable to
            (B, H, L, S); an expanded view stays small (sliced per block, never expanded).
        alignment: None, "top_left" or "bottom_right" causal (see :mod:`attnlab.masks`).
        scale: the scores' multiplier.
        dropout_p: in [0, 1); survivors are scaled by 1 / (1 - p), p rounded as the draws
            round it (:meth:`_Plan.kept`).
        generator: draws the call's dropout seed (default: torch's default generator).

    Rows with no attendable key give output 0 and zero gradients. Differentiable in q, k, v.
    """
    scale, dropout_p = float(scale), float(dropout_p)
    if torch.compiler.is_compiling():  # the operator: a node of the graph
        if dropout_p > 0:
            seed = torch.randint(2**62, (), generator=generator)
        else:
            seed = torch.zeros((), dtype=torch.int64)
        # (the stats' width, fixed when traced: a constant of the graph)
        width = _stats_width(q.dtype, operator.index(q.shape[-1]), operator.index(v.shape[-1]))
        return _flash_op(q, k, v, mask, alignment, scale, dropout_p, seed, width)[0]
    seed = int(torch.randint(2**62, (), generator=generator)) if dropout_p > 0 else 0
    # (decided here, outside the Function: inside it torch.func shows its forward no transform)
    native_ok = not _under_torch_func()
    exact = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))  # (see _forward)
    return _FlashAttention.apply(
        q, k, v, mask, alignment, scale, dropout_p, seed, native_ok, exact
    )[0]


def weights_unfit(q, k, v, mask) -> str | None:
    """None when :func:`forward_with_weights` serves this call (the C++ kernel, inputs of its
    products' dtype), else why not, in one line."""
    why = supports(q, k, v, mask, 0.0)
    if why is not None:
        return why
    if q.dtype != _products_dtype(q.dtype, q.shape[-1], v.shape[-1]):
        return f"{q.dtype} here: its products are float32, the weights {q.dtype}"
    if q.dtype == torch.bfloat16 and not _brgemm(q.dtype, q.shape[-1], v.shape[-1]):
        # (at::bmm's bfloat16 products with an odd key count carry a NaN row's NaN into the
        # next row, and its bfloat16 scores gave the backward's float32 ones stale stats)
        return "bfloat16 without the brgemm path (no brgemm for this CPU)"
    if _under_torch_func() or torch.compiler.is_compiling():
        return "traced or transformed (the C++ kernel is not an operator that returns weights)"
    return cpu_flash_native.unavailable()


@torch.no_grad()
def forward_with_weights(q, k, v, mask, alignment, scale, weights):
    """The C++ kernel's forward, writing each block's weights ``W = softmax(s Q K^T + M)`` into
    ``weights`` (B, H, L, S), contiguous, of q's dtype, as it makes them (no pass of its own),
    or their average over the heads into ``weights`` (B, 1, L, S) (a task sums one row block
    over every head in a float32 buffer, then writes it): -> out (B, H, L, Ev), stats (B, H, L,
    2): each row's max score and the log of its sum of exponentials (natural units; +inf and 0
    for a row with no key). Rows with no attendable key get weights and output 0. Only where
    :func:`weights_unfit` says None."""
    plan = _Plan(q, k, v, mask, alignment, scale, 0.0, 0)
    plan.load(q, k, v)
    B, Hkv, G, L, S = plan.B, plan.Hkv, plan.G, plan.L, plan.S
    heads = (1, 1) if weights.shape[1] == 1 else (Hkv, G)
    with torch.autocast("cpu", enabled=False):
        out, stats = plan.native().forward(
            plan.q, plan.k, plan.v, *plan.native_args(), False, weights.view(B, *heads, L, S)
        )
    return out.view(B, plan.H, L, plan.Ev), stats.view(B, plan.H, L, 2)


@torch.no_grad()
def backward_with_weights(dout, q, k, v, stats, mask, alignment, scale, d_weights):
    """(dq, dk, dv) of :func:`forward_with_weights`'s output and weights, from float32
    products (16-bit inputs widened): its blocks again (the at::bmm ones: whole rows, so each
    row's ``D = sum_j W_j (dP_j + dW_j)`` is summed in the block), the weights' gradient
    ``d_weights`` (B, H, L, S) or None added to ``dP`` (averaged weights' (B, 1, L, S)
    gradient: divided by H and broadcast, as a view)."""
    dtype = q.dtype
    if dtype != torch.float32:  # (16-bit inputs: float32 products, rounded once at the end;
        # dS rounded to 16 bits for the products took dQ to 2.6x the readable formula's error)
        q, k, v, dout = (t.float() for t in (q, k, v, dout))
    plan = _Plan(q, k, v, mask, alignment, scale, 0.0, 0)
    plan.load(q, k, v)
    B, Hkv, G, L, S, E, Ev = plan.B, plan.Hkv, plan.G, plan.L, plan.S, plan.E, plan.Ev
    do = dout.to(plan.mm_dtype).reshape(B, Hkv, G, L, Ev)
    # (read through its strides: a broadcast gradient, as a sum's, is not materialised)
    if d_weights is not None and d_weights.shape[1] != plan.H:  # (averaged: W = sum_h W_h / H)
        d_weights = (d_weights.float() / plan.H).expand(B, plan.H, L, S)
    dw = None if d_weights is None else d_weights.float().view(B, Hkv, G, L, S)
    with torch.autocast("cpu", enabled=False):
        dq, dk, dv = plan.native().backward(
            do, plan.q, plan.k, plan.v, stats.reshape(B, Hkv, G, L, 2), *plan.native_args(False),
            dw,
        )  # fmt: skip
    return dq.view(B, plan.H, L, E).to(dtype), dk.to(dtype), dv.to(dtype)


class _FlashAttention(torch.autograd.Function):
    """The eager path (the operator's dispatch and autograd wrapper cost ~0.3 ms a call).

    Forward and context apart (``setup_context``), so that ``torch.func.grad`` takes it too.
    """

    @staticmethod
    def forward(q, k, v, mask, alignment, scale, dropout_p, seed, native_ok, exact):
        return _forward(q, k, v, mask, alignment, scale, dropout_p, seed, native_ok, exact)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, mask, alignment, scale, dropout_p, seed, native_ok, _ = inputs
        out, stats = output
        ctx.mark_non_differentiable(stats)
        # (no zeros made for stats' gradient: 2 + Ev floats a row, 5 ms at (4, 8, 1024, 64))
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, stats, mask)
        ctx.args = (alignment, scale, dropout_p, seed, native_ok)  # (the same implementation)

    @staticmethod
    @first_derivatives_only("attnlab's blocked CPU kernel")
    def backward(ctx, dout, dstats):
        if dout is None:  # (only stats reached the loss: it carries no gradient)
            return (None,) * 10
        q, k, v, out, stats, mask = ctx.saved_tensors
        grads = _backward(dout, q, k, v, out, stats, mask, *ctx.args)
        return (*grads, None, None, None, None, None, None, None)


class _Plan:
    """The tiling of one call, shared by forward and backward (so dropout blocks match)."""

    def __init__(self, q, k, v, mask, alignment, scale, dropout_p, seed):
        B, H, L, E = q.shape
        Hkv, S, Ev = k.shape[1], k.shape[2], v.shape[3]
        self.B, self.H, self.Hkv, self.G, self.L, self.S, self.E, self.Ev = (
            B, H, Hkv, H // Hkv, L, S, E, Ev,
        )  # fmt: skip
        self.dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # softmax
        self.mm_dtype = _products_dtype(q.dtype, E, Ev)
        self.offset = None if alignment is None else (S - L if alignment == "bottom_right" else 0)
        self.rows = min(L, BLOCK_ROWS)
        if self.mm_dtype == torch.bfloat16 and H // Hkv * L * S * 4 <= ONE_BLOCK_BYTES_BF16:
            self.rows = L
        elif self.G * self.rows * S * 4 > LONG_BLOCK_BYTES:
            self.rows = max(1, LONG_BLOCK_BYTES // (self.G * S * 4))
        per_head = self.G * self.rows * S * 4  # bytes of one kv head's scores in a block
        if per_head * Hkv <= BLOCK_BYTES:  # several batch rows, all heads
            self.batches, self.heads = min(B, max(1, BLOCK_BYTES // (per_head * Hkv))), Hkv
        else:  # one batch row, some heads
            self.batches, self.heads = 1, max(1, BLOCK_BYTES // per_head)
        # scores in base 2 (2^(x log2 e) = e^x: exp2 was ~2x faster than exp on a Zen 4), but
        # with a float mask in natural units: log2(e) times a bias beyond +-2.4e38 overflows
        self.unit = 1.0 if mask is not None and mask.is_floating_point() else LOG2E
        self.scale, self.scale2 = scale, scale * self.unit
        self.p, self.seed = dropout_p, seed
        # the draws (see kept): `width`-bit integers, `dropped` of every 2^width values dropped
        # (p rounded; near 1 one value is kept), `keep` = rho the exact keep rate, 1 / rho the scale
        self.width = 16 if 2**-8 <= dropout_p <= 1 - 2**-8 else 32
        self.dropped = min(round(dropout_p * 2**self.width), 2**self.width - 1)
        self.keep = 1.0 - self.dropped / 2**self.width
        self.mask = _mask5(mask, self)

    def groups(self):
        """[(b-slice, j-slice, [(n, r0, r1, kmax), ...])]: kv heads, and their row blocks.

        Block n covers query rows r0:r1 of kv heads js of batch rows bs, and keys 0:kmax.
        """
        out, n = [], 0
        for b0 in range(0, self.B, self.batches):
            bs = slice(b0, min(self.B, b0 + self.batches))
            for j0 in range(0, self.Hkv, self.heads):
                js = slice(j0, min(self.Hkv, j0 + self.heads))
                rows = []
                for r0 in range(0, self.L, self.rows):
                    r1 = min(self.L, r0 + self.rows)
                    kmax = self.S if self.offset is None else min(self.S, r1 + self.offset)
                    rows.append((n, r0, r1, kmax))
                    n += 1
                out.append((bs, js, rows))
        return out

    def native(self):
        """The C++ kernel (:mod:`~attnlab.kernels.cpu_flash_native`) where it serves this plan
        (float32 or bfloat16 products), else None: these blocks in torch ops serve."""
        if self.mm_dtype == torch.float64:
            return None
        return cpu_flash_native.module()

    def native_args(self, brgemm=None):
        """The C++ kernel's arguments after q, k, v (and dout, stats for the backward).

        Its blocks: ``rows`` query rows of a kv head's G heads, the block's float32 scores
        within ``BLOCK_BYTES`` (all L rows with 16-bit products while they fit, as here)."""
        mask = self.mask
        if mask is not None:  # (B, Hkv, G, L, S), broadcast (stride 0): nothing materialised
            if mask.is_floating_point():
                mask = mask.float()  # (the bias in its own, small, shape)
            mask = mask.expand(self.B, self.Hkv, self.G, self.L, self.S)
        rows = self.rows
        if not (self.mm_dtype == torch.bfloat16 and rows == self.L):  # (16-bit: one block)
            # (L <= BLOCK_ROWS too: a long S took all L rows, 400 MiB at L = 256, S = 200k)
            rows = max(1, min(self.L, BLOCK_ROWS, BLOCK_BYTES // max(1, self.G * self.S * 4)))
        threads = cpu_flash_native.threads()
        groups = 1  # (batch row, kv head) groups per block: short sequences take several, in
        brgemm = self.brgemm() if brgemm is None else brgemm
        if brgemm:  # a head's rows per block, a group per task (products accumulate in float32)
            rows = min(self.L, BRGEMM_ROWS)
        elif rows == self.L:  # batched products, while their scores fit and each thread gets ~3
            fit = BLOCK_BYTES // (self.G * self.L * self.S * 4)
            groups = max(1, min(fit, -(-self.B * self.Hkv // (3 * threads))))
        causal = self.offset is not None
        return (
            mask, causal, self.offset if causal else 0, self.scale, rows, groups, self.width,
            self.dropped if self.p > 0 else 0, self.keep, self.seed, threads, brgemm,
        )  # fmt: skip

    def brgemm(self):
        """Whether the C++ kernel's products go through oneDNN's brgemm, else at::bmm."""
        return _brgemm(self.mm_dtype, self.E, self.Ev)

    def load(self, q, k, v):
        """The compute-dtype q (B, Hkv, G, L, E), k, v (16-bit widened once, unless native)."""
        B, Hkv, G, L, E = self.B, self.Hkv, self.G, self.L, self.E
        self.q = q.detach().to(self.mm_dtype).view(B, Hkv, G, L, E)  # (B, H, L, E) -> 5-D
        self.k, self.v = k.detach().to(self.mm_dtype), v.detach().to(self.mm_dtype)

    def scores(self, bs, js, r0, r1, kmax, scratch, shift=None):
        """Block scores in the plan's unit, ``u (s Q K^T + M) - shift``, (n, G*R, kmax), -inf =
        masked; ``u`` is log2(e) (base 2) or 1 (with a float mask: :meth:`exp_`).

        ``shift`` (n, G*R, 1) is subtracted inside the GEMM (``baddbmm``: no pass of its own).
        """
        nb, nh, R = bs.stop - bs.start, js.stop - js.start, r1 - r0
        qb = scratch_view(scratch, "q", (nb, nh, self.G, R, self.E), self.mm_dtype)
        kb = self.k[bs, js, :kmax].flatten(0, 1)  # (n, kmax, E)
        s = scratch_view(scratch, "s", (nb * nh, self.G * R, kmax), self.mm_dtype)
        if self.mm_dtype == self.dtype:  # the scale on the (small) query block
            torch.mul(self.q[bs, js, :, r0:r1], self.scale2, out=qb)
            qb = qb.view(nb * nh, self.G * R, self.E)  # (n, G*R, E)
            if shift is None:
                s = torch.bmm(qb, kb.transpose(1, 2), out=s)
            else:
                s = torch.baddbmm(shift.neg().expand(s.shape), qb, kb.transpose(1, 2), out=s)
        else:  # bf16 products: the scale and the shift in float32, after, so that the scores
            # are rounded once, as the naive formula's (scaling the bf16 query first rounded
            # it: 1.2-1.3x the naive error); the scale in the pass that widens them anyway
            qb = qb.copy_(self.q[bs, js, :, r0:r1]).view(nb * nh, self.G * R, self.E)
            s16 = torch.bmm(qb, kb.transpose(1, 2), out=s)
            s = scratch_view(scratch, "s32", s.shape, self.dtype).copy_(s16)  # (widened)
            if shift is None:  # (ops of one dtype: mixing bf16 and float32 is 2-3x slower)
                s.mul_(self.scale2)
            else:
                s = torch.add(shift.neg(), s, alpha=self.scale2, out=s)
        s5 = s.view(nb, nh, self.G, R, kmax)
        if self.mask is not None:
            m = self.mask
            m = m[bs] if m.shape[0] > 1 else m
            m = m[:, js] if m.shape[1] > 1 else m
            m = m[:, :, :, r0:r1] if m.shape[3] > 1 else m
            m = m[..., :kmax] if m.shape[4] > 1 else m
            if m.dtype == torch.bool:  # True = masked here (inverted once, see _mask5)
                s5.masked_fill_(m, -inf)
            else:  # the bias, in natural units, in the softmax dtype (no copy of the mask)
                s5.add_(m)
        if self.offset is not None:  # keys past the block's first row: the triangle
            c0 = max(0, r0 + self.offset + 1)
            if c0 < kmax:
                q_pos = torch.arange(r0, r1)[:, None] + self.offset  # (R, 1)
                hidden = torch.arange(c0, kmax)[None, :] > q_pos  # (R, kmax - c0)
                s5[..., c0:].masked_fill_(hidden, -inf)
        return s

    def kept(self, n, shape, scratch):
        """Block n's dropout keep mask, 1.0 or 0.0: the same draws in forward and backward.

        Block n's bits come from numpy's SFC64 seeded with ``(seed, n)`` (2x torch's generator,
        which is serial and draws one word per element). Each 64-bit word gives four int16
        ``x`` when ``2^-8 <= p <= 1 - 2^-8`` (p rounded to a multiple of 2^-16: the keep rate
        within 2^-17, at most 2^-9 of p or of 1 - p; FlashAttention rounds it to 1/255), else
        two int32 (p to 2^-32, a keep rate of at least 2^-32); kept iff ``x >= -2^(w-1) +
        round(p 2^w)``. The rounded rate is ``self.keep``, whose inverse scales the survivors
        (unbiased, however near 1 p is). The mask is written in the
        softmax dtype, not as bools: comparing into floats and multiplying by them is ~4x
        faster on CPU than through a bool tensor (measured).
        """
        size = math.prod(shape)
        width = self.width
        per_word = 64 // width
        words = np.random.SFC64([self.seed, n]).random_raw((size + per_word - 1) // per_word)
        x = torch.from_numpy(words.view(f"int{width}"))[:size].view(shape)
        keep = scratch_view(scratch, "k", shape, self.dtype)
        return torch.ge(x, -(2 ** (width - 1)) + self.dropped, out=keep)

    def exp_(self, s):
        """``s`` exponentiated in place in the plan's unit (exp2 for base 2, else exp)."""
        return s.exp2_() if self.unit != 1.0 else s.exp_()

    def forward_block(self, task, out, stats, scratch):
        """Output rows and their softmax statistics (row max and log of the sum, in the plan's
        unit) of one block: exact softmax over keys 0:kmax."""
        bs, js, (n, r0, r1, kmax) = task
        shape4 = (bs.stop - bs.start, js.stop - js.start, self.G, r1 - r0)
        if kmax <= 0:  # every row of the block comes before the first key: dead
            out[bs, js, :, r0:r1] = 0.0
            return
        s = self.scores(bs, js, r0, r1, kmax, scratch)  # (n, G*R, kmax)
        m = s.amax(-1, keepdim=True)  # (n, G*R, 1)
        dead = m == -inf
        m.masked_fill_(dead, 0.0)  # 2^(-inf - 0) = 0: a dead row sums to 0
        self.exp_(s.sub_(m))
        total = s.sum(-1, keepdim=True)
        if self.p > 0:  # the sum is of the undropped weights; the dropped ones are zeroed
            s.mul_(self.kept(n, s.shape, scratch))
        norm = total.reciprocal().masked_fill_(dead, 0.0) / self.keep  # (n, G*R, 1)
        vb = self.v[bs, js, :kmax].flatten(0, 1)  # (n, kmax, Ev)
        if self.mm_dtype == self.dtype:  # the norm on the small output
            o = torch.bmm(s, vb).mul_(norm)  # (n, G*R, Ev)
        else:  # bf16 products: P normalised before it is rounded, so that the output is rounded
            # once, as the naive formula's (normalising the bf16 output after rounded it twice:
            # 1.16-1.36x the naive error); the same one pass over s as the cast alone
            pn = scratch_view(scratch, "p", s.shape, self.mm_dtype).copy_(s.mul_(norm))
            o = torch.bmm(pn, vb)
        out[bs, js, :, r0:r1] = o.view(*shape4, self.Ev)
        log_total = total.log2() if self.unit != 1.0 else total.log()
        stats[bs, js, :, r0:r1, 0] = m.masked_fill_(dead, inf).view(shape4)  # +inf: P = 0
        stats[bs, js, :, r0:r1, 1] = log_total.masked_fill_(dead, 0.0).view(shape4)

    def backward_group(self, group, do, D, stats, dq, dk, dv, scratch):
        """dQ of the group's rows, and its kv heads' dK, dV summed over its row blocks.

        With dropout, every product here misses the factor 1 / rho (``D`` is given times rho,
        the keep rate): dQ gets it with the scale, dK and dV once at the end.
        """
        bs, js, blocks = group
        G, E, Ev, p, mm = self.G, self.E, self.Ev, self.p, self.mm_dtype
        # bf16 products and one row block: dK, dV get one product each, rounded once either
        # way, so it may be a bf16 GEMM (fwd+bwd 6-33% faster at L = 64-1,024); more blocks
        # would add one rounding per block, so they accumulate in float32 (_accumulate)
        once = mm != self.dtype and len(blocks) == 1
        for n, r0, r1, kmax in blocks:
            shape5 = (bs.stop - bs.start, js.stop - js.start, G, r1 - r0, E)
            if kmax <= 0:
                dq[bs, js, :, r0:r1] = 0.0
                continue
            R = G * (r1 - r0)
            m_b = stats[bs, js, :, r0:r1, 0].reshape(-1, R, 1)  # (n, G*R, 1)
            log_total = stats[bs, js, :, r0:r1, 1].reshape(-1, R, 1)
            D_b = None if D is None else D[bs, js, :, r0:r1].reshape(-1, R, 1)
            # P = exp(s - m - log_total), the shift inside the GEMM: m + log_total in one (the
            # lse), unless a row's max is so large that its rounding would lose log_total (a
            # row of scores absorbed by a huge bias, e.g. finfo.min: uniform in the forward,
            # P = 1 instead of 1/S from the lse); then the sum divides P in a pass of its own
            exact = bool((m_b.abs() >= HUGE_MAX).logical_and_(m_b.isfinite()).any())
            shift = m_b if exact else m_b + log_total
            P = self.exp_(self.scores(bs, js, r0, r1, kmax, scratch, shift=shift))
            if exact:
                P.mul_(self.exp_(log_total.neg()))  # (n, G*R, kmax)
            dob = do[bs, js, :, r0:r1].reshape(-1, R, Ev)  # (n, G*R, Ev)
            kb, vb = self.k[bs, js, :kmax].flatten(0, 1), self.v[bs, js, :kmax].flatten(0, 1)
            W = P
            if p > 0:
                W = self.kept(n, P.shape, scratch).mul_(P)  # P Z: the mask's buffer, in place
            dv_blk = dv[bs, js, :kmax].view(-1, kmax, Ev)  # (n, kmax, Ev), a view (never a copy)
            if once:
                dv_blk.add_(torch.bmm(W.transpose(1, 2).to(mm), dob))
            else:
                _accumulate(dv_blk, W.transpose(1, 2), dob)  # += (P Z)^T dO
            dp = scratch_view(scratch, "dp", P.shape, mm)
            if mm != self.dtype:  # bf16 products: dP = dO V^T is rounded; D is its own row sum
                dp = torch.bmm(dob, vb.transpose(1, 2), out=dp).to(self.dtype)
                dS = dp.mul_(W)  # P * dP (kept; W = P without dropout)
                # D = sum_j P_ij dP_ij of this rounded dP (a block holds whole rows), not dO . O
                # of the rounded output: each row of dS then sums to 0, as the naive formula's
                # does; D from the output made dQ, dK 1.2-1.4x the naive error (median)
                dS.addcmul_(P, dS.sum(-1, keepdim=True), value=-1.0)  # P * (dP - D)
            elif p > 0:
                dp = torch.bmm(dob, vb.transpose(1, 2), out=dp)  # P (Z dP - D), in two passes
                dS = dp.mul_(W).addcmul_(P, D_b, value=-1.0)
            else:  # dO V^T - D in one GEMM
                dp = torch.baddbmm(D_b.neg().expand(dp.shape), dob, vb.transpose(1, 2), out=dp)
                dS = dp.mul_(P)  # P * (dP - D)
            dS_mm = dS.to(mm)
            dq_b = torch.bmm(dS_mm, kb).mul_(self.scale / self.keep)
            dq[bs, js, :, r0:r1] = dq_b.view(shape5)
            dk_blk = dk[bs, js, :kmax].view(-1, kmax, E)
            # dK = dS^T (s Q / rho), the factor on the (small) query block, so that a bf16
            # one-block dK is rounded once (a factor after a bf16 GEMM rounds it twice)
            qb = torch.mul(self.q[bs, js, :, r0:r1], self.scale / self.keep)
            qb = qb.reshape(-1, R, E)  # (n, G*R, E) (a copy for a view of projections)
            if once:
                dk_blk.add_(torch.bmm(dS_mm.transpose(1, 2), qb))
            else:
                _accumulate(dk_blk, dS.transpose(1, 2), qb)  # += dS^T qb


def _under_torch_func() -> bool:
    """Whether a torch.func transform is active (``grad``: the dispatch lets this kernel serve
    one): its backward gets wrappers with no storage of their own, which C++ cannot read, so
    the torch-ops blocks serve the call, forward and backward (decided once, by the caller of
    the Function: inside its forward the transform is out of sight)."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def _accumulate(dst, a, b):
    """dst += a @ b, batched, in place in ``dst`` (a float32 view).

    bf16 operands (native bf16 only) are widened: a bf16 ``bmm`` rounds its result to bf16, and
    dK, dV would collect one such rounding per row block (2x the naive formula's error).
    """
    dst.baddbmm_(a.to(dst.dtype), b.to(dst.dtype))  # (no copies when already float32)


def _mask5(mask, plan):
    """The mask as (Bm, Hkv|1, G|1, L|1, S|1), its broadcast dims of size 1 (nothing expanded).

    A bool mask is inverted once (True = masked: one byte per element of its own shape); a bias
    is used as it is.
    """
    if mask is None:
        return None
    for d in range(mask.dim()):  # an expanded dim (stride 0) back to size 1
        if mask.stride(d) == 0 and mask.shape[d] > 1:
            mask = mask.narrow(d, 0, 1)
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # -> (Bm, Hm, Lm, Sm)
    Bm, Hm, Lm, Sm = mask.shape
    if Hm > 1:  # (Bm, H, Lm, Sm) -> (Bm, Hkv, G, Lm, Sm)
        mask = mask.view(Bm, plan.Hkv, plan.G, Lm, Sm)
    else:
        mask = mask.view(Bm, 1, 1, Lm, Sm)
    return ~mask if mask.dtype == torch.bool else mask


def _forward(q, k, v, mask, alignment, scale, dropout_p, seed, native_ok=True, exact=True):
    """(out (B, H, L, Ev), stats (B, H, L, 2 or 2 + Ev)): the blocks of the forward, on the
    kernel's threads; ``stats`` holds each row's max score and the log of its sum of
    exponentials, in the plan's unit (the log-sum-exp is their sum), for the backward only.

    ``exact`` (a forward for a backward), where the C++ kernel's products go through brgemm:
    ``stats`` also holds each row's output in float32, before its rounding to the output's
    dtype, so that the backward's D = dO . O needs no pass over every key before its key
    chunks (:func:`_stats_width`)."""
    plan = _Plan(q, k, v, mask, alignment, scale, dropout_p, seed)
    plan.load(q, k, v)
    B, Hkv, G, L = plan.B, plan.Hkv, plan.G, plan.L
    native = plan.native() if native_ok else None
    if native is not None:
        with torch.autocast("cpu", enabled=False):
            out, stats = native.forward(plan.q, plan.k, plan.v, *plan.native_args(), exact, None)
        return out.view(B, plan.H, L, plan.Ev).to(q.dtype), stats.view(B, plan.H, L, -1)
    out = q.new_empty(B, Hkv, G, L, plan.Ev)
    stats = torch.zeros(B, Hkv, G, L, 2, dtype=plan.dtype)
    stats[..., 0] = inf  # +inf: a dead row (a block that sees no key writes nothing)
    blocks = [(bs, js, b) for bs, js, rows in plan.groups() for b in rows]
    in_threads(blocks, lambda task, scratch: plan.forward_block(task, out, stats, scratch))
    return out.view(B, plan.H, L, plan.Ev), stats.view(B, plan.H, L, 2)


def _backward(dout, q, k, v, out, stats, mask, alignment, scale, dropout_p, seed, native_ok=True):
    """(dq, dk, dv): the plan rebuilt from the same arguments (the same blocks, the same
    dropout draws), each block's weights recomputed from the forward's ``stats``."""
    plan = _Plan(q, k, v, mask, alignment, scale, dropout_p, seed)
    plan.load(q, k, v)
    B, Hkv, G, L, S, E, Ev = plan.B, plan.Hkv, plan.G, plan.L, plan.S, plan.E, plan.Ev
    acc = plan.dtype
    stats = stats.view(B, Hkv, G, L, -1)
    do = dout.to(plan.mm_dtype).reshape(B, Hkv, G, L, Ev)  # (B, H, L, Ev) -> 5-D
    native = plan.native() if native_ok else None
    if native is not None:
        with torch.autocast("cpu", enabled=False):
            # (brgemm only from a forward for a backward's stats: 2 + Ev wide)
            brgemm = plan.brgemm() and stats.shape[-1] == 2 + Ev
            args = plan.native_args(brgemm)
            dq, dk, dv = native.backward(do, plan.q, plan.k, plan.v, stats, *args, None)
        return dq.view(B, plan.H, L, E).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    D = None  # rowsum(dO * O) (bf16 products: each block sums its own, see backward_group)
    if plan.mm_dtype == plan.dtype:
        D = (do.to(acc) * out.to(acc).view(B, Hkv, G, L, Ev)).sum(-1)
        D.mul_(plan.keep)  # (see backward_group)
    dq = torch.empty(B, Hkv, G, L, E, dtype=acc)
    dk = torch.zeros(B, Hkv, S, E, dtype=acc)
    dv = torch.zeros(B, Hkv, S, Ev, dtype=acc)
    in_threads(  # one thread per group of kv heads: dK, dV are summed over row blocks
        plan.groups(),
        lambda g, scratch: plan.backward_group(g, do, D, stats, dq, dk, dv, scratch),
    )
    return (
        dq.view(B, plan.H, L, E).to(q.dtype),
        dk.to(k.dtype),
        dv.mul_(1.0 / plan.keep).to(v.dtype),
    )


# The kernel as two torch operators with autograd, for torch.compile: opaque nodes of its graph
# (the blocks run on Python threads, which a graph cannot hold). The dropout seed is a tensor so
# that the compiled graph draws it. The stats' width is an argument, fixed when the graph is
# traced: a graph compiled (and cached on disk) where the other product path served still gets
# stats of the shape it was compiled for. (Eager calls take _FlashAttention: the same two
# functions.)
@torch.library.custom_op("attnlab::cpu_flash", mutates_args=(), device_types="cpu")
def _flash_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    alignment: str | None,
    scale: float,
    dropout_p: float,
    seed: torch.Tensor,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, stats = _forward(q, k, v, mask, alignment, scale, dropout_p, int(seed), exact=width > 2)
    if stats.shape[-1] < width:  # (traced where brgemm served; (m, log l) is what is read here)
        stats = F.pad(stats, (0, width - stats.shape[-1]))
    return out, stats


@_flash_op.register_fake
def _(q, k, v, mask, alignment, scale, dropout_p, seed, width):
    B, H, L, _ = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(B, H, L, v.shape[-1]), q.new_empty(B, H, L, width, dtype=acc)


def _stats_width(dtype: torch.dtype, E: int, Ev: int) -> int:
    """The last dim of ``stats`` from an exact forward (the operator's: a graph may train)."""
    mm = _products_dtype(dtype, E, Ev)
    native = mm != torch.float64 and cpu_flash_native.module() is not None
    return 2 + Ev if native and _brgemm(mm, E, Ev) else 2


# torch.compiler.assume_constant_result(_stats_width), without importing torch._dynamo: run
# when traced (it may build the C++ kernel), its answer a constant of the graph
_stats_width._dynamo_marked_constant = True


@torch.library.custom_op("attnlab::cpu_flash_backward", mutates_args=(), device_types="cpu")
def _flash_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    stats: torch.Tensor,
    mask: torch.Tensor | None,
    alignment: str | None,
    scale: float,
    dropout_p: float,
    seed: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(dout, q, k, v, out, stats, mask, alignment, scale, dropout_p, int(seed))


@_flash_backward_op.register_fake
def _(dout, q, k, v, out, stats, mask, alignment, scale, dropout_p, seed):
    # contiguous, as _backward returns them (empty_like would keep a transposed input's strides)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save(ctx, inputs, output):
    q, k, v, mask, alignment, scale, dropout_p, seed, _ = inputs
    ctx.save_for_backward(q, k, v, *output, mask, seed)
    ctx.args = (alignment, scale, dropout_p)


def _differentiate(ctx, dout, dstats):
    q, k, v, out, stats, mask, seed = ctx.saved_tensors
    alignment, scale, dropout_p = ctx.args
    dq, dk, dv = _flash_backward_op(
        dout.contiguous(), q, k, v, out, stats, mask, alignment, scale, dropout_p, seed
    )
    return dq, dk, dv, None, None, None, None, None, None


_flash_op.register_autograd(_differentiate, setup_context=_save)
