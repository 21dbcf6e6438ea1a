"""Every attention mechanism of attnlab in plain NumPy, float64: the specification.

Read this file to learn what each mechanism computes; the torch functions in
:mod:`attnlab.functional` are tested against it. Each function has the same name and signature
as its torch twin. Nothing here imports torch, and nothing is optimised: one line per idea.

Shape legend: B batch, H query heads, Hkv key/value heads (G = H // Hkv), L queries, S keys,
E query/key width, Ev value width, A additive-attention width. Leading [B, H] dims are optional.
Masks: bool True = may attend; a float mask is an additive bias (-inf = masked).
"""

from __future__ import annotations

import numpy as np

from attnlab.reference.masks import causal_mask


def _f64(x):
    return None if x is None else np.asarray(x, dtype=np.float64)


def _apply_mask(scores, mask):
    # [..., L, S] scores; bool mask -> -inf where False; float mask -> added
    # (a bool mask acts as its bias 0 / -inf would: a NaN or +inf score it forbids is NaN)
    if mask is None:
        return scores
    mask = np.asarray(mask)
    if mask.dtype != bool and not np.issubdtype(mask.dtype, np.floating):  # (as the torch twin)
        raise TypeError(f"a mask is bool (True = may attend) or a float bias; got {mask.dtype}")
    if mask.ndim > scores.ndim:  # (it would cross its batch with the scores')
        raise ValueError(f"mask {mask.shape} has more dims than the scores {scores.shape}")
    if mask.dtype == bool:
        with np.errstate(invalid="ignore"):  # inf - inf
            return np.where(mask, scores, scores - np.inf)
    return scores + mask.astype(np.float64)


def masked_softmax(scores, mask=None, dim=-1):
    # [..., L, S], mask broadcastable -> [..., L, S]
    # Masked keys get weight 0; a row with no attendable key gets weight 0 everywhere.
    x = np.moveaxis(_apply_mask(_f64(scores), mask), dim, -1)
    # does the row see any key? Only masks make a row dead: a NaN keeps it alive, and NaN
    alive = (x != -np.inf).any(axis=-1, keepdims=True)  # (S = 0: no key, a dead row)
    shift = np.where(alive, x.max(axis=-1, keepdims=True, initial=-np.inf), 0.0)  # for exp
    with np.errstate(invalid="ignore"):  # a +inf score: inf - inf is NaN, as it should be
        e = np.exp(x - shift)  # exp(-inf) = 0 for masked keys
    total = e.sum(axis=-1, keepdims=True)
    weights = np.where(alive, e / np.where(alive, total, 1.0), 0.0)
    return np.moveaxis(weights, -1, dim)


