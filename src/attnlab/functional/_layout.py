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
    if nd == 4:
        return query, key, value, attn_mask, lambda t: t
    if attn_mask is not None:  # (..., L, S) -> as many dims as the scores
        attn_mask = attn_mask.reshape((1,) * (nd - attn_mask.dim()) + tuple(attn_mask.shape))
    if nd > 4:  # (..., B, H, L, E) -> (B', H, L, E), B' the product of the leading dims
        lead = query.shape[:-3]
        flat = lambda t: t.reshape(-1, *t.shape[-3:])  # noqa: E731
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


def nonfinite_rows(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_finite: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which output rows a NaN or an infinity reaches: (..., L, E), (..., S, *) -> (..., L, 1).

    attnlab's policy (docs/conventions.md): non-finite inputs propagate as NaN, never turn
    into numbers. Output row ``i`` is NaN when query row ``i`` holds a NaN or an inf, or when
    any key or value that its head reads does -- masked or not, as in torch's kernels (a mask
    does not clean a NaN). 4-D grouped-query inputs: head ``h`` reads kv head ``h // G``;
    other leading dims broadcast.

    ``kv_finite`` (B, Hkv) bool, when given, is that verdict for key and value already (a KV
    cache checks each slot once, when it is written): K and V are then not read here.
    """
    bad = ~_finite_rows(query)[..., None]  # (..., L, 1)
    if kv_finite is None:
        kv_finite = _finite_rows(key.flatten(-2)) & _finite_rows(value.flatten(-2))
    if query.dim() == 4 and key.dim() == 4 and 0 < key.shape[1] != query.shape[1]:
        G = query.shape[1] // key.shape[1]
        kv_finite = kv_finite.repeat_interleave(G, dim=1)  # (B, Hkv) -> (B, H)
    return bad | ~kv_finite[..., None, None]


def propagate_nonfinite(query, key, value, out, weights=None, kv_finite=None):
    """``out`` (..., L, Ev) and ``weights`` (..., H or 1, L, S) with :func:`nonfinite_rows` NaN.

    Eagerly on CPU, one sum per input screens first (a finite sum means no NaN and no inf
    anywhere; only a non-finite one, or an overflow of large finite values, pays for the
    row-by-row check): the fast path's cost is three reductions. Traced (``torch.compile``,
    ``torch.export``) or on other devices the row check always runs (no data-dependent branch,
    no host sync). Results that need no gradient are filled in place. ``kv_finite``: see
    :func:`nonfinite_rows` (with it, only the query is screened: a decode step against a cache
    reads the cache once, for attention itself).
    """
    if query.device.type == "cpu" and not torch.compiler.is_compiling():
        # (written out, no dtype argument unless needed: each costs ~1 us at tiny shapes)
        if kv_finite is not None:  # the caller vouched for K and V: screen the query only
            clean = math.isfinite(query.sum(dtype=torch.float32).item()) and bool(kv_finite.all())
        elif query.dtype in _SHORT:  # 16-bit sums overflow early: sum in float32
            f32 = torch.float32
            total = query.sum(dtype=f32).item() + key.sum(dtype=f32).item()
            clean = math.isfinite(total + value.sum(dtype=f32).item())
        else:
            clean = math.isfinite(query.sum().item() + key.sum().item() + value.sum().item())
        if clean:
            return out, weights
    bad = nonfinite_rows(query, key, value, kv_finite)
    out = _fill_nan(out, bad)
    if weights is not None:
        weights = _fill_nan(weights, bad.any(-3, keepdim=True) if weights.shape[-3] == 1 else bad)
    return out, weights


_SHORT = (torch.float16, torch.bfloat16)


def _fill_nan(t: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    return (
        t.masked_fill(bad, float("nan")) if t.requires_grad else t.masked_fill_(bad, float("nan"))
    )


def _finite_rows(x: torch.Tensor) -> torch.Tensor:
    """(..., N) -> (...,): True where the row holds no NaN or inf (an empty row is finite).

    max |x| is NaN or inf exactly when x holds one (amax propagates NaN and cannot overflow),
    and a max-reduction is ~15x faster on CPU than ``isfinite(x).all()``: this runs every call.
    """
    if x.shape[-1] == 0:
        return torch.ones(x.shape[:-1], dtype=torch.bool, device=x.device)
    return torch.isfinite(x.abs().amax(-1))


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
    w = weights.reshape(B, Hkv, (H // Hkv) * L, S)  # (B, H, L, S) -> (B, Hkv, G*L, S)
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
