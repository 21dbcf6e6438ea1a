"""A Llama-architecture decoder built from attnlab layers, able to run real pretrained weights.

The point is proof and use: the attention of every layer is :class:`attnlab.nn.MultiHeadAttention`
(grouped-query heads, rotary positions, a KV cache), and loading a Hugging Face Llama's weights
(:meth:`LlamaModel.from_hf`) must reproduce its logits and its greedy generations -- which the
tests check on SmolLM2-135M.

One block::

    x -> RMSNorm -> MultiHeadAttention (causal, GQA, RoPE) -> + x -> RMSNorm -> SwiGLU MLP -> + .

Two paths, side by side. :meth:`LlamaModel.forward` is the readable one: every layer's attention
is one call of ``MultiHeadAttention`` (any cache, any number of new tokens). :meth:`LlamaModel.
forward_step` is the decode fast path that :class:`attnlab.models.decode.DecodeStep` compiles: one
new token per row against a fixed-shape cache's storage, written in place, with the slot and
the mask computed once per step on the device (not once per layer), so that the step holds no
Python number that changes from token to token. ``generate(..., compile=True)``
uses it; the tests check that both paths give the same tokens.

References: Touvron et al., "LLaMA", 2023; Zhang & Sennrich, "Root Mean Square Layer
Normalization", 2019; Shazeer, "GLU Variants Improve Transformer", 2020.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from attnlab.cache import (
    Cache,
    DynamicCache,
    SlidingWindowCache,
    StaticCache,
    kept_static_cache,
    write_token,
)
from attnlab.functional.rotary import (
    RotaryScaling,
    check_positions,
    rotary_angles,
    rotate_qk,
    unsupported_hf,
)
from attnlab.functional.sdpa import attention_with
from attnlab.kernels.few_rows import linear
from attnlab.nn import MultiHeadAttention

# generate(compile=True) rounds a static cache's length up to a multiple of this, so prompts of
# nearby lengths reuse one compiled step instead of compiling one each.
CACHE_LENGTH_STEP = 64


@dataclass
class LlamaConfig:
    vocab_size: int = 1024
    d_model: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int | None = None
    d_ff: int = 688
    rope_base: float = 10000.0
    rope_scaling: RotaryScaling | None = None  # the frequencies' stretch (Llama 3.1: "llama3")
    norm_eps: float = 1e-5
    sliding_window: int | None = None
    tie_embeddings: bool = True

    @classmethod
    def from_hf(cls, config) -> LlamaConfig:
        """From a ``transformers`` Llama or Mistral config. Only Mistral's model applies
        ``sliding_window``; a Llama config's is ignored, as by Hugging Face's Llama.

        Raises:
            ValueError: a config this architecture does not compute as Hugging Face does
                (another model type, biases, another activation, rotary frequencies scaled
                otherwise than "linear" or "llama3"): its weights would load and give other
                logits.
        """
        _check_hf_config(config)
        rope = _hf_rope(config)
        return cls(
            vocab_size=config.vocab_size,
            d_model=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None),
            d_ff=config.intermediate_size,
            rope_base=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            rope_scaling=RotaryScaling.from_hf(
                rope, getattr(config, "max_position_embeddings", None)
            ),
            norm_eps=config.rms_norm_eps,
            # (Hugging Face's Llama never reads a sliding_window its config may carry)
            sliding_window=getattr(config, "sliding_window", None)
            if config.model_type == "mistral"
            else None,
            tie_embeddings=config.tie_word_embeddings,
        )


HF_MODEL_TYPES = ("llama", "mistral")


def _hf_rope(config) -> dict:
    """A Hugging Face config's rotary settings: ``rope_parameters`` (transformers 5) or the
    older ``rope_scaling``."""
    return getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}


def _check_hf_config(config) -> None:
    """Refuse what :class:`LlamaModel` would silently compute differently from ``config``."""
    found = {
        "model_type": (getattr(config, "model_type", None), HF_MODEL_TYPES),
        "attention_bias": (getattr(config, "attention_bias", False), (False,)),
        "mlp_bias": (getattr(config, "mlp_bias", False), (False,)),
        "hidden_act": (getattr(config, "hidden_act", "silu"), ("silu",)),
    }
    wrong = [f"{name}={got!r} (takes {' or '.join(map(repr, ok))})"
             for name, (got, ok) in found.items() if got not in ok]  # fmt: skip
    rope_refusal = unsupported_hf(_hf_rope(config))  # None, or what the scaling sets
    if rope_refusal is not None:
        wrong.append(rope_refusal)
    if wrong:
        raise ValueError(
            f"LlamaModel.from_hf: this config sets {', '.join(wrong)}; attnlab's LlamaModel "
            f"(SwiGLU MLP, no biases, rotary frequencies plain or scaled 'linear' or 'llama3') "
            f"would load these weights and compute other logits. Fix: run the Hugging Face "
            f"model itself on attnlab's attention, with attn_implementation='attnlab' "
            f"(attnlab.integrations.transformers)."
        )


def _eos_ids(eos_token_id, device) -> torch.Tensor | None:
    """``generate``'s end-of-sequence ids as a 1-D tensor (None: no stopping): one id, or
    several (Hugging Face configs hold a list: Llama 3's two)."""
    if eos_token_id is None:
        return None
    ids = eos_token_id
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    ids = list(ids) if isinstance(ids, (list, tuple)) else [ids]
    try:
        if not ids or any(isinstance(i, bool) for i in ids):
            raise TypeError
        ids = [operator.index(i) for i in ids]
    except TypeError:
        raise TypeError(
            f"eos_token_id must be a token id or a non-empty list of them; got {eos_token_id!r}. "
            "Fix: e.g. eos_token_id=hf_model.generation_config.eos_token_id"
        ) from None
    return torch.tensor(ids, dtype=torch.long, device=device)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = MultiHeadAttention(
            cfg.d_model,
            cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            bias=False,
            is_causal=True,
            rope=cfg.rope_base,
            rope_scaling=cfg.rope_scaling,
            sliding_window=cfg.sliding_window,
            layer_idx=layer_idx,
        )
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x, *, cache, key_mask, rope_angles, return_weights):
        attn = self.attn(
            self.attn_norm(x),
            cache=cache,
            key_mask=key_mask,
            rope_angles=rope_angles,
            return_weights=return_weights,
        )
        attn, weights = attn if return_weights else (attn, None)
        x = x + attn
        return self._mlp(x), weights

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mlp_norm(x)
        up = nn.functional.silu(linear(self.gate, h)) * linear(self.up, h)  # SwiGLU
        return x + linear(self.down, up)

    def forward_step(self, x, mask, rope_angles, slot, keys, values, finite):
        """The decode fast path of one block: x (B, 1, D), mask (B, 1, 1, C), rope_angles
        (cos, sin) (B, 1, E) each, slot (1,); keys/values (B, Hkv, C, E) and finite (B, Hkv, C)
        this layer's cache storage (written at ``slot``) -> (B, 1, D). The same computation as
        :meth:`forward` with a cache."""
        attn = self.attn
        B, H, Hkv, E = x.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim
        h = self.attn_norm(x)
        q = linear(attn.q_proj, h).view(B, 1, H, E).transpose(1, 2)  # (B,1,H*E) -> (B,H,1,E)
        k = linear(attn.k_proj, h).view(B, 1, Hkv, E).transpose(1, 2)  # -> (B, Hkv, 1, E)
        v = linear(attn.v_proj, h).view(B, 1, Hkv, E).transpose(1, 2)
        q, k = rotate_qk(q, k, *rope_angles)
        write_token(keys, values, finite, slot, k, v)  # in place; finiteness checked once
        out = attention_with(q, keys, values, mask, kv_finite=finite.all(-1))  # (B, H, 1, E)
        x = x + linear(attn.o_proj, out.transpose(1, 2).reshape(B, 1, H * E))  # (B, 1, D)
        return self._mlp(x)


