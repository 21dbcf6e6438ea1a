"""Hard attention: each query picks keys instead of averaging over all of them.

Soft attention returns a weighted average of every value. Hard attention (Xu et al. 2015)
selects: the output is one value (or a few). Selection is not differentiable, so training uses
a surrogate gradient:

* ``"argmax"``: one-hot at the best-scoring key. Forward is exactly one-hot; backward uses the
  softmax's gradient (the straight-through estimator, Bengio et al. 2013).
* ``"sample"``: one-hot at a key *sampled* from softmax(scores), drawn with the Gumbel-max
  trick (argmax of scores + Gumbel noise); backward through softmax((scores + noise) / tau)
  (straight-through Gumbel-softmax, Jang et al. 2017).
* ``"topk"``: softmax over the ``top_k`` best keys only, the rest get weight 0; its gradient is
  the exact gradient of that restricted softmax.

Masked keys are never chosen; a query with no attendable key gets weight 0 everywhere.
"""

from __future__ import annotations

import math

import torch

from attnlab._checks import (
    autocast_inputs,
    causal_alignment,
    check_floating,
    check_mask,
    check_qkv,
    check_scale,
)
from attnlab.functional._layout import (
    as_4d,
    grouped_scores,
    grouped_weighted_sum,
    with_causal,
)
from attnlab.functional.nonfinite import propagate_nonfinite
from attnlab.functional.softmax import LOW_PRECISION, apply_mask, masked_softmax
from attnlab.masks import unwrap

MODES = ("argmax", "sample", "topk")


def _one_hot_argmax(x: torch.Tensor) -> torch.Tensor:
    """One-hot (..., S) at the first maximum of each row; rows of only -inf give all zeros."""
    if x.shape[-1] == 0:  # S = 0: no key to pick
        return torch.zeros_like(x)
    hard = torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
    return hard.masked_fill(~(x > float("-inf")).any(-1, keepdim=True), 0.0)


def hard_attention_weights(
    scores: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    mode: str = "argmax",
    top_k: int | None = None,
    tau: float = 1.0,
    noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Hard attention weights over scores (see the module docstring for the modes).

    Math:
        argmax: :math:`w_i = \\text{onehot}(\\arg\\max_j s_{ij})`;
        sample: :math:`w_i = \\text{onehot}(\\arg\\max_j (s_{ij} + g_{ij}))`,
        :math:`g = -\\log(-\\log u)`, :math:`u \\sim U(0, 1)`;
        topk: :math:`w_i = \\text{softmax}(s_i)` restricted to the ``top_k`` largest
        :math:`s_{ij}`.

    Args:
        scores: (..., L, S).
        attn_mask: bool (True = may attend) or additive float, broadcastable to ``scores``.
        mode: ``"argmax"``, ``"sample"`` or ``"topk"``.
        top_k: number of keys kept per query (``"topk"`` only).
        tau: temperature of the surrogate softmax of ``"sample"`` (gradient only).
        noise: Gumbel noise of the shape of ``scores`` for ``"sample"``; drawn from
            ``generator`` when None. Passing it makes a draw reproducible across frameworks.
        generator: torch random generator for the noise.

    Returns:
        (..., L, S) weights in the dtype of ``scores``; rows sum to 1, or 0 if fully masked.

    Reference: :func:`attnlab.reference.hard_attention_weights`.
    """
    check_floating("scores", scores)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}; got {mode!r}.")
    if attn_mask is not None:
        check_mask(attn_mask, tuple(scores.shape), device=scores.device)
    x = scores.float() if scores.dtype in LOW_PRECISION else scores
    x = apply_mask(x, attn_mask)  # masked keys -> -inf, never chosen
    if mode == "topk":
        if not isinstance(top_k, int) or top_k < 1:
            raise ValueError(
                f"mode='topk' needs top_k, an int >= 1 (keys kept per query); got {top_k!r}."
            )
        k = min(top_k, x.shape[-1])
        # the k largest, ties to the lower index (a stable sort; topk's pick among ties is
        # its own); a NaN sorts first, and its row is NaN
        best = x.sort(dim=-1, descending=True, stable=True).indices[..., :k]
        keep = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, best, True)
        return masked_softmax(x, keep).to(scores.dtype)
    if top_k is not None:
        raise ValueError(f"top_k is only used with mode='topk'; got mode={mode!r}.")
    if mode == "sample":
        if not tau > 0:
            raise ValueError(f"tau must be > 0; got {tau!r}.")
        if noise is None:
            u = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype)
            noise = -torch.log(-torch.log(u.clamp_min(torch.finfo(x.dtype).tiny)))
        elif noise.shape != scores.shape:
            raise ValueError(
                f"noise must have the scores' shape {tuple(scores.shape)}; got "
                f"{tuple(noise.shape)}."
            )
        x = (x + noise.to(x.dtype)) / tau
    soft = masked_softmax(x)  # the surrogate whose gradient flows back
    hard = _one_hot_argmax(x)
    return (hard + (soft - soft.detach())).to(scores.dtype)  # forward: exactly hard


def hard_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    mode: str = "argmax",
    top_k: int | None = None,
    tau: float = 1.0,
    is_causal: bool | str = False,
    scale: float | None = None,
    noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    return_weights: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Hard attention over scaled dot-product scores: select values instead of averaging.

    Shapes and masking follow :func:`attnlab.functional.scaled_dot_product_attention`
    (grouped-query heads included); the weights follow :func:`hard_attention_weights`.

    Returns:
        The (B, H, L, Ev) output, or ``(output, weights)`` if ``return_weights``.

    References:
        Xu et al., "Show, Attend and Tell", 2015; Jang, Gu, Poole, "Categorical
        Reparameterization with Gumbel-Softmax", 2017.
        Oracle: :func:`attnlab.reference.hard_attention`.
    """
    query, key, value = autocast_inputs(query, key, value)  # (as scaled_dot_product_attention)
    check_qkv(query, key, value)
    L, S = query.shape[-2], key.shape[-2]
    alignment = causal_alignment(is_causal, L, S)
    if attn_mask is not None:
        check_mask(attn_mask, (*query.shape[:-2], L, S), device=query.device)
        attn_mask = unwrap(attn_mask)
    q, k, v, mask, restore = as_4d(query, key, value, attn_mask)
    if noise is not None:
        if tuple(noise.shape) != (*query.shape[:-2], L, S):
            raise ValueError(
                f"noise must have the scores' shape {(*query.shape[:-2], L, S)}; got "
                f"{tuple(noise.shape)}."
            )
        noise = noise.reshape(*q.shape[:-1], S)  # user layout -> (B, H, L, S)
    scale = check_scale(scale)
    if scale is None:  # E = 0: every score is 0 whatever the scale
        scale = 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0
    scores = grouped_scores(q * scale, k)  # (B, H, L, S)
    mask = with_causal(mask, alignment, L, S, q.device)
    weights = hard_attention_weights(
        scores, mask, mode=mode, top_k=top_k, tau=tau, noise=noise, generator=generator
    )
    out = grouped_weighted_sum(weights, v)  # (B, H, L, Ev)
    out, weights = propagate_nonfinite(q, k, v, out, weights)  # NaN/inf inputs propagate
    return (restore(out), restore(weights)) if return_weights else restore(out)
