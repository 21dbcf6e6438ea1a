"""Scaled dot-product attention: one function, a fast path and a readable path.

``scaled_dot_product_attention`` picks a path for every call:

* **fused** -- torch's own ``F.scaled_dot_product_attention`` (on CPU its flash kernel), used
  whenever it gives the same result: no weights requested, and no dropout on CPU (torch's CPU
  kernel has no dropout and would silently fall back to its slow math path).
* **weights** -- the weights on demand: scores, weights and output computed together, one block
  of heads x query rows at a time, written in place into the returned weights, so the extra
  memory is one block (not the several (B, H, L, S) temporaries of the textbook formula). Used
  when weights are requested for inference.
* **eager** -- the readable formula ``masked_softmax(Q K^T * scale) V``, used when the weights
  need gradients, or with dropout on CPU (torch's CPU kernel has no dropout).

Both paths compute the same function: float64 results agree with the NumPy oracle
:func:`attnlab.reference.scaled_dot_product_attention` to rounding. Which path ran and why is
told by :func:`explain` (and logged at DEBUG level on the ``attnlab.dispatch`` logger)::

    >>> print(explain(q, k, v, return_weights=True))          # doctest: +SKIP
    weights: weights (per head) and output computed together in blocks of 2 head(s) x 1024 ...
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnlab._checks import (
    causal_alignment,
    check_bias_range,
    check_dropout,
    check_mask,
    check_qkv,
    check_scale,
)
from attnlab.functional._layout import (
    as_4d,
    grouped_scores,
    grouped_weighted_sum,
    nonfinite_rows,
    with_causal,
)
from attnlab.functional.softmax import masked_softmax
from attnlab.masks import causal_keep, plain

inf = float("inf")

logger = logging.getLogger("attnlab.dispatch")


@dataclass(frozen=True)
class Dispatch:
    """The path a call takes (``"fused"``, ``"weights"`` or ``"eager"``) and the reasons."""

    path: str
    reasons: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.path}: " + "; ".join(self.reasons)


_FUSED = Dispatch("fused", ("torch F.scaled_dot_product_attention",))
WEIGHTS_BLOCK_BYTES = 8 * 2**20  # scores of one block of query rows, on the weights path


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _choose(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: torch.Tensor | None,
    alignment: str | None,
    dropout_p: float,
    return_weights: bool | str,
    value: torch.Tensor | None = None,
    *,
    why: bool = True,
) -> Dispatch:
    """The path of a call; ``why=False`` skips writing the fused path's reasons (hot path)."""
    if 0 in query.shape or 0 in key.shape[-2:]:
        return Dispatch(
            "eager",
            (
                f"an empty dimension (query {tuple(query.shape)}, key "
                f"{tuple(key.shape)}): nothing to fuse",
            ),
        )
    if return_weights and dropout_p > 0:
        return Dispatch(
            "eager", ("return_weights with dropout -- the weights must be the dropped ones",)
        )
    if return_weights and _needs_grad(query, key, value, attn_mask):
        return Dispatch(
            "eager",
            (
                "return_weights with autograd -- the weights need a graph; the weights path "
                "runs without one (call under torch.no_grad() to use it)",
            ),
        )
    if return_weights:
        heads, rows = _block_shape(
            query.shape[1], query.shape[2], key.shape[2], query.element_size()
        )
        what = "averaged over heads" if return_weights == "average" else "per head"
        return Dispatch(
            "weights",
            (
                f"weights ({what}) and output computed together in blocks of {heads} head(s) x "
                f"{rows} query rows, written in place: extra memory one block, not (B, H, L, S)",
            ),
        )
    if dropout_p > 0 and query.device.type == "cpu":
        return Dispatch(
            "eager",
            (
                "dropout_p > 0 on CPU -- torch's fused CPU kernel has no dropout and would fall "
                "back to its own math path",
            ),
        )
    if not why:
        return _FUSED
    reasons = ["torch F.scaled_dot_product_attention"]
    if key.shape[1] != query.shape[1]:
        reasons.append(f"grouped-query heads H={query.shape[1]}, Hkv={key.shape[1]} (enable_gqa)")
    L, S = query.shape[-2], key.shape[-2]
    if alignment is not None and L == S and attn_mask is None:
        reasons.append("is_causal (L == S: top-left and bottom-right coincide)")
    elif alignment == "top_left" and attn_mask is None:
        reasons.append("is_causal (top-left)")
    elif alignment == "bottom_right" and L == 1:
        reasons.append("bottom-right causal with one query sees every key: no mask needed")
    elif alignment is not None:
        reasons.append(f"{alignment} causal with L={L}, S={S} passed as a bool mask")
    if attn_mask is not None and query.device.type != "cpu":
        reasons.append("fully masked rows zeroed after the kernel")
    return Dispatch("fused", tuple(reasons))


