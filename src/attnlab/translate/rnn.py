"""RNN encoder-decoder with pluggable attention (Cho et al. 2014; Bahdanau et al. 2015;
Luong et al. 2015).

The encoder is a bidirectional GRU: each source position ``i`` gets ``h_i``, the forward and
backward states side by side (width ``D``, ``D/2`` per direction). The decoder is a GRU that
writes the target one token at a time; what differs between variants is how it looks at the
``h_i``:

================== ==========================================================================
``none``           no attention: the decoder sees only a fixed summary of the source (the
                   encoder's last states), at every step. The bottleneck attention removes.
``bahdanau``       additive attention, query = the *previous* decoder state ``s_{t-1}``:
                   ``e_ti = v^T tanh(W_q s_{t-1} + W_k h_i)``; the context ``c_t`` is an input
                   of the GRU step. ``W_k h_i`` is computed once per sentence and reused by every
                   step (``AdditiveAttention.project_keys``).
``luong-dot``      Luong's global attention, query = the *current* state ``s_t``:
``luong-general``  ``score = s_t^T h_i`` / ``s_t^T W h_i`` / ``v^T tanh(W [s_t; h_i])``, then
``luong-concat``   the attentional state ``tanh(W_c [c_t; s_t])`` predicts the word.
``multihead``      as Luong, with multi-head scaled dot-product cross-attention
                   (``MultiHeadAttention``; keys/values projected once per sentence).
``hard``           as Luong-general, but each step *selects* one source position (argmax;
                   straight-through gradient, :func:`attnlab.functional.hard_attention`).
================== ==========================================================================

Since the Luong-style variants do not feed the context back into the GRU (no "input feeding"),
their decoder GRU runs over the whole target at once in training (one fused ``nn.GRU`` call),
and attention is one batched call over all target positions. Bahdanau's context is a GRU input,
so its training loop is step by step.

Shapes: ``B`` batch, ``S`` source length, ``T`` target length, ``D`` hidden width, ``E``
embedding width, ``V`` vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from attnlab.translate.batching import source_mask
from attnlab.translate.settings import RNN_ATTENTIONS
from attnlab.translate.tokenizer import PAD


class HardAttention(nn.Module):
    """Hard (argmax) attention with a bilinear score: each query selects one source position.

    ``score_i = (W q)^T k_i / sqrt(D)``; the weights are one-hot at the best score in the
    forward pass, and the softmax's gradient flows back (straight-through estimator).
    """

    def __init__(self, query_dim: int, key_dim: int):
        super().__init__()
        self.q_proj = nn.Linear(query_dim, key_dim, bias=False)

    def forward(self, query, key, value=None, *, key_mask=None, return_weights=False):
        from attnlab.functional import hard_attention

        value = key if value is None else value
        mask = None if key_mask is None else key_mask[:, None, :]  # (B, 1, S)
        return hard_attention(
            self.q_proj(query), key, value, mask, mode="argmax", return_weights=return_weights
        )


class RNNSeq2Seq(nn.Module):
    """Bidirectional-GRU encoder, GRU decoder, attention chosen by name (see module docstring).

    Args:
        vocab_size: joint source/target vocabulary.
        attention: one of :data:`RNN_ATTENTIONS`.
        emb_dim: embedding width ``E`` (shared by source, target and the output layer).
        hidden: decoder width ``D``; the encoder has ``D/2`` per direction.
        enc_layers: encoder GRU layers.
        heads: heads of ``multihead``.
        dropout: on embeddings and before the output layer.
    """

    kind = "rnn"

    def __init__(
        self,
        vocab_size: int,
        attention: str = "bahdanau",
        emb_dim: int = 256,
        hidden: int = 512,
        enc_layers: int = 1,
        heads: int = 4,
        dropout: float = 0.2,
    ):
        super().__init__()
        if attention not in RNN_ATTENTIONS:
            raise ValueError(
                f"unknown RNN attention {attention!r}; expected one of {RNN_ATTENTIONS}"
            )
        if hidden % 2:
            raise ValueError(f"hidden must be even (two encoder directions), got {hidden}")
        if attention == "multihead" and hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        from attnlab.nn import AdditiveAttention, LuongAttention, MultiHeadAttention

        self.hparams = {
            "kind": "rnn",
            "attention": attention,
            "emb_dim": emb_dim,
            "hidden": hidden,
            "enc_layers": enc_layers,
            "heads": heads,
            "dropout": dropout,
        }
        self.attention_type = attention
        self.hidden = hidden
        self.embedding = nn.Embedding(vocab_size, emb_dim, padding_idx=PAD)
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.GRU(
            emb_dim,
            hidden // 2,
            num_layers=enc_layers,
            bidirectional=True,
            batch_first=True,
            dropout=dropout if enc_layers > 1 else 0.0,
        )
        self.bridge = nn.Linear(hidden, hidden)  # encoder summary -> first decoder state
        if attention == "bahdanau":
            self.attn = AdditiveAttention(hidden, hidden, hidden)
            self.cell = nn.GRUCell(emb_dim + hidden, hidden)
            self.combine = nn.Linear(hidden + hidden + emb_dim, emb_dim)  # [s_t; c_t; y_{t-1}]
        elif attention == "none":
            self.attn = None
            self.decoder = nn.GRU(emb_dim + hidden, hidden, batch_first=True)
            self.combine = nn.Linear(hidden + hidden + emb_dim, emb_dim)  # [s_t; c; y_{t-1}]
        else:
            if attention.startswith("luong-"):
                self.attn = LuongAttention(hidden, hidden, score=attention.removeprefix("luong-"))
            elif attention == "multihead":
                self.attn = MultiHeadAttention(hidden, heads)
            else:
                self.attn = HardAttention(hidden, hidden)
            self.decoder = nn.GRU(emb_dim, hidden, batch_first=True)
            self.combine = nn.Linear(hidden + hidden, emb_dim)  # Luong: tanh(W_c [c_t; s_t])
        self.out = nn.Linear(emb_dim, vocab_size, bias=False)
        self.out.weight = self.embedding.weight  # tied (Press & Wolf 2017)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.embedding.weight, std=self.embedding.embedding_dim**-0.5)
        with torch.no_grad():
            self.embedding.weight[PAD].zero_()

    # ------------------------------------------------------------------------------ encoder
    def encode(self, src: torch.Tensor, src_lengths: torch.Tensor) -> dict:
        """src (B, S) -> memory: ``enc`` (B, S, D), ``mask`` (B, S) True = real, ``s`` (B, D)."""
        B, S = src.shape
        x = self.drop(self.embedding(src))  # (B, S, E)
        packed = pack_padded_sequence(x, src_lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, h_n = self.encoder(packed)
        enc, _ = pad_packed_sequence(out, batch_first=True, total_length=S)  # (B, S, D)
        # h_n: (layers * 2, B, D/2); the top layer's forward (last word) and backward (first word)
        summary = torch.cat([h_n[-2], h_n[-1]], dim=-1)  # (B, D)
        mask = source_mask(src_lengths.to(src.device), S)  # (B, S)
        memory = {"enc": enc, "mask": mask, "s": torch.tanh(self.bridge(summary))}
        if self.attention_type == "bahdanau" or self.attention_type.startswith("luong-"):
            memory["keys"] = self.attn.project_keys(enc)  # W_k h_i: once per sentence
        elif self.attention_type == "multihead":
            memory["k"], memory["v"] = self.attn.project_kv(enc)  # (B, H, S, E) each
        elif self.attention_type == "none":
            memory["c"] = summary  # the fixed context: all the decoder knows of the source
        return memory

    def _attend(self, memory: dict, query: torch.Tensor, return_weights: bool):
        """query (B, L, D) -> context (B, L, D) and weights (B, L, S) or None."""
        kind = self.attention_type
        kw = {"key_mask": memory["mask"], "return_weights": return_weights}
        if kind == "multihead":
            r = self.attn(query, kv=(memory["k"], memory["v"]), average_weights=True, **kw)
        elif "keys" in memory:  # Bahdanau, Luong: keys projected once per sentence
            r = self.attn(query, memory["enc"], keys_proj=memory["keys"], **kw)
        else:
            r = self.attn(query, memory["enc"], **kw)
        return r if return_weights else (r, None)

    # ------------------------------------------------------------------------------ training
    def forward(self, src, src_lengths, tgt_in, *, return_attention: bool = False):
        """Teacher forcing. Returns logits (B, T, V), and attention (B, T, S) if asked."""
        memory = self.encode(src, src_lengths)
        y = self.drop(self.embedding(tgt_in))  # (B, T, E)
        kind = self.attention_type
        weights = None
        if kind == "bahdanau":
            s, states, contexts, all_w = memory["s"], [], [], []
            for y_t in y.unbind(1):  # (B, E) per step; unbind: one backward op, not T slices
                c, w = self._attend(memory, s[:, None], return_attention)  # query s_{t-1}
                s = self.cell(torch.cat([y_t, c[:, 0]], dim=-1), s)
                states.append(s)
                contexts.append(c[:, 0])
                all_w.append(w)
            s_all, c_all = torch.stack(states, 1), torch.stack(contexts, 1)  # (B, T, D)
            h = torch.tanh(self.combine(torch.cat([s_all, c_all, y], dim=-1)))
            if return_attention:
                weights = torch.cat(all_w, dim=1)  # (B, T, S)
        elif kind == "none":
            c = memory["c"][:, None].expand(-1, y.shape[1], -1)  # (B, T, D)
            s_all, _ = self.decoder(torch.cat([y, c], dim=-1), memory["s"][None])
            h = torch.tanh(self.combine(torch.cat([s_all, c, y], dim=-1)))
        else:
            s_all, _ = self.decoder(y, memory["s"][None])  # (B, T, D), all steps at once
            c_all, weights = self._attend(memory, s_all, return_attention)
            h = torch.tanh(self.combine(torch.cat([c_all, s_all], dim=-1)))
        logits = self.out(self.drop(h))  # (B, T, V)
        return (logits, weights) if return_attention else logits

    # ------------------------------------------------------------------------------ decoding
    def start(
        self, memory: dict, *, max_length: int | None = None, compile=False, reuse_cache=False
    ) -> dict:
        """Decoder state before the first step: the memory plus the current GRU state.

        (``max_length`` is not needed: the state does not grow. ``compile`` is refused: a
        compiled step is the Transformer's, whose KV cache it fixes in shape; ``reuse_cache``
        is the Transformer's too, and means nothing here.)
        """
        if compile:
            raise ValueError(
                "compile=True compiles the Transformer's decoder step (over a fixed-shape KV "
                "cache); this is an RNN, whose step is a GRU cell. Fix: compile=False."
            )
        return dict(memory)

    def step(self, tokens: torch.Tensor, state: dict, *, return_attention: bool = False):
        """One decoder step. tokens (N,) -> logits (N, V), new state, attention (N, S) or None."""
        y = self.embedding(tokens)  # (N, E)
        kind = self.attention_type
        w = None
        if kind == "bahdanau":
            c, w = self._attend(state, state["s"][:, None], return_attention)
            s = self.cell(torch.cat([y, c[:, 0]], dim=-1), state["s"])
            h = torch.tanh(self.combine(torch.cat([s, c[:, 0], y], dim=-1)))
        elif kind == "none":
            c = state["c"]
            s_seq, _ = self.decoder(torch.cat([y, c], dim=-1)[:, None], state["s"][None])
            s = s_seq[:, 0]
            h = torch.tanh(self.combine(torch.cat([s, c, y], dim=-1)))
        else:
            s_seq, _ = self.decoder(y[:, None], state["s"][None])  # (N, 1, D)
            c, w = self._attend(state, s_seq, return_attention)
            s = s_seq[:, 0]
            h = torch.tanh(self.combine(torch.cat([c[:, 0], s], dim=-1)))
        new_state = dict(state)
        new_state["s"] = s
        logits = self.out(h)
        return logits, new_state, (w[:, 0] if w is not None else None)

    @staticmethod
    def reorder(state: dict, index: torch.Tensor) -> dict:
        """Select / repeat batch rows of the state (beam search)."""
        return {k: v.index_select(0, index) for k, v in state.items()}
