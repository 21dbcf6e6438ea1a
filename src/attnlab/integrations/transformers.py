"""Hugging Face ``transformers`` models on attnlab's attention: ``attn_implementation="attnlab"``.

Since transformers 5 every model picks its attention from a registry. The attention module
projects query/key/value, applies RoPE, updates the KV cache, then calls
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key, value, mask, ...)``.
:func:`register` puts :func:`attnlab_attention_forward` in that registry together with the mask
function :func:`attnlab_mask` -- both are needed: without a mask function transformers hands
``attention_mask=None`` to every layer and padding is silently ignored.

Example:
    >>> from attnlab.integrations.transformers import register
    >>> register()                                                              # doctest: +SKIP
    'attnlab'
    >>> model = AutoModel.from_pretrained(path, attn_implementation="attnlab")  # doctest: +SKIP
    >>> out = model(**batch, output_attentions=True)    # a forward() kwarg     # doctest: +SKIP
    >>> out.attentions[0].shape                         # (B, H, L, S) per layer # doctest: +SKIP

``attnlab.pretrained.load_model(name, attn_implementation="attnlab")`` registers by itself, and a
loaded model switches with ``model.set_attn_implementation("attnlab")`` once registered.
(``output_attentions=True`` must go to ``forward()``/``generate()``: transformers refuses it in
the config for anything but ``"eager"``. A model whose ``forward`` does not pass it on to its
attention layers -- GPT-2 in transformers 5.x -- returns no weights with ``"attnlab"``, as with
``"sdpa"``: the request never reaches the attention function; use ``"eager"`` there.)

How Hugging Face's arguments map onto attnlab's (letters as in docs/conventions.md)::

    Hugging Face                          attnlab.functional.scaled_dot_product_attention
    ------------------------------------  -----------------------------------------------------
    query (B, H, L, E)                    query
    key, value (B, Hkv, S, E / Ev)        key, value: grouped-query natively, no repeat_kv
    attention_mask bool (B, 1, L, S)      attn_mask: True = may attend, attnlab's own meaning
    attention_mask float (B, 1, L, S)     attn_mask: additive bias
    attention_mask None                   is_causal="top_left" when causal and L > 1
    scaling                               scale
    dropout (while module.training)       dropout_p
    output_attentions=True                return_weights=True
    sliding_window                        in HF's mask; the argument is ignored, as eager/sdpa
    softcap (Gemma 2)                     scores -> softcap * tanh(scores / softcap)
    position_bias (T5) (B|1, H, L, S)     float mask: the bias where allowed, -inf elsewhere

    returned: (output (B, L, H, Ev) contiguous, weights (B, H, L, S) or None)

The fast path. The mask function is transformers' own ``sdpa_mask``: a bool ``(B, 1, L, S)``
mask, or ``None`` when nothing but causality needs masking (no padding). ``None`` then reaches
torch's fused kernel as ``is_causal`` with no dense mask: 1.1x faster than a materialised causal
mask at L = 256, 1.6x at L = 1024 (benchmarks/bench_hf.py). ``None`` + causal means *top-left*,
because a StaticCache prefill sends L prompt queries against S = max_cache_len keys, of which
only the first L are written::

    StaticCache prefill, mask None    DynamicCache decode, L = 1    with padding: HF's mask
    (L=3, S=6): top_left              (L=1, S=P+1): no mask         bool (B, 1, L, S)
      ■ · · · · ·                       ■ ■ ■ ■ ■ ■
      ■ ■ · · · ·
      ■ ■ ■ · · ·   <- columns >= L are empty cache slots, cropped before the fused kernel

Fully masked query rows (the pad positions of a left-padded batch attend no key): attnlab gives
them weights 0 and output 0; Hugging Face's eager gives them uniform weights 1/S (its mask adds
``finfo.min``, not ``-inf``); "sdpa" gives them 0, as attnlab. Only those rows differ, and no
real token's attention reads them; but a causal LM's shifted labels score the last pad
position's logits against the first real token, so a loss that keeps that label differs from
eager's (as sdpa's does): label it -100, as the pad positions themselves.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from attnlab import functional as AF
from attnlab.functional._layout import with_causal

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "attnlab.integrations.transformers needs transformers >= 5.0 (the AttentionInterface "
        "registry); fix: pip install 'attnlab[hf]'"
    ) from exc

__all__ = [
    "NAME",
    "attnlab_attention_forward",
    "attnlab_mask",
    "is_registered",
    "register",
    "unregister",
]

NAME = "attnlab"

# Arguments some models pass that change the attention's result and that attnlab does not do.
_UNSUPPORTED = {
    "s_aux": "attention sinks (s_aux, as gpt-oss)",
    "sinks": "attention sinks",
    "cache": "a paged KV cache (continuous batching)",
    "indices": "sparse attention over selected keys (indices, as DeepSeek-V3.2's indexer)",
    "block_indices": "block-sparse attention over selected key blocks (block_indices)",
}


def attnlab_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A transformers attention function that runs attnlab's scaled dot-product attention.

    Same signature and result as transformers' ``eager_attention_forward`` (its readable spec)
    and ``sdpa_attention_forward``. Without ``output_attentions`` it takes attnlab's fused path
    (torch's kernel); with it, a path that also returns the weights (which one and why:
    :func:`attnlab.functional.explain`, or DEBUG logging on ``attnlab.dispatch``).

    Math:
        .. math:: \\text{out} = \\text{softmax}\\big(\\text{scaling}\\, Q K^\\top + M\\big) V

        with ``M`` 0 where attending is allowed and ``-inf`` elsewhere (from ``attention_mask``,
        causality, ``sliding_window`` and ``position_bias``). With ``softcap`` the scaled scores
        ``s`` become ``softcap * tanh(s / softcap)`` before ``M`` is added.

    Args:
        module: the calling attention layer. Read: ``training`` (dropout only while training)
            and ``is_causal`` (used when ``attention_mask`` is None; True if absent, as sdpa).
        query: (B, H, L, E).
        key: (B, Hkv, S, E), Hkv dividing H; query head ``h`` reads key head ``h // (H//Hkv)``.
            S includes the cached positions (and, for a StaticCache, its empty slots).
        value: (B, Hkv, S, Ev).
        attention_mask: what :func:`attnlab_mask` built: bool (B, 1, L, S), True = may attend;
            or a float additive mask (a 4-D mask the user passed); or None: only causality.
        dropout: probability of zeroing a weight; applied only while ``module.training``.
        scaling: score multiplier; ``E ** -0.5`` when None.
        is_causal: overrides ``module.is_causal`` when the mask is None.
        sliding_window: ignored, as by transformers' eager and sdpa functions: the window is
            in the mask transformers builds for a sliding layer, which is never None while the
            window masks anything (``_ignore_causal_mask_sdpa`` refuses to skip it). A model that
            passes a window its mask does not have (OLMoE with ``config.sliding_window`` set)
            attends every key, as under eager; only flash attention would apply it there.
        softcap: positive cap of the scores (Gemma 2's ``attn_logit_softcapping``).
        position_bias: additive bias broadcastable to (B, H, L, S) (T5's relative positions).
        **kwargs: ``output_attentions=True`` returns the weights; ``position_ids``,
            ``use_cache`` and the like are accepted and ignored.

    Returns:
        ``(output, weights)``: output (B, L, H, Ev), contiguous (the layout the caller reshapes to
        (B, L, H * Ev)); weights (B, H, L, S) if ``output_attentions`` else None. Fully masked
        query rows get weights 0 and output 0 (eager: uniform weights).

    Raises:
        ValueError: ``softcap`` not a positive number, attention sinks, a paged cache or
            sparse attention's selected keys (``indices``, ``block_indices``), query not 4-D;
            and every check of :func:`attnlab.functional.scaled_dot_product_attention`
            (shapes, dtypes, Hkv not dividing H, a mask that does not broadcast).

    References:
        Hugging Face, "Attention Interface" (transformers docs); oracle:
        :func:`attnlab.reference.scaled_dot_product_attention`.

    Example:
        >>> layer = torch.nn.Module().eval()   # stands in for LlamaAttention
        >>> layer.is_causal = True
        >>> q = torch.randn(1, 9, 5, 64)                               # B=1, H=9, L=5, E=64
        >>> k, v = torch.randn(1, 3, 5, 64), torch.randn(1, 3, 5, 64)  # Hkv=3, S=5
        >>> out, w = attnlab_attention_forward(layer, q, k, v, None, output_attentions=True)
        >>> out.shape, w.shape                 # (B, L, H, Ev), (B, H, L, S)
        (torch.Size([1, 5, 9, 64]), torch.Size([1, 9, 5, 5]))
    """
    for name, what in _UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise ValueError(
                f"attnlab attention does not support {what}; got {name}= from "
                f"{type(module).__name__}. Fix: model.set_attn_implementation('eager')."
            )
    if query.dim() != 4:
        raise ValueError(
            f"query must be (B, H, L, E) as transformers passes it; got shape {tuple(query.shape)}."
        )
    if softcap is not None and (
        isinstance(softcap, bool) or not isinstance(softcap, int | float) or not softcap > 0
    ):
        raise ValueError(
            f"softcap must be a positive number (scores become softcap * tanh(scores / "
            f"softcap)); got {softcap!r}. Fix: set attn_logit_softcapping to a positive float, "
            f"or to None for no capping."
        )
    return_weights = bool(kwargs.get("output_attentions", False))
    dropout_p = float(dropout) if getattr(module, "training", False) else 0.0
    L, S = query.shape[2], key.shape[2]

    mask, alignment = attention_mask, None
    if mask is None:  # sdpa_mask's None: nothing to mask but causality (and maybe a window)
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if causal and L > 1:
            alignment = "top_left"  # the queries are the first L positions (StaticCache prefill)
    if position_bias is not None:
        mask = _add_bias(position_bias, mask)

    if softcap is not None:
        result = _softcapped(
            query, key, value, mask, alignment, scaling, softcap, dropout_p, return_weights
        )
    else:
        if alignment == "top_left" and mask is None and S > L and not return_weights:
            # Keys L..S-1 are never seen with top-left alignment (empty StaticCache slots):
            # cropping makes L == S, the shape torch's fused kernel is fastest on.
            key, value = key[:, :, :L], value[:, :, :L]
        result = AF.scaled_dot_product_attention(
            query,
            key,
            value,
            mask,
            is_causal=alignment or False,
            scale=scaling,
            dropout_p=dropout_p,
            return_weights=return_weights,
        )
    out, weights = result if return_weights else (result, None)
    # (B, H, L, Ev) -> (B, L, H, Ev): the caller merges the heads with reshape(B, L, H * Ev)
    return out.transpose(1, 2).contiguous(), weights


