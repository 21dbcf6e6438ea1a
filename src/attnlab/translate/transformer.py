"""Transformer encoder-decoder (Vaswani et al. 2017), built from attnlab's MultiHeadAttention.

Pre-layer-norm blocks (Xiong et al. 2020: stable without a long warm-up, which matters for
15-minute runs), sinusoidal positions, one embedding matrix shared by source, target and output
(the vocabulary is joint)::

    encoder layer:  x += SelfAttn(LN(x), key padding)          ; x += FFN(LN(x))
    decoder layer:  y += SelfAttn(LN(y), causal, KV cache)     ; y += CrossAttn(LN(y), memory)
                    y += FFN(LN(y))

Cross-attention keys and values depend only on the source, so they are projected once per
sentence (``MultiHeadAttention.project_kv``) and reused by every decoder step. While decoding,
the decoder's self-attention keys/values of past tokens live in an ``attnlab.cache.DynamicCache``:
each step computes one query row against the cache (bottom-right causal alignment).
``num_kv_heads < heads`` gives grouped-query attention (fewer key/value heads, smaller cache).

Shapes: ``B`` batch, ``S`` source length, ``T`` target length, ``D`` model width, ``N``
layers, ``H`` heads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from attnlab.translate.batching import source_mask
from attnlab.translate.tokenizer import PAD

BUCKET = 16  # compiled decoding: cache and source lengths rounded up to a multiple of this


def sinusoids(length: int, dim: int, offset: int = 0, device=None) -> torch.Tensor:
    """(length, dim) sinusoidal position codes for positions offset .. offset + length - 1."""
    pos = torch.arange(offset, offset + length, device=device, dtype=torch.float32)[:, None]
    freq = torch.exp(
        torch.arange(0, dim, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / dim)
    )
    pe = torch.zeros(length, dim, device=device)
    pe[:, 0::2] = torch.sin(pos * freq)
    pe[:, 1::2] = torch.cos(pos * freq[: dim // 2])
    return pe


class FeedForward(nn.Sequential):
    def __init__(self, d_model: int, d_ff: int, dropout: float):
        super().__init__(
            nn.Linear(d_model, d_ff), nn.GELU(), nn.Dropout(dropout), nn.Linear(d_ff, d_model)
        )


class EncoderLayer(nn.Module):
    def __init__(self, d_model, heads, kv_heads, d_ff, dropout):
        super().__init__()
        from attnlab.nn import MultiHeadAttention

        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.self_attn = MultiHeadAttention(d_model, heads, num_kv_heads=kv_heads)
        self.ff = FeedForward(d_model, d_ff, dropout)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mask):
        x = x + self.drop(self.self_attn(self.norm1(x), key_mask=mask))
        return x + self.drop(self.ff(self.norm2(x)))


class DecoderLayer(nn.Module):
    def __init__(self, d_model, heads, kv_heads, d_ff, dropout, layer_idx):
        super().__init__()
        from attnlab.nn import MultiHeadAttention

        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(d_model) for _ in range(3))
        self.self_attn = MultiHeadAttention(
            d_model, heads, num_kv_heads=kv_heads, is_causal=True, layer_idx=layer_idx
        )
        self.cross_attn = MultiHeadAttention(d_model, heads, num_kv_heads=kv_heads)
        self.ff = FeedForward(d_model, d_ff, dropout)
        self.drop = nn.Dropout(dropout)

    def forward(self, y, kv, mask, *, cache=None, return_weights=False):
        """y (B, T, D); kv: this layer's projected memory; mask (B, S) True = real source token."""
        y = y + self.drop(self.self_attn(self.norm1(y), cache=cache))
        r = self.cross_attn(self.norm2(y), kv=kv, key_mask=mask, return_weights=return_weights)
        a, w = r if return_weights else (r, None)
        y = y + self.drop(a)
        return y + self.drop(self.ff(self.norm3(y))), w  # w: (B, H, T, S) or None