def explain(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    is_causal: bool | str = False,
    dropout_p: float = 0.0,
    return_weights: bool | str = False,
) -> Dispatch:
    """Which path :func:`scaled_dot_product_attention` takes for these inputs, and why."""
    check_qkv(query, key, value)
    alignment = causal_alignment(is_causal, query.shape[-2], key.shape[-2])
    attn_mask = plain(attn_mask)
    q, k, v, mask, _ = as_4d(query, key, value, attn_mask)
    return _choose(q, k, mask, alignment, dropout_p, return_weights, v)


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    is_causal: bool | str = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool | str = False,
    weights_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention with grouped-query heads, masks, dropout and weights.

    Math:
        .. math:: \\text{Attention}(Q, K, V) = \\text{softmax}\\Big(\\frac{Q K^\\top}{\\sqrt{E}}
                  + M\\Big) V

        with ``M`` 0 where attending is allowed and ``-inf`` where it is not. Query rows that
        may attend no key at all get weights 0 and output 0.

    Grouped-query attention: key/value may have Hkv heads for H query heads (Hkv divides H);
    query head ``h`` reads key/value head ``h // (H // Hkv)``. Hkv == 1 is multi-query
    attention. See :mod:`attnlab.functional._layout` for the picture.

    Args:
        query: (B, H, L, E); (B, L, E) and (L, E) are accepted too.
        key: (B, Hkv, S, E), with as many dims as ``query``.
        value: (B, Hkv, S, Ev).
        attn_mask: bool (True = may attend) or float (additive bias), broadcastable to
            (B, H, L, S). May be combined with ``is_causal``.
        is_causal: False; True (requires L == S); ``"top_left"`` or ``"bottom_right"`` to say
            how queries align with keys when L != S (see :mod:`attnlab.masks`).
        scale: multiplier of the scores; ``1/sqrt(E)`` by default. ``scale=1.0`` gives plain
            dot-product attention.
        dropout_p: probability of zeroing an attention weight (survivors are scaled by
            1 / (1 - p)). Applied whenever > 0: pass 0 at evaluation time.
        return_weights: also return the attention weights: ``True`` per head (B, H, L, S),
            ``"average"`` averaged over the heads (B, L, S). With dropout they are the dropped
            weights that produced the output. Under ``torch.no_grad()`` they are computed at
            bounded extra memory while the output keeps the fused kernel (see :func:`explain`).
        weights_out: a contiguous tensor of the returned weights' shape and the inputs' dtype
            and device, into which the weights are written (and which is returned): reuse one
            across calls to spare the page faults of a fresh (B, H, L, S) result. Inference
            only (under ``torch.no_grad()``, no dropout).

    Returns:
        The (B, H, L, Ev) output, or ``(output, weights)`` if ``return_weights``.

    Raises:
        TypeError: non-floating inputs, mixed dtypes, an integer mask.
        ValueError: mismatched batch/head/length/width dims, Hkv not dividing H, a mask that
            does not broadcast, dropout_p outside [0, 1), is_causal=True with L != S.

    References:
        Vaswani et al., "Attention Is All You Need", 2017; Ainslie et al., "GQA", 2023.
        Oracle: :func:`attnlab.reference.scaled_dot_product_attention`.

    Example:
        >>> q = torch.randn(2, 8, 5, 16)                 # B=2, H=8, L=5, E=16
        >>> k, v = torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 32)   # Hkv=2, S=7, Ev=32
        >>> out, w = scaled_dot_product_attention(q, k, v, is_causal="bottom_right",
        ...                                       return_weights=True)
        >>> out.shape, w.shape
        (torch.Size([2, 8, 5, 32]), torch.Size([2, 8, 5, 7]))
    """
    check_qkv(query, key, value)
    check_dropout(dropout_p)
    check_scale(scale)
    if return_weights not in (False, True, "average"):
        raise ValueError(
            f"return_weights must be False, True (per head) or 'average' (mean over heads); "
            f"got {return_weights!r}."
        )
    L, S = query.shape[-2], key.shape[-2]
    alignment = causal_alignment(is_causal, L, S)
    if attn_mask is not None:
        scores_shape = (*query.shape[:-2], L, S)
        check_mask(attn_mask, scores_shape)
        check_bias_range(attn_mask, query.dtype)
        attn_mask = plain(attn_mask)  # a masks.Mask is a bool tensor that prints as a picture
    q, k, v, mask, restore = as_4d(query, key, value, attn_mask)
    buffer = None  # the caller's weights_out, as a (B, H or 1, L, S) view
    if weights_out is not None:
        buffer = _check_weights_out(weights_out, query, q, S, return_weights, dropout_p)
    if scale is None:  # E = 0: every score is 0 whatever the scale (torch: the mean of values)
        scale = 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0
    if q.shape[1] == 0:  # H = 0 (and Hkv = 0): no heads, nothing to compute
        out = q.new_zeros(*q.shape[:-1], v.shape[-1])
        weights = q.new_zeros(q.shape[0], 1 if return_weights == "average" else 0, L, S)
        return _finish(out, weights, return_weights, restore, query.dim())

    log = not torch.compiler.is_compiling() and logger.isEnabledFor(logging.DEBUG)
    decision = _choose(q, k, mask, alignment, dropout_p, return_weights, v, why=log)
    if log:
        logger.debug("scaled_dot_product_attention %s", decision)  # (dynamo cannot trace logging)

    weights = None
    if decision.path == "fused":
        out = _fused(q, k, v, mask, alignment, scale, dropout_p)
    elif decision.path == "weights":
        out, weights = _weights_in_blocks(
            q, k, v, mask, alignment, scale, return_weights == "average", buffer
        )
    else:
        out, weights = _eager(q, k, v, mask, alignment, scale, dropout_p)
        if return_weights == "average":
            weights = weights.mean(1, keepdim=True)
    # NaN/inf in the inputs propagate (no path may turn them into numbers): see nonfinite_rows
    bad = nonfinite_rows(q, k, v)  # (B, H, L, 1)
    if out.requires_grad:
        out = out.masked_fill(bad, float("nan"))
    else:  # a fresh result nobody else holds: no second copy
        out.masked_fill_(bad, float("nan"))
    if return_weights:
        bad_w = bad.any(1, keepdim=True) if weights.shape[1] == 1 else bad
        if weights.requires_grad:
            weights = weights.masked_fill(bad_w, float("nan"))
        else:
            weights.masked_fill_(bad_w, float("nan"))
    if buffer is not None:
        if weights is not buffer:  # (an empty dimension took the eager path)
            buffer.copy_(weights)
        return _finish(out, None, False, restore, query.dim()), weights_out
    return _finish(out, weights, return_weights, restore, query.dim())


def _finish(out, weights, return_weights, restore, ndim):
    """(B, H, L, Ev) output and (B, H or 1, L, S) weights -> the user's layout and return."""
    if not return_weights:
        return restore(out)
    if return_weights == "average":  # (B, 1, L, S) -> (B, L, S), in the user's layout
        return restore(out), restore(weights).squeeze(-3) if ndim >= 4 else restore(weights)
    return restore(out), restore(weights)