def _add_bias(bias: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Fold a (B|1, H, L, S) additive bias and the mask into one float mask."""
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return torch.where(mask, bias, float("-inf"))  # (B, 1, L, S) & (1, H, L, S) -> (B, H, L, S)
    return bias + mask


def _softcapped(query, key, value, mask, alignment, scaling, softcap, dropout_p, return_weights):
    """The readable path with capped scores: (B, H, L, E), (B, Hkv, S, E), (B, Hkv, S, Ev)."""
    L, S = query.shape[2], key.shape[2]
    scores = AF.scaled_dot_product_scores(query, key, scaling)  # (B, H, L, S), GQA mapping
    scores = softcap * torch.tanh(scores / softcap)
    mask = with_causal(mask, alignment, L, S, query.device)
    return AF.attention(scores, value, mask, dropout_p=dropout_p, return_weights=return_weights)


def attnlab_mask(*args, **kwargs) -> torch.Tensor | None:
    """The mask function registered with :func:`attnlab_attention_forward`: transformers' own
    ``sdpa_mask``.

    Called by transformers' ``create_causal_mask`` / ``create_bidirectional_mask`` /
    ``create_sliding_window_causal_mask`` with ``batch_size, q_length, kv_length, q_offset,
    kv_offset, mask_function, attention_mask (B, S) bool True = real token, ...``.

    Returns:
        A bool (B, 1, L, S) mask, True = may attend (padding, causality, sliding window and
        cache offsets all folded in) -- attnlab's own convention, passed on unchanged; or None
        when the pattern is plain causal or plain bidirectional with no padding (then the
        attention function uses ``is_causal``, the fused kernel's fastest mode).

        A model whose layers share keys and values (``num_kv_shared_layers``, Gemma 4) always
        gets the mask: it keeps only the last queries for its shared layers after the mask is
        made, slicing the mask with them, and a None there would read as top-left causal (as
        ``is_causal`` does in torch's kernel; transformers materialises it for "sdpa" alone).
    """
    config = kwargs.get("config")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "num_kv_shared_layers", 0):  # (a text config is its own text config)
        kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# Registration

_REGISTRIES = (
    (AttentionInterface, "attnlab_attention_forward"),
    (AttentionMaskInterface, "attnlab_mask"),
)
_RESERVED = ("sdpa", "flash", "flex_attention", "paged", "eager")


def _ours(fn: Callable | None, qualname: str) -> bool:
    # By name, not identity, so that a reloaded module still recognises its registration.
    return (
        getattr(fn, "__module__", None) == __name__ and getattr(fn, "__qualname__", "") == qualname
    )


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
        raise ValueError(
            f"name must be a non-empty string of letters, digits, '_', '.' or '-'; got {name!r} "
            f"(transformers reads 'owner/repo' as a Hub kernel and 'paged|x' as a paged "
            f"backend). Fix: register('attnlab')."
        )
    hit = [word for word in _RESERVED if word in name.lower()]
    if hit:
        raise ValueError(
            f"name {name!r} contains {hit[0]!r}, which transformers treats as its own backend "
            f"and runs that backend's checks on. Fix: pick another name, e.g. 'attnlab'."
        )


def register(name: str = NAME) -> str:
    """Register attnlab as the attention implementation ``name`` in transformers; idempotent.

    Registers :func:`attnlab_attention_forward` in ``AttentionInterface`` and
    :func:`attnlab_mask` in ``AttentionMaskInterface`` (both global, for every model).

    Returns:
        ``name``, to pass as ``attn_implementation``.

    Raises:
        ValueError: a name transformers would misread (with '/', '|', or containing 'sdpa',
            'flash', 'flex_attention', 'paged', 'eager'), or one already registered to another
            function (unregister that first, or pick another name).
    """
    _check_name(name)
    for registry, qualname in _REGISTRIES:
        current = registry._global_mapping.get(name)
        if current is not None and not _ours(current, qualname):
            raise ValueError(
                f"attention implementation {name!r} is already registered in "
                f"{registry.__name__} to {getattr(current, '__qualname__', current)!r}. Fix: "
                f"register under another name, e.g. register('attnlab_2')."
            )
    AttentionInterface.register(name, attnlab_attention_forward)
    AttentionMaskInterface.register(name, attnlab_mask)
    return name


def unregister(name: str = NAME) -> bool:
    """Remove attnlab's registration ``name``; True if there was one.

    Models loaded with it fail on their next forward until it is registered again (or they are
    switched with ``model.set_attn_implementation("eager")``). Registrations under ``name`` by
    other libraries are left alone.
    """
    removed = False
    for registry, qualname in _REGISTRIES:  # transformers has no public unregister
        if _ours(registry._global_mapping.get(name), qualname):
            del registry._global_mapping[name]
            removed = True
    return removed


def is_registered(name: str = NAME) -> bool:
    """Whether ``name`` is registered to attnlab's attention and mask functions."""
    return all(_ours(reg._global_mapping.get(name), qn) for reg, qn in _REGISTRIES)
