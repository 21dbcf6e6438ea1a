"""A Llama-architecture decoder built from attnlab layers, able to run real pretrained weights.

The point is proof and use: the attention of every layer is :class:`attnlab.nn.MultiHeadAttention`
(grouped-query heads, rotary positions, a KV cache), and loading a Hugging Face Llama's weights
(:meth:`LlamaModel.from_hf`) must reproduce its logits and its greedy generations -- which the
tests check on SmolLM2-135M.

One block::

    x -> RMSNorm -> MultiHeadAttention (causal, GQA, RoPE) -> + x -> RMSNorm -> SwiGLU MLP -> + .

References: Touvron et al., "LLaMA", 2023; Zhang & Sennrich, "Root Mean Square Layer
Normalization", 2019; Shazeer, "GLU Variants Improve Transformer", 2020.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attnlab.cache import Cache, DynamicCache, SlidingWindowCache, StaticCache
from attnlab.nn import MultiHeadAttention


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
    norm_eps: float = 1e-5
    sliding_window: int | None = None
    tie_embeddings: bool = True

    @classmethod
    def from_hf(cls, config) -> LlamaConfig:
        """From a ``transformers.LlamaConfig``."""
        rope = getattr(config, "rope_parameters", None) or {}
        return cls(
            vocab_size=config.vocab_size,
            d_model=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None),
            d_ff=config.intermediate_size,
            rope_base=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            norm_eps=config.rms_norm_eps,
            sliding_window=getattr(config, "sliding_window", None),
            tie_embeddings=config.tie_word_embeddings,
        )


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
            sliding_window=cfg.sliding_window,
            layer_idx=layer_idx,
        )
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x, *, cache, key_mask, position_ids, return_weights):
        attn = self.attn(
            self.attn_norm(x),
            cache=cache,
            key_mask=key_mask,
            position_ids=position_ids,
            return_weights=return_weights,
        )
        attn, weights = attn if return_weights else (attn, None)
        x = x + attn
        h = self.mlp_norm(x)
        x = x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))  # SwiGLU
        return x, weights


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
    ):
        """(B, L) token ids -> (B, L, vocab) logits [, per-layer weights (B, H, L, S)].

        ``key_mask`` (B, L), True = real token (left padding for batched prompts);
        with padding, positions count from each row's first real token.
        """
        if key_mask is not None and position_ids is None:
            past = 0 if cache is None else cache.get_seq_length(0)
            position_ids = key_mask.long().cumsum(1) - 1 + past
            if cache is not None and past:  # continue each row from its own count
                raise ValueError("pass position_ids when padding a continuation")
            position_ids = position_ids.clamp_min(0)
        x = self.embed(input_ids)
        all_weights = []
        for block in self.blocks:
            x, w = block(
                x,
                cache=cache,
                key_mask=key_mask,
                position_ids=position_ids,
                return_weights=return_weights,
            )
            all_weights.append(w)
        logits = self.lm_head(self.norm(x))
        return (logits, all_weights) if return_weights else logits

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

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        *,
        cache: str | Cache = "dynamic",
        key_mask: torch.Tensor | None = None,
        eos_token_id: int | None = None,
    ) -> torch.Tensor:
        """Greedy decoding with a KV cache: (B, P) prompt -> (B, P + new) tokens."""
        B, P = input_ids.shape
        if isinstance(cache, str):
            cache = self.make_cache(cache, P + max_new_tokens)
        logits = self(input_ids, cache=cache, key_mask=key_mask)
        if key_mask is None:
            next_pos = torch.full((B, 1), P, dtype=torch.long, device=input_ids.device)
        else:
            next_pos = key_mask.long().sum(1, keepdim=True)
        tokens = [input_ids]
        done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
        for _ in range(max_new_tokens):
            nxt = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
            if eos_token_id is not None:
                nxt = nxt.masked_fill(done[:, None], eos_token_id)
                done |= nxt[:, 0] == eos_token_id
            tokens.append(nxt)
            if eos_token_id is not None and done.all():
                break
            logits = self(nxt, cache=cache, position_ids=next_pos)
            next_pos = next_pos + 1
        return torch.cat(tokens, dim=1)

    @classmethod
    def from_hf(cls, hf_model) -> LlamaModel:
        """Copy the weights of a ``transformers`` ``LlamaForCausalLM`` into an attnlab model."""
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