def _eager(q, k, v, mask, alignment, scale, dropout_p):
    """The readable path: (B, H, L, E), (B, Hkv, S, E), (B, Hkv, S, Ev) -> out, weights."""
    L, S = q.shape[-2], k.shape[-2]
    mask = with_causal(mask, alignment, L, S, q.device)
    scores = grouped_scores(q * scale, k)  # (B, H, L, S)
    weights = masked_softmax(scores, mask)  # float32 accumulation for 16-bit inputs
    if dropout_p > 0:
        weights = F.dropout(weights, dropout_p)
    return grouped_weighted_sum(weights, v), weights  # (B, H, L, Ev), (B, H, L, S)


def _check_weights_out(buffer, query, q, S, return_weights, dropout_p) -> torch.Tensor:
    """Validate a caller's weights buffer; return it as a (B, H or 1, L, S) view."""
    B, H, L, _ = q.shape
    heads = 1 if return_weights == "average" else H
    shape = (*query.shape[:-3], L, S) if heads == 1 and query.dim() >= 4 else (*query.shape[:-1], S)
    if not return_weights:
        raise ValueError("weights_out is only used with return_weights=True or 'average'.")
    if dropout_p > 0 or _needs_grad(query):
        raise ValueError(
            "weights_out is for inference: with dropout or autograd the weights are a new "
            "tensor of the graph. Fix: call under torch.no_grad() with dropout_p=0, or drop "
            "weights_out."
        )
    if (
        not isinstance(buffer, torch.Tensor)
        or buffer.shape != shape
        or (
            buffer.dtype != query.dtype
            or buffer.device != query.device
            or not buffer.is_contiguous()
        )
    ):
        got = (
            (tuple(buffer.shape), buffer.dtype, str(buffer.device))
            if isinstance(buffer, torch.Tensor)
            else type(buffer).__name__
        )
        raise ValueError(
            f"weights_out must be a contiguous {query.dtype} tensor of shape {shape} on "
            f"{query.device}; got {got}. Fix: allocate it once with "
            f"torch.empty({shape}, dtype={query.dtype}) and pass it at every call."
        )
    return buffer.view(B, heads, L, S)