def _repeat_kv(x, query_heads):
    # [..., Hkv, S, E] -> [..., H, S, E]: kv head j serves query heads j*G .. j*G + G-1
    # (inputs without a heads dim, or with as many heads, or one to broadcast: as they are)
    if x.ndim < 4 or not 1 < x.shape[-3] < query_heads:
        return x
    if query_heads % x.shape[-3]:
        raise ValueError(f"Hkv={x.shape[-3]} must divide H={query_heads}")
    return np.repeat(x, query_heads // x.shape[-3], axis=-3)


def _heads(x):
    # the heads dim H of [..., H, L, E] (1 for [B, L, E] and [L, E], which have none)
    return x.shape[-3] if x.ndim >= 4 else 1


def _dropout(weights, dropout_p):
    if not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p must lie in [0, 1); got {dropout_p!r}")
    if dropout_p == 0:
        return weights
    keep = np.random.default_rng().random(weights.shape) >= dropout_p
    return np.where(keep, weights / (1.0 - dropout_p), 0.0)


def attention(scores, value, attn_mask=None, *, dropout_p=0.0, return_weights=False):
    # [..., H, L, S], [..., Hkv, S, Ev] -> [..., H, L, Ev] (and weights [..., H, L, S])
    weights = _dropout(masked_softmax(scores, attn_mask), dropout_p)
    value = _repeat_kv(_f64(value), _heads(weights))
    out = weights @ value
    # a NaN or an inf in a value reaches every row of the heads that read it, masked or not
    # (docs/conventions.md; a NaN or +inf score already made its row NaN in masked_softmax)
    bad = ~np.isfinite(value).all(axis=(-2, -1), keepdims=True)  # [..., H, 1, 1]
    out, weights = _propagate(out, weights, bad)
    return (out, weights) if return_weights else out


def dot_product_scores(query, key):
    # [..., H, L, E], [..., Hkv, S, E] -> [..., H, L, S]: s_ij = q_i . k_j
    query, key = _f64(query), _f64(key)
    if query.ndim >= 4 and key.ndim >= 4 and key.shape[-3] > query.shape[-3]:
        # (as the torch twin; numpy would broadcast one query head over the kv heads)
        raise ValueError(f"Hkv={key.shape[-3]} must divide H={query.shape[-3]}")
    key = _repeat_kv(key, _heads(query))
    return query @ np.swapaxes(key, -1, -2)


def scaled_dot_product_scores(query, key, scale=None):
    # s_ij = q_i . k_j / sqrt(E): keeps the scores' variance at 1 when q, k have unit variance
    if scale is None:
        E = np.shape(query)[-1]
        scale = 1.0 / np.sqrt(E) if E else 1.0  # E = 0: every score is 0 whatever the scale
    if not np.isfinite(scale):
        raise ValueError(f"scale must be a finite number; got {scale!r}")
    return dot_product_scores(query, key) * scale


def general_scores(query, key, weight):
    # [..., L, Eq], [..., S, Ek], [Eq, Ek] -> [..., L, S]: s_ij = q_i^T W k_j  (Luong)
    return dot_product_scores(_f64(query) @ _f64(weight), key)


def additive_scores(query, key, w_query, w_key, w_score, bias=None):
    # [..., L, Dq], [..., S, Dk], [A, Dq], [A, Dk], [A] -> [..., L, S]
    # s_ij = w . tanh(W_q q_i + W_k k_j + b)  (Bahdanau)
    # w_query / w_key None: that input is already projected to width A
    a = _f64(query) if w_query is None else _f64(query) @ _f64(w_query).T  # [..., L, A]
    if bias is not None:
        a = a + _f64(bias)
    b = _f64(key) if w_key is None else _f64(key) @ _f64(w_key).T  # [..., S, A]
    hidden = np.tanh(a[..., :, None, :] + b[..., None, :, :])  # [..., L, S, A]
    return hidden @ _f64(w_score)  # [..., L, S]


def concat_scores(query, key, weight, w_score):
    # s_ij = w . tanh(W [q_i; k_j])  (Luong "concat") = additive with W = [W_q W_k], no bias
    query, key, weight = _f64(query), _f64(key), _f64(weight)
    L, S = query.shape[-2], key.shape[-2]
    lead = np.broadcast_shapes(query.shape[:-2], key.shape[:-2])
    q = np.broadcast_to(query[..., :, None, :], (*lead, L, S, query.shape[-1]))
    k = np.broadcast_to(key[..., None, :, :], (*lead, L, S, key.shape[-1]))
    pairs = np.concatenate([q, k], axis=-1)  # [..., L, S, Eq + Ek]
    return np.tanh(pairs @ weight.T) @ _f64(w_score)


def _nonfinite_rows(query, key, value):
    # [..., L, E], [..., S, E], [..., S, Ev] -> [..., L, 1]: the output rows a NaN or an inf
    # reaches (docs/conventions.md): those of a non-finite query row, and every row of a head
    # whose keys or values hold one, masked or not (a mask does not clean a NaN)
    query, key, value = _f64(query), _f64(key), _f64(value)
    bad_q = ~np.isfinite(query).all(axis=-1, keepdims=True)
    kv_ok = np.isfinite(key).all(axis=(-2, -1)) & np.isfinite(value).all(axis=(-2, -1))
    kv_ok = _repeat_kv(kv_ok[..., None, None], _heads(query))  # [..., Hkv, 1, 1] -> [..., H, 1, 1]
    return bad_q | ~kv_ok


def _propagate(out, weights, bad):
    # NaN where the inputs were not finite; weights [..., H or none, L, S], bad [..., L, 1]
    out = np.where(bad, np.nan, out)
    return out if weights is None else (out, np.where(bad, np.nan, weights))


def _causal(mask, is_causal, L, S):
    if is_causal is False or is_causal is None:
        return mask
    alignment = None if is_causal is True else is_causal
    causal = causal_mask(L, S, alignment=alignment)  # [L, S]
    if mask is None:
        return causal
    mask = np.asarray(mask)
    return mask & causal if mask.dtype == bool else np.where(causal, mask, -np.inf)


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    *,
    is_causal=False,
    scale=None,
    dropout_p=0.0,
    return_weights=False,
    weights_out=None,
):
    # [..., H, L, E], [..., Hkv, S, E], [..., Hkv, S, Ev] -> [..., H, L, Ev]
    # softmax(Q K^T * scale + M) V, query head h reading kv head h // (H // Hkv)
    # return_weights: True -> weights [..., H, L, S]; "average" -> mean over heads [B, L, S]
    # weights_out: an array the weights are written into (and which is returned)
    scores = scaled_dot_product_scores(query, key, scale)
    mask = _causal(attn_mask, is_causal, scores.shape[-2], scores.shape[-1])
    out, weights = attention(scores, value, mask, dropout_p=dropout_p, return_weights=True)
    out, weights = _propagate(out, weights, _nonfinite_rows(query, key, value))
    if not return_weights:
        return out
    if return_weights == "average" and scores.ndim >= 4:
        weights = weights.mean(axis=-3)
    if weights_out is not None:
        np.copyto(weights_out, weights)
        weights = weights_out
    return out, weights


