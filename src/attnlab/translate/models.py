"""Model registry: a JSON-able config dict -> an RNN or Transformer translator.

Both models share one interface, which the decoders and the trainer rely on::

    logits = model(src, src_lengths, tgt_in)                        # teacher forcing
    logits, attn = model(src, src_lengths, tgt_in, return_attention=True)
    memory = model.encode(src, src_lengths)                         # dict of (B, ...) tensors
    state = model.start(memory, max_length=limit, compile=False)   # compile: Transformer only
    logits, state, attn = model.step(tokens, state, return_attention=...)
    state = model.reorder(state, index)                             # beam search

Cross-attention maps: RNN (B, T, S); Transformer (B, layers, heads, T, S).
"""

from __future__ import annotations

import torch
from torch import nn

from attnlab.translate.rnn import RNNSeq2Seq
from attnlab.translate.settings import (  # noqa: F401 - part of this module's API
    MODELS,
    RNN_ATTENTIONS,
    SIZES,
    TRANSFORMER_ATTENTIONS,
)
from attnlab.translate.transformer import TransformerSeq2Seq


def model_config(model: str, attention: str | None, size: str = "small", **overrides) -> dict:
    """The config dict of a model: kind, attention and widths (non-None ``overrides`` win)."""
    asked = attention  # (None: the default, which --kv-heads alone makes gqa)
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; expected one of {MODELS}")
    if size not in SIZES[model]:
        raise ValueError(f"unknown size {size!r}; expected one of {list(SIZES[model])}")
    cfg = {"kind": model, **SIZES[model][size]}
    if model == "rnn":
        attention = attention or "bahdanau"
        if attention not in RNN_ATTENTIONS:
            raise ValueError(
                f"--attention {attention} is not an RNN attention; expected one of "
                f"{', '.join(RNN_ATTENTIONS)}"
            )
    else:
        attention = attention or "multihead"
        if attention not in TRANSFORMER_ATTENTIONS:
            raise ValueError(
                f"--attention {attention} is not a Transformer attention; expected multihead or "
                "gqa (grouped-query: fewer key/value heads, --kv-heads), or use --model rnn"
            )
    cfg["attention"] = attention
    for key, value in overrides.items():
        if value is not None:
            cfg[key] = value
    if model == "transformer":
        _grouped_heads(cfg, asked, overrides.get("kv_heads"))
    return cfg


def _grouped_heads(cfg: dict, asked: str | None, kv_heads: int | None) -> None:
    """Settle ``kv_heads`` and the attention's name of a Transformer config, in place: gqa
    without ``--kv-heads`` takes half the heads; an option is never overridden, and a
    combination that is not what it says (gqa with as many kv heads as heads, multihead with
    fewer) is refused with the fix."""
    heads = cfg["heads"]
    if cfg["attention"] == "gqa":
        if kv_heads is None:
            cfg["kv_heads"] = max(1, heads // 2)
        if cfg["kv_heads"] == heads:
            raise ValueError(
                f"--attention gqa (grouped-query) needs fewer key/value heads than heads; got "
                f"--heads {heads} with {cfg['kv_heads']} key/value head(s), which is multi-head "
                "attention. Fix: "
                + (f"--kv-heads K with K < {heads} dividing {heads}" if heads > 1 else
                   "--heads 2 or more (gqa then takes half as many key/value heads)")
                + ", or --attention multihead"
            )  # fmt: skip
    elif kv_heads is not None and kv_heads != heads:
        if asked == "multihead":
            raise ValueError(
                f"--attention multihead has as many key/value heads as heads ({heads}); got "
                f"--kv-heads {kv_heads}. Fix: --attention gqa --kv-heads {kv_heads}, or drop "
                "--kv-heads"
            )
        cfg["attention"] = "gqa"  # (--kv-heads alone asks for grouped-query heads)


def build_model(config: dict, vocab_size: int) -> nn.Module:
    """Instantiate the model described by ``config`` (as returned by :func:`model_config`)."""
    cfg = dict(config)
    kind = cfg.pop("kind")
    if kind == "rnn":
        return RNNSeq2Seq(vocab_size, **cfg)
    if kind == "transformer":
        cfg.pop("attention", None)
        return TransformerSeq2Seq(vocab_size, **cfg)
    raise ValueError(f"unknown model kind {kind!r}; expected one of {MODELS}")


def count_parameters(model: nn.Module) -> int:
    """Trainable parameters, tied weights counted once."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def select_rows(memory: dict, index: torch.Tensor) -> dict:
    """Pick / repeat the batch rows of an encoder memory (every tensor's dim 0)."""
    return {k: v.index_select(0, index) if torch.is_tensor(v) else v for k, v in memory.items()}
