"""Multi-head attention: self- and cross-attention, MQA/GQA, RoPE, KV caches, weights on demand.

The layer is projections and bookkeeping around one call of
:func:`attnlab.functional.scaled_dot_product_attention`::

    x (B, L, D) --q_proj--> (B, L, H*E) --view--> (B, H, L, E) -+
    y (B, S, Dk) --k_proj--> (B, S, Hkv*E) -----> (B, Hkv, S, E) -+-> sdpa -> (B, H, L, E)
    y (B, S, Dv) --v_proj--> (B, S, Hkv*E) -----> (B, Hkv, S, E) -+            |
                                          (B, L, H*E) <--transpose/reshape--+
                                          --o_proj--> (B, L, D)

``num_kv_heads`` < ``num_heads`` gives grouped-query attention (``num_kv_heads == 1``:
multi-query): fewer key/value heads to project and, above all, to cache.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from attnlab._checks import check_count, check_dropout, check_floating, check_mask, divisors
from attnlab.cache import Cache, SlidingWindowCache
from attnlab.functional.rotary import RotaryScaling, apply_rotary_qk, rotate_qk
from attnlab.functional.sdpa import attention_with
from attnlab.kernels.few_rows import linear
from attnlab.masks import restrict, sliding_window_mask, unwrap
from attnlab.nn._names import COMPAT, FORWARD, INIT, refuse


class MultiHeadAttention(nn.Module):
    """Multi-head (and multi-query / grouped-query) attention.

    Args:
        d_model: D, the width of the queries and of the output.
        num_heads: H, query heads.
        num_kv_heads: Hkv, key/value heads; must divide H. Default H (multi-head); 1 is
            multi-query attention.
        head_dim: E; default D // H (then H must divide D).
        kdim, vdim: widths of the key and value inputs for cross-attention (default D).
        bias: biases in the four projections.
        attn_dropout: dropout on the attention weights (training only).
        out_dropout: dropout on the output (training only).
        is_causal: default for ``forward``: each position attends only to itself and earlier
            positions.
        rope: rotary position embedding of queries and keys (self-attention only): ``True``
            (base 10000), or a float: the base, finite and > 1.
        rope_scaling: the rotary frequencies' stretch for a longer context
            (:class:`attnlab.functional.RotaryScaling`: "linear" or Llama 3.1's "llama3"), with
            ``rope``; None (the default) for plain RoPE.
        sliding_window: each query sees only itself and the ``sliding_window - 1`` positions
            before it (causal).
        layer_idx: this layer's index in a :mod:`attnlab.cache` cache: one per application
            in a forward pass. A cache cannot tell two applications of one index in a pass
            from two decode steps, so a layer applied twice per pass (weights shared across
            depth) with one index stores both applications' keys in one sequence and attends
            to the wrong keys: give it an index per application (a ``layer_idx`` attribute
            changed between calls, or one module per application sharing the weights).

    Raises:
        ValueError: at construction, for an inconsistent configuration (the message names both
            values and the fix).

    Example:
        >>> mha = MultiHeadAttention(d_model=64, num_heads=8, num_kv_heads=2, is_causal=True)
        >>> x = torch.randn(3, 10, 64)
        >>> y, w = mha(x, return_weights=True)
        >>> y.shape, w.shape
        (torch.Size([3, 10, 64]), torch.Size([3, 8, 10, 10]))
    """

    def __init__(
        self,
        d_model: int | None = None,  # required; None only so torch's names get a clear error
        num_heads: int | None = None,
        *positional,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        bias: bool = True,
        attn_dropout: float = 0.0,
        out_dropout: float = 0.0,
        is_causal: bool = False,
        rope: bool | float = False,
        rope_scaling: RotaryScaling | None = None,
        sliding_window: int | None = None,
        layer_idx: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **torch_names,
    ) -> None:
        if positional:
            raise TypeError(
                f"MultiHeadAttention takes d_model and num_heads positionally and everything else "
                f"by keyword; got {len(positional)} more positional argument(s) {positional!r}. "
                f"Fix: name them, e.g. num_kv_heads=2 or attn_dropout=0.1 (torch's third "
                f"positional argument is dropout), or use {COMPAT}."
            )
        refuse("MultiHeadAttention", torch_names, INIT)
        for name, value in (("d_model", d_model), ("num_heads", num_heads)):
            if value is None:
                raise TypeError(
                    f"MultiHeadAttention needs {name}; e.g. (d_model=512, num_heads=8)."
                )
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        d_model, num_heads, num_kv_heads, head_dim = _check_config(
            d_model, num_heads, num_kv_heads, head_dim, attn_dropout, out_dropout
        )
        head_dim = d_model // num_heads if head_dim is None else head_dim
        if rope is not False and head_dim % 2:
            raise ValueError(f"rope needs an even head_dim; got head_dim={head_dim}.")
        if rope_scaling is not None and (
            rope is False or not isinstance(rope_scaling, RotaryScaling)
        ):
            raise TypeError(
                f"rope_scaling stretches the frequencies of a layer with rope=...: expected an "
                f"attnlab.functional.RotaryScaling and rope=True or a base; got rope={rope!r}, "
                f"rope_scaling={rope_scaling!r}. Fix: e.g. rope=500000.0, rope_scaling="
                f"RotaryScaling('llama3', 8.0, 1.0, 4.0, 8192)."
            )
        if not isinstance(rope, bool) and not (
            isinstance(rope, numbers.Real) and math.isfinite(rope) and rope > 1
        ):
            raise ValueError(
                f"rope must be True (base 10000), False, or a rotary base: a finite number > 1 "
                f"(theta_i = base^(-2i/E)); got {rope!r}. Fix: rope=True, or e.g. rope=500000.0."
            )
        if sliding_window is not None and (
            not isinstance(sliding_window, int) or sliding_window < 1
        ):
            raise ValueError(f"sliding_window must be an int >= 1 or None; got {sliding_window!r}.")
        self.d_model, self.num_heads, self.num_kv_heads = d_model, num_heads, num_kv_heads
        self.head_dim, self.is_causal, self.layer_idx = head_dim, is_causal, layer_idx
        self.kdim, self.vdim = kdim or d_model, vdim or d_model
        self.rope_base = None if rope is False else (10000.0 if rope is True else float(rope))
        self.rope_scaling = rope_scaling
        self.sliding_window = sliding_window
        self.attn_dropout = attn_dropout
        kw = {"bias": bias, "device": device, "dtype": dtype}
        self.q_proj = nn.Linear(d_model, num_heads * head_dim, **kw)
        self.k_proj = nn.Linear(self.kdim, num_kv_heads * head_dim, **kw)
        self.v_proj = nn.Linear(self.vdim, num_kv_heads * head_dim, **kw)
        self.o_proj = nn.Linear(num_heads * head_dim, d_model, **kw)
        self.out_dropout = nn.Dropout(out_dropout)

    def extra_repr(self) -> str:
        extra = f", rope base {self.rope_base}" if self.rope_base is not None else ""
        extra += f", {self.rope_scaling}" if self.rope_scaling else ""
        extra += f", sliding_window={self.sliding_window}" if self.sliding_window else ""
        return (
            f"d_model={self.d_model}, num_heads={self.num_heads}, num_kv_heads="
            f"{self.num_kv_heads}, head_dim={self.head_dim}, is_causal={self.is_causal}{extra}"
        )

    def project_kv(
        self, key: torch.Tensor, value: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values for cross-attention, computed once per source sequence.

        (B, S, kdim), (B, S, vdim) -> (B, Hkv, S, E), (B, Hkv, S, E). Pass the result as
        ``kv=`` at every decoder step instead of recomputing the projections.
        """
        value = key if value is None else value
        _check_width("key", key, self.kdim, self.q_proj.weight.dtype)
        _check_width("value", value, self.vdim, self.q_proj.weight.dtype)
        B, S, _ = key.shape
        k = linear(self.k_proj, key).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = linear(self.v_proj, value).view(B, S, self.num_kv_heads, self.head_dim)
        return k, v.transpose(1, 2)  # (B, S, Hkv*E) -> (B, Hkv, S, E)

    def forward(
        self,
        query: torch.Tensor,
        *positional,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        mask: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        is_causal: bool | str | None = None,
        cache: Cache | None = None,
        position_ids: torch.Tensor | None = None,
        rope_angles: tuple[torch.Tensor, torch.Tensor] | None = None,
        return_weights: bool = False,
        average_weights: bool = False,
        **torch_names,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``query`` to ``key``/``value`` (or to ``query`` itself).

        Args:
            query: (B, L, D).
            key: (B, S, kdim) for cross-attention; None for self-attention.
            value: (B, S, vdim); defaults to ``key``.
            kv: precomputed ``project_kv(key, value)`` for cross-attention (instead of key).
            mask: bool (True = may attend) or additive float, broadcastable to
                (B, H, L, S). With a ``cache``, S counts the keys it returns: P + L for a
                :class:`~attnlab.cache.DynamicCache`, its slots for a static or sliding-window
                one (``cache.key_positions(layer_idx)``: each slot's position, -1 = empty).
            key_mask: (B, S) bool, True = real token. With a ``cache``: (B, L) for the
                new tokens only; the cache remembers it.
            is_causal: overrides the layer's default. With a cache, causality is always
                bottom-right: the new tokens come after the cached ones. A non-causal layer
                with a cache lets each new token see the cached and new tokens only (what a
                prefix holds), so token-by-token outputs differ from one call on the whole
                sequence, where earlier tokens also see later ones.
            cache: a :mod:`attnlab.cache` cache (self-attention only); the new keys/values are
                appended under ``self.layer_idx``.
            position_ids: (L,) or (B, L) positions for RoPE; default: after the cached tokens.
            rope_angles: instead of ``position_ids``, their rotation angles ``(cos, sin)``, each
                (L, E) or (B, L, E), from :func:`attnlab.functional.rotary_angles` with this
                layer's ``rope_base`` and ``rope_scaling``: a model computes them once per
                forward for all its layers (as Hugging Face's ``position_embeddings``) instead
                of once per layer.
            return_weights: also return the attention weights, (B, H, L, S).
            average_weights: average the returned weights over heads: (B, L, S).

        Returns:
            (B, L, D), and the weights if ``return_weights``.
        """
        if positional:
            raise TypeError(
                f"MultiHeadAttention.forward takes key= and value= by keyword (got "
                f"{len(positional)} more positional tensor(s)), and returns the output alone "
                f"unless return_weights=True: torch's `out, w = mha(q, k, v)` would split the "
                f"batch. Fix: layer(query, key=key, value=value), or use {COMPAT}."
            )
        refuse("MultiHeadAttention.forward", torch_names, FORWARD)
        if cache is not None and not isinstance(cache, Cache):
            raise TypeError(
                f"cache must be an attnlab.cache cache (DynamicCache, StaticCache, "
                f"SlidingWindowCache); got {type(cache).__module__}.{type(cache).__name__}. Fix: "
                f"build one with attnlab.cache.DynamicCache() (Hugging Face caches belong to "
                f"Hugging Face models; attnlab.integrations.transformers runs those)."
            )
        if kv is not None and (key is not None or value is not None):
            raise ValueError(
                "kv= (keys and values already projected by project_kv) replaces key= and "
                "value=; got both, and one would be ignored. Fix: pass kv=layer.project_kv(key, "
                "value), or key= and value= alone."
            )
        _check_width("query", query, self.d_model, self.q_proj.weight.dtype)
        B, L, _ = query.shape
        q = linear(self.q_proj, query).view(B, L, self.num_heads, self.head_dim).transpose(1, 2)
        self_attention = key is None and kv is None  # (B, L, H*E) -> (B, H, L, E) above
        if kv is not None:
            k, v = kv
        else:
            k, v = self.project_kv(query if key is None else key, value)
        causal = self.is_causal if is_causal is None else is_causal
        if not self_attention and (
            cache is not None or self.rope_base is not None or self.sliding_window
        ):
            raise ValueError(
                "cache, rope and sliding_window apply to self-attention only; for cross-"
                "attention, project the source once with project_kv() and pass kv=."
            )
        if cache is not None and self.layer_idx is None:
            raise ValueError(
                "this layer has no layer_idx, so it cannot use a cache. Fix: "
                "MultiHeadAttention(..., layer_idx=i), one index per layer."
            )
        q_pos = None  # (L,) positions of the new tokens, with a cache
        if cache is not None and cache.stepping:  # a compiled decode step: no Python count
            self._check_step(cache, L, key_mask)
            q_pos = cache.next_position(self.layer_idx)  # (1,), on the device
        elif cache is not None:
            past = cache.get_seq_length(self.layer_idx)
            q_pos = torch.arange(past, past + L, device=query.device)
        if rope_angles is not None:
            self._check_rope_angles(rope_angles, position_ids, B, L)
            q, k = rotate_qk(q, k, *rope_angles)
        elif self.rope_base is not None:
            if position_ids is None:
                position_ids = torch.arange(L, device=query.device) if q_pos is None else q_pos
            q, k = apply_rotary_qk(q, k, position_ids, self.rope_base, self.rope_scaling)
        allowed = None  # what the cache or the window allows
        kv_finite = None  # (B, Hkv): the cache checked each slot for NaN/inf when writing it
        if cache is not None:
            every_slot = mask is not None  # (a mask of the caller's is sized to every slot)
            k, v, allowed, causal = self._from_cache(
                cache, k, v, key_mask, causal, q_pos, every_slot
            )
            key_mask = None  # now part of allowed
            kv_finite = cache.kv_finite(self.layer_idx)
        elif self.sliding_window is not None:
            allowed = unwrap(
                sliding_window_mask(
                    L,
                    k.shape[2],
                    window=self.sliding_window,
                    alignment="bottom_right",
                    device=q.device,
                )
            )
            causal = False
        if mask is not None:  # (checked before it meets the cache's or window's own mask)
            _check_user_mask(mask, (B, self.num_heads, L, k.shape[2]), cache, q.device)
        mask = _combine(allowed, unwrap(mask), key_mask, B, k.shape[2])
        dropout = self.attn_dropout if self.training else 0.0
        want = ("average" if average_weights else True) if return_weights else False
        out = attention_with(
            q,
            k,
            v,
            mask,
            is_causal=causal,
            dropout_p=dropout,
            return_weights=want,
            kv_finite=kv_finite,
        )
        out, weights = out if return_weights else (out, None)
        if weights is not None and cache is not None:
            weights = _every_slot(weights, cache.key_positions(self.layer_idx).shape[0])
        out = out.transpose(1, 2).reshape(B, L, self.num_heads * self.head_dim)
        out = self.out_dropout(linear(self.o_proj, out))  # (B, H, L, E) -> (B, L, H*E) -> (B, L, D)
        return (out, weights) if return_weights else out

    def _from_cache(self, cache, k, v, key_mask, causal, q_pos, every_slot=False):
        """Store the new keys/values (at positions ``q_pos`` (L,)); return the keys, values,
        mask and alignment to attend with: all slots when ``every_slot``, else where the cache
        knows its filled slots (:meth:`Cache.filled_prefix`) those alone."""
        self._check_window(cache)
        if cache.stepping:  # the slot found on the device; counted after the step
            keys, values = cache.write_step(k, v, self.layer_idx, q_pos)
        else:
            keys, values = cache.update(k, v, self.layer_idx, key_mask=key_mask)
        padding = cache.key_mask(self.layer_idx)
        mask = None if padding is None else padding[:, None, None, :]  # (B, S) -> (B, 1, 1, S)
        n = None  # attend to slots 0..n-1 alone, bottom-right aligned
        if self.sliding_window is None and (cache.in_order or not (every_slot or cache.stepping)):
            n = cache.filled_prefix(self.layer_idx)
        if n is not None:
            # slots 0..n-1 hold positions 0..n-1 in order: the new queries are the last L ->
            # bottom-right alignment, and no mask for empty slots (a static cache's n: an eager
            # prefill attends to its P keys, not to every slot)
            if n < keys.shape[2]:
                keys, values = keys[:, :, :n], values[:, :, :n]
                mask = None if mask is None else mask[..., :n]
            return keys, values, mask, "bottom_right" if causal else False
        k_pos = cache.key_positions(self.layer_idx)  # (S,), -1 = empty slot
        L = q_pos.shape[0]
        allowed = (k_pos >= 0)[None, :].expand(L, -1)  # (L, S)
        if causal:
            allowed = allowed & (k_pos[None, :] <= q_pos[:, None])
        if self.sliding_window is not None:  # causal: itself and the w - 1 positions before it
            distance = q_pos[:, None] - k_pos[None, :]  # (L, S)
            allowed = allowed & (distance >= 0) & (distance < self.sliding_window)
        mask = allowed if mask is None else mask & allowed
        return keys, values, mask, False

    def _check_window(self, cache) -> None:
        if isinstance(cache, SlidingWindowCache) and (
            self.sliding_window is None or self.sliding_window > cache.window
        ):
            raise ValueError(
                f"a SlidingWindowCache of window {cache.window} drops keys this layer still "
                f"attends to (sliding_window={self.sliding_window}). Fix: "
                f"MultiHeadAttention(..., sliding_window=w) with w <= {cache.window}."
            )

    def _check_rope_angles(self, angles, position_ids, B: int, L: int) -> None:
        """``rope_angles``: a (cos, sin) pair of (L, E) or (B, L, E), on a layer with RoPE."""
        if self.rope_base is None or position_ids is not None:
            raise ValueError(
                "rope_angles rotates the queries and keys of a layer built with rope=..., in "
                "place of position_ids; got "
                + ("a layer without RoPE" if self.rope_base is None else "both")
                + ". Fix: MultiHeadAttention(..., rope=True), and pass one of the two."
            )
        pair = isinstance(angles, tuple | list) and len(angles) == 2
        pair = pair and all(isinstance(a, torch.Tensor) and a.is_floating_point() for a in angles)
        shape = tuple(angles[0].shape) if pair else None
        if not (
            pair
            and tuple(angles[1].shape) == shape
            and len(shape) in (2, 3)
            and shape[-2:] == (L, self.head_dim)
            and (len(shape) == 2 or shape[0] in (1, B))
        ):
            got = [tuple(a.shape) for a in angles] if pair else type(angles).__name__
            raise ValueError(
                f"rope_angles must be (cos, sin), two floating tensors of shape (L, E) or "
                f"(B, L, E) with B = {B}, L = {L} and E = head_dim = {self.head_dim}; got {got}. "
                f"Fix: rope_angles=attnlab.functional.rotary_angles(position_ids, "
                f"{self.head_dim}, {self.rope_base}, scaling=layer.rope_scaling)."
            )

    def _check_step(self, cache, L, key_mask) -> None:
        """A compiled decode step (``cache.stepping``) writes one real token per row."""
        if L != 1 or key_mask is not None:
            raise ValueError(
                f"a decode step (cache.stepping) writes one new token per row with no key_mask; "
                f"got L={L}" + (" and a key_mask" if key_mask is not None else "") + ". Fix: "
                "prefill the prompt (and its padding) with an ordinary call, outside the step."
            )

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> MultiHeadAttention:
        """An attnlab layer with the weights of a batch-first ``torch.nn.MultiheadAttention``.

        The result computes the same function with attnlab's conventions: ``(B, L, D)`` inputs,
        ``mask`` bool True = may attend and ``key_mask`` True = real token, where torch's bool
        ``attn_mask`` and ``key_padding_mask`` mean True = *not* allowed (convert them with
        :func:`attnlab.masks.from_torch_mask`; float masks are additive in both). To keep
        torch's interface and meanings instead, load the module's ``state_dict()`` into
        :class:`attnlab.compat.MultiheadAttention`. The layer takes the module's mode (train
        or eval: attention dropout only in training) and, when every parameter is frozen,
        stays frozen.

        Raises:
            TypeError: ``module`` is not a ``torch.nn.MultiheadAttention``.
            ValueError: ``batch_first=False`` (its inputs are (L, B, D); attnlab layers read
                (B, L, D)), ``add_bias_kv`` or ``add_zero_attn`` (no equivalent here).
        """
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(f"from_torch expects torch.nn.MultiheadAttention; got {type(module)}.")
        if not module.batch_first:
            raise ValueError(
                "from_torch: the module has batch_first=False, so the code around it feeds "
                "(L, B, D) tensors, while attnlab layers read (B, L, D): the same tensors would "
                "be silently misread. Fix: attnlab.compat.MultiheadAttention(...) with "
                "load_state_dict(module.state_dict()) keeps torch's layout; or, if you will "
                "feed (B, L, D) inputs, set module.batch_first = True first (the weights do not "
                "depend on the layout)."
            )
        if module.bias_k is not None or module.add_zero_attn:
            raise ValueError(
                "from_torch: add_bias_kv and add_zero_attn have no equivalent in attnlab's "
                "layer. Fix: attnlab.compat.MultiheadAttention supports both (load the "
                "module's state_dict into it)."
            )
        D, H = module.embed_dim, module.num_heads
        w = module.in_proj_weight
        bias = module.in_proj_bias is not None
        layer = cls(
            D,
            H,
            kdim=module.kdim,
            vdim=module.vdim,
            bias=bias,
            attn_dropout=module.dropout,
            device=module.out_proj.weight.device,
            dtype=module.out_proj.weight.dtype,
        )
        with torch.no_grad():
            if module._qkv_same_embed_dim:
                wq, wk, wv = w.chunk(3)
            else:
                wq, wk, wv = module.q_proj_weight, module.k_proj_weight, module.v_proj_weight
            for proj, weight in ((layer.q_proj, wq), (layer.k_proj, wk), (layer.v_proj, wv)):
                proj.weight.copy_(weight)
            if bias:
                for proj, b in zip(
                    (layer.q_proj, layer.k_proj, layer.v_proj),
                    module.in_proj_bias.chunk(3),
                    strict=True,
                ):
                    proj.bias.copy_(b)
            layer.o_proj.weight.copy_(module.out_proj.weight)
            if layer.o_proj.bias is not None:
                if module.out_proj.bias is None:
                    layer.o_proj.bias.zero_()
                else:
                    layer.o_proj.bias.copy_(module.out_proj.bias)
        frozen = not any(p.requires_grad for p in module.parameters())
        if frozen:  # (a frozen module stays frozen)
            layer.requires_grad_(False)
        return layer.train(module.training)  # (eval: no attention dropout, as the module)


def _check_user_mask(mask, scores_shape, cache, device) -> None:
    """:func:`check_mask` against the scores (B, H, L, S), saying what S is with a cache.

    A 3-D mask (n, L, S) with n > 1 is refused: Keras's ``attention_mask`` is (B, L, S) and
    torch's 3-D ``attn_mask`` (B*H, L, S), while broadcasting would read it as (H, L, S) --
    silently wrong for both when n == H.
    """
    if isinstance(mask, torch.Tensor) and mask.dim() == 3 and mask.shape[0] > 1:
        B, H = scores_shape[:2]
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} is ambiguous: a 3-D mask may be per batch row "
            f"(B, L, S), as Keras's attention_mask, or per head, and broadcasting against the "
            f"scores (B, H, L, S) = {tuple(scores_shape)} would read it per head. Fix: "
            f"mask[:, None] for (B, 1, L, S) (B = {B}), or mask[None] for (1, H, L, S) "
            f"(H = {H}); for torch's (B*H, L, S) attn_mask, mask.view(B, H, L, S)."
        )
    try:
        check_mask(mask, scores_shape, name="mask", device=device)
    except ValueError as error:
        if cache is None or "broadcast" not in str(error):
            raise
        raise ValueError(
            f"{error} With a {type(cache).__name__}, S = {scores_shape[-1]} is the number of "
            f"keys it returns (P + L for a DynamicCache, the slots of a static or sliding-window "
            f"cache: cache.key_positions(layer_idx) gives each slot's position)."
        ) from None


def _combine(allowed, mask, key_mask, B, S):
    """AND (or add) the structural mask, the user's mask and the key padding mask."""
    if key_mask is not None:
        if key_mask.dtype != torch.bool or key_mask.shape != (B, S):
            raise ValueError(
                f"key_mask must be a (B, S) = {(B, S)} bool tensor, True = real token; "
                f"got {tuple(key_mask.shape)} {key_mask.dtype}. (A mask from "
                f"torch.nn.MultiheadAttention means the opposite: convert it with "
                f"attnlab.masks.from_torch_mask.)"
            )
        allowed = restrict(allowed, key_mask[:, None, None, :])  # (B, S) -> (B, 1, 1, S)
    return restrict(mask, allowed)


def _every_slot(weights: torch.Tensor, slots: int) -> torch.Tensor:
    """Weights (..., n) over the slots a cache's layer read (its filled prefix) -> (..., slots):
    the empty slots after them get 0, or NaN in a NaN row (the NaN rule makes a row NaN
    whole), as a mask over every slot would have given."""
    n = weights.shape[-1]
    if n >= slots:
        return weights
    rest = (weights[..., :1] * 0).expand(*weights.shape[:-1], slots - n)  # 0; NaN * 0 = NaN
    return torch.cat([weights, rest], dim=-1)


def _check_width(name: str, x: torch.Tensor, width: int, dtype: torch.dtype) -> None:
    check_floating(name, x)
    if x.dtype != dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(
            f"{name} is {x.dtype} but the layer's weights are {dtype}. Fix: convert one of "
            f"them ({name}.to({dtype}) or layer.to({x.dtype})), or run under torch.autocast."
        )
    if x.dim() != 3 or x.shape[-1] != width:
        raise ValueError(
            f"{name} must be (B, L, {width}) (batch, length, features); got {tuple(x.shape)}. "
            f"Fix: layers take batch-first inputs; add a batch dim with .unsqueeze(0) or "
            f"transpose (L, B, D) inputs with .transpose(0, 1)."
        )


def _check_config(d_model, num_heads, num_kv_heads, head_dim, attn_dropout, out_dropout):
    """The sizes as ints (numpy integers taken, bools refused), or a ValueError naming the fix."""
    d_model = check_count(d_model, "d_model", 1, "the model width")
    num_heads = check_count(num_heads, "num_heads", 1, "query heads")
    num_kv_heads = check_count(num_kv_heads, "num_kv_heads", 1, "key/value heads")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads} (each kv head "
            f"serves num_heads // num_kv_heads query heads). Fix: num_kv_heads in "
            f"{divisors(num_heads)}."
        )
    if head_dim is None and d_model % num_heads:
        raise ValueError(
            f"num_heads={num_heads} must divide d_model={d_model} when head_dim is not given. "
            f"Fix: num_heads in {divisors(d_model)}, or pass head_dim explicitly."
        )
    if head_dim is not None:
        head_dim = check_count(head_dim, "head_dim", 1, "the width of one head")
    check_dropout(attn_dropout, "attn_dropout")
    check_dropout(out_dropout, "out_dropout")
    return d_model, num_heads, num_kv_heads, head_dim
