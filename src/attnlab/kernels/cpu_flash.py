"""Blocked ("flash") attention on CPU, forward and backward, in torch ops.

Math (per head; ``s`` the scale, ``M`` 0 / -inf from the mask and the causal triangle)::

    S = s Q K^T + M                 lse_i = log sum_j exp(S_ij)     P = exp(S - lse)
    O = (P * Z / (1 - p)) V         Z ~ Bernoulli(1 - p), the dropout keep mask (1 if p = 0)

    backward, with W = P * Z / (1 - p) and D_i = sum_e dO_ie O_ie (= sum_j P_ij dP_ij):
    dV = W^T dO     dP = (dO V^T) * Z / (1 - p)     dS = P * (dP - D)
    dQ = s dS K     dK = s dS^T Q

A row with no attendable key gets ``lse = +inf``, so its ``P`` row is 0: output 0, gradients 0.

Tiling. One block is a range of query rows (``BLOCK_ROWS`` per head) of several whole heads
(a batch row's kv heads, or several batch rows), against **every key that block can see** --
not a loop over key blocks with an online softmax: on a CPU the scores of a block fit in cache
(``BLOCK_BYTES``), so each block's softmax is exact in one pass and every matrix product is one
large ``bmm`` instead of many small ones (Python pays per op, the GEMM per call)::

                 keys 0 ........... kmax            S
    rows r0..r1  [ Q_blk K^T  | triangle ]  (skipped) ]   kmax = last key the block sees
    heads h0..h1   G query heads of kv head j are stacked as G * BLOCK_ROWS rows (GQA folding)

Causal blocks stop at ``kmax`` (half the work at L = S); only the columns past the block's first
row get the triangle, built from positions (never the (L, S) mask). The forward saves Q, K, V, O
and the row ``lse`` (B, H, L); the backward recomputes ``P`` block by block from ``lse`` and
accumulates dK, dV (the G heads of a group summed by the folding) in float32.

Dtypes: softmax statistics in float32 (float64 for float64 inputs, which is how the gradcheck
test runs; :func:`supports` refuses float64 for dispatch). The matrix products run in bfloat16
only where the CPU has native bf16 GEMMs (AMX / AVX512-BF16); elsewhere (e.g. AVX2, where a
bf16 ``bmm`` runs at < 1 GFLOP/s) 16-bit inputs are widened to float32 once per call.

Dropout: one int64 seed per call (from ``generator`` or torch's default generator); block
``n`` draws its keep mask from ``torch.Generator().manual_seed(seed + n)``, so the backward
regenerates exactly the forward's mask and nothing of size (B, H, L, S) is stored.

Bound: the 4 (forward 2) GEMMs of the backward plus the forward's at the CPU's GEMM rate, plus
~10 passes over each block of scores (exp, masks, dropout draws) from cache.

References: Dao et al., "FlashAttention", 2022; Dao, "FlashAttention-2", 2023.
Oracle: :func:`attnlab.reference.scaled_dot_product_attention`.
"""

from __future__ import annotations

import functools
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

BLOCK_ROWS = 256  # query rows per head in one block (measured: 64-512 within noise, 256 best)
BLOCK_BYTES = 2 * 2**20  # float32 scores of one block (at least one head x G*BLOCK_ROWS x S)
PARALLEL_BLOCKS = True  # blocks on Python threads (see _in_threads), not one op at a time
LOG2E, LN2 = 1.0 / math.log(2.0), math.log(2.0)
inf = float("inf")


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


def flash_attention(q, k, v, mask, alignment, scale, dropout_p, generator=None):
    """softmax(Q K^T * scale + M) V in blocks; (B,H,L,E), (B,Hkv,S,E), (B,Hkv,S,Ev) -> (B,H,L,Ev).

    Args:
        q, k, v: 4-D, one dtype, on CPU; Hkv divides H (query head h reads kv head h // G).
        mask: None, bool (True = may attend) or an additive float bias, broadcastable to
            (B, H, L, S); an expanded view stays small (sliced per block, never expanded).
        alignment: None, "top_left" or "bottom_right" causal (see :mod:`attnlab.masks`).
        scale: the scores' multiplier.
        dropout_p: in [0, 1); survivors are scaled by 1 / (1 - p).
        generator: draws the call's dropout seed (default: torch's default generator).

    Rows with no attendable key give output 0 and zero gradients. Differentiable in q, k, v.
    """
    seed = 0
    if dropout_p > 0:
        seed = int(torch.randint(2**62, (), generator=generator))
    return _FlashAttention.apply(q, k, v, mask, alignment, float(scale), float(dropout_p), seed)


