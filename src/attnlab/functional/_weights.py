"""Weights on demand: the (B, H, L, S) attention weights and the output, computed in blocks.

The textbook formula ``W = softmax(Q K^T * scale + M); O = W V`` keeps several (B, H, L, S)
temporaries alive (scores, masked scores, exponentials, weights) and, under autograd, saves them
for the backward. Here the scores of one **block** -- a few whole heads of one batch row, or a
range of query rows of one head: a contiguous slice of the result -- are computed at a time and
written in place into the returned weights, so the extra memory is one block
(``WEIGHTS_BLOCK_BYTES``). Each block holds complete rows, so its softmax is exact.

Forward, per block (h heads x r rows; ``m`` = the row maximum)::

    w = Qs_blk K^T (+ bias, masked -> -inf)        (h, r, S)   Qs = Q * scale
    w = softmax(w); rows with no key -> 0          the weights, in place
    (m, log l), log l = -log max(w)               (h, r, 2)   kept for the backward (>= fp32)
    O_blk = w V                                    (h, r, Ev)

Backward (:class:`WeightsAttention`), per block; ``w`` is the per-head weights the caller
holds (saved with the output), or, for averaged weights, recomputed as ``exp((s - m) - log l)``
(one GEMM and one exp; the max and the log-sum apart: a row a huge bias covers, ``finfo.min``
on every key, has ``|m|`` so large that ``m + log l`` rounds ``log l`` away, which made its
weights 1 each, not 1/S): never a (B, H, L, S) tensor besides what the caller holds::

    dW = dO_blk V^T + dW_user                      (h, r, S)   (dW_user / H for averaged weights)
    dS = w * (dW - rowsum(dW * w))                 softmax's Jacobian, row by row, where
         rowsum(dO V^T * w) = rowsum(dO * O)       (one (B, H, L) pass, as FlashAttention)
    dQ_blk = dS K * scale,  dK += dS^T Qs,  dV += w^T dO_blk

Grouped-query heads: query head h reads kv head ``h // G``; the gradients of the G query heads
of a group are summed into their kv head (``index_add_``).

Where the blocked CPU kernel in C++ serves (float32, or bfloat16 on a CPU that multiplies it
natively: :func:`native`), its blocks -- also whole rows against every visible key -- compute
the forward above and write each block's weights as they make them
(:func:`attnlab.kernels.cpu_flash.forward_with_weights`): no Python per block, no pass of its
own over the weights (averaged: each row block summed over the heads in a float32 buffer,
then written); with autograd its backward too. The blocks here are its readable twin, and
serve the rest (float64, float16, traced calls, a machine without a C++ compiler).
"""

from __future__ import annotations

import torch

from attnlab._derivatives import first_derivatives_only
from attnlab.functional import _memory
from attnlab.kernels import cpu_flash
from attnlab.masks import causal_keep

WEIGHTS_BLOCK_BYTES = 8 * 2**20  # scores of one block of query rows, on the weights path
BACKWARD_BLOCK_BYTES = 2 * 2**20  # the backward runs several passes per block: smaller blocks
inf = float("inf")


