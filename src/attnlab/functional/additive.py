"""Additive (Bahdanau) attention in bounded memory.

The naive formula broadcasts the projected queries against the projected keys,
``tanh(W_q q_i + W_k k_j)`` for every pair (i, j): a (B, L, S, A) tensor. At B = 8,
L = S = 1024, A = 256 that is 2^31 floats -- 8 GiB, twice over with the tanh, and autograd keeps
it for the backward pass. Yet only the (B, L, S) scores are needed downstream.

Here the (i, j) pairs are visited in blocks of query rows: each block's tanh lives in one reused
buffer of about ``CHUNK_BYTES`` and is reduced against ``w`` at once. Small blocks stay in the
CPU caches, and no fresh memory is touched, which is why this is also ~10x faster than the naive
formula on CPU, not only smaller. The backward pass recomputes
each block's tanh instead of storing it (as FlashAttention recomputes its scores), so training
also runs in bounded memory:

    s_ij = w . t_ij,   t_ij = tanh(a_i + b_j),   a = W_q q + bias,   b = W_k k
    ds/dw   = sum_ij g_ij t_ij
    ds/da_i = sum_j  g_ij w * (1 - t_ij^2)
    ds/db_j = sum_i  g_ij w * (1 - t_ij^2)

On CUDA (and on CPU under ``TRITON_INTERPRET=1``) :func:`additive_attention` runs attnlab's fused
Triton kernel instead (:mod:`attnlab.kernels.triton_additive`): the same math tiled over (L, S)
with an online softmax; it keeps the (B, L, S) scores for the backward only in training and up
to a budget (past it the backward rebuilds them). It falls back to the path above for what it
does not take (weights requested, dropout, float64, ...);
:func:`explain_additive` says which path a call takes and why.
"""

from __future__ import annotations

import functools
import math
import time

import torch

from attnlab._checks import (
    broadcast_shapes,
    causal_alignment,
    check_bias_range,
    check_dropout,
    check_floating,
    check_mask,
)
from attnlab._derivatives import first_derivatives_only
from attnlab.functional import _transforms
from attnlab.functional._layout import with_causal
from attnlab.functional.nonfinite import is_finite_assumed, propagate_nonfinite
from attnlab.functional.sdpa import Dispatch, _exporting
from attnlab.functional.softmax import LOW_PRECISION, attention
from attnlab.kernels import _triton
from attnlab.kernels.choice import env_setting
from attnlab.masks import unwrap

CHUNK_BYTES = 8 * 2**20  # per-block buffer: large enough for big matmuls, small for the caches


