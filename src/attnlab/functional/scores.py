"""Score functions -- how well does query i match key j? -- and the softmax attention over them.

Every mechanism in attnlab is ``softmax(score(Q, K)) V`` with a different score:

=================  ==========================================  ============================
name               score(q, k)                                  paper
=================  ==========================================  ============================
dot product        q . k                                        Luong et al. 2015 ("dot")
scaled dot         q . k / sqrt(E)                              Vaswani et al. 2017
general            q^T W k                                      Luong et al. 2015
concat             w^T tanh(W [q; k])                           Luong et al. 2015
additive           w^T tanh(W_q q + W_k k + b)                  Bahdanau et al. 2015
=================  ==========================================  ============================

Shapes: query (..., L, Eq), key (..., S, Ek) -> scores (..., L, S). The dot-product family uses
the (B, H, L, E) / (B, Hkv, S, E) layout with grouped-query heads; its leading dims are optional.
"""

from __future__ import annotations

import math

import torch

from attnlab._checks import check_floating, check_qkv, check_scale
from attnlab.functional._layout import as_4d, grouped_scores
from attnlab.functional.additive import additive_scores


def _dot(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    check_qkv(query, key, key)
    q, k, _, _, restore = as_4d(query, key, key, None)
    return restore(grouped_scores(q, k))


def dot_product_scores(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Unscaled dot-product scores ``Q K^T`` (seed 000's first attention).

    Math:
        .. math:: s_{ij} = q_i \\cdot k_j

    Args:
        query: (B, H, L, E), (B, L, E) or (L, E).
        key: (B, Hkv, S, E), (B, S, E) or (S, E); Hkv must divide H.

    Returns:
        (B, H, L, S) (or the same leading dims as ``query``).

    Reference: :func:`attnlab.reference.dot_product_scores`.
    """
    return _dot(query, key)


def scaled_dot_product_scores(
    query: torch.Tensor, key: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Scaled dot-product scores ``Q K^T / sqrt(E)``.

    Why scale: if the entries of q and k are independent with variance 1, q . k has variance E.
    Unscaled, large E pushes the softmax into a near one-hot regime where its gradients vanish;
    dividing by sqrt(E) keeps the scores' variance at 1 (Vaswani et al. 2017, section 3.2.1).

    Math:
        .. math:: s_{ij} = \\text{scale} \\cdot q_i \\cdot k_j, \\quad
                  \\text{scale} = 1/\\sqrt{E} \\text{ by default}

    Shapes as :func:`dot_product_scores`.
    Reference: :func:`attnlab.reference.scaled_dot_product_scores`.
    """
    scale = check_scale(scale)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1]) if query.shape[-1] else 1.0  # (E = 0: all 0)
    return _dot(query, key) * scale


def general_scores(query: torch.Tensor, key: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Luong's "general" (bilinear) scores ``q^T W k``.

    Math:
        .. math:: s_{ij} = q_i^\\top W k_j

    Args:
        query: (..., L, Eq).
        key: (..., S, Ek).
        weight: (Eq, Ek).

    Returns:
        (..., L, S).

    Reference: :func:`attnlab.reference.general_scores`.
    """
    check_floating("weight", weight)
    if weight.dim() != 2 or weight.shape != (query.shape[-1], key.shape[-1]):
        raise ValueError(
            f"weight must have shape (Eq, Ek) = ({query.shape[-1]}, {key.shape[-1]}) for query "
            f"{tuple(query.shape)} and key {tuple(key.shape)}; got {tuple(weight.shape)}."
        )
    return _dot(query @ weight.to(query.dtype), key)


def concat_scores(
    query: torch.Tensor, key: torch.Tensor, weight: torch.Tensor, w_score: torch.Tensor
) -> torch.Tensor:
    """Luong's "concat" scores ``w^T tanh(W [q; k])``.

    Splitting ``W = [W_q  W_k]`` shows it is additive attention without a bias:
    ``W [q; k] = W_q q + W_k k``; it is computed by the same memory-bounded kernel.

    Args:
        query: (..., L, Eq).
        key: (..., S, Ek).
        weight: (A, Eq + Ek).
        w_score: (A,).

    Returns:
        (..., L, S).

    Reference: :func:`attnlab.reference.concat_scores`.
    """
    check_floating("weight", weight)
    eq, ek = query.shape[-1], key.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != eq + ek:
        raise ValueError(
            f"weight must have shape (A, Eq + Ek) = (A, {eq + ek}) for query width {eq} and key "
            f"width {ek}; got {tuple(weight.shape)}."
        )
    return additive_scores(query, key, weight[:, :eq], weight[:, eq:], w_score)
