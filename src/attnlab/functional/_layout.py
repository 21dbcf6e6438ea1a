"""Layout plumbing: optional leading dims, and the grouped-query head mapping.

Grouped-query attention (GQA): with H query heads and Hkv key/value heads (Hkv divides H,
G = H // Hkv), query head ``h`` reads key/value head ``h // G``::

    query heads   0   1   2 | 3   4   5        H = 6
                   \\  |  /  |  \\  |  /
    kv heads          0     |     1            Hkv = 2, G = 3

Multi-head attention is Hkv == H (G = 1); multi-query attention is Hkv == 1 (G = H). This is
``key.repeat_interleave(G, dim=1)``, as in torch SDPA's ``enable_gqa``, Hugging Face's
``repeat_kv`` and FlashAttention -- but attnlab never materialises the repeated keys: the G query
heads of a group are folded into the query length, ``(B, H, L, E) -> (B, Hkv, G*L, E)``, which
is a view because the heads of one group are adjacent.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from attnlab.masks import causal_keep, restrict


def as_4d(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, Callable]:
    """Bring (L, E) / (B, L, E) / (B, H, L, E) / (..., B, H, L, E) inputs to 4-D.

    Returns the 4-D query, key, value and mask and a function that gives a 4-D result the
    user's layout back. Leading dims beyond four are flattened into B (as torch SDPA accepts
    them). A mask given for the user's layout (..., L, S) is brought to broadcast against
    (B, H, L, S) the same way.
    """
    nd = query.dim()
    if attn_mask is not None and attn_mask.dim() < 2:  # (S,) or a scalar: (1, S) for torch's
        attn_mask = attn_mask.reshape(1, attn_mask.numel())  # (not -1: S may be 0)
    if nd == 4:
        return query, key, value, attn_mask, _same
    if attn_mask is not None:  # (..., L, S) -> as many dims as the scores
        attn_mask = attn_mask.reshape((1,) * (nd - attn_mask.dim()) + tuple(attn_mask.shape))
    if nd > 4:  # (..., B, H, L, E) -> (B', H, L, E), B' the product of the leading dims
        lead = query.shape[:-3]
        n = math.prod(lead)  # (not -1: ambiguous when L, S or E is 0)
        flat = lambda t: t.reshape(n, *t.shape[-3:])  # noqa: E731
        if attn_mask is not None:
            attn_mask = flat(attn_mask.expand(*lead, *attn_mask.shape[-3:]))
        unflat = lambda t: t.reshape(*lead, *t.shape[1:])  # noqa: E731
        return flat(query), flat(key), flat(value), attn_mask, unflat
    if nd == 3:  # (B, L, E) -> (B, 1, L, E): a single head
        lift = lambda t: t.unsqueeze(1)  # noqa: E731
        drop = lambda t: t.squeeze(1)  # noqa: E731
    else:  # (L, E) -> (1, 1, L, E)
        lift = lambda t: t[None, None]  # noqa: E731
        drop = lambda t: t[0, 0]  # noqa: E731
    if attn_mask is not None:
        attn_mask = lift(attn_mask)
    return lift(query), lift(key), lift(value), attn_mask, drop


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def grouped_scores(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Dot products of every query with every key, with the GQA head mapping.

    (B, H, L, E), (B, Hkv, S, E) -> (B, H, L, S), where query head h uses key head h // G.
    """
    B, H, L, E = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    q = query.reshape(B, Hkv, (H // Hkv) * L, E)  # (B, H, L, E) -> (B, Hkv, G*L, E)
    return (q @ key.transpose(-2, -1)).view(B, H, L, S)  # (B, Hkv, G*L, S) -> (B, H, L, S)


def grouped_weighted_sum(weights: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Weighted sum of values with the GQA head mapping.

    (B, H, L, S), (B, Hkv, S, Ev) -> (B, H, L, Ev).
    """
    B, H, L, S = weights.shape
    Hkv, Ev = value.shape[1], value.shape[3]
    G = H // Hkv if Hkv else 1  # (no heads at all: nothing to group)
    w = weights.reshape(B, Hkv, G * L, S)  # (B, H, L, S) -> (B, Hkv, G*L, S)
    return (w @ value).view(B, H, L, Ev)  # (B, Hkv, G*L, Ev) -> (B, H, L, Ev)


def with_causal(
    attn_mask: torch.Tensor | None,
    alignment: str | None,
    query_length: int,
    key_length: int,
    device: torch.device,
) -> torch.Tensor | None:
    """Fold a causal constraint (``alignment`` = "top_left" / "bottom_right") into a mask.

    A bool mask is AND-ed with the (L, S) causal mask; a float bias gets ``-inf`` above the
    diagonal. Returns the mask unchanged when ``alignment`` is None.
    """
    if alignment is None:
        return attn_mask
    return restrict(attn_mask, causal_keep(query_length, key_length, alignment, device))
