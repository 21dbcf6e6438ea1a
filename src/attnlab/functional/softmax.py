"""The masked softmax at the heart of every soft attention mechanism, and attention over scores."""

from __future__ import annotations

import math

import torch

from attnlab._checks import check_bias_range, check_dropout, check_floating, check_mask
from attnlab.functional._layout import grouped_weighted_sum
from attnlab.functional.nonfinite import fill_nan, value_heads_to_fill

LOW_PRECISION = (torch.float16, torch.bfloat16)


def apply_mask(
    scores: torch.Tensor, mask: torch.Tensor | None, name: str = "attn_mask"
) -> torch.Tensor:
    """Scores with the mask applied: bool False -> ``-inf``; a float mask is added (refused if
    its finite values would become ``-inf`` in the scores' dtype: :func:`check_bias_range`).

    A bool mask acts as the bias ``0`` / ``-inf`` would: ``s - inf`` where it forbids, so a NaN
    (or ``+inf``) score stays NaN there too -- a mask does not clean a NaN, whatever its dtype.
    """
    if mask is None:
        return scores
    if mask.dtype == torch.bool:  # (the bias has the mask's shape, not the scores')
        bias = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
        return scores + bias.masked_fill(~mask, float("-inf"))  # (not in place: vmap)
    check_bias_range(mask, scores.dtype, name)
    return scores + mask.to(scores.dtype)


def masked_softmax(
    scores: torch.Tensor, mask: torch.Tensor | None = None, dim: int = -1
) -> torch.Tensor:
    """Softmax over ``dim`` that ignores masked positions and survives fully masked rows.

    Math:
        .. math:: w_{ij} = \\frac{m_{ij} e^{s_{ij}}}{\\sum_k m_{ik} e^{s_{ik}}}, \\qquad
                  w_{ij} = 0 \\text{ for every } j \\text{ if } \\sum_k m_{ik} = 0

        where ``m`` is 1 where the bool mask is True (a float mask is added to ``s`` instead;
        ``-inf`` entries count as masked).

    Guarantees:
        * masked positions get weight exactly 0;
        * a row whose keys are all masked gets weight 0 everywhere (so its attention output is
          0) -- never NaN, never uniform "ghost" weights -- and its gradient is 0, not NaN;
        * float16/bfloat16 scores are accumulated in float32 and the result is cast back.

    Args:
        scores: (..., L, S) attention scores.
        mask: None, a bool mask (True = may attend) or an additive float bias, broadcastable
            to ``scores``.
        dim: the key dimension.

    Returns:
        Weights with the shape and dtype of ``scores``.

    Reference: :func:`attnlab.reference.masked_softmax`.

    Example:
        >>> s = torch.tensor([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]])
        >>> masked_softmax(s, torch.tensor([[True, True, False], [False, False, False]]))
        tensor([[0.2689, 0.7311, 0.0000],
                [0.0000, 0.0000, 0.0000]])
    """
    if mask is not None:
        check_mask(mask, tuple(scores.shape), name="mask", device=scores.device)
    x = scores.float() if scores.dtype in LOW_PRECISION else scores
    x = apply_mask(x, mask, "mask")
    # A row with no attendable key would be softmax([-inf, ...]) = NaN. Give it finite dummy
    # scores, then zero its weights: the output is 0 and so is the gradient.
    # Only masks make a row dead: a NaN (or +inf) score keeps its row alive and NaN.
    alive = (x != float("-inf")).any(dim, keepdim=True)
    x = x.masked_fill(~alive, 0.0)
    weights = torch.softmax(x, dim).masked_fill(~alive, 0.0)
    return weights.to(scores.dtype)