def additive_attention(
    query,
    key,
    value,
    w_query,
    w_key,
    w_score,
    attn_mask=None,
    *,
    bias=None,
    is_causal=False,
    dropout_p=0.0,
    return_weights=False,
):
    # [..., L, Dq], [..., S, Dk], [..., S, Dv] -> [..., L, Dv]
    scores = additive_scores(query, key, w_query, w_key, w_score, bias)
    mask = _causal(attn_mask, is_causal, scores.shape[-2], scores.shape[-1])
    out, weights = attention(scores, value, mask, dropout_p=dropout_p, return_weights=True)
    out, weights = _propagate(out, weights, _nonfinite_rows(query, key, value))
    return (out, weights) if return_weights else out


def _one_hot_argmax(x):
    # [..., S] -> one-hot at the first maximum; rows of only -inf -> zeros (S = 0: no key)
    hard = np.zeros_like(x)
    if x.shape[-1] == 0:
        return hard
    np.put_along_axis(hard, x.argmax(axis=-1)[..., None], 1.0, axis=-1)
    return np.where((x > -np.inf).any(axis=-1, keepdims=True), hard, 0.0)


def hard_attention_weights(
    scores,
    attn_mask=None,
    *,
    mode="argmax",
    top_k=None,
    tau=1.0,
    noise=None,
    generator=None,
):
    # [..., L, S] -> [..., L, S]; ties go to the lower index; a row holding a NaN or a +inf
    # score is NaN, as masked_softmax's (a NaN is never turned into a choice)
    if mode == "topk" and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"mode='topk' needs top_k, an int >= 1; got {top_k!r}")
    if mode != "topk" and top_k is not None:
        raise ValueError(f"top_k is only used with mode='topk'; got mode={mode!r}")
    if mode == "sample" and not tau > 0:
        raise ValueError(f"tau must be > 0; got {tau!r}")
    x = _apply_mask(_f64(scores), attn_mask)
    nonfinite = (np.isnan(x) | (x == np.inf)).any(axis=-1, keepdims=True)
    if mode == "argmax":  # the best key
        weights = _one_hot_argmax(x)
    elif mode == "sample":  # a key drawn from softmax(x): argmax of x + Gumbel noise
        if noise is None:
            noise = (generator or np.random.default_rng()).gumbel(size=x.shape)
        weights = _one_hot_argmax((x + _f64(noise)) / tau)
    elif mode == "topk":  # softmax over the top_k best keys only
        best = np.argsort(-x, axis=-1, kind="stable")[..., :top_k]
        keep = np.zeros(x.shape, dtype=bool)
        np.put_along_axis(keep, best, True, axis=-1)
        weights = masked_softmax(x, keep)
    else:
        raise ValueError(f"mode must be 'argmax', 'sample' or 'topk'; got {mode!r}")
    return np.where(nonfinite, np.nan, weights)


