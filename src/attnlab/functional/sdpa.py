"""Scaled dot-product attention: one function, a fast path and a readable path.

``scaled_dot_product_attention`` picks a path for every call:

* **fused** -- torch's own ``F.scaled_dot_product_attention`` (on CPU its flash kernel), used
  whenever it gives the same result: no weights requested, and no dropout on CPU (torch's CPU
  kernel has no dropout and would silently fall back to its slow math path).
* **eager** -- the readable formula ``masked_softmax(Q K^T * scale) V``, used when the weights
  are asked for or when the fused kernel cannot do the job well.

Both paths compute the same function: float64 results agree with the NumPy oracle
:func:`attnlab.reference.scaled_dot_product_attention` to rounding. Which path ran and why is
told by :func:`explain` (and logged at DEBUG level on the ``attnlab.dispatch`` logger)::

    >>> print(explain(q, k, v, return_weights=True))          # doctest: +SKIP
    eager: return_weights=True -- the fused kernel does not return the weights
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnlab._checks import causal_alignment, check_dropout, check_mask, check_qkv
from attnlab.functional._layout import as_4d, grouped_scores, grouped_weighted_sum, with_causal
from attnlab.functional.softmax import masked_softmax

logger = logging.getLogger("attnlab.dispatch")


@dataclass(frozen=True)
class Dispatch:
    """The path a call takes (``"fused"`` or ``"eager"``) and the reasons for it."""

    path: str
    reasons: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.path}: " + "; ".join(self.reasons)


def _choose(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: torch.Tensor | None,
    alignment: str | None,
    dropout_p: float,
    return_weights: bool,
) -> Dispatch:
    if return_weights:
        return Dispatch("eager", ("return_weights=True -- the fused kernel does not return them",))
    if dropout_p > 0 and query.device.type == "cpu":
        return Dispatch(
            "eager",
            (
                "dropout_p > 0 on CPU -- torch's fused CPU kernel has no dropout and would fall "
                "back to its own math path",
            ),
        )
    reasons = ["torch F.scaled_dot_product_attention"]
    if key.shape[1] != query.shape[1]:
        reasons.append(f"grouped-query heads H={query.shape[1]}, Hkv={key.shape[1]} (enable_gqa)")
    L, S = query.shape[-2], key.shape[-2]
    if alignment == "top_left" and attn_mask is None:
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
    return_weights: bool = False,
) -> Dispatch:
    """Which path :func:`scaled_dot_product_attention` takes for these inputs, and why."""
    check_qkv(query, key, value)
    alignment = causal_alignment(is_causal, query.shape[-2], key.shape[-2])
    q, k, _, mask, _ = as_4d(query, key, value, attn_mask)
    return _choose(q, k, mask, alignment, dropout_p, return_weights)


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    is_causal: bool | str = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
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
        return_weights: also return the (B, H, L, S) attention weights (after dropout, exactly
            the weights that produced the output).

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
    L, S = query.shape[-2], key.shape[-2]
    alignment = causal_alignment(is_causal, L, S)
    if attn_mask is not None:
        scores_shape = (*query.shape[:-2], L, S)
        check_mask(attn_mask, scores_shape)
        attn_mask = attn_mask.as_subclass(torch.Tensor)  # a masks.Mask is a plain bool tensor
    q, k, v, mask, restore = as_4d(query, key, value, attn_mask)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])

    decision = _choose(q, k, mask, alignment, dropout_p, return_weights)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("scaled_dot_product_attention %s", decision)

    if decision.path == "fused":
        out = _fused(q, k, v, mask, alignment, scale, dropout_p)
        return restore(out)
    out, weights = _eager(q, k, v, mask, alignment, scale, dropout_p)
    return (restore(out), restore(weights)) if return_weights else restore(out)


def _eager(q, k, v, mask, alignment, scale, dropout_p):
    """The readable path: (B, H, L, E), (B, Hkv, S, E), (B, Hkv, S, Ev) -> out, weights."""
    L, S = q.shape[-2], k.shape[-2]
    mask = with_causal(mask, alignment, L, S, q.device)
    scores = grouped_scores(q * scale, k)  # (B, H, L, S)
    weights = masked_softmax(scores, mask)  # float32 accumulation for 16-bit inputs
    if dropout_p > 0:
        weights = F.dropout(weights, dropout_p)
    return grouped_weighted_sum(weights, v), weights  # (B, H, L, Ev), (B, H, L, S)


def _fused(q, k, v, mask, alignment, scale, dropout_p):
    """torch's fused kernel, with attnlab's mask and causal semantics."""
    L, S = q.shape[-2], k.shape[-2]
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