def _rows_per_chunk(t: torch.Tensor, num_keys: int, attn_dim: int, chunk_bytes: int) -> int:
    return max(1, chunk_bytes // (t.element_size() * max(1, num_keys * attn_dim)))


TANH_ENV = "ATTNLAB_CPU_TANH"
TANH_SETTINGS = ("measure", "tanh", "sigmoid")


def tanh_by_sigmoid() -> bool:
    """Whether the blocked path computes tanh as ``2 sigmoid(2x) - 1`` (else ``torch.tanh``).

    ``torch.tanh`` has a relative error. ``sigmoid(2x) - 1/2`` is rounded near 1/2, so it
    carries up to ~6e-8 *absolute* error however small x is: weights and outputs keep a naive
    float32 control's error (a softmax sees score differences), but the scores and the gradient
    of ``w`` lose relative precision when every pre-activation is small (|x| ~ 1e-2: ~8x the
    control's error, 5-48x for dw). It is taken only where it is much faster, and CPUs differ
    (one thread, float32: on an AMD Zen 4 sigmoid took 1.1 ms and tanh 5.3 ms per 8 MiB; on an
    Intel Xeon with AMX tanh 0.66 ns and sigmoid 1.18 ns per element).

    ``ATTNLAB_CPU_TANH``: ``tanh``, ``sigmoid``, or ``measure`` (the default: sigmoid only if
    it runs in less than 2/3 of tanh's time, measured once per process, ~2 ms).
    """
    setting = env_setting(TANH_ENV, TANH_SETTINGS)
    return setting == "sigmoid" if setting != "measure" else _sigmoid_much_faster()


def _sigmoid_much_faster() -> bool:
    """:func:`_measured_sigmoid_much_faster`; torch.compile calls it when it traces a call and
    keeps the answer in the graph as a constant (marked below, as sdpa's _blocked_in_graph)."""
    return _measured_sigmoid_much_faster()


# torch.compiler.assume_constant_result(_sigmoid_much_faster), without importing torch._dynamo
_sigmoid_much_faster._dynamo_marked_constant = True


@functools.cache
def _measured_sigmoid_much_faster() -> bool:
    x = torch.linspace(-4.0, 4.0, 2**18)  # (not random: vmap refuses random ops by default)
    out = torch.empty_like(x)
    best = {"sigmoid": math.inf, "tanh": math.inf}
    for _ in range(5):
        for name in best:
            start = time.perf_counter()
            if name == "sigmoid":
                torch.sigmoid(x, out=out).sub_(0.5)
            else:
                torch.tanh(x, out=out)
            best[name] = min(best[name], time.perf_counter() - start)
    return best["sigmoid"] < best["tanh"] * 2 / 3


def _tanh(a_i: torch.Tensor, b: torch.Tensor, out: torch.Tensor, c: float) -> torch.Tensor:
    """out = c tanh(x), x = (a_i + b) / (2c): c = 1 (``torch.tanh``) or 1/2 (via
    ``tanh(x) = 2 sigmoid(2x) - 1``, a_i and b pre-doubled); see :func:`tanh_by_sigmoid`."""
    torch.add(a_i[:, None, :], b[None, :, :], out=out)  # (r, 1, A) + (1, S, A) -> (r, S, A)
    if c == 1.0:
        return torch.tanh(out, out=out)
    return torch.sigmoid(out, out=out).sub_(0.5)


def _chunked_scores(a, b, w, chunk_bytes, c):
    """s (N, L, S) from a (N, L, A), b (N, S, A), w (A,), tanh in row blocks (``c``: _tanh)."""
    N, L, A = a.shape
    S = b.shape[1]
    rows = _rows_per_chunk(a, S, A, chunk_bytes)
    a2, b2, w2 = (a, b, w) if c == 1.0 else (a / c, b / c, w / c)
    scores = a.new_empty(N, L, S)
    buf = a.new_empty(min(rows, L) * S * A)
    for n in range(N):
        for i in range(0, L, rows):
            r = min(rows, L - i)
            t = _tanh(a2[n, i : i + r], b2[n], buf[: r * S * A].view(r, S, A), c)
            torch.matmul(t, w2, out=scores[n, i : i + r])  # (r, S, A) @ (A,) -> (r, S)
    return scores


class _AdditiveScores(torch.autograd.Function):
    """s[n, i, j] = w . tanh(a[n, i] + b[n, j]) without storing the (N, L, S, A) tanh.

    The context is set in ``forward``: ``apply`` then binds no signature (a ``setup_context``
    Function pays ~20 us a call for it, a quarter of a small call); :class:`_AdditiveScoresFunc`
    is the twin that ``torch.func.grad`` takes.
    """

    @staticmethod
    def forward(ctx, a, b, w, chunk_bytes, c):  # a (N, L, A), b (N, S, A), w (A,); c: _tanh
        ctx.save_for_backward(a, b, w)
        ctx.chunk_bytes, ctx.c = chunk_bytes, c
        return _chunked_scores(a, b, w, chunk_bytes, c)

    @staticmethod
    @first_derivatives_only("attnlab's chunked additive scores")
    def backward(ctx, grad):  # grad (N, L, S)
        a, b, w = ctx.saved_tensors
        N, L, A = a.shape
        S = b.shape[1]
        c = ctx.c
        rows = _rows_per_chunk(a, S, A, ctx.chunk_bytes)
        a2, b2 = (a, b) if c == 1.0 else (a / c, b / c)
        grad = grad.contiguous()
        da, db, dw = torch.empty_like(a), torch.zeros_like(b), torch.zeros_like(w)
        buf = a.new_empty(min(rows, L) * S * A)
        for n in range(N):
            for i in range(0, L, rows):
                r = min(rows, L - i)
                g = grad[n, i : i + r]  # (r, S)
                h = _tanh(a2[n, i : i + r], b2[n], buf[: r * S * A].view(r, S, A), c)  # c t
                dw += (g.reshape(1, -1) @ h.view(-1, A)).view(A) / c  # sum_ij g_ij t_ij
                h.square_().mul_(-1.0 / c**2).add_(1.0).mul_(w).mul_(g[..., None])  # g w (1-t^2)
                da[n, i : i + r] = h.sum(1)
                db[n] += h.sum(0)
        return da, db, dw, None, None


class _AdditiveScoresFunc(_AdditiveScores):
    """:class:`_AdditiveScores` with forward and context apart (``setup_context``), which
    ``torch.func.grad`` requires; the same backward."""

    @staticmethod
    def forward(a, b, w, chunk_bytes, c):
        return _chunked_scores(a, b, w, chunk_bytes, c)

    @staticmethod
    def setup_context(ctx, inputs, output):
        a, b, w, chunk_bytes, c = inputs
        ctx.save_for_backward(a, b, w)
        ctx.chunk_bytes, ctx.c = chunk_bytes, c


def additive_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    w_query: torch.Tensor,
    w_key: torch.Tensor,
    w_score: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Additive (Bahdanau) scores ``w^T tanh(W_q q + W_k k + b)`` in bounded memory.

    Math:
        .. math:: s_{ij} = w^\\top \\tanh(W_q q_i + W_k k_j + b)

    Args:
        query: (..., L, Dq), e.g. the decoder state(s).
        key: (..., S, Dk), e.g. the encoder states; same leading dims as ``query``.
        w_query: (A, Dq) -- ``W_q``; A is the attention width. ``None`` when ``query`` is
            already projected (width A).
        w_key: (A, Dk) -- ``W_k``; ``None`` when ``key`` is already projected (width A): a
            decoder projects the encoder states once per sentence, not at every step.
        w_score: (A,) -- ``w`` (Bahdanau's ``v_a``).
        bias: optional (A,).

    Memory: the tanh is computed in blocks of query rows in one reused buffer of about
    ``attnlab.functional.additive.CHUNK_BYTES`` (8 MiB), instead of 4 * B * L * S * A bytes
    for the naive formula; the backward pass recomputes it block by block.

    Returns:
        (..., L, S) scores. float16/bfloat16 inputs are computed in float32 and cast back.

    Reference: :func:`attnlab.reference.additive_scores`.
    """
    return _scores(query, key, w_query, w_key, w_score, bias).to(query.dtype)


def _scores(query, key, w_query, w_key, w_score, bias) -> torch.Tensor:
    """additive_scores in the compute dtype (float32 for float16/bfloat16 inputs)."""
    for name, t in (("query", query), ("key", key), ("w_query", w_query), ("w_key", w_key)):
        if t is not None:
            check_floating(name, t)
    check_floating("w_score", w_score)
    _check_additive_shapes(query, key, w_query, w_key, w_score, bias)
    dtype = torch.float32 if query.dtype in LOW_PRECISION else query.dtype
    a, b = _projections(query, key, w_query, w_key, bias, dtype)
    lead = broadcast_shapes(a.shape[:-2], b.shape[:-2])
    N = math.prod(lead)
    a3 = a.expand(*lead, *a.shape[-2:]).reshape(N, *a.shape[-2:])  # (N, L, A)
    b3 = b.expand(*lead, *b.shape[-2:]).reshape(N, *b.shape[-2:])  # (N, S, A)
    if _readable_because() is not None:  # the naive formula, which they can take
        return (
            torch.tanh(a3[:, :, None, :] + b3[:, None, :, :])
            .matmul(w_score.to(dtype))
            .view(*lead, a.shape[-2], b.shape[-2])
        )  # (N, L, S, A) @ (A,) -> (N, L, S)
    c = 0.5 if tanh_by_sigmoid() else 1.0
    function = _AdditiveScoresFunc if "grad" in _transforms.active() else _AdditiveScores
    scores = function.apply(
        a3.contiguous(), b3.contiguous(), w_score.to(dtype).contiguous(), CHUNK_BYTES, c
    )
    return scores.view(*lead, a.shape[-2], b.shape[-2])


def _projections(query, key, w_query, w_key, bias, dtype):
    """a = W_q q + bias (..., L, A) and b = W_k k (..., S, A), in ``dtype``.

    Under ``torch.autocast`` the products run in its 16-bit dtype, as autocast asks; their
    results are cast back to ``dtype``, so that the tanh, the scores and the backward's sums
    over row blocks stay in ``dtype`` (a 16-bit ``db`` rounded at every block).
    """
    a = query.to(dtype) if w_query is None else query.to(dtype) @ w_query.to(dtype).T  # (.., L, A)
    if bias is not None:
        a = a + bias.to(dtype)
    b = key.to(dtype) if w_key is None else key.to(dtype) @ w_key.to(dtype).T  # (..., S, A)
    return a.to(dtype), b.to(dtype)


def _check_additive_shapes(query, key, w_query, w_key, w_score, bias) -> None:
    if key.dtype != query.dtype and not _autocasting(key):  # (weights may differ: cast)
        raise TypeError(
            f"query and key must share one dtype; got {query.dtype} and {key.dtype}: the "
            f"computation would silently run in the query's. Fix: cast one, e.g. "
            f"key.to(query.dtype)."
        )
    A = w_score.shape[0] if w_score.dim() == 1 else None
    problems = []
    if A is None:
        problems.append(f"w_score must be (A,), got {tuple(w_score.shape)}")
    for name, x, w, width in (("query", query, w_query, "Dq"), ("key", key, w_key, "Dk")):
        if A is None:
            break
        if w is None and x.shape[-1] != A:
            problems.append(
                f"a projected {name} (w_{name}=None) must have width A={A}, got {x.shape[-1]}"
            )
        elif w is not None and w.shape != (A, x.shape[-1]):
            problems.append(
                f"w_{name} must be (A, {width}) = ({A}, {x.shape[-1]}), got {tuple(w.shape)}"
            )
    if A is not None and bias is not None and bias.shape != (A,):
        problems.append(f"bias must be (A,) = ({A},), got {tuple(bias.shape)}")
    fixes = []
    if problems:
        fixes.append(
            "W_q maps queries (width Dq) and W_k keys (width Dk) to the attention width A, and "
            "w_score reduces A to one score"
        )
    if query.dim() < 2 or key.dim() != query.dim():
        problems.append(
            f"query (..., L, Dq) and key (..., S, Dk) need the same number of dims (>= 2), got "
            f"{tuple(query.shape)} and {tuple(key.shape)}"
        )
        fixes.append("give key the query's leading dims, e.g. (B, H, S, Dk) for (B, H, L, Dq)")
    else:
        try:
            broadcast_shapes(query.shape[:-2], key.shape[:-2])
        except RuntimeError:
            problems.append(
                f"query and key leading dims must match (or broadcast), got "
                f"{tuple(query.shape)} and {tuple(key.shape)}"
            )
            fixes.append(
                "additive attention pairs every query with the keys of the same leading index "
                "(no grouped-query heads): with H query heads and Hkv kv heads, repeat the "
                "key and value heads, key.repeat_interleave(H // Hkv, dim=-3)"
            )
    if problems:
        raise ValueError(
            "additive attention: " + "; ".join(problems) + ". Fix: " + "; ".join(fixes) + "."
        )


def additive_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    w_query: torch.Tensor,
    w_key: torch.Tensor,
    w_score: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    is_causal: bool | str = False,
    dropout_p: float = 0.0,
    return_weights: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Additive (Bahdanau) attention: ``softmax(w^T tanh(W_q q + W_k k + b)) V``.

    The (B, L, S, A) tanh tensor of the naive formula is never materialised (see the module
    docstring): memory is O(B L S) for the scores plus one bounded block, in forward and
    backward.

    Math:
        .. math:: s_{ij} = w^\\top \\tanh(W_q q_i + W_k k_j + b), \\quad
                  \\alpha_i = \\text{masked\\_softmax}(s_i), \\quad
                  c_i = \\sum_j \\alpha_{ij} v_j

    Args:
        query: (..., L, Dq).
        key: (..., S, Dk).
        value: (..., S, Dv).
        w_query, w_key, w_score, bias: (A, Dq), (A, Dk), (A,), optional (A,). ``w_query`` or
            ``w_key`` may be ``None`` when that input is already projected to width A.
        attn_mask: bool (True = may attend) or additive float, broadcastable to (..., L, S).
        is_causal: False, True (L == S), "top_left" or "bottom_right".
        dropout_p: attention dropout probability, applied when > 0.
        return_weights: also return the (..., L, S) weights.

    Returns:
        (..., L, Dv) context vectors, and the weights if ``return_weights``.

    References:
        Bahdanau, Cho, Bengio, "Neural Machine Translation by Jointly Learning to Align and
        Translate", ICLR 2015. Oracle: :func:`attnlab.reference.additive_attention`.

    Example:
        >>> q, k = torch.randn(2, 3, 8), torch.randn(2, 5, 6)
        >>> w_q, w_k, w = torch.randn(16, 8), torch.randn(16, 6), torch.randn(16)
        >>> additive_attention(q, k, k, w_q, w_k, w).shape
        torch.Size([2, 3, 6])
    """
    _check_value(key, value)
    dropout_p = check_dropout(dropout_p)  # (also where the fused kernel serves: no dropout)
    _check_devices(query, key=key, value=value, w_query=w_query, w_key=w_key, w_score=w_score,
                   bias=bias)  # fmt: skip
    # (is_cuda first: the CPU path pays ~0.1 us for the question, not unfit()'s ~5)
    if (query.is_cuda or _triton.INTERPRET) and _triton.unfit(query, key, value, attn_mask) is None:
        lead, alignment = _checked(query, key, w_query, w_key, w_score, bias, attn_mask, is_causal)
        if _kernel_unfit(query, key, value, w_score, attn_mask, dropout_p, return_weights) is None:
            out = _fused(
                query, key, value, w_query, w_key, w_score, attn_mask, bias, lead, alignment
            )
            q, k, v = _broadcast(lead, query, key, value)
            return propagate_nonfinite(q, k, v, out)[0].to(query.dtype)
    scores = _scores(query, key, w_query, w_key, w_score, bias)  # (..., L, S)
    query, key, value = _broadcast(scores.shape[:-2], query, key, value)
    L, S = scores.shape[-2], scores.shape[-1]
    alignment = causal_alignment(is_causal, L, S)
    if attn_mask is not None:
        check_mask(attn_mask, tuple(scores.shape), device=scores.device)
    mask = with_causal(attn_mask, alignment, L, S, scores.device)
    out, weights = attention(scores, value, mask, dropout_p=dropout_p, return_weights=True)
    # NaN/inf inputs propagate (docs/conventions.md)
    out, weights = propagate_nonfinite(query, key, value, out, weights)
    return (out.to(query.dtype), weights.to(query.dtype)) if return_weights else out.to(query.dtype)


def explain_additive(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    w_query: torch.Tensor,
    w_key: torch.Tensor,
    w_score: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    is_causal: bool | str = False,
    dropout_p: float = 0.0,
    return_weights: bool = False,
) -> Dispatch:
    """Which path :func:`additive_attention` takes for these inputs, and why.

    ``"triton"``: the fused kernel (:mod:`attnlab.kernels.triton_additive`); ``"chunked"``: the
    blocked torch path of this module, with the reason the kernel does not serve the call.

    Example:
        >>> q, k = torch.randn(2, 3, 8), torch.randn(2, 5, 6)
        >>> w_q, w_k, w = torch.randn(16, 8), torch.randn(16, 6), torch.randn(16)
        >>> explain_additive(q, k, k, w_q, w_k, w).path  # CPU, no TRITON_INTERPRET=1
        'chunked'
    """
    _check_value(key, value)
    dropout_p = check_dropout(dropout_p)
    _check_devices(query, key=key, value=value, w_query=w_query, w_key=w_key, w_score=w_score,
                   bias=bias)  # fmt: skip
    lead, alignment = _checked(query, key, w_query, w_key, w_score, bias, attn_mask, is_causal)
    _broadcast(lead, query, key, value)  # (refuses a value of other leading dims, as the call)
    why = _triton.unfit(query, key, value, attn_mask) or _kernel_unfit(
        query, key, value, w_score, attn_mask, dropout_p, return_weights
    )
    if why is None:
        from attnlab.kernels import triton_additive

        return Dispatch(
            "triton",
            (triton_additive.describe(query, key, value, w_score, w_query, w_key, bias),),
        ).noting_assumption()
    A, L, S = w_score.shape[0], query.shape[-2], key.shape[-2]
    readable = _readable_because()
    if readable is not None:
        return Dispatch(
            "naive",
            (
                f"the fused Triton kernel does not serve: {why}",
                f"{readable}: the readable formula tanh(W_q q + W_k k + b) w, its (..., L, S, A) "
                "tanh stored (the chunked path fills buffers in place and defines only a "
                "backward)",
            ),
        ).noting_assumption()
    dtype = torch.float32 if query.dtype in LOW_PRECISION else query.dtype
    rows = min(L, _rows_per_chunk(query.new_empty((), dtype=dtype), S, A, CHUNK_BYTES))
    return Dispatch(
        "chunked",
        (
            f"the fused Triton kernel does not serve: {why}",
            f"tanh ({'2 sigmoid(2x) - 1' if tanh_by_sigmoid() else 'torch.tanh'}) in blocks of "
            f"{rows} query rows x {S} keys x A={A} in one "
            f"{CHUNK_BYTES / 2**20:g} MiB buffer, (..., L, S) scores stored, recomputed tanh in "
            "the backward",
        ),
    ).noting_assumption()


def _readable_because() -> str | None:
    """Why the scores must be the naive formula's torch ops, or None: under ``torch.func.vmap``,
    forward-mode AD or a nested ``grad`` (:func:`attnlab.functional._transforms.readable_only`),
    torch's ``sdpa_kernel(SDPBackend.MATH)`` (a second derivative: :mod:`attnlab._derivatives`),
    or ``torch.export`` (whose program keeps torch's ops, with gradients)."""
    transform = _transforms.readable_only()
    if transform is not None:
        return f"under torch.func ({transform})"
    if _transforms.math_backend_only():
        return "under torch's sdpa_kernel(SDPBackend.MATH)"
    if _exporting():
        return "under torch.export"
    return None


def _autocasting(t: torch.Tensor) -> bool:
    """Whether ``torch.autocast`` is on for ``t``'s device: there a bf16 projection meets a
    float32 state by design, and the scores are computed in float32 whatever they hold."""
    return torch.is_autocast_enabled(t.device.type)


def _check_value(key, value) -> None:
    check_floating("value", value)
    if value.dtype != key.dtype and not _autocasting(key):
        raise TypeError(
            f"key and value must share one dtype; got {key.dtype} and {value.dtype}: one of "
            f"them would silently be cast to the other's. Fix: cast one, e.g. "
            f"value.to(key.dtype)."
        )
    if value.shape[-2] != key.shape[-2]:
        raise ValueError(
            f"key and value must have the same length S; got key {tuple(key.shape)} and value "
            f"{tuple(value.shape)}. Fix: every key needs exactly one value."
        )


def _broadcast(lead, query, key, value):
    """query, key and value expanded to the scores' leading dims ``lead`` (views): what each
    score row reads, for the NaN rule, and one value sequence per score matrix. A value whose
    leading dims would enlarge them is refused."""
    try:
        fits = broadcast_shapes(value.shape[:-2], lead) == tuple(lead)
    except RuntimeError:
        fits = False
    if not fits or value.dim() != key.dim():
        raise ValueError(
            f"value (..., S, Dv) must have leading dims that broadcast to those of query and "
            f"key together, {tuple(lead)}; got value {tuple(value.shape)} for query "
            f"{tuple(query.shape)} and key {tuple(key.shape)}. Fix: one value sequence per key "
            f"sequence, e.g. value of shape {(*lead, key.shape[-2], value.shape[-1])}."
        )
    return tuple(t.expand(*lead, *t.shape[-2:]) for t in (query, key, value))


def _check_devices(query, **tensors) -> None:
    """Every tensor of the call on query's device (the fused kernel would read another GPU's
    memory through its pointer; torch's ops would fail mid-way with their own words)."""
    wrong = {n: t.device for n, t in tensors.items() if t is not None and t.device != query.device}
    if wrong:
        where = ", ".join(f"{n} on {d}" for n, d in wrong.items())
        raise ValueError(
            f"additive attention: every tensor must be on query's device, {query.device}; got "
            f"{where}. Fix: move them with .to(query.device)."
        )


def _checked(query, key, w_query, w_key, w_score, bias, attn_mask, is_causal):
    """The chunked path's checks, up front: (the broadcast leading dims, the causal alignment)."""
    for name, t in (("query", query), ("key", key), ("w_query", w_query), ("w_key", w_key)):
        if t is not None:
            check_floating(name, t)
    check_floating("w_score", w_score)
    _check_additive_shapes(query, key, w_query, w_key, w_score, bias)
    lead = broadcast_shapes(query.shape[:-2], key.shape[:-2])
    L, S = query.shape[-2], key.shape[-2]
    alignment = causal_alignment(is_causal, L, S)
    if attn_mask is not None:
        check_mask(attn_mask, (*lead, L, S), device=query.device)
        check_bias_range(attn_mask, torch.float32 if query.dtype in LOW_PRECISION else query.dtype)
    return lead, alignment


def _kernel_unfit(query, key, value, w_score, attn_mask, dropout_p, return_weights) -> str | None:
    """None when the fused kernel serves a call whose tensors Triton can take, else why not."""
    if return_weights:
        return "return_weights=True: the kernel never forms the weights (this path returns them)"
    if dropout_p > 0:
        return "dropout_p > 0: the kernel has no dropout"
    if torch.compiler.is_compiling():
        return "under torch.compile (its graph keeps torch's ops)"
    if _transforms.active():
        return "under a torch.func transform (its tensors cannot enter a Triton kernel)"
    from attnlab.kernels import triton_additive  # imports Triton: only now that it may run

    return triton_additive.supports(query, key, value, attn_mask, w_score.shape[0])


def _fused(query, key, value, w_query, w_key, w_score, attn_mask, bias, lead, alignment):
    """The kernel's call: projections by torch GEMMs (float32), batch dims flattened to N."""
    from attnlab.kernels import triton_additive

    a, b = _projections(query, key, w_query, w_key, bias, torch.float32)  # (.., L, A), (.., S, A)
    (L, A), S, Dv = a.shape[-2:], key.shape[-2], value.shape[-1]
    N = math.prod(lead)
    a = a.expand(*lead, L, A).reshape(N, L, A)  # (..., L, A) -> (N, L, A)
    b = b.expand(*lead, S, A).reshape(N, S, A)  # (..., S, A) -> (N, S, A)
    v = value.expand(*lead, S, Dv).reshape(N, S, Dv)  # (..., S, Dv) -> (N, S, Dv)
    if attn_mask is not None:  # (..., L, S) -> (N, L, S), a view when the dims merge
        attn_mask = unwrap(attn_mask).expand(*lead, L, S).reshape(N, L, S)
    out = triton_additive.additive_attention(
        a, b, w_score.float(), v, attn_mask, alignment, finite=is_finite_assumed()
    )
    return out.view(*lead, L, Dv)
