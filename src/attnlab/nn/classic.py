"""The classic single-head attention layers: Bahdanau, Luong, dot-product, self-attention.

Each is a few parameters around one call into :mod:`attnlab.functional`. Shapes: queries
(B, L, Dq) -- for a decoder step L = 1 --, keys (B, S, Dk), values (B, S, Dv); weights (B, L, S).
Padding enters as ``key_mask`` (B, S), True = real token; other masks as ``mask`` (bool True =
may attend, or an additive float bias). torch's names (``key_padding_mask``, ``attn_mask``,
which mean the opposite in ``nn.MultiheadAttention``) are refused with the attnlab spelling.
"""

from __future__ import annotations

import torch
from torch import nn

from attnlab import functional as AF
from attnlab._checks import check_dropout
from attnlab.masks import restrict
from attnlab.nn._names import FORWARD, refuse


def _mask(mask, key_mask, B, S):
    """mask (L, S)/(B, L, S) and key padding (B, S) -> one mask broadcasting to (B, L, S)."""
    if key_mask is None:
        return mask
    if key_mask.dtype != torch.bool or key_mask.shape != (B, S):
        raise ValueError(
            f"key_mask must be a (B, S) = {(B, S)} bool tensor, True = real token; got "
            f"{tuple(key_mask.shape)} {key_mask.dtype}."
        )
    return restrict(mask, key_mask[:, None, :])  # (B, S) -> (B, 1, S)


def _check_3d(name: str, x: torch.Tensor, width: int | None = None) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or (width and x.shape[-1] != width):
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        want = f"(B, n, {width})" if width else "(B, n, features)"
        raise ValueError(
            f"{name} must be {want}; got {got}. Fix: for one decoder step use (B, 1, features)."
        )