class _Plan:
    """The tiling of one call, shared by forward and backward (so dropout blocks match)."""

    def __init__(self, q, k, v, mask, alignment, scale, dropout_p, seed):
        B, H, L, E = q.shape
        Hkv, S, Ev = k.shape[1], k.shape[2], v.shape[3]
        self.B, self.H, self.Hkv, self.G, self.L, self.S, self.E, self.Ev = (
            B, H, Hkv, H // Hkv, L, S, E, Ev,
        )  # fmt: skip
        self.dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # softmax
        wide = q.dtype == torch.bfloat16 and native_bf16()
        self.mm_dtype = q.dtype if q.dtype == torch.float64 or wide else torch.float32
        self.offset = None if alignment is None else (S - L if alignment == "bottom_right" else 0)
        self.rows = min(L, BLOCK_ROWS)
        per_head = self.G * self.rows * S * 4  # bytes of one kv head's scores in a block
        if per_head * Hkv <= BLOCK_BYTES:  # several batch rows, all heads
            self.batches, self.heads = max(1, BLOCK_BYTES // (per_head * Hkv)), Hkv
        else:  # one batch row, some heads
            self.batches, self.heads = 1, max(1, BLOCK_BYTES // per_head)
        self.scale, self.scale2 = scale, scale * LOG2E  # 2^(x log2 e) = e^x: exp2 is ~2x faster
        self.p, self.seed = dropout_p, seed
        self.mask = _mask5(mask, self, q.device)

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

    def load(self, q, k, v):
        """The compute-dtype q (B, Hkv, G, L, E), k, v (16-bit widened once, unless native)."""
        B, Hkv, G, L, E = self.B, self.Hkv, self.G, self.L, self.E
        self.q = q.detach().to(self.mm_dtype).view(B, Hkv, G, L, E)  # (B, H, L, E) -> 5-D
        self.k, self.v = k.detach().to(self.mm_dtype), v.detach().to(self.mm_dtype)

    def scores(self, bs, js, r0, r1, kmax, scratch):
        """Block scores in base 2, ``log2(e) s Q K^T + M``, (n, G*R, kmax), -inf = masked.

        Also returns the block's (n, G*R, E) ``log2(e) s Q`` (G heads stacked, GQA folding).
        """
        nb, nh, R = bs.stop - bs.start, js.stop - js.start, r1 - r0
        qb = _scratch(scratch, "q", (nb, nh, self.G, R, self.E), self.mm_dtype)
        torch.mul(self.q[bs, js, :, r0:r1], self.scale2, out=qb)
        qb = qb.view(nb * nh, self.G * R, self.E)  # (n, G*R, E)
        kb = self.k[bs, js, :kmax].flatten(0, 1)  # (n, kmax, E)
        s = _scratch(scratch, "s", (nb * nh, self.G * R, kmax), self.mm_dtype)
        s = torch.bmm(qb, kb.transpose(1, 2), out=s).to(self.dtype)
        s5 = s.view(nb, nh, self.G, R, kmax)
        if self.mask is not None:
            m = self.mask
            m = m[bs] if m.shape[0] > 1 else m
            m = m[:, js] if m.shape[1] > 1 else m
            m = m[:, :, :, r0:r1] if m.shape[3] > 1 else m
            m = m[..., :kmax] if m.shape[4] > 1 else m
            if m.dtype == torch.bool:  # True = masked here (inverted once, see _mask5)
                s5.masked_fill_(m, -inf)
            else:
                s5.add_(m)
        if self.offset is not None:  # keys past the block's first row: the triangle
            c0 = max(0, r0 + self.offset + 1)
            if c0 < kmax:
                q_pos = torch.arange(r0, r1)[:, None] + self.offset  # (R, 1)
                hidden = torch.arange(c0, kmax)[None, :] > q_pos  # (R, kmax - c0)
                s5[..., c0:].masked_fill_(hidden, -inf)
        return s, qb

    def dropped(self, n, shape, scratch):
        """Block n's dropout, bool (True = dropped): the same draws in forward and backward."""
        g = torch.Generator().manual_seed(self.seed + n)
        u = _scratch(scratch, "u", shape, self.dtype).uniform_(generator=g)
        return torch.lt(u, self.p, out=_scratch(scratch, "d", shape, torch.bool))

    def forward_block(self, task, out, lse, scratch):
        """Output rows and their (base 2) lse of one block: exact softmax over keys 0:kmax."""
        bs, js, (n, r0, r1, kmax) = task
        shape4 = (bs.stop - bs.start, js.stop - js.start, self.G, r1 - r0)
        if kmax <= 0:  # every row of the block comes before the first key: dead
            out[bs, js, :, r0:r1] = 0.0
            return
        s, _ = self.scores(bs, js, r0, r1, kmax, scratch)  # (n, G*R, kmax)
        m = s.amax(-1, keepdim=True)  # (n, G*R, 1)
        dead = m == -inf
        m.masked_fill_(dead, 0.0)  # 2^(-inf - 0) = 0: a dead row sums to 0
        s.sub_(m).exp2_()
        total = s.sum(-1, keepdim=True)
        if self.p > 0:  # lse is of the undropped weights; the dropped ones are zeroed
            s.masked_fill_(self.dropped(n, s.shape, scratch), 0.0)
        o = torch.bmm(s.to(self.mm_dtype), self.v[bs, js, :kmax].flatten(0, 1))  # (n, G*R, Ev)
        norm = total.reciprocal().masked_fill_(dead, 0.0) / (1.0 - self.p)
        out[bs, js, :, r0:r1] = o.mul_(norm).view(*shape4, self.Ev)
        lse[bs, js, :, r0:r1] = (m + total.log2()).masked_fill_(dead, inf).view(shape4)

    def backward_group(self, group, do, D, lse2, dq, dk, dv, scratch):
        """dQ of the group's rows, and its kv heads' dK, dV summed over its row blocks."""
        bs, js, blocks = group
        G, E, Ev, p, mm = self.G, self.E, self.Ev, self.p, self.mm_dtype
        for n, r0, r1, kmax in blocks:
            shape5 = (bs.stop - bs.start, js.stop - js.start, G, r1 - r0, E)
            if kmax <= 0:
                dq[bs, js, :, r0:r1] = 0.0
                continue
            s, qb = self.scores(bs, js, r0, r1, kmax, scratch)
            R = G * (r1 - r0)
            P = s.sub_(lse2[bs, js, :, r0:r1].reshape(-1, R, 1)).exp2_()  # (n, G*R, kmax)
            dob = do[bs, js, :, r0:r1].reshape(-1, R, Ev)  # (n, G*R, Ev)
            kb, vb = self.k[bs, js, :kmax].flatten(0, 1), self.v[bs, js, :kmax].flatten(0, 1)
            W = P
            if p > 0:
                dropped = self.dropped(n, P.shape, scratch)
                W = torch.mul(P, 1.0 / (1.0 - p), out=_scratch(scratch, "w", P.shape, P.dtype))
                W.masked_fill_(dropped, 0.0)
            dv_blk = dv[bs, js, :kmax].view(-1, kmax, Ev)  # (n, kmax, Ev), a view (never a copy)
            _accumulate(dv_blk, W.transpose(1, 2), dob)  # += W^T dO
            dp = _scratch(scratch, "dp", P.shape, mm)
            dp = torch.bmm(dob, vb.transpose(1, 2), out=dp).to(self.dtype)  # dO V^T
            if p > 0:
                dp.masked_fill_(dropped, 0.0).mul_(1.0 / (1.0 - p))
            dS = dp.sub_(D[bs, js, :, r0:r1].reshape(-1, R, 1)).mul_(P)  # P * (dP - D)
            dq[bs, js, :, r0:r1] = torch.bmm(dS.to(mm), kb).mul_(self.scale).view(shape5)
            dk_blk = dk[bs, js, :kmax].view(-1, kmax, E)
            _accumulate(dk_blk, dS.transpose(1, 2), qb)  # += dS^T (log2(e) s Q)


def _in_threads(tasks, work):
    """``work(task, scratch)`` for every task, on torch.get_num_threads() Python threads.

    Each thread takes the next task when it is done with one, runs torch single-threaded and
    keeps its own scratch: on a CPU shared with other processes, one OpenMP parallel region per
    op waits for its slowest thread at every op, while whole blocks per thread do not.
    """
    threads = min(torch.get_num_threads(), len(tasks))
    if threads <= 1 or not PARALLEL_BLOCKS:
        scratch = {}
        for task in tasks:
            work(task, scratch)
        return
    todo, lock = iter(tasks), threading.Lock()

    def worker():
        torch.set_num_threads(1)
        scratch = {}
        with torch.no_grad():
            while True:
                with lock:
                    task = next(todo, None)
                if task is None:
                    return
                work(task, scratch)

    outer = torch.get_num_threads()
    try:
        with ThreadPoolExecutor(threads) as pool:
            for f in [pool.submit(worker) for _ in range(threads)]:
                f.result()
    finally:
        torch.set_num_threads(outer)  # MKL's thread count is global: give it back


def _accumulate(dst, a, b):
    """dst += a @ b, batched, in place in ``dst`` (a float32 view).

    bf16 operands (native bf16 only) are widened: a bf16 ``bmm`` rounds its result to bf16, and
    dK, dV would collect one such rounding per row block (2x the naive formula's error).
    """
    dst.baddbmm_(a.to(dst.dtype), b.to(dst.dtype))  # (no copies when already float32)


def _scratch(scratch, name, shape, dtype):
    """A contiguous (shape) view of the thread's reusable flat buffer ``name`` (grown on need)."""
    size = math.prod(shape)
    buf = scratch.get(name)
    if buf is None or buf.numel() < size or buf.dtype != dtype:
        buf = scratch[name] = torch.empty(size, dtype=dtype)
    return buf[:size].view(shape)


def _mask5(mask, plan, device):
    """The mask as (Bm, Hkv|1, G|1, L|1, S|1), its broadcast dims of size 1 (nothing expanded).

    A bool mask is inverted (True = masked); a bias is cast to the softmax dtype and taken to
    base 2 (times log2 e), once.
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
    if mask.dtype == torch.bool:
        return ~mask
    return mask.to(device=device, dtype=plan.dtype) * LOG2E


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, alignment, scale, dropout_p, seed):
        plan = _Plan(q, k, v, mask, alignment, scale, dropout_p, seed)
        plan.load(q, k, v)
        B, Hkv, G, L = plan.B, plan.Hkv, plan.G, plan.L
        out = q.new_empty(B, Hkv, G, L, plan.Ev)
        lse = torch.full((B, Hkv, G, L), inf, dtype=plan.dtype)  # base 2 here; +inf: dead row
        blocks = [(bs, js, b) for bs, js, rows in plan.groups() for b in rows]
        _in_threads(blocks, lambda task, scratch: plan.forward_block(task, out, lse, scratch))
        out = out.view(B, plan.H, L, plan.Ev)
        lse = lse.mul_(LN2).view(B, plan.H, L)  # natural log: the row log-sum-exp of the scores
        plan.q = plan.k = plan.v = None  # the backward reloads from the saved inputs
        ctx.save_for_backward(q, k, v, out, lse, plan.mask)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, mask = ctx.saved_tensors
        plan = ctx.plan
        plan.mask = mask
        plan.load(q, k, v)
        B, Hkv, G, L, S, E, Ev = plan.B, plan.Hkv, plan.G, plan.L, plan.S, plan.E, plan.Ev
        acc = plan.dtype
        lse2 = (lse * LOG2E).view(B, Hkv, G, L)
        do = dout.to(plan.mm_dtype).reshape(B, Hkv, G, L, Ev)  # (B, H, L, Ev) -> 5-D
        D = (do.to(acc) * out.to(acc).view(B, Hkv, G, L, Ev)).sum(-1)  # rowsum(dO * O)
        dq = torch.empty(B, Hkv, G, L, E, dtype=acc)
        dk = torch.zeros(B, Hkv, S, E, dtype=acc)
        dv = torch.zeros(B, Hkv, S, Ev, dtype=acc)
        _in_threads(  # one thread per group of kv heads: dK, dV are summed over row blocks
            plan.groups(),
            lambda g, scratch: plan.backward_group(g, do, D, lse2, dq, dk, dv, scratch),
        )
        plan.mask = plan.q = plan.k = plan.v = None
        return (
            dq.view(B, plan.H, L, E).to(q.dtype),
            dk.mul_(LN2).to(k.dtype),  # qb carried log2(e): take it back out
            dv.to(v.dtype),
            None, None, None, None, None,
        )  # fmt: skip