@torch.no_grad()
def _weights_in_blocks(q, k, v, mask, alignment, scale, average, weights=None):
    """Output and weights together, one block of the (B, H, L, S) scores at a time.

    A block is several whole heads of one batch row, or a range of query rows of one head:
    either way a contiguous slice of the result, written in place. Each block holds complete
    rows, so its softmax is exact, and its output rows are ``weights_block @ V``. Extra memory
    is one block (``WEIGHTS_BLOCK_BYTES``); with ``average`` the (B, H, L, S) tensor never
    exists. Returns the (B, H, L, Ev) output and (B, H, L, S) or (B, 1, L, S) weights.
    """
    B, H, L, _ = q.shape
    Hkv, S, Ev = k.shape[1], k.shape[2], v.shape[3]
    G = H // Hkv
    out = q.new_empty(B, H, L, Ev)
    if weights is None:
        weights = q.new_zeros(B, 1, L, S) if average else q.new_empty(B, H, L, S)
    elif average:
        weights.zero_()  # the blocks add into it
    heads, rows = _block_shape(H, L, S, q.element_size())
    scratch = q.new_empty(heads, rows, S) if average else None
    m4 = None if mask is None else mask.expand(B, H, L, S)  # a view: nothing is copied
    qs = q * scale
    kv_head = torch.arange(H, device=q.device) // G  # query head h reads kv head h // G
    causal = None  # (L, S), built once
    if alignment is not None:
        causal = causal_keep(L, S, alignment, q.device)
    can_die = m4 is not None or causal is not None  # rows with no attendable key are possible
    for b in range(B):
        for h0 in range(0, H, heads):
            h1 = min(H, h0 + heads)
            kb, vb = k[b, kv_head[h0:h1]], v[b, kv_head[h0:h1]]  # (h, S, E), (h, S, Ev)
            for r0 in range(0, L, rows):
                r1 = min(L, r0 + rows)
                w = scratch[: h1 - h0, : r1 - r0] if average else weights[b, h0:h1, r0:r1]
                torch.matmul(qs[b, h0:h1, r0:r1], kb.transpose(-2, -1), out=w)  # (h, r, S)
                keep = None if m4 is None else m4[b, h0:h1, r0:r1]
                if keep is not None and keep.dtype != torch.bool:
                    w.add_(keep)
                    keep = None
                if causal is not None:
                    keep = causal[r0:r1] if keep is None else keep & causal[r0:r1]
                if keep is not None:
                    w.masked_fill_(~keep, -inf)
                dead = w.amax(-1, keepdim=True) == -inf if can_die else None  # (NaN: not dead)
                torch.softmax(w, -1, out=w)
                if dead is not None:
                    w.masked_fill_(dead, 0.0)  # rows with no attendable key: weights 0
                torch.matmul(w, vb, out=out[b, h0:h1, r0:r1])  # (h, r, S) @ (h, S, Ev)
                if average:
                    weights[b, 0, r0:r1].add_(w.sum(0), alpha=1.0 / H)
    return out, weights


def _block_shape(H: int, L: int, S: int, itemsize: int) -> tuple[int, int]:
    """(heads, rows) of a block of scores of at most ``WEIGHTS_BLOCK_BYTES``."""
    per_head = L * S * itemsize
    if per_head <= WEIGHTS_BLOCK_BYTES:
        return max(1, min(H, WEIGHTS_BLOCK_BYTES // per_head)), L
    return 1, max(1, WEIGHTS_BLOCK_BYTES // (S * itemsize))


def _fused(q, k, v, mask, alignment, scale, dropout_p):
    """torch's fused kernel, with attnlab's mask and causal semantics."""
    L, S = q.shape[-2], k.shape[-2]
    if alignment == "bottom_right" and L == S:
        alignment = "top_left"  # the same triangle: let torch use its is_causal fast path
    torch_causal = alignment == "top_left" and mask is None
    if alignment == "bottom_right" and L == 1:
        alignment = None  # the last position sees every key
    if not torch_causal:
        mask = with_causal(mask, alignment, L, S, q.device)
    if mask is not None and mask.is_floating_point() and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=torch_causal,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    if mask is not None and q.device.type != "cpu":
        # CPU's kernel returns 0 for rows with no attendable key; others may return NaN.
        alive = (mask if mask.dtype == torch.bool else mask > float("-inf")).any(-1, keepdim=True)
        out = out.masked_fill(~alive, 0.0)
    return out