def hard_attention(
    query,
    key,
    value,
    attn_mask=None,
    *,
    mode="argmax",
    top_k=None,
    tau=1.0,
    is_causal=False,
    scale=None,
    noise=None,
    generator=None,
    return_weights=False,
):
    # [..., H, L, E], [..., Hkv, S, E], [..., Hkv, S, Ev] -> [..., H, L, Ev]
    scores = scaled_dot_product_scores(query, key, scale)
    mask = _causal(attn_mask, is_causal, scores.shape[-2], scores.shape[-1])
    weights = hard_attention_weights(
        scores, mask, mode=mode, top_k=top_k, tau=tau, noise=noise, generator=generator
    )
    out = weights @ _repeat_kv(_f64(value), _heads(weights))
    out, weights = _propagate(out, weights, _nonfinite_rows(query, key, value))
    return (out, weights) if return_weights else out


def rotary_frequencies(head_dim, base=10000.0, scaling=None, dtype=None, device=None):
    # [E/2]: theta_i = base^(-2i/E), stretched by scaling (an attnlab.functional.RotaryScaling,
    # read for its fields): "linear" divides every theta_i by the factor; "llama3" keeps the
    # fast ones (wavelength 2 pi / theta_i < original_context / high_freq_factor), divides the
    # slow ones (wavelength > original_context / low_freq_factor) and blends in between
    # (dtype, device: the torch twin's; here always float64 on the host)
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embeddings; got {head_dim}")
    theta = base ** (-np.arange(0, head_dim, 2) / head_dim)  # [E/2]
    if scaling is None:
        return theta
    if scaling.kind == "linear":
        return theta / scaling.factor
    wavelength = 2 * np.pi / theta
    fast = wavelength < scaling.original_context / scaling.high_freq_factor
    slow = wavelength > scaling.original_context / scaling.low_freq_factor
    blend = (scaling.original_context / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    middle = (1 - blend) * theta / scaling.factor + blend * theta
    return np.where(fast, theta, np.where(slow, theta / scaling.factor, middle))


def rotary_angles(positions, head_dim, base=10000.0, dtype=None, scaling=None):
    # positions [..., L] -> (cos, sin), each [..., L, E]: the angle m * theta_i of pair i,
    # written twice (for both halves of the head dim, as apply_rotary pairs them)
    theta = rotary_frequencies(head_dim, base, scaling)  # [E/2]
    angle = np.asarray(positions, dtype=np.float64)[..., None] * theta  # [..., L, E/2]
    angle = np.concatenate([angle, angle], axis=-1)  # [..., L, E]
    return np.cos(angle), np.sin(angle)


def apply_rotary(x, positions, base=10000.0, scaling=None):
    # [B, H, L, E] (or [B, L, E], [L, E]), positions [L], [B, L] or [1, L] -> the shape of x
    # rotate each pair (x_i, x_{i+E/2}) of a token at position m by the angle m * theta_i
    x = _f64(x)
    E = x.shape[-1]
    theta = rotary_frequencies(E, base, scaling)  # [E/2]
    angle = np.asarray(positions, dtype=np.float64)[..., None] * theta  # [..., L, E/2]
    if angle.ndim == 3 and (x.ndim not in (3, 4) or angle.shape[0] not in (1, x.shape[0])):
        raise ValueError(f"positions [B, L] need x of that batch; got x {x.shape}")
    if angle.ndim == 3 and x.ndim == 4:  # [B, L, E/2] -> [B, 1, L, E/2]: every head
        angle = angle[:, None]
    x1, x2 = x[..., : E // 2], x[..., E // 2 :]
    cos, sin = np.cos(angle), np.sin(angle)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