def block_shape(
    H: int, L: int, S: int, itemsize: int, nbytes: int | None = None, G: int = 1, B: int = 1
) -> tuple[int, int, int]:
    """(batch rows, heads, rows) of a block of scores of at most ``nbytes``
    (``WEIGHTS_BLOCK_BYTES``); a block of at least ``G`` heads (query heads per kv head) holds
    whole kv groups. All ``B`` batch rows make one block when they fit in it (decoding: B x
    (H, 1, S)); else a block is part of one batch row."""
    nbytes = WEIGHTS_BLOCK_BYTES if nbytes is None else nbytes
    per_head = L * S * itemsize
    if B * H * per_head <= nbytes:
        return B, H, L
    if per_head > nbytes:
        return 1, 1, max(1, nbytes // (S * itemsize))
    heads = max(1, min(H, nbytes // per_head))
    return 1, (heads - heads % G if heads >= G else heads), L


class _Blocks:
    """The blocks of a (B, H, L, S) score tensor and what each needs: kv heads, mask, causal."""

    def __init__(self, q, k, mask, alignment, nbytes=None):
        B, H, L, _ = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        self.shape = (B, H, L, S)
        self.G = G = H // Hkv  # (a block of >= G heads holds whole kv groups: see fold)
        # one batch row a block (every batch row in one block is weights_in_blocks' _one_block;
        # the backward sums dK and dV per batch row)
        _, self.heads, self.rows = block_shape(H, L, S, q.element_size(), nbytes, G)
        self.kv_head = torch.arange(H, device=q.device) // (H // Hkv)  # head h reads h // G
        self.mask = None if mask is None else mask.expand(B, H, L, S)  # a view, not a copy
        self.causal = None if alignment is None else causal_keep(L, S, alignment, q.device)
        self.can_die = self.mask is not None or self.causal is not None

    def __iter__(self):
        """Yield (b, heads slice, rows slice, kv heads index)."""
        B, H, L, _ = self.shape
        for b in range(B):
            for h0 in range(0, H, self.heads):
                h1 = min(H, h0 + self.heads)
                for r0 in range(0, L, self.rows):
                    yield b, slice(h0, h1), slice(r0, min(L, r0 + self.rows)), self.kv_head[h0:h1]

    def fold(self, hs: slice, rs: slice) -> int | None:
        """How many kv heads a block spans when its query heads can fold into rows -- whole
        kv groups, all rows -- else None. Folded, a block is ``(h, L, *) -> (h / G, G * L, *)``
        views and its K, V are slices: no copy of them per query head (what decoding with
        weights needs, its cache's empty slots masked). The mask is applied to the unfolded
        view, where it broadcasts as it does everywhere (:meth:`mask_`)."""
        L, G = self.shape[2], self.G
        h = hs.stop - hs.start
        if G == 1 or rs.stop - rs.start != L or h % G:
            return None
        return h // G

    def scores_(self, w, qs_blk, kb, b, hs, rs):
        """Write the masked scores of a block into ``w`` (h, r, S); -inf where not allowed."""
        torch.matmul(qs_blk, kb.transpose(-2, -1), out=w)  # (h, r, E) @ (h, E, S)
        return self.mask_(w, b, hs, rs)

    def mask_(self, w, b, hs, rs):
        """The mask and the causal triangle on a block's scores ``w`` (h, r, S), in place."""
        keep = None if self.mask is None else self.mask[b, hs, rs]
        return _mask_(w, keep, None if self.causal is None else self.causal[rs])


def _mask_(w, keep, causal):
    """Scores ``w`` masked in place: ``keep`` a bool mask or an additive bias (its -inf entries
    mask), ``causal`` a bool (r, S) triangle; either may be None; both broadcast to ``w``."""
    if keep is not None and keep.dtype != torch.bool and w.element_size() >= 4:
        w.add_(keep)
        keep = None
    elif keep is not None and keep.dtype != torch.bool:
        # 16-bit scores: the bias is added in float32 and each row kept relative to its max
        # (softmax is unchanged by a row's shift), so that a bias near the dtype's limit (a
        # float16 mask row of -65504) does not absorb the scores, as it would added in 16 bits
        t = w.float().add_(keep)
        if causal is not None:  # (first: the max is over the keys a row may attend)
            t.masked_fill_(~causal, -inf)
            causal = None
        top = t.amax(-1, keepdim=True)
        w.copy_(t.sub_(top.masked_fill_(~top.isfinite(), 0.0)))  # (dead and NaN rows as they are)
        keep = None
    if causal is not None:
        keep = causal if keep is None else keep & causal
    if keep is not None:
        w.masked_fill_(~keep, -inf)
    return w


@torch.no_grad()
def weights_in_blocks(q, k, v, mask, alignment, scale, average, weights=None, stats=None):
    """Output (B, H, L, Ev) and weights (B, H, L, S), or (B, 1, L, S) averaged, in blocks.

    ``weights``: a buffer to write into (a caller's ``weights_out``). ``stats``: a (B, H, L, 2)
    float32 (float64 for float64 inputs) tensor that receives each row's max score ``m``
    (``-inf`` for rows with no key) and ``log l``, its log-sum-exp less ``m``, for
    :class:`WeightsAttention`'s backward. With ``average`` the (B, H, L, S) tensor never exists.
    """
    B, H, L, _ = q.shape
    S, Ev = k.shape[2], v.shape[3]
    out = q.new_empty(B, H, L, Ev)
    if weights is None:  # fresh: huge pages where possible (see _memory)
        weights = _memory.empty(B, 1 if average else H, L, S, like=q)
    if alignment == "bottom_right" and L == 1:
        alignment = None  # the last position sees every key
    kind, _ = path(q, k, v, mask, stats is not None)
    if kind == "one block":
        return _one_block(q * scale, k, v, mask, alignment, average, out, weights, stats)
    if kind == "native":  # the C++ kernel's blocks
        return cpu_flash.forward_with_weights(q, k, v, mask, alignment, scale, weights)[0], weights
    qs = q * scale
    if average:
        weights.zero_()  # the blocks add into it
    blocks = _Blocks(q, k, mask, alignment)
    scratch = q.new_empty(blocks.heads, blocks.rows, S) if average else None
    for b, hs, rs, kv in blocks:
        h, r = hs.stop - hs.start, rs.stop - rs.start
        w = scratch[:h, :r] if average else weights[b, hs, rs]  # (h, r, S)
        n = blocks.fold(hs, rs)
        if n is not None:  # (h, L, *) -> (n, G * L, *): K and V sliced, not gathered
            hk = hs.start // (h // n)
            kb, vb = k[b, hk : hk + n], v[b, hk : hk + n]  # (n, S, E), (n, S, Ev)
            # (the queries reshaped: a copy where they are a view of (B, L, H, E) projections)
            q_rows = qs[b, hs].reshape(n, -1, qs.shape[-1])  # -> (n, G * L, E)
            torch.matmul(q_rows, kb.transpose(-2, -1), out=_fold(w, n))
            blocks.mask_(w, b, hs, rs)  # (on the (h, L, S) view)
            _softmax_(w, blocks.can_die, None if stats is None else stats[b, hs, rs])
            torch.matmul(_fold(w, n), vb, out=_fold(out[b, hs], n))
        else:
            kb, vb = k[b, kv], v[b, kv]  # (h, S, E), (h, S, Ev)
            blocks.scores_(w, qs[b, hs, rs], kb, b, hs, rs)
            _softmax_(w, blocks.can_die, None if stats is None else stats[b, hs, rs])
            torch.matmul(w, vb, out=out[b, hs, rs])  # (h, r, S) @ (h, S, Ev)
        if average:
            weights[b, 0, rs].add_(w.sum(-3), alpha=1.0 / H)
    return out, weights


# Where all the scores fit one block, the one-block path (six torch operators) or the C++
# kernel's blocks: the C++ blocks were as fast or faster from L = 128 query rows in float32 and
# from L = 16 in bfloat16; below, one block (decoding, L = 1-4: 1.3-2.3x faster than the C++
# blocks, whose row blocks it leaves nearly empty). Measured with weights_out on 2 threads of an
# AMX Xeon at (1-4, 8-32, 1-512, 64-2048 keys), E = 64.
NATIVE_FROM_ROWS = {torch.float32: 128, torch.bfloat16: 16}


def path(q, k, v, mask, stats=False) -> tuple[str, str | None]:
    """Which weights path a call takes: ``"one block"`` (:func:`_one_block`), ``"native"``
    (the C++ kernel's blocks) or ``"blocks"`` (the torch-ops blocks), and why the C++ kernel
    does not serve it (None where it does, or where one block is taken without asking: below
    :data:`NATIVE_FROM_ROWS`). One block where all the scores fit one block
    (``WEIGHTS_BLOCK_BYTES``) and the C++ kernel does not serve or serves slower; ``stats``: a
    caller that needs the row statistics of :func:`weights_in_blocks`, which it does not give."""
    B, H, L, _ = q.shape
    fits = block_shape(H, L, k.shape[2], q.element_size(), B=B) == (B, H, L)
    if fits and (stats or L < NATIVE_FROM_ROWS.get(q.dtype, 0)):
        return "one block", None  # (decoding's hot path asks no more)
    why = "the row statistics are asked for" if stats else native(q, k, v, mask)
    if why is None:
        return "native", None
    return ("one block" if fits else "blocks"), why


def native(q, k, v, mask) -> str | None:
    """None when the blocked CPU kernel in C++ (:func:`attnlab.kernels.cpu_flash.
    forward_with_weights`) computes the weights with the output, else why not: its blocks hold
    each row's every key, as these do, and write the weights as they make them (averaged: a row
    block summed over the heads first), with no Python per block and no pass of their own
    (1.0-1.2x the call without weights into ``weights_out``, against 1.5-1.6x for the torch-ops
    blocks below; float32, (4, 8, 1024, 64), 1 and 2 threads)."""
    return cpu_flash.weights_unfit(q, k, v, mask)


def _fold(t: torch.Tensor, n: int) -> torch.Tensor:
    """([B,] h, L, X) -> ([B,] n, h / n * L, X), a view (``view`` raises rather than copy:
    results are written through it)."""
    return t.view(*t.shape[:-3], n, -1, t.shape[-1])


def _one_block(qs, k, v, mask, alignment, average, out, weights, stats):
    """:func:`weights_in_blocks` when all the scores make one block (decoding: B x (H, 1, S)):
    each kv group's query heads as rows of its kv head, ``(B, H, L, *) -> (B, Hkv, G * L, *)``
    views, so that K and V are read once per kv head and a call is six operators, not the
    block loop's machinery (a decode step calls it once per layer)."""
    B, H, L, E = qs.shape
    Hkv = k.shape[1]
    w = qs.new_empty(B, H, L, k.shape[2]) if average else weights
    torch.matmul(qs.reshape(B, Hkv, -1, E), k.transpose(-2, -1), out=_fold(w, Hkv))
    causal = None if alignment is None else causal_keep(L, k.shape[2], alignment, qs.device)
    _mask_(w, mask, causal)  # (on the (B, H, L, S) view, where the mask broadcasts)
    _softmax_(w, mask is not None or causal is not None, stats)
    torch.matmul(_fold(w, Hkv), v, out=_fold(out, Hkv))
    if average:  # (as the block loop sums them: 0 + sum / H)
        torch.sum(w, 1, keepdim=True, out=weights).mul_(1.0 / H)
    return out, weights


def _softmax_(w, can_die, stats):
    """Softmax of a block's scores in place; dead rows 0; each row's max ``m`` and ``log l``
    into ``stats`` (the block's rows of it, a view), if given."""
    top = w.amax(-1, keepdim=True) if can_die or stats is not None else None
    dead = top == -inf if can_die else None  # (h, r, 1); a NaN row is not dead
    torch.softmax(w, -1, out=w)
    if stats is not None:
        # the largest weight is exp(m - lse) = 1 / l, so log l = -log(max w): one max-pass
        # instead of logsumexp's, in float32 at least; m = -inf for rows with no key
        stats[..., 0].copy_(top[..., 0])
        stats[..., 1].copy_(w.amax(-1).to(stats.dtype).log().neg_())
    if dead is not None:
        w.masked_fill_(dead, 0.0)  # rows with no attendable key: weights 0


class WeightsAttention(torch.autograd.Function):
    """Output and weights that both carry gradients, at the weights path's memory.

    ``apply(q, k, v, mask, alignment, scale, average) -> (out, weights)``; the mask (bool or a
    bias) takes no gradient. Saves Q, K, V, O, the row log-sum-exp and the per-head weights it
    returns; averaged, the backward recomputes each block's weights (see the module docstring).
    Where the C++ kernel serves (:func:`native`), it runs both ways: its forward writes the
    weights, its backward recomputes each block's from the row statistics and adds the weights'
    gradient to ``dO V^T`` (:func:`attnlab.kernels.cpu_flash.backward_with_weights`).
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, alignment, scale, average):
        B, H, L, _ = q.shape
        ctx.alignment, ctx.scale, ctx.average = alignment, scale, average
        ctx.native = path(q, k, v, mask)[0] == "native"
        if ctx.native:  # the C++ kernel's blocks, forward and backward
            weights = _memory.empty(B, 1 if average else H, L, k.shape[2], like=q)
            out, stats = cpu_flash.forward_with_weights(q, k, v, mask, alignment, scale, weights)
            ctx.save_for_backward(q, k, v, stats, mask, weights)
            return out, weights
        stats = q.new_empty(B, H, L, 2, dtype=torch.promote_types(q.dtype, torch.float32))
        out, weights = weights_in_blocks(q, k, v, mask, alignment, scale, average, stats=stats)
        # per head, the weights the caller holds are the backward's w: saved, not recomputed
        # (an in-place change to them then fails the backward loudly, as torch.softmax's does)
        ctx.save_for_backward(q, k, v, out, stats, mask, None if average else weights)
        return out, weights

    @staticmethod
    @first_derivatives_only("attnlab's weights-on-demand path")
    def backward(ctx, d_out, d_weights):
        if ctx.native:
            q, k, v, stats, mask, _ = ctx.saved_tensors  # (the weights: saved, so that an
            # in-place change to them fails the backward loudly, as on the other path)
            if d_out is None:  # only the weights were used
                d_out = q.new_zeros(*q.shape[:-1], v.shape[-1])
            grads = cpu_flash.backward_with_weights(
                d_out, q, k, v, stats, mask, ctx.alignment, ctx.scale, d_weights
            )
            return *grads, None, None, None, None
        q, k, v, out, stats, mask, weights = ctx.saved_tensors
        scale, average = ctx.scale, ctx.average
        H = q.shape[1]
        # (dq contiguous, as out= of its blocks: q may be a view of (B, L, H, E) projections,
        # and a compiled graph takes no out= that is not contiguous)
        dq, dk, dv = q.new_empty(q.shape), torch.zeros_like(k), torch.zeros_like(v)
        if d_out is None:  # only the weights were used
            d_out = torch.zeros_like(out)
        # rowsum(dW * w) over the part of dW that comes from the output is rowsum(dO * O)
        d_rows = (d_out * out).sum(-1, keepdim=True)  # (B, H, L, 1)
        blocks = _Blocks(q, k, mask, ctx.alignment, BACKWARD_BLOCK_BYTES)
        qs = q * scale
        dw_buf = q.new_empty(blocks.heads, blocks.rows, k.shape[2])
        w_buf = torch.empty_like(dw_buf) if weights is None else None  # (averaged: recomputed)
        for b, hs, rs, kv in blocks:
            kb, vb = k[b, kv], v[b, kv]  # (h, S, E), (h, S, Ev)
            h, r = hs.stop - hs.start, rs.stop - rs.start
            if weights is not None:
                w = weights[b, hs, rs]  # (h, r, S)
            else:
                w = blocks.scores_(w_buf[:h, :r], qs[b, hs, rs], kb, b, hs, rs)
                m, logl = stats[b, hs, rs].to(w.dtype).unbind(-1)  # (h, r) each
                w = torch.exp(w.sub_(m[..., None]).sub_(logl[..., None]), out=w)
                if blocks.can_die:  # dead rows: exp(-inf + inf) = NaN -> 0
                    w.masked_fill_(m[..., None] == -inf, 0.0)
            do = d_out[b, hs, rs]  # (h, r, Ev)
            dw = torch.matmul(do, vb.transpose(-2, -1), out=dw_buf[:h, :r])  # (h, r, S)
            rows = d_rows[b, hs, rs]  # (h, r, 1)
            if d_weights is not None:
                user = d_weights[b, 0, rs] / H if average else d_weights[b, hs, rs]
                dw += user
                rows = rows + torch.linalg.vecdot(user, w)[..., None]
            ds = dw.sub_(rows).mul_(w)  # softmax backward: w * (dW - rowsum(dW * w)), in place
            torch.matmul(ds, kb, out=dq[b, hs, rs])
            dk[b].index_add_(0, kv, ds.transpose(-2, -1) @ qs[b, hs, rs])
            dv[b].index_add_(0, kv, w.transpose(-2, -1) @ do)
        return dq.mul_(scale), dk, dv, None, None, None, None