class AdditiveAttention(nn.Module):
    """Bahdanau (additive) attention: ``score(q, k) = w^T tanh(W_q q + b + W_k k)``.

    The key projection ``W_k k`` does not depend on the decoder step: compute it once per source
    sentence with :meth:`project_keys` and pass it as ``keys_proj`` at every step.

    Args:
        query_dim: Dq, width of the queries (e.g. the decoder state).
        key_dim: Dk, width of the keys (e.g. the encoder states).
        attn_dim: A, width of the hidden layer of the score.
        bias: the bias ``b`` (on the query side, so precomputed keys stay valid).
        dropout: dropout on the attention weights (training only).

    Example:
        >>> attn = AdditiveAttention(query_dim=32, key_dim=64, attn_dim=16)
        >>> enc = torch.randn(2, 7, 64)
        >>> keys = attn.project_keys(enc)             # once per sentence
        >>> ctx, w = attn(torch.randn(2, 1, 32), enc, keys_proj=keys, return_weights=True)
        >>> ctx.shape, w.shape
        (torch.Size([2, 1, 64]), torch.Size([2, 1, 7]))

    Reference: Bahdanau, Cho, Bengio, ICLR 2015.
    """

    def __init__(
        self,
        query_dim: int,
        key_dim: int,
        attn_dim: int,
        *,
        bias: bool = True,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.q_proj = nn.Linear(query_dim, attn_dim, bias=bias)  # W_q, b
        self.k_proj = nn.Linear(key_dim, attn_dim, bias=False)  # W_k
        self.score = nn.Linear(attn_dim, 1, bias=False)  # w (Bahdanau's v_a)
        self.dropout = check_dropout(dropout, "dropout")

    def project_keys(self, key: torch.Tensor) -> torch.Tensor:
        """(B, S, Dk) -> (B, S, A): ``W_k k``, reusable at every decoder step."""
        _check_3d("key", key, self.k_proj.in_features)
        return self.k_proj(key)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor | None = None,
        *,
        keys_proj: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        return_weights: bool = False,
        **torch_names,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """(B, L, Dq), (B, S, Dk), (B, S, Dv) -> (B, L, Dv) [, weights (B, L, S)]."""
        refuse(f"{type(self).__name__}.forward", torch_names, FORWARD)
        _check_3d("query", query, self.q_proj.in_features)
        _check_3d("key", key)
        value = key if value is None else value
        if keys_proj is None:
            k, w_key = key, self.k_proj.weight
        else:
            _check_3d("keys_proj", keys_proj, self.k_proj.out_features)
            k, w_key = keys_proj, None  # already W_k k
        mask = _mask(mask, key_mask, key.shape[0], key.shape[1])
        return AF.additive_attention(
            query,
            k,
            value,
            self.q_proj.weight,
            w_key,
            self.score.weight[0],
            mask,
            bias=self.q_proj.bias,
            dropout_p=self.dropout if self.training else 0.0,
            return_weights=return_weights,
        )


class LuongAttention(nn.Module):
    """Luong's attention with the ``"dot"``, ``"general"`` or ``"concat"`` score.

    =========  =======================  =============================================
    score      score(q, k)              computed as
    =========  =======================  =============================================
    dot        q . k                    fused dot-product attention, scale 1
    general    q^T W k                  fused dot-product attention on (q, W k)
    concat     w^T tanh(W [q; k])       additive attention with W = [W_q  W_k]
    =========  =======================  =============================================

    The scores are unscaled, as in the paper. ``"dot"`` needs ``query_dim == key_dim``.

    Reference: Luong, Pham, Manning, "Effective Approaches to Attention-based Neural Machine
    Translation", EMNLP 2015.
    """

    SCORES = ("dot", "general", "concat")

    def __init__(
        self,
        query_dim: int,
        key_dim: int,
        score: str = "general",
        attn_dim: int | None = None,
        *,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if score not in self.SCORES:
            raise ValueError(f"score must be one of {self.SCORES}; got {score!r}.")
        if score == "dot" and query_dim != key_dim:
            raise ValueError(
                f'score="dot" needs query_dim == key_dim; got {query_dim} and {key_dim}. Fix: '
                f'score="general" (learns W of shape ({query_dim}, {key_dim})).'
            )
        self.score_name, self.query_dim, self.key_dim = score, query_dim, key_dim
        self.dropout = check_dropout(dropout, "dropout")
        if score == "general":
            self.weight = nn.Linear(key_dim, query_dim, bias=False)  # W: k -> W k
        elif score == "concat":
            attn_dim = attn_dim or query_dim
            self.q_proj = nn.Linear(query_dim, attn_dim, bias=False)  # W = [W_q W_k]
            self.k_proj = nn.Linear(key_dim, attn_dim, bias=False)
            self.score = nn.Linear(attn_dim, 1, bias=False)

    def extra_repr(self) -> str:
        return f"score={self.score_name!r}, query_dim={self.query_dim}, key_dim={self.key_dim}"

    def project_keys(self, key: torch.Tensor) -> torch.Tensor:
        """The part of the score that depends only on the keys, once per source sentence."""
        _check_3d("key", key, self.key_dim)
        if self.score_name == "general":
            return self.weight(key)  # W k: (B, S, Dq)
        if self.score_name == "concat":
            return self.k_proj(key)  # W_k k: (B, S, A)
        return key

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor | None = None,
        *,
        keys_proj: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        return_weights: bool = False,
        **torch_names,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """(B, L, Dq), (B, S, Dk), (B, S, Dv) -> (B, L, Dv) [, weights (B, L, S)]."""
        refuse(f"{type(self).__name__}.forward", torch_names, FORWARD)
        _check_3d("query", query, self.query_dim)
        _check_3d("key", key, self.key_dim)
        value = key if value is None else value
        k = self.project_keys(key) if keys_proj is None else keys_proj
        mask = _mask(mask, key_mask, key.shape[0], key.shape[1])
        dropout = self.dropout if self.training else 0.0
        if self.score_name == "concat":
            return AF.additive_attention(
                query,
                k,
                value,
                self.q_proj.weight,
                None,
                self.score.weight[0],
                mask,
                dropout_p=dropout,
                return_weights=return_weights,
            )
        return AF.scaled_dot_product_attention(
            query, k, value, mask, scale=1.0, dropout_p=dropout, return_weights=return_weights
        )


class DotProductAttention(nn.Module):
    """Parameter-free (scaled) dot-product attention over given queries, keys and values.

    Args:
        scaled: divide the scores by sqrt(E) (Vaswani et al.); ``False`` for the plain dot
            product of seed 000.
        dropout: dropout on the weights (training only).
    """

    def __init__(self, scaled: bool = True, *, dropout: float = 0.0) -> None:
        super().__init__()
        self.scaled, self.dropout = scaled, check_dropout(dropout, "dropout")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        is_causal: bool | str = False,
        return_weights: bool = False,
        **torch_names,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """(B, L, E), (B, S, E), (B, S, Ev) -> (B, L, Ev) [, weights (B, L, S)]."""
        refuse(f"{type(self).__name__}.forward", torch_names, FORWARD)
        if key_mask is not None:
            _check_3d("key", key)
            mask = _mask(mask, key_mask, key.shape[0], key.shape[1])
        return AF.scaled_dot_product_attention(
            query,
            key,
            value,
            mask,
            is_causal=is_causal,
            scale=None if self.scaled else 1.0,
            dropout_p=self.dropout if self.training else 0.0,
            return_weights=return_weights,
        )


class SelfAttention(nn.Module):
    """Single-head self-attention with its own query/key width and value width (seed 001).

    ``x (B, L, d_in) -> softmax(x W_q (x W_k)^T / sqrt(d_kq)) x W_v -> (B, L, d_v)``: the value
    width may differ from the query/key width. No output projection (that belongs to
    multi-head attention).
    """

    def __init__(self, d_in: int, d_kq: int, d_v: int, *, bias: bool = False) -> None:
        super().__init__()
        self.q_proj = nn.Linear(d_in, d_kq, bias=bias)
        self.k_proj = nn.Linear(d_in, d_kq, bias=bias)
        self.v_proj = nn.Linear(d_in, d_v, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        return_weights: bool = False,
        **torch_names,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """(B, L, d_in) or (L, d_in) -> (B, L, d_v) [, weights (B, L, L)]; ``key_mask`` (B, L)
        bool, True = real token ((L,) for (L, d_in) inputs)."""
        refuse(f"{type(self).__name__}.forward", torch_names, FORWARD)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if key_mask is not None and x.dim() == 2:  # (L, d_in): one sequence, key_mask (L,)
            if key_mask.dtype != torch.bool or key_mask.shape != x.shape[:1]:
                raise ValueError(
                    f"key_mask must be an (S,) = ({x.shape[0]},) bool tensor for one sequence "
                    f"x (L, d_in) = {tuple(x.shape)}, True = real token; got "
                    f"{tuple(key_mask.shape)} {key_mask.dtype}."
                )
            mask = _mask(mask, key_mask[None], 1, x.shape[0])  # (1, 1 | L, S)
            mask = mask[0]  # -> (1 | L, S), as the (L, S) scores
        elif key_mask is not None:
            mask = _mask(mask, key_mask, x.shape[0], x.shape[1])
        return AF.scaled_dot_product_attention(
            q, k, v, mask, is_causal=is_causal, return_weights=return_weights
        )