class TransformerSeq2Seq(nn.Module):
    """Encoder-decoder Transformer; see the module docstring.

    Args:
        vocab_size: joint vocabulary.
        d_model, heads, d_ff: widths; ``d_model`` divisible by ``heads``.
        kv_heads: key/value heads (``None`` = ``heads``; fewer = grouped-query attention).
        enc_layers, dec_layers: depths.
        dropout: on embeddings, residual branches and inside the feed-forward blocks
            (attention weights are not dropped, as in Vaswani et al.'s base model; on CPU it
            would cost 1.5-1.8x the attention's time, in attnlab's blocked kernel).
    """

    kind = "transformer"

    def __init__(
        self,
        vocab_size: int,
        d_model: int = 256,
        heads: int = 4,
        kv_heads: int | None = None,
        d_ff: int = 1024,
        enc_layers: int = 3,
        dec_layers: int = 3,
        dropout: float = 0.1,
    ):
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by heads ({heads})")
        if kv_heads is not None and (kv_heads < 1 or heads % kv_heads):
            raise ValueError(f"kv_heads ({kv_heads}) must divide heads ({heads})")
        self.hparams = {
            "kind": "transformer",
            "attention": "multihead" if kv_heads in (None, heads) else "gqa",
            "d_model": d_model,
            "heads": heads,
            "kv_heads": kv_heads,
            "d_ff": d_ff,
            "enc_layers": enc_layers,
            "dec_layers": dec_layers,
            "dropout": dropout,
        }
        self.attention_type = self.hparams["attention"]
        self.d_model = d_model
        self.embedding = nn.Embedding(vocab_size, d_model, padding_idx=PAD)
        # position codes, computed once and grown on demand (not saved: they are a formula)
        self.register_buffer("pe", sinusoids(256, d_model), persistent=False)
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.ModuleList(
            EncoderLayer(d_model, heads, kv_heads, d_ff, dropout) for _ in range(enc_layers)
        )
        self.decoder = nn.ModuleList(
            DecoderLayer(d_model, heads, kv_heads, d_ff, dropout, i) for i in range(dec_layers)
        )
        self.enc_norm, self.dec_norm = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab_size, bias=False)
        self.out.weight = self.embedding.weight  # tied
        nn.init.normal_(self.embedding.weight, std=d_model**-0.5)
        with torch.no_grad():
            self.embedding.weight[PAD].zero_()

    def _embed(self, ids: torch.Tensor, offset: int = 0, positions=None) -> torch.Tensor:
        """Token embeddings plus position codes: of ``offset, offset + 1, ...``, or of
        ``positions`` ((L,) long, on the device: a compiled step; codes grown beforehand)."""
        x = self.embedding(ids) * math.sqrt(self.d_model)  # (B, L, D)
        if positions is not None:
            return self.drop(x + self.pe.index_select(0, positions))
        self._grow_positions(offset + ids.shape[1])
        return self.drop(x + self.pe[offset : offset + ids.shape[1]])

    def _grow_positions(self, length: int) -> None:
        if length > self.pe.shape[0]:
            self.pe = sinusoids(
                max(length, 2 * self.pe.shape[0]), self.d_model, device=self.pe.device
            )

    def encode(self, src: torch.Tensor, src_lengths: torch.Tensor) -> dict:
        """src (B, S) -> memory: ``mask`` (B, S) and each decoder layer's cross-attention k/v."""
        S = src.shape[1]
        mask = source_mask(src_lengths.to(src.device), S)  # (B, S)
        x = self._embed(src)
        for layer in self.encoder:
            x = layer(x, mask)
        x = self.enc_norm(x)  # (B, S, D)
        memory = {"mask": mask}
        for i, layer in enumerate(self.decoder):
            # (B, S, D) -> (B, Hkv, S, E): once per sentence, reused by every decoder step
            memory[f"k{i}"], memory[f"v{i}"] = layer.cross_attn.project_kv(x)
        return memory

    def _decode(self, y, memory, *, cache=None, return_attention=False):
        weights = []
        for i, layer in enumerate(self.decoder):
            kv = (memory[f"k{i}"], memory[f"v{i}"])
            y, w = layer(y, kv, memory["mask"], cache=cache, return_weights=return_attention)
            weights.append(w)
        logits = self.out(self.dec_norm(y))  # (B, T, V)
        attn = torch.stack(weights, dim=1) if return_attention else None  # (B, N, H, T, S)
        return logits, attn

    def forward(self, src, src_lengths, tgt_in, *, return_attention: bool = False):
        """Teacher forcing. logits (B, T, V); attention (B, N, H, T, S) if asked."""
        memory = self.encode(src, src_lengths)
        logits, attn = self._decode(self._embed(tgt_in), memory, return_attention=return_attention)
        return (logits, attn) if return_attention else logits

    def __getstate__(self) -> dict:
        """Pickled (torch.save, deepcopy) without its compiled decoder steps: they are code."""
        state = dict(self.__dict__)
        state.pop("_decode_steps", None)
        return state

    # ------------------------------------------------------------------------------ decoding
    def start(
        self, memory: dict, *, max_length: int | None = None, compile=False, reuse_cache=False
    ) -> dict:
        """Decoder state before the first token: the memory, a KV cache and the position.

        ``compile`` (True, or a dict of :class:`attnlab.models.DecodeStep` options): every step
        after the first runs one compiled graph (on CUDA a CUDA graph) over a
        ``StaticCache(max_length)``, with the memory as its inputs; compiled with symbolic
        sizes (``dynamic=True``), so batches of other sizes and source lengths reuse it. The
        cache's length and the source (masked) are rounded up to a multiple of ``BUCKET``:
        a CUDA graph is recorded per geometry, and this keeps them few.

        ``reuse_cache``: the model's last static cache of that length is reset and used again
        (its storage kept when the batch has the same size), so that a CUDA graph replays over
        the same addresses instead of being recorded again for every batch. For callers that
        finish one decoding before they start the next, as :func:`greedy` and
        :func:`beam_search` do; two states decoding at once need a cache each.
        """
        from attnlab.cache import DynamicCache, StaticCache, kept_static_cache

        if not compile:
            return {**memory, "cache": DynamicCache(), "pos": 0}
        if max_length is None or max_length < 1:
            raise ValueError(
                f"a compiled decoder step needs the number of tokens to make room for, "
                f"max_length >= 1; got {max_length}. Fix: start(memory, max_length=limit, "
                f"compile=True)."
            )
        max_length = -(-max_length // BUCKET) * BUCKET
        self._grow_positions(max_length)  # (not inside the graph)
        options = {"dynamic": True, **(compile if isinstance(compile, dict) else {})}
        key = tuple(sorted(options.items()))  # (names differ: values never compared)
        steps = self.__dict__.setdefault("_decode_steps", {})  # (not a submodule: no state)
        if key not in steps:  # one per options: the same graph serves every batch
            from attnlab.models.decode import DecodeStep

            steps[key] = DecodeStep(StepDecoder(self), **options)
        S = memory["mask"].shape[1]
        pad = -S % BUCKET  # masked source slots: exactly zero weight, the same output
        padded = {k: F.pad(v, (0, 0, 0, pad)) for k, v in memory.items() if k != "mask"}
        padded["mask"] = F.pad(memory["mask"], (0, pad), value=False)
        state = {**memory, **padded, "source_length": S}
        cache = kept_static_cache(self, max_length) if reuse_cache else StaticCache(max_length)
        return {**state, "cache": cache, "pos": 0, "step": steps[key]}

    def step(self, tokens: torch.Tensor, state: dict, *, return_attention: bool = False):
        """One token per row: tokens (N,) -> logits (N, V), state, attention (N, N_l, H, S)."""
        compiled = state.get("step")
        if compiled is not None and state["pos"] > 0 and not return_attention:
            kv = tuple((state[f"k{i}"], state[f"v{i}"]) for i in range(len(self.decoder)))
            logits = compiled(tokens[:, None], state["cache"], mask=state["mask"], kv=kv)
            return logits[:, 0], {**state, "pos": state["pos"] + 1}, None
        y = self._embed(tokens[:, None], offset=state["pos"])  # (N, 1, D)
        logits, attn = self._decode(
            y, state, cache=state["cache"], return_attention=return_attention
        )
        new_state = dict(state)
        new_state["pos"] = state["pos"] + 1
        if attn is not None:  # (N, N_l, H, 1, S): the real source only (see start)
            attn = attn[:, :, :, 0, : state.get("source_length", attn.shape[-1])]
        return logits[:, 0], new_state, attn

    @staticmethod
    def reorder(state: dict, index: torch.Tensor) -> dict:
        out = {}
        for k, v in state.items():
            if k == "cache":
                v.reorder(index)
                out[k] = v
            elif torch.is_tensor(v):
                out[k] = v.index_select(0, index)
            else:
                out[k] = v
        return out


class StepDecoder(nn.Module):
    """A :class:`TransformerSeq2Seq`'s decoder as :class:`attnlab.models.DecodeStep` calls it.

    ``forward(tokens (N, 1), cache=, mask= (N, S), kv= ((k, v) per layer))`` -> logits
    (N, 1, V). The token's position comes from the cache (``next_position``, on the device), so
    no Python int changes from step to step and one graph serves them all.
    """

    def __init__(self, seq2seq: TransformerSeq2Seq) -> None:
        super().__init__()
        self.seq2seq = seq2seq

    def forward(self, tokens, cache, *, mask, kv):
        m = self.seq2seq
        y = m._embed(tokens, positions=cache.next_position(0))  # (N, 1, D)
        for layer, layer_kv in zip(m.decoder, kv, strict=True):
            y, _ = layer(y, layer_kv, mask, cache=cache)
        return m.out(m.dec_norm(y))  # (N, 1, V)