class LlamaModel(nn.Module):
    """A Llama-style causal language model on attnlab attention.

    Example:
        >>> model = LlamaModel(LlamaConfig(vocab_size=100, d_model=32, num_layers=2,
        ...                                num_heads=4, num_kv_heads=2, d_ff=64))
        >>> tokens = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5)
        >>> tokens.shape
        torch.Size([1, 8])
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        cache: Cache | None = None,
        key_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        return_weights: bool = False,
        logits_to_keep: int = 0,
    ):
        """(B, L) token ids -> (B, L, vocab) logits [, per-layer weights (B, H, L, S)].

        ``key_mask`` (B, L), True = real token (left padding for batched prompts);
        with padding, positions count from each row's first real token, also when a cache
        that holds a padded prompt is continued (:meth:`attnlab.cache.Cache.token_counts`).
        ``logits_to_keep`` > 0: logits of the last that many positions only (B, n, vocab), as
        Hugging Face's argument: a prefill needs the last one (projecting every prompt position
        onto the vocabulary is a fifth of a prefill's work at SmolLM2's shape).
        """
        if key_mask is not None:
            self._check_key_mask(key_mask, input_ids, cache)
        counts = None if cache is None else cache.token_counts(0)  # (B,) when it holds padding
        if position_ids is None and (key_mask is not None or counts is not None):
            # each row counts from its own first real token, after the real tokens it has seen
            B, L = input_ids.shape
            if counts is None:
                past = 0 if cache is None else cache.get_seq_length(0)
                counts = torch.full((B,), past, device=input_ids.device)
            if key_mask is not None:
                steps = key_mask.long().cumsum(1) - 1
            else:
                steps = torch.arange(L, device=input_ids.device).expand(B, L)
            position_ids = (counts[:, None] + steps).clamp_min(0)
        x = self.embed(input_ids)
        angles = self._rope_angles(position_ids, cache, input_ids)  # once, for every layer
        all_weights = []
        for block in self.blocks:
            x, w = block(
                x,
                cache=cache,
                key_mask=key_mask,
                rope_angles=angles,
                return_weights=return_weights,
            )
            all_weights.append(w)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = linear(self.lm_head, self.norm(x))
        return (logits, all_weights) if return_weights else logits

    def forward_step(
        self,
        input_ids: torch.Tensor,
        buffers: tuple[tuple[torch.Tensor, ...], ...],
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One new token per row against a fixed-shape cache: what a compiled step runs.

        The cache's storage is written in place; the caller counts the token afterwards
        (``cache.advance(1)``). Prefer :class:`attnlab.models.decode.DecodeStep`, which checks
        the cache, compiles this once and does the counting. This step checks nothing on the
        host (no sync): on a full StaticCache its slot wraps to 0 over the first token, and
        ``advance`` then raises.

        Everything that moves from step to step is a tensor computed here, from the positions
        tensor of the cache (C slots, -1 = empty)::

            t    = positions.max() + 1          the new token's index in the sequence
            slot = t % C                        StaticCache: t itself (t < C); sliding: ring
            mask = (positions >= 0) & real      (B, C): filled, non-padding slots, the new one
                   [& (t - positions < window)]  included; every one of them is at or before t

        Args:
            input_ids: (B, 1) the new tokens.
            buffers: per layer ``cache.buffers(i)``: keys (B, Hkv, C, E), values (B, Hkv, C, E),
                positions (C,), real (B, C), finite (B, Hkv, C).
            position_ids: (B, 1) rotary positions of the new tokens (left-padded rows count
                from their first real token); None: ``t`` for every row.

        Returns:
            (B, 1, vocab) logits.
        """
        B = input_ids.shape[0]
        positions = buffers[0][2]
        t = positions.max().add(1).view(1)  # (1,), on the device: no host sync
        slot = t % positions.shape[0]
        if position_ids is None:
            position_ids = t.expand(B, 1)
        for _, _, layer_positions, layer_real, _ in buffers:  # keep every layer's record exact
            layer_positions.index_copy_(0, slot, t)
            layer_real.index_fill_(1, slot, True)
        allowed = (positions >= 0)[None, :] & buffers[0][3]  # (B, C)
        if self.cfg.sliding_window is not None:
            allowed = allowed & (t - positions < self.cfg.sliding_window)[None, :]
        mask = allowed[:, None, None, :]  # (B, C) -> (B, 1, 1, C), shared by every layer
        x = self.embed(input_ids)
        angles = self._rope_angles(position_ids, None, input_ids)
        for block, (keys, values, _, _, finite) in zip(self.blocks, buffers, strict=True):
            x = block.forward_step(x, mask, angles, slot, keys, values, finite)
        return linear(self.lm_head, self.norm(x))

    def _rope_angles(self, position_ids, cache, input_ids):
        """(cos, sin) of the new tokens' rotary angles, (L, E) or (B, L, E), computed once for
        every layer; positions by default after the cache's tokens, as each layer counts them."""
        if position_ids is None:
            past = 0 if cache is None else cache.get_seq_length(0)
            L = input_ids.shape[1]
            position_ids = torch.arange(past, past + L, device=input_ids.device)
        check_positions(position_ids, input_ids.shape[1])
        attn = self.blocks[0].attn
        dtype = torch.float64 if self.embed.weight.dtype == torch.float64 else torch.float32
        return rotary_angles(position_ids, attn.head_dim, attn.rope_base, dtype, attn.rope_scaling)

    def make_cache(self, kind: str = "dynamic", max_length: int | None = None) -> Cache:
        """A cache for this model: ``"dynamic"``, ``"static"`` (needs max_length), ``"sliding"``."""
        if kind == "dynamic":
            return DynamicCache(self.cfg.num_layers)
        if kind == "static":
            if max_length is None:
                raise ValueError("a static cache needs max_length (prompt + new tokens).")
            return StaticCache(max_length, self.cfg.num_layers)
        if kind == "sliding":
            if self.cfg.sliding_window is None:
                raise ValueError("a sliding-window cache needs a model with sliding_window set.")
            return SlidingWindowCache(self.cfg.sliding_window, self.cfg.num_layers)
        raise ValueError(f"kind must be 'dynamic', 'static' or 'sliding'; got {kind!r}.")

    def _check_key_mask(self, key_mask, input_ids, cache) -> None:
        """``key_mask`` (B, L) bool; with a sliding window, left padding of an empty cache only.

        Positions count each row's real tokens, but the window is measured in cache slots,
        which count padding: the two agree only while every pad comes before the row's first
        real token (a pad after one pushed real keys out of the window: logits off by ~100).
        """
        B, L = input_ids.shape
        if (
            not isinstance(key_mask, torch.Tensor)
            or key_mask.dtype != torch.bool
            or key_mask.shape != (B, L)
        ):
            got = (
                f"{tuple(key_mask.shape)} {key_mask.dtype}"
                if torch.is_tensor(key_mask)
                else type(key_mask).__name__
            )
            raise ValueError(
                f"key_mask must be a (B, L) = {(B, L)} bool tensor, True = real token; got "
                f"{got}. Fix: key_mask=attention_mask.bool() for a tokenizer's 0/1 mask."
            )
        window = self.cfg.sliding_window
        if window is None:
            return
        late = (key_mask[:, :-1] & ~key_mask[:, 1:]).any(1)  # a real token, then a pad
        past = 0 if cache is None else cache.get_seq_length(0)
        if bool(late.any()) or (past and not bool(key_mask.all())):
            rows = late.nonzero().flatten().tolist()
            where = f"row(s) {rows} pad after a real token" if rows else (
                f"padding follows the {past} token(s) the cache holds"
            )  # fmt: skip
            raise ValueError(
                f"key_mask: {where}. With sliding_window={window} the window counts cache "
                f"slots, padding included, while positions count real tokens: they agree for "
                f"left padding of a new sequence only. Fix: left-pad the prompts (tokenizer "
                f"padding_side='left') and give key_mask only with an empty cache."
            )

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        *,
        cache: str | Cache | None = None,
        key_mask: torch.Tensor | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        compile: bool = False,
    ) -> torch.Tensor:
        """Greedy decoding with a KV cache: (B, P) prompt -> (B, P + new) tokens.

        Args:
            input_ids: (B, P) prompt token ids (left-padded when ``key_mask`` is given).
            max_new_tokens: tokens to generate per row.
            cache: ``"dynamic"``, ``"static"``, ``"sliding"`` or a cache object; default
                ``"static"`` with ``compile=True``, else ``"dynamic"``. A cache object that
                already holds tokens is continued: they are the context before ``input_ids``,
                whose positions follow them, row by row when they were a padded prompt
                (``cache.reset()`` first for an unrelated prompt).
            key_mask: (B, P) bool, True = real token: left padding, so that every row's last
                token is real (the next token is read there).
            eos_token_id: rows stop at it, or at any of several (a list, as Hugging Face
                configs hold); later tokens of a stopped row repeat the one it stopped at.
            compile: decode with a compiled step (:class:`attnlab.models.decode.DecodeStep`):
                the prompt is prefilled eagerly, then every new token replays one graph
                captured once by ``torch.compile`` (on CUDA ``mode="reduce-overhead"``: CUDA
                graphs, one launch per step). Needs a fixed-shape cache (static or sliding); a
                static cache made here gets a length rounded up to a multiple of
                ``CACHE_LENGTH_STEP`` so that nearby prompt lengths share a graph. The first call
                per (batch size, cache length) compiles: seconds on a GPU, tens of seconds on
                a 2-core CPU; later ones reuse it. That static cache is kept with the model and
                reset for the next call (the same storage: a CUDA graph holds its address), so
                concurrent calls on one model must pass their own caches. Greedy tokens equal
                those of ``compile=False``, which with a static or sliding cache runs the same
                step eagerly (:meth:`forward_step`: the slot and mask made once per step, not
                once per layer; 6-10% faster than :meth:`forward` on a 2-core CPU), and with a
                dynamic cache :meth:`forward`. :meth:`forward_step` calls the blocks' norms and
                projections, not the blocks' and attention layers' ``forward``: while forward
                hooks sit on those (or the model), or their ``forward`` is overridden (by a
                subclass, or replaced on the instance as accelerate's hooks do),
                ``compile=False`` decodes with :meth:`forward` so that they run for every token
                (a compiled step never runs them).

        Raises:
            TypeError: ``compile=True`` with a dynamic cache (its storage grows); the fix is
                ``cache="static"``.
            ValueError: ``key_mask`` with a cache that already holds tokens (a padded prompt
                starts a sequence), or whose last column holds padding (right padding).
        """
        from attnlab.models.decode import DecodeStep

        B, P = input_ids.shape
        if (
            isinstance(max_new_tokens, bool)
            or not isinstance(max_new_tokens, int)
            or (max_new_tokens < 1)
        ):
            raise ValueError(
                f"max_new_tokens must be an int >= 1; got {max_new_tokens!r}. Fix: to score a "
                f"prompt without generating, call the model itself."
            )
        if key_mask is not None:
            self._check_key_mask(key_mask, input_ids, None)
        if cache is None:
            cache = "static" if compile else "dynamic"
        if isinstance(cache, str):
            length = P + max_new_tokens
            if compile and cache == "static":
                length = -(-length // CACHE_LENGTH_STEP) * CACHE_LENGTH_STEP
                cache = kept_static_cache(self, length, self.cfg.num_layers)
            else:
                cache = self.make_cache(cache, length)
        step = None
        fixed = isinstance(cache, StaticCache | SlidingWindowCache)
        if compile or (fixed and self._steps_as_forward()):
            step = DecodeStep(self, compile=compile)
        if step is not None:
            step.check_cache_kind(cache)  # before the prefill: fail fast
        past = cache.get_seq_length(0)  # tokens the cache already holds: the prompt follows them
        needed = past + P + max_new_tokens - 1  # (the last new token needs no forward)
        if isinstance(cache, StaticCache) and needed > cache.max_length:
            raise ValueError(
                f"a StaticCache of max_length={cache.max_length} cannot hold {past} cached + {P} "
                f"prompt + {max_new_tokens - 1} decoded tokens (the last new token is not "
                f"written). Fix: StaticCache(max_length >= {needed}), or fewer max_new_tokens."
            )
        if key_mask is not None and P and not bool(key_mask[:, -1].all()):
            rows = (~key_mask[:, -1]).nonzero().flatten().tolist()
            raise ValueError(
                f"key_mask marks the last prompt token of row(s) {rows} as padding: generate "
                f"reads each row's next token at the last position, so prompts must be "
                f"left-padded. Fix: put the padding before each prompt (tokenizer "
                f"padding_side='left')."
            )
        if key_mask is not None and past:
            raise ValueError(
                f"key_mask (a left-padded prompt) needs an empty cache; this one holds {past} "
                f"token(s). Fix: cache.reset() (or a new cache) for a padded prompt, or leave "
                f"key_mask out to continue the cached sequence."
            )
        logits = self(input_ids, cache=cache, key_mask=key_mask, logits_to_keep=1)
        counts = cache.token_counts(0)  # (B,) real tokens per row, when there was padding
        if counts is None:
            next_pos = torch.full((B, 1), past + P, dtype=torch.long, device=input_ids.device)
        else:
            next_pos = counts[:, None].clone()
        tokens = [input_ids]
        done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
        eos = _eos_ids(eos_token_id, input_ids.device)
        for i in range(max_new_tokens):
            nxt = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
            if eos is not None:
                nxt = torch.where(done[:, None], tokens[-1][:, -1:], nxt)  # (a stopped row's)
                done |= torch.isin(nxt[:, 0], eos)
            tokens.append(nxt)
            if i == max_new_tokens - 1 or (eos is not None and done.all()):
                break  # (the last token needs no forward)
            if step is None:
                logits = self(nxt, cache=cache, position_ids=next_pos)
            else:
                logits = step(nxt, cache, position_ids=next_pos)
            next_pos = next_pos + 1
        return torch.cat(tokens, dim=1)

    def _steps_as_forward(self) -> bool:
        """Whether :meth:`forward_step` runs what :meth:`forward` would, hooks included: no
        forward hook on the model, its blocks or their attention layers (whose ``forward`` it
        does not call) and none of those ``forward`` overridden (by a subclass, or on the
        instance)."""
        from torch.nn.modules import module

        if module._global_forward_hooks or module._global_forward_pre_hooks:
            return False
        layers = [self, *self.blocks, *(block.attn for block in self.blocks)]
        if any(m._forward_hooks or m._forward_pre_hooks for m in layers):
            return False
        if any("forward" in m.__dict__ for m in layers):  # (replaced on the instance: accelerate)
            return False
        return type(self).forward is LlamaModel.forward and all(
            type(block).forward is Block.forward
            and type(block.attn).forward is MultiHeadAttention.forward
            for block in self.blocks
        )

    @classmethod
    def from_hf(cls, hf_model) -> LlamaModel:
        """Copy the weights of a ``transformers`` ``LlamaForCausalLM`` (or Mistral) into an
        attnlab model; a config it would compute differently is refused
        (:meth:`LlamaConfig.from_hf`)."""
        if not (hasattr(hf_model, "model") and hasattr(hf_model, "lm_head")):
            raise ValueError(
                f"from_hf takes a model with its language-model head (LlamaForCausalLM, "
                f"MistralForCausalLM); got {type(hf_model).__name__}, which has none. Fix: "
                "load it with transformers.AutoModelForCausalLM"
            )
        cfg = LlamaConfig.from_hf(hf_model.config)
        model = cls(cfg).to(dtype=next(hf_model.parameters()).dtype)
        src = hf_model.model
        with torch.no_grad():
            model.embed.weight.copy_(src.embed_tokens.weight)
            model.norm.weight.copy_(src.norm.weight)
            if not cfg.tie_embeddings:
                model.lm_head.weight.copy_(hf_model.lm_head.weight)
            for ours, theirs in zip(model.blocks, src.layers, strict=True):
                for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                    getattr(ours.attn, name).weight.copy_(getattr(theirs.self_attn, name).weight)
                ours.attn_norm.weight.copy_(theirs.input_layernorm.weight)
                ours.mlp_norm.weight.copy_(theirs.post_attention_layernorm.weight)
                ours.gate.weight.copy_(theirs.mlp.gate_proj.weight)
                ours.up.weight.copy_(theirs.mlp.up_proj.weight)
                ours.down.weight.copy_(theirs.mlp.down_proj.weight)
        return model.eval()