def attention(
    scores: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    dropout_p: float = 0.0,
    return_weights: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Soft attention over precomputed scores: ``softmax(scores) V``.

    Combine it with any score function, e.g. ``attention(general_scores(q, k, W), v)``.

    Math:
        .. math:: \\text{out}_i = \\sum_j w_{ij} v_j, \\quad w = \\text{masked\\_softmax}(s)

    Args:
        scores: (B, H, L, S) (or (B, L, S), (L, S)).
        value: (B, Hkv, S, Ev) with the same number of dims as ``scores``; Hkv divides H.
        attn_mask: bool (True = may attend) or additive float, broadcastable to ``scores``.
        dropout_p: probability of zeroing each weight (the rest are scaled by 1 / (1 - p)).
            Only applied when > 0; pass 0 at evaluation time.
        return_weights: also return the weights (after dropout: exactly those that produced
            the output).

    Returns:
        (B, H, L, Ev), and the (B, H, L, S) weights if ``return_weights``. NaN and inf follow
        the rule of docs/conventions.md: a NaN (or ``+inf``) score makes its row NaN, a NaN or
        an inf in a value every row of the heads that read it, masked or not.

    Reference: :func:`attnlab.reference.attention`.
    """
    check_floating("scores", scores)
    check_floating("value", value)
    dropout_p = check_dropout(dropout_p)
    if value.dim() != scores.dim() or value.shape[-2] != scores.shape[-1]:
        raise ValueError(
            f"value must be (..., S, Ev) matching scores (..., L, S): got scores "
            f"{tuple(scores.shape)} and value {tuple(value.shape)}."
        )
    if scores.dim() > 4:  # (..., B, H, L, S): the leading dims flattened into B, as torch SDPA
        return _attention_flat(scores, value, attn_mask, dropout_p, return_weights)
    if scores.dim() == 4 and (
        value.shape[0] != scores.shape[0]
        or (scores.shape[1] % value.shape[1] if value.shape[1] else scores.shape[1]) != 0
    ):
        raise ValueError(
            f"value (B, Hkv, S, Ev) must have the scores' batch size and Hkv dividing H: got "
            f"scores {tuple(scores.shape)} and value {tuple(value.shape)}."
        )
    if scores.dim() == 3 and value.shape[0] not in (1, scores.shape[0]):
        raise ValueError(  # (4-D below would read it as kv heads: batch b taking value b // G)
            f"value (B, S, Ev) must have the scores' batch size B={scores.shape[0]}, or 1 to "
            f"share one value sequence; got scores {tuple(scores.shape)} and value "
            f"{tuple(value.shape)}. Fix: pass one value sequence per score matrix."
        )
    if attn_mask is not None:
        check_mask(attn_mask, tuple(scores.shape), device=scores.device)
    weights = masked_softmax(scores, attn_mask)
    if dropout_p > 0:
        weights = torch.nn.functional.dropout(weights, dropout_p)
    w4 = weights.reshape((1,) * (4 - weights.dim()) + tuple(weights.shape))
    v4 = value.reshape((1,) * (4 - value.dim()) + tuple(value.shape))
    out = grouped_weighted_sum(w4, v4.to(weights.dtype))
    bad = value_heads_to_fill(v4, w4.shape[1])  # (the scores' own NaN rows: masked_softmax)
    if bad is not None:  # a NaN or an inf in a value reaches every row of its heads, masked or not
        out = fill_nan(out, bad)
        weights = fill_nan(w4, bad).reshape(weights.shape)
    out = out.reshape(tuple(weights.shape[:-2]) + tuple(out.shape[-2:]))
    return (out, weights) if return_weights else out


def _attention_flat(scores, value, attn_mask, dropout_p, return_weights):
    """:func:`attention` of (..., H, L, S) scores and (..., Hkv, S, Ev) values with more than
    one leading dim: flattened to (N, H, L, S), computed, and shaped back."""
    lead = tuple(scores.shape[:-3])
    if tuple(value.shape[:-3]) != lead:
        raise ValueError(
            f"value (..., Hkv, S, Ev) must have the scores' leading dims {lead}; got scores "
            f"{tuple(scores.shape)} and value {tuple(value.shape)}."
        )
    n = math.prod(lead)
    mask = attn_mask
    if mask is not None:
        check_mask(mask, tuple(scores.shape), device=scores.device)
        mask = mask.reshape((1,) * (scores.dim() - mask.dim()) + tuple(mask.shape))
        mask = mask.expand(*lead, *mask.shape[-3:]).reshape(n, *mask.shape[-3:])
    out = attention(
        scores.reshape(n, *scores.shape[-3:]),
        value.reshape(n, *value.shape[-3:]),
        mask,
        dropout_p=dropout_p,
        return_weights=return_weights,
    )
    if not return_weights:
        return out.reshape(*lead, *out.shape[1:])
    out, weights = out
    return out.reshape(*lead, *out.shape[1:]), weights.reshape(scores.shape)
