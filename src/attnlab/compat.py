"""A drop-in ``torch.nn.MultiheadAttention`` computed by attnlab: porting is one changed import.

::

    from torch.nn import MultiheadAttention          # before
    from attnlab.compat import MultiheadAttention    # after: nothing else changes

Constructor, parameter names and shapes (state dicts load both ways, strict), forward
signature, input layouts, mask meanings and exception types are torch's. At the boundary the
masks are converted once to attnlab's convention; the attention itself is one call of
:func:`attnlab.functional.scaled_dot_product_attention`.

Mask polarity, the trap when moving code between the two (this module speaks torch's):

=========================  =====================================  ==========================
mask                       torch ``nn.MultiheadAttention``, here  attnlab everywhere else
=========================  =====================================  ==========================
bool ``attn_mask``         True = may NOT attend                  True = may attend
bool ``key_padding_mask``  True = padding, ignore it              True = real token
float mask                 added to the scores                    added to the scores
=========================  =====================================  ==========================

Differences from torch, kept on purpose:

* A query row that may attend no key at all (every key padded or masked) gets attention
  weights 0 and attention output 0 -- the layer then returns ``out_proj.bias`` for it -- with
  finite gradients. torch returns NaN there with ``need_weights=True`` (and NaN or 0,
  depending on the kernel, without), and the NaN then spreads through the loss.
* Dropout draws its random numbers differently, so training-mode outputs follow the same
  distribution as torch's but not the same values for a given seed.
* ``dropout=1.0`` (every weight dropped) is refused in training mode, as attnlab's dropout
  takes probabilities in [0, 1).
* A float mask whose finite values lie below the inputs' dtype's range (a float32 mask filled
  with ``torch.finfo(torch.float32).min`` for bfloat16 inputs) is refused with a
  ``ValueError``: cast to the inputs' dtype those values become ``-inf`` and a row torch reads
  as "uniform over its keys" would be dead instead. attnlab's functions refuse it the same way.
* There is no NestedTensor fast path; where torch's fast path (eval, batch_first,
  self-attention) and slow path differ in rounding, this module follows the slow path.

Bad inputs raise torch's exception type (``AssertionError`` or ``RuntimeError`` for shapes and
mask dtypes) through classes that are also attnlab's ``ValueError``/``TypeError``, so an
``except`` written for either keeps working, and the message names the argument, what was
expected, what was received and the fix.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from attnlab._checks import check_bias_range, divisors
from attnlab.functional import scaled_dot_product_attention
from attnlab.masks import restrict

__all__ = ["MultiheadAttention"]


# torch reports bad inputs with AssertionError or RuntimeError; attnlab with ValueError or
# TypeError. These errors are both, so that ``except`` clauses written for either keep working.
class AssertionShapeError(ValueError, AssertionError):
    """A bad shape that torch reports with ``AssertionError``."""


class RuntimeShapeError(ValueError, RuntimeError):
    """A bad shape that torch reports with ``RuntimeError``."""


class MaskDtypeError(TypeError, AssertionError):
    """A mask dtype that torch reports with ``AssertionError``."""


class MultiheadAttention(nn.Module):
    """Multi-head attention with the interface of ``torch.nn.MultiheadAttention``.

    Math:
        .. math:: \\text{head}_h = \\text{softmax}\\Big(\\frac{(X_q W^Q_h)(X_k W^K_h)^\\top}
                  {\\sqrt{E}} + M\\Big) X_v W^V_h, \\qquad
                  \\text{out} = [\\text{head}_1; \\dots; \\text{head}_H]\\, W^O + b^O

        with ``E = embed_dim // num_heads`` and ``M`` the additive form of the masks (0 where
        attending is allowed, ``-inf`` where not). ``add_bias_kv`` appends one learned key and
        value (``bias_k``, ``bias_v``) to every sequence; ``add_zero_attn`` appends a key and
        value of zeros after them. Neither appended key is ever masked.

    Shapes (``N`` batch, ``L`` query length, ``S`` key length, ``D = embed_dim``):
        query (L, N, D) -- (N, L, D) with ``batch_first`` -- or (L, D) unbatched;
        key (S, N, kdim), value (S, N, vdim), likewise; key_padding_mask (N, S) or (S,);
        attn_mask (L, S) or (N * num_heads, L, S); output like query; weights (N, L, S)
        averaged over heads or (N, num_heads, L, S) per head (no N when unbatched), with
        ``S + 1`` or ``S + 2`` columns when keys are appended.

    Args:
        embed_dim: D, width of the queries and of the output.
        num_heads: H; must divide D.
        dropout: dropout on the attention weights, in training mode only.
        bias: biases in the input and output projections.
        add_bias_kv: learn one extra key and value appended to every sequence.
        add_zero_attn: append a zero key and value (a place to put attention "nowhere").
        kdim, vdim: widths of key and value (default D); if either differs from D the input
            projections are ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight`` instead of
            the packed ``in_proj_weight``, as in torch.
        batch_first: inputs and outputs are (N, L, D) instead of (L, N, D).

    Raises:
        ValueError: embed_dim or num_heads not positive. ``AssertionError`` (also a
            ``ValueError`` here) if num_heads does not divide embed_dim. ``forward`` raises
            torch's exception types for bad inputs, with messages that say the fix.

    References:
        Vaswani et al., "Attention Is All You Need", 2017. Oracle:
        :func:`attnlab.reference.scaled_dot_product_attention` (the per-head attention).

    Example:
        >>> torch_mha = torch.nn.MultiheadAttention(16, 4, batch_first=True)
        >>> mha = MultiheadAttention(16, 4, batch_first=True)
        >>> mha.load_state_dict(torch_mha.state_dict())
        <All keys matched successfully>
        >>> x = torch.randn(2, 5, 16)
        >>> pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])  # True = padding
        >>> out, w = mha(x, x, x, key_padding_mask=pad)
        >>> out.shape, w.shape
        (torch.Size([2, 5, 16]), torch.Size([2, 5, 5]))
    """

    def __init__(
        self,
        embed_dim,
        num_heads,
        dropout=0.0,
        bias=True,
        add_bias_kv=False,
        add_zero_attn=False,
        kdim=None,
        vdim=None,
        batch_first=False,
        device=None,
        dtype=None,
    ) -> None:
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(
                f"embed_dim and num_heads must be positive; got embed_dim={embed_dim}, "
                f"num_heads={num_heads}."
            )
        if embed_dim % num_heads:
            raise AssertionShapeError(
                f"num_heads={num_heads} must divide embed_dim={embed_dim} (each head gets "
                f"embed_dim // num_heads features). Fix: num_heads in {divisors(embed_dim)}."
            )
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.dropout, self.batch_first, self.add_zero_attn = dropout, batch_first, add_zero_attn
        # Created in torch's order, and initialised in _reset_parameters as torch does, so that
        # the same seed gives the same parameters.
        D = embed_dim
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * D, D, **kw))  # [W_q; W_k; W_v]
            for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                self.register_parameter(name, None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(D, D, **kw))
            self.k_proj_weight = nn.Parameter(torch.empty(D, self.kdim, **kw))
            self.v_proj_weight = nn.Parameter(torch.empty(D, self.vdim, **kw))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * D, **kw))  # [b_q; b_k; b_v]
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(D, D, bias=bias, **kw)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, D, **kw))
            self.bias_v = nn.Parameter(torch.empty(1, 1, D, **kw))
        else:
            self.bias_k = self.bias_v = None
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """torch's initialisation: Glorot-uniform projections, zero biases, normal bias_k/v."""
        for w in (self.in_proj_weight, self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
            if w is not None:
                nn.init.xavier_uniform_(w)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)
        for b in (self.bias_k, self.bias_v):
            if b is not None:
                nn.init.xavier_normal_(b)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, kdim={self.kdim}, "
            f"vdim={self.vdim}, batch_first={self.batch_first} (torch's interface, attnlab inside)"
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """torch's ``MultiheadAttention.forward``: see the class docstring for shapes and masks.

        ``is_causal`` is a hint that ``attn_mask`` is causal, as in torch: it requires
        ``attn_mask``; when there is no ``key_padding_mask`` and ``need_weights=False`` the
        mask is not read and top-left causal attention is computed instead.

        Returns:
            ``(output, weights)``; weights are None when ``need_weights=False``.
        """
        same = query is key and key is value  # self-attention: one projection (before views)
        batched = self._check(query, key, value, key_padding_mask, attn_mask, is_causal)
        if not batched:  # (L, D) -> (1, L, D)
            query, key, value = query[None], key[None], value[None]
            key_padding_mask = None if key_padding_mask is None else key_padding_mask[None]
        elif not self.batch_first:  # (L, N, D) -> (N, L, D)
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        N, L, D = query.shape
        S, H, E = key.shape[1], self.num_heads, self.head_dim
        # is_causal hint: torch then drops attn_mask unread (but an unbatched 3-D one is checked)
        causal_hint = is_causal and key_padding_mask is None and not need_weights
        checked = attn_mask if not causal_hint or (not batched and attn_mask.dim() == 3) else None
        self._check_lengths(query, key, value, key_padding_mask, checked, batched)

        q, k, v = self._in_projection(query, key, value, same)  # (N, L, D), (N, S, D) x 2
        if self.bias_k is not None:  # one learned key/value more: (N, S, D) -> (N, S + 1, D)
            k = torch.cat([k, self.bias_k.expand(N, 1, D)], 1)
            v = torch.cat([v, self.bias_v.expand(N, 1, D)], 1)
        q = q.view(N, L, H, E).transpose(1, 2)  # (N, L, D) -> (N, H, L, E)
        k = k.view(N, k.shape[1], H, E).transpose(1, 2)  # (N, S', D) -> (N, H, S', E)
        v = v.view(N, v.shape[1], H, E).transpose(1, 2)  # (sizes, not -1: N may be 0)
        if self.add_zero_attn:  # one zero key/value more: (N, H, S', E) -> (N, H, S' + 1, E)
            k = torch.cat([k, k.new_zeros(N, H, 1, E)], 2)
            v = torch.cat([v, v.new_zeros(N, H, 1, E)], 2)

        if causal_hint:  # torch drops attn_mask and runs its SDPA's is_causal (top-left)
            mask, causal = None, "top_left"
        else:
            for name, given in (("attn_mask", attn_mask), ("key_padding_mask", key_padding_mask)):
                if given is not None:  # (before the cast below turns such values into -inf)
                    check_bias_range(given, q.dtype, name, "True = masked, as torch reads it")
            mask, causal = _attnlab_mask(attn_mask, key_padding_mask, N, H, k.shape[2] - S), False
            if mask is not None and mask.is_floating_point():
                mask = mask.to(q.dtype)
        want = ("average" if average_attn_weights else True) if need_weights else False
        p = self.dropout if self.training else 0.0
        out = scaled_dot_product_attention(
            q, k, v, mask, is_causal=causal, dropout_p=p, return_weights=want
        )
        out, weights = out if need_weights else (out, None)
        out = self.out_proj(out.transpose(1, 2).reshape(N, L, D))  # (N, H, L, E) -> (N, L, D)
        if not batched:  # (1, L, D) -> (L, D); weights (1, [H,] L, S) -> ([H,] L, S)
            return out[0], None if weights is None else weights[0]
        return (out if self.batch_first else out.transpose(0, 1)), weights

    def _in_projection(self, query, key, value, same):
        """(N, L, D), (N, S, kdim), (N, S, vdim) -> q (N, L, D), k (N, S, D), v (N, S, D)."""
        b = (None,) * 3 if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
        if not self._qkv_same_embed_dim:
            weights = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
        elif same:
            return F.linear(query, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        else:
            weights = self.in_proj_weight.chunk(3)
        return tuple(
            F.linear(x, w, bi) for x, w, bi in zip((query, key, value), weights, b, strict=True)
        )

    def _check(self, query, key, value, key_padding_mask, attn_mask, is_causal) -> bool:
        """Dims and dtypes, checked before any work; returns whether the input is batched."""
        if any(getattr(x, "is_nested", False) for x in (query, key, value)):
            raise AssertionShapeError(
                "NestedTensor inputs are not supported. Fix: pad the sequences to one length "
                "and pass key_padding_mask (True = padding)."
            )
        if query.dim() not in (2, 3):
            raise AssertionShapeError(
                f"query must be 3-D (L, N, D) -- (N, L, D) with batch_first -- or 2-D (L, D) "
                f"unbatched; got shape {tuple(query.shape)}."
            )
        if key.dim() != query.dim() or value.dim() != query.dim():
            raise AssertionShapeError(
                f"key and value must have as many dims as query ({query.dim()}-D); got key "
                f"{tuple(key.shape)}, value {tuple(value.shape)}."
            )
        kpm_dim = query.dim() - 1
        if key_padding_mask is not None and key_padding_mask.dim() != kpm_dim:
            raise AssertionShapeError(
                f"key_padding_mask must be {'(N, S)' if kpm_dim == 2 else '(S,)'} for a "
                f"{query.dim()}-D query; got shape {tuple(key_padding_mask.shape)}."
            )
        if attn_mask is not None and attn_mask.dim() not in (2, 3):
            raise AssertionShapeError(
                f"attn_mask must be (L, S) or (N * num_heads, L, S); got shape "
                f"{tuple(attn_mask.shape)}. Fix: a (N, num_heads, L, S) mask can be flattened "
                f"with .flatten(0, 1)."
            )
        for name, m in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
            if m is not None and m.dtype != torch.bool and not m.is_floating_point():
                raise MaskDtypeError(
                    f"{name} must be bool (True = masked) or floating (added to the scores); "
                    f"got dtype {m.dtype}. Fix: {name}.bool() if 1 means 'masked'."
                )
        if key_padding_mask is not None and attn_mask is not None:
            if key_padding_mask.dtype != attn_mask.dtype:
                warnings.warn(
                    f"key_padding_mask ({key_padding_mask.dtype}) and attn_mask "
                    f"({attn_mask.dtype}) have different dtypes; torch deprecates mixing them. "
                    f"Fix: give both the same dtype.",
                    UserWarning,
                    stacklevel=3,
                )
        if is_causal and attn_mask is None:  # (torch: RuntimeError; attnlab: ValueError)
            raise RuntimeShapeError(
                "is_causal=True is a hint that attn_mask is causal, and needs attn_mask. Fix: "
                "pass attn_mask=torch.nn.Transformer.generate_square_subsequent_mask(L) (or "
                "the bool torch.ones(L, L, dtype=torch.bool).triu(1), True = masked)."
            )
        return query.dim() == 3

    def _check_lengths(self, query, key, value, key_padding_mask, attn_mask, batched) -> None:
        """Widths, batch sizes and mask shapes, on (N, L, D) / (N, S, kdim) inputs."""
        N, L, D = query.shape
        S = key.shape[1]
        if D != self.embed_dim:
            raise AssertionShapeError(
                f"query must have embed_dim={self.embed_dim} features; got {D} (query "
                f"{tuple(query.shape)}). Fix: project it to {self.embed_dim} first."
            )
        same_length = key.shape[:2] == value.shape[:2]
        if not same_length or (self._qkv_same_embed_dim and key.shape != value.shape):
            raise AssertionShapeError(
                f"key and value must have the same batch size and length"
                f"{' and, with kdim == vdim == embed_dim, width' if same_length else ''}; got "
                f"key {tuple(key.shape)}, value {tuple(value.shape)} (batch-first view)."
            )
        # torch: AssertionError with separate projection weights, RuntimeError from the matmul
        # with the packed in_proj_weight
        error = RuntimeShapeError if self._qkv_same_embed_dim else AssertionShapeError
        for name, what, x in (("key", "kdim", key), ("value", "vdim", value)):
            if x.shape[-1] != (width := getattr(self, what)):
                raise error(
                    f"{name} must have {what}={width} features; got {x.shape[-1]}. Fix: "
                    f"MultiheadAttention(..., {what}={x.shape[-1]}) for inputs of that width."
                )
        if key.shape[0] != N:
            raise RuntimeShapeError(
                f"key and value must have query's batch size {N}; got {key.shape[0]} (query "
                f"{tuple(query.shape)}, key {tuple(key.shape)}, batch-first view)."
            )
        if key_padding_mask is not None and key_padding_mask.shape != (N, S):
            raise AssertionShapeError(
                f"key_padding_mask must be (N, S) = {(N, S)}, one flag per key (True = padding); "
                f"got {tuple(key_padding_mask.shape)}."
            )
        if attn_mask is None:
            return
        if attn_mask.dim() == 2:
            expected, legend = (L, S), "(L, S)"
        elif batched:
            expected, legend = (N * self.num_heads, L, S), "(N * num_heads, L, S)"
        else:
            expected, legend = (self.num_heads, L, S), "(num_heads, L, S)"
        if attn_mask.shape != expected:
            error = AssertionShapeError if legend == "(num_heads, L, S)" else RuntimeShapeError
            raise error(
                f"attn_mask must be {legend} = {expected}; got {tuple(attn_mask.shape)}. Fix: "
                f"L is the query length, S the key length (before add_bias_kv/add_zero_attn)."
            )


def _attnlab_mask(attn_mask, key_padding_mask, N, H, appended):
    """torch's masks -> one attnlab mask (True = may attend, or additive), (N, H | 1, L | 1, S').

    ``appended`` keys (bias_k, zero attention) were added after the S real ones: never masked.
    """
    mask = None
    if attn_mask is not None:
        mask = ~attn_mask if attn_mask.dtype == torch.bool else attn_mask  # flip polarity
        if mask.dim() == 3:  # (N * H, L, S) -> (N, H, L, S): index n * H + h, as torch
            mask = mask.view(N, H, *mask.shape[1:])
    if key_padding_mask is not None:
        pad = key_padding_mask
        pad = (~pad if pad.dtype == torch.bool else pad)[:, None, None, :]  # (N,S)->(N,1,1,S)
        if mask is None:
            mask = pad
        elif mask.is_floating_point() and pad.is_floating_point():
            mask = mask + pad  # two additive biases add
        else:  # AND of two bool masks, or -inf in the bias where the bool one forbids
            mask = restrict(mask, pad) if pad.dtype == torch.bool else restrict(pad, mask)
    if mask is not None and appended:
        fill = mask.new_ones if mask.dtype == torch.bool else mask.new_zeros
        mask = torch.cat([mask, fill(*mask.shape[:-1], appended)], -1)
    return mask
