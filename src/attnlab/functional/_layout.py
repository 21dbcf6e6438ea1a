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

inf = float("inf")


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
        return query, key, value, attn_mask, _same
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


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


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

    How: ``max |x|`` per query row and per kv head (one read of each input, no copy), their
    maximum per row (NaN and inf propagate through both, which cannot overflow), then one
    finiteness test: this runs at every traced or GPU call, so it is a few small kernels.
    """
    rows = _max_abs(query, 1)  # (..., L, 1)
    if kv_finite is None:
        heads = torch.maximum(_max_abs(key, 2), _max_abs(value, 2))  # (..., 1, 1)
    else:
        heads = torch.where(kv_finite, 0.0, inf)[..., None, None]  # (B, Hkv, 1, 1)
    if query.dim() == 4 and key.dim() == 4 and 0 < key.shape[1] != query.shape[1]:
        B, H, L, _ = query.shape
        Hkv = key.shape[1]  # (B, H, L, 1) -> (B, Hkv, G, L, 1): a view
        reach = torch.maximum(rows.view(B, Hkv, H // Hkv, L, 1), heads[:, :, None])
        return ~torch.isfinite(reach.view(B, H, L, 1))
    return ~torch.isfinite(torch.maximum(rows, heads))


def propagate_nonfinite(query, key, value, out, weights=None, kv_finite=None):
    """``out`` (..., L, Ev) and ``weights`` (..., H or 1, L, S) with :func:`nonfinite_rows` NaN.

    Eagerly on CPU, one sum per input screens first (:func:`all_finite`): only a non-finite
    input pays for the row-by-row check. Traced (``torch.compile``, ``torch.export``) or on
    other devices the row check always runs (no data-dependent branch, no host sync). Results
    that need no gradient are filled in place. ``kv_finite``: see :func:`nonfinite_rows` (with
    it, only the query is screened: a decode step against a cache reads the cache once, for
    attention itself).
    """
    bad = rows_to_fill(query, key, value, kv_finite)
    if bad is None:
        return out, weights
    out = _fill_nan(out, bad)
    if weights is not None:
        weights = _fill_nan(weights, bad.any(-3, keepdim=True) if weights.shape[-3] == 1 else bad)
    return out, weights


def rows_to_fill(query, key, value, kv_finite=None) -> torch.Tensor | None:
    """:func:`nonfinite_rows`, or None where an eager CPU screen finds every input finite (see
    :func:`propagate_nonfinite`): the rows a path must make NaN."""
    if query.is_cpu and not torch.compiler.is_compiling():
        if kv_finite is not None:  # the caller vouched for K and V: screen the query only
            clean = all_finite(query) and bool(kv_finite.all())
        else:
            clean = all_finite(query, key, value)
        if clean:
            return None
    return nonfinite_rows(query, key, value, kv_finite)


def all_finite(*tensors: torch.Tensor) -> bool:
    """Whether no tensor holds a NaN or an inf (eager; reads each once, syncs with the host).

    A sum is non-finite when its tensor holds a NaN or an inf, or when finite values overflow
    (float16 from 65,504; float32 and bfloat16 from 3.4e38): only then does a min and max,
    which cannot overflow, decide. Each tensor is summed in its own dtype (torch accumulates
    16-bit sums in float32 and rounds once): ``sum(dtype=float32)`` first makes a float32 copy,
    5-27x slower from a million elements.
    """
    if math.isfinite(sum([t.sum().item() for t in tensors])):
        return True
    return all(math.isfinite(m.item()) for t in tensors if t.numel() for m in torch.aminmax(t))


def _fill_nan(t: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    return (
        t.masked_fill(bad, float("nan")) if t.requires_grad else t.masked_fill_(bad, float("nan"))
    )


def _max_abs(x: torch.Tensor, dims: int) -> torch.Tensor:
    """max |x| over the last ``dims`` dims, kept as size-1 dims (0 where they are empty).

    NaN or inf exactly when x holds one there: the inf-norm propagates NaN and cannot overflow.
    One pass over x (``abs().amax()`` writes a copy first).
    """
    reduced = tuple(range(-dims, 0))
    if any(x.shape[d] == 0 for d in reduced):
        return x.new_zeros(*x.shape[:-dims], *(1,) * dims)
    return torch.linalg.vector_norm(x, inf, dim=reduced, keepdim=True)


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
