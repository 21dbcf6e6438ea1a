"""Run a model once and keep what the pictures need: tokens, weights, hidden states, head writes.

A :class:`Trace` holds plain NumPy arrays, so the plotting functions never see a model. Three
ways to get one:

* :func:`trace_model` -- a Hugging Face model (e.g. ``attnlab.pretrained.load_model(name,
  attn_implementation="attnlab")``) on one text;
* :func:`trace_layer` -- one attnlab self-attention layer on a batch of one;
* ``Trace(tokens=..., attentions=...)`` -- arrays you already have (a translator's
  cross-attention, say).

What "before" and "after" attention mean in a transformer layer ``l`` with a residual stream::

    x_l = hidden_states[l] ──┬──────────────────────────────┐
                             └─ attention: heads h = 0..H-1  │
                                  ctx_h = Σ_j w_hij v_hj     │
                                  write_h = ctx_h W_O[:, h]ᵀ │  (the head's slice of o_proj)
                             ┌─ Σ_h write_h + b_O ───────────┴─(+)──> x_l + attention output
                             │                                        ("after attention")
    x_{l+1} = hidden_states[l+1]  (after the MLP and norms too)

``after_attention(l) = x_l + Σ_h write_h + b_O`` is the token vectors right after the attention
sublayer; ``after_head(l, h) = x_l + write_h`` is where head ``h`` alone would move them. The
writes are recorded with a hook on the input of each layer's output projection (``o_proj`` in
Llama, ``attention.output.dense`` in BERT, ``o_proj`` in attnlab's MultiHeadAttention); for other
architectures only the hidden states are used. In post-norm encoders (BERT and its kin) the
model norms ``x_l + attention output`` before its MLP: the point drawn is that sum, before the
LayerNorm, which rescales it. Where a norm stands between the attention output and the residual
sum (Gemma 2 and 3's ``post_attention_layernorm``, followed by a ``pre_feedforward_layernorm``),
the heads' writes do not add up: the vectors after attention are then recorded as the model
carries them (``attended``), and no head writes are kept.

Legend: ``L`` query tokens, ``S`` key tokens, ``H`` query heads, ``D`` model width, ``Ev``
value head width.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._arrays import attention_map, check_tokens, layer_stack, split_occurrence, to_numpy

__all__ = [
    "Trace",
    "default_fit_on",
    "merge_subwords",
    "trace_layer",
    "trace_model",
    "trace_translation",
    "word_distances",
]

# Output projections of the attention sublayer, by architecture (module name suffixes).
OUT_PROJECTIONS = (
    "self_attn.o_proj",  # Llama, Mistral, Qwen, ...
    "attention.output.dense",  # BERT
    "attn.o_proj",
    "self_attn.out_proj",
    "attention.out_lin",  # DistilBERT
)


@dataclass
class Trace:
    """Tokens, attention weights and (optionally) token vectors of one input.

    Attributes:
        tokens: ``L`` query token labels, as they should be drawn.
        attentions: ``[layers, H, L, S]`` attention weights (rows sum to 1); a 3-D array is
            one layer's ``[H, L, S]`` (a one-head model's layers: ``A[:, None]``).
        key_tokens: ``S`` key labels; ``None`` means ``tokens`` (self-attention).
        hidden_states: ``[layers + 1, L, D]``: ``[l]`` is the input of layer ``l`` and ``[-1]``
            the model's output (self-attention models only).
        context: ``[layers, L, H * Ev]`` the concatenated head outputs, before the output
            projection.
        out_weight: ``[layers, D, H * Ev]`` the output projection's weights; ``out_bias``
            ``[layers, D]`` or ``None``.
        model: the model's name, for titles.
        text: the input text.
        special: ``L`` flags, True for tokens the tokenizer added (``[CLS]``, ``[SEP]``, BOS).
        offsets: ``L`` character spans ``(start, end)`` into ``text`` (``(0, 0)`` for special
            tokens), or ``None``.
        layer_names: one label per layer.
        kind: ``"self"`` for self-attention, ``"cross"`` for a decoder's cross-attention.
        attended: ``[layers, L, D]`` the token vectors right after each attention sublayer, as
            recorded from the model, where they are not ``x_l`` plus the heads' writes (a norm
            on the attention output); else ``None``.
    """

    tokens: list[str]
    attentions: np.ndarray
    key_tokens: list[str] | None = None
    hidden_states: np.ndarray | None = None
    context: np.ndarray | None = None
    out_weight: np.ndarray | None = None
    out_bias: np.ndarray | None = None
    model: str = "model"
    text: str = ""
    special: list[bool] = field(default_factory=list)
    offsets: list[tuple[int, int]] | None = None
    layer_names: list[str] = field(default_factory=list)
    kind: str = "self"
    attended: np.ndarray | None = None

    def __post_init__(self) -> None:
        A = to_numpy(self.attentions, "attentions", np.float32)
        if A.ndim == 3:  # [H, L, S] of one layer (see the docstring)
            A = A[None]
        if A.ndim != 4:  # (and [layers, B=1, H, L, S], as torch.stack(outputs.attentions))
            A = layer_stack(A)
        self.attentions = A
        n_layers, _, L, S = A.shape
        self.tokens = check_tokens(self.tokens, L, "tokens")
        if self.key_tokens is not None or S != L:
            self.key_tokens = check_tokens(self.key_tokens, S, "key_tokens")
        if self.special is None or len(self.special) == 0:  # (a NumPy array has no truth)
            self.special = [False] * L
        self.special = [bool(x) for x in self.special]
        if len(self.special) != L:
            raise ValueError(f"special has {len(self.special)} flags for {L} tokens")
        if not self.layer_names:
            self.layer_names = [f"layer {i}" for i in range(n_layers)]
        if self.hidden_states is not None:
            Hs = to_numpy(self.hidden_states, "hidden_states", np.float32)
            # (one per layer only, the embeddings dropped as hidden_states[1:], every before()
            # would be a layer late and the last layer's movement zero)
            if Hs.ndim != 3 or Hs.shape[1] != L or Hs.shape[0] != n_layers + 1:
                raise ValueError(
                    f"hidden_states must be [layers + 1, L, D] = [{n_layers + 1}, {L}, D]; "
                    f"got {Hs.shape}. Fix: pass every hidden state, the embeddings first (a "
                    f"Hugging Face model's hidden_states, not hidden_states[1:])"
                )
            self.hidden_states = Hs
        if self.attended is not None:
            self.attended = to_numpy(self.attended, "attended", np.float32)
            if self.attended.shape[:2] != (n_layers, L) or self.attended.ndim != 3:
                raise ValueError(
                    f"attended must be [layers, L, D] = [{n_layers}, {L}, D]; got "
                    f"{self.attended.shape}"
                )
        if self.context is not None:
            self.context = to_numpy(self.context, "context", np.float32)
            self.out_weight = to_numpy(self.out_weight, "out_weight", np.float32)
            if self.out_bias is not None:
                self.out_bias = to_numpy(self.out_bias, "out_bias", np.float32)

    # -- sizes -------------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return self.attentions.shape[0]

    @property
    def num_heads(self) -> int:
        return self.attentions.shape[1]

    @property
    def keys(self) -> list[str]:
        """The ``S`` key labels (``tokens`` for self-attention)."""
        return self.key_tokens if self.key_tokens is not None else self.tokens

    @property
    def has_movement(self) -> bool:
        """Whether token vectors are known (self-attention with hidden states)."""
        return self.hidden_states is not None and self.key_tokens is None

    @property
    def has_head_writes(self) -> bool:
        return self.has_movement and self.context is not None

    def check_layer(self, layer: int) -> int:
        """``layer`` as a non-negative index (negative counts from the end), checked."""
        n = self.num_layers
        if not -n <= layer < n:
            raise ValueError(
                f"layer {layer} is out of range: {self.model} has {n} layers "
                f"(0 to {n - 1}, or -1 for the last)"
            )
        return int(layer) % n  # (a Python int: it goes into JSON)

    def check_head(self, head: int | None) -> int | None:
        if head is None:
            return None
        if not 0 <= head < self.num_heads:
            raise ValueError(
                f"head {head} is out of range: {self.model} has {self.num_heads} "
                f"heads per layer (0 to {self.num_heads - 1}); omit it for the mean"
            )
        return int(head)

    # -- weights and vectors -----------------------------------------------------------------

    def weights(self, layer: int, head: int | None = None) -> np.ndarray:
        """``[L, S]``: one head's weights, or the mean over heads (``head=None``)."""
        layer, head = self.check_layer(layer), self.check_head(head)
        A = self.attentions[layer]
        return A.mean(axis=0) if head is None else A[head]

    def _require_movement(self) -> np.ndarray:
        if not self.has_movement:
            raise ValueError(
                "this trace has no token vectors (hidden_states): embedding movement needs a "
                "self-attention model traced with trace_model or trace_layer"
            )
        assert self.hidden_states is not None
        return self.hidden_states

    def before(self, layer: int) -> np.ndarray:
        """``[L, D]``: the token vectors entering layer ``layer``."""
        return self._require_movement()[self.check_layer(layer)]

    def head_writes(self, layer: int) -> np.ndarray:
        """``[H, L, D]``: what each head adds to the residual stream (its slice of o_proj)."""
        layer = self.check_layer(layer)
        if not self.has_head_writes:
            raise ValueError("this trace did not record the heads' outputs (no o_proj found)")
        assert self.context is not None and self.out_weight is not None
        H = self.num_heads
        ctx = self.context[layer]  # [L, H * Ev]
        W = self.out_weight[layer]  # [D, H * Ev]
        L, HEv = ctx.shape
        Ev = HEv // H
        per_head = ctx.reshape(L, H, Ev).transpose(1, 0, 2)  # (L, H * Ev) -> (H, L, Ev)
        W_h = W.reshape(W.shape[0], H, Ev).transpose(1, 2, 0)  # (D, H * Ev) -> (H, Ev, D)
        return per_head @ W_h  # (H, L, D): write_h = ctx_h W_O[:, h]^T

    def after_attention(self, layer: int) -> np.ndarray:
        """``[L, D]``: the token vectors right after layer ``layer``'s attention sublayer
        (``attended`` when recorded; the next layer's input when neither it nor the head
        outputs were recorded)."""
        layer = self.check_layer(layer)
        states = self._require_movement()
        if self.attended is not None:  # (recorded: a norm stands before the residual sum)
            return self.attended[layer]
        if not self.has_head_writes:
            return states[layer + 1]
        assert self.context is not None and self.out_weight is not None
        out = self.context[layer] @ self.out_weight[layer].T  # [L, D]
        if self.out_bias is not None:
            out = out + self.out_bias[layer]
        return states[layer] + out

    def after_head(self, layer: int, head: int) -> np.ndarray:
        """``[L, D]``: the token vectors moved by head ``head`` alone."""
        return self.before(layer) + self.head_writes(layer)[self.check_head(head)]

    # -- tokens and words --------------------------------------------------------------------

    def word_tokens(self, word: str, occurrence: int = 0) -> list[int]:
        """The token positions of the ``occurrence``-th use of ``word`` (case-insensitive).

        Raises:
            ValueError: the word is not in the text.
        """
        word = word.strip()
        if not word:
            raise ValueError("the word to look for is empty")
        if self.offsets is not None and self.text:
            pattern = re.compile(r"(?<!\w)" + re.escape(word) + r"(?!\w)", re.IGNORECASE)
            spans = [m.span() for m in pattern.finditer(self.text)]
            if len(spans) > occurrence:
                start, end = spans[occurrence]
                found = [
                    i
                    for i, (a, b) in enumerate(self.offsets)
                    if not self.special[i] and b > a and a < end and b > start
                ]
                if found:
                    return found
        else:
            wanted = word.lower()
            found = [i for i, t in enumerate(self.tokens) if t.lower().lstrip("#") == wanted]
            if len(found) > occurrence:
                return [found[occurrence]]
        raise ValueError(
            f"the word {word!r} is not in {self.text or ' '.join(self.tokens)!r}"
            + (f" {occurrence + 1} times" if occurrence else "")
            + "; pick a word of the sentence"
        )

    def default_focus(self) -> int:
        """The last token that is not a special token (e.g. "bank" in seed 001's sentence)."""
        for i in range(len(self.tokens) - 1, -1, -1):
            if not self.special[i]:
                return i
        return len(self.tokens) - 1

    def find_focus(self, focus: int | str | None) -> int:
        """A token position from an index, a word or ``None`` (:meth:`default_focus`).

        A word means its **first** use in the text (``"bank#2"``: its second), and of a word
        split into several tokens, the last one. :func:`attnlab.viz.plot_movement` and the
        explorer page read a word the same way, so every picture of one text shows the same
        token.
        """
        if focus is None:
            return self.default_focus()
        if isinstance(focus, str):
            if focus.lstrip("-").isdigit():
                focus = int(focus)
            else:
                word, occurrence = split_occurrence(focus)
                return self.word_tokens(word, occurrence)[-1]
        L = len(self.tokens)
        if not -L <= focus < L:
            raise ValueError(f"focus token {focus} is out of range for {L} tokens")
        return int(focus) % L

    def word_vector(self, layer: int, word: str, occurrence: int = 0) -> np.ndarray:
        """``[D]``: the mean of the word's token vectors at ``hidden_states[layer]``."""
        states = self._require_movement()
        return states[layer, self.word_tokens(word, occurrence)].mean(axis=0)


def default_fit_on(trace: Trace, layer: int) -> np.ndarray:
    """``[L]`` flags: the tokens a movement projection of ``layer`` is fitted on.

    Special tokens and tokens whose vector is over 3x the median length are left out (they are
    still drawn): BERT's ``[CLS]``/``[SEP]`` and a decoder's first token (an "attention sink"
    with a huge vector) would otherwise take a whole axis of the picture. If that would leave
    fewer than 3 tokens, all are used.
    """
    before = trace.before(layer)
    norms = np.linalg.norm(before, axis=-1)
    keep = ~np.asarray(trace.special, bool) & (norms <= 3 * np.median(norms))
    return keep if keep.sum() >= 3 else np.ones(len(keep), bool)


# ---------------------------------------------------------------------------------------------
# Hugging Face models


def display_tokens(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Readable token labels: ``"bank"`` for ``"Ġbank"``, ``"##ing"`` kept, ``"␣"``/``"⏎"``
    for whitespace-only tokens."""
    raw = tokenizer.convert_ids_to_tokens(list(ids))
    out = []
    for i, tok in zip(ids, raw, strict=True):
        if tok.startswith("##"):
            out.append(tok)
            continue
        text = tokenizer.decode([i])
        label = text.strip()
        if not label:
            label = "⏎" if "\n" in text else "␣"
        out.append(label)
    return out


def max_tokens_of(model: Any, tokenizer: Any) -> int:
    """The longest input the model reads: its position table, or the tokenizer's limit."""
    return _token_limit(model, tokenizer)[0]


def _token_limit(model: Any, tokenizer: Any) -> tuple[int, str]:
    """``(limit, where it comes from)``: the smaller of the position table and the tokenizer's
    ``model_max_length`` (tokenizers with no limit say 1e30: ignored)."""
    limits = [
        (getattr(model.config, "max_position_embeddings", None), "max_position_embeddings"),
        (getattr(tokenizer, "model_max_length", None), "the tokenizer's model_max_length"),
    ]
    known = [(int(n), why) for n, why in limits if isinstance(n, int | float) and 0 < n < 10**7]
    return min(known) if known else (10**7, "no limit")


MAX_WEIGHT_BYTES = 1 << 30
"""The most memory the attention weights of one traced text may take: 1 GiB of float32, i.e.
``layers x H x L x L x 4`` bytes (SmolLM2, 30 layers x 9 heads: 997 tokens; MiniLM's 512 tokens
take 75 MB). Weights grow with the square of the length; while the model runs they exist twice
(its outputs and the trace's copy)."""


def _out_projections(model: Any) -> list[Any]:
    import torch

    found = [
        module
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.endswith(OUT_PROJECTIONS)
    ]
    return found


def _pre_feedforward_norms(model: Any) -> list[Any]:
    """The ``pre_feedforward_layernorm`` modules of layers that also norm their attention
    output (Gemma 2, 3): the input of each is the residual stream right after attention."""
    both = ("pre_feedforward_layernorm", "post_attention_layernorm")
    return [
        module.pre_feedforward_layernorm
        for _, module in model.named_modules()
        if all(hasattr(module, name) for name in both)
    ]


def trace_model(
    model: Any,
    tokenizer: Any,
    text: str,
    *,
    name: str | None = None,
    max_tokens: int | None = None,
    truncate: bool = False,
    max_weight_bytes: int = MAX_WEIGHT_BYTES,
) -> Trace:
    """Run a Hugging Face model on ``text`` once and record what the pictures need.

    The model must return attention weights: load it with ``attn_implementation="attnlab"``
    (attnlab's kernels; :mod:`attnlab.integrations.transformers`) or ``"eager"``.
    Grouped-query models come back with one map per *query* head (SmolLM2: 9, not 3).

    Args:
        model: a ``transformers`` model in eval mode.
        tokenizer: its tokenizer (a fast one gives character offsets, used to find words).
        text: the input; special tokens are added as the tokenizer does by default.
        name: the model's name for titles (default: its ``model_type``).
        max_tokens: refuse longer inputs (the model's own limit always applies).
        truncate: keep the first tokens that fit (the model's limit and ``max_tokens``) instead
            of refusing a longer text; the tokenizer keeps its closing special token.
        max_weight_bytes: refuse texts whose weights (``layers x H x L x L`` float32) would
            take more memory than this (:data:`MAX_WEIGHT_BYTES`).

    Returns:
        A :class:`Trace` with attentions, hidden states and, for BERT- and Llama-like models,
        every head's write into the residual stream.

    Raises:
        ValueError: empty text, text longer than the limit, or a model that returns no
            attention weights.
    """
    import inspect

    import torch

    if not isinstance(text, str) or not text.strip():
        raise ValueError(
            "the text is empty; pass a sentence, e.g. "
            "'Write a poem about a man fishing on a river bank'"
        )
    name = name or getattr(model.config, "model_type", type(model).__name__)
    fast = bool(getattr(tokenizer, "is_fast", False))
    limit, why = _token_limit(model, tokenizer)
    keep = limit if max_tokens is None else min(limit, max_tokens)
    # verbose=False: a text over the model's limit gets attnlab's error below, not a warning
    enc = tokenizer(
        text,
        return_tensors="pt",
        return_offsets_mapping=fast,
        return_special_tokens_mask=True,
        verbose=False,
        **({"truncation": True, "max_length": keep} if truncate else {}),
    )
    offsets = enc.pop("offset_mapping")[0].tolist() if fast else None
    special_mask = enc.pop("special_tokens_mask")[0].tolist()
    ids = enc["input_ids"][0].tolist()
    if len(ids) > limit:
        raise ValueError(
            f"the text is {len(ids)} tokens long but {name} reads at most {limit} ({why}); "
            f"shorten the text, or pass truncate=True (--truncate) to show its first {limit} tokens"
        )
    if max_tokens is not None and len(ids) > max_tokens:
        raise ValueError(
            f"the text is {len(ids)} tokens long, over the limit of {max_tokens} "
            "(max_tokens, --max-tokens); shorten the text, raise the limit, or pass "
            "truncate=True (--truncate)"
        )
    layers = getattr(model.config, "num_hidden_layers", None)
    heads = getattr(model.config, "num_attention_heads", None)
    if isinstance(layers, int) and isinstance(heads, int):
        need = layers * heads * len(ids) ** 2 * 4
        if need > max_weight_bytes:
            fits = math.isqrt(max_weight_bytes // (layers * heads * 4))
            raise ValueError(
                f"the text is {len(ids)} tokens long: its attention weights ({layers} layers x "
                f"{heads} heads x {len(ids)} x {len(ids)} float32) would take "
                f"{need / 2**30:.1f} GiB, over the {max_weight_bytes / 2**30:.1f} GiB allowed "
                f"(max_weight_bytes); fix: shorten the text to {fits} tokens, or pass "
                f"--max-tokens {fits} --truncate"
            )
    if (
        "token_type_ids" in enc
        and "token_type_ids" not in inspect.signature(model.forward).parameters
    ):
        del enc["token_type_ids"]  # decoders take no segment ids

    sandwiched = _pre_feedforward_norms(model)  # a norm on the attention output: see module doc
    projections = [] if sandwiched else _out_projections(model)  # (writes: none add up there)
    captured: list[Any] = []
    residuals: list[Any] = []

    def keep_input(_module: Any, args: tuple[Any, ...]) -> None:
        captured.append(args[0].detach()[0].float().cpu())  # (B=1, L, H * Ev) -> (L, H * Ev)

    def keep_residual(_module: Any, args: tuple[Any, ...]) -> None:
        residuals.append(args[0].detach()[0].float().cpu())  # (B=1, L, D) -> (L, D)

    hooks = [p.register_forward_pre_hook(keep_input) for p in projections]
    hooks += [n.register_forward_pre_hook(keep_residual) for n in sandwiched]
    try:
        with torch.no_grad():
            out = model(**enc, output_attentions=True, output_hidden_states=True, return_dict=True)
    finally:
        for hook in hooks:
            hook.remove()
    attentions = getattr(out, "attentions", None)
    if not attentions or any(a is None for a in attentions):
        raise ValueError(
            f"{name} returned no attention weights; load it with "
            "attn_implementation='attnlab' (or 'eager'), e.g. "
            "attnlab.pretrained.load_model(name, attn_implementation='attnlab')"
        )
    A = np.empty((len(attentions), *attentions[0].shape[1:]), np.float32)  # [layers, H, L, S]
    for layer, a in enumerate(attentions):  # one layer at a time: no third copy of all weights
        A[layer] = a[0].float().cpu().numpy()
    states = getattr(out, "hidden_states", None)
    hidden = torch.stack([h[0].float() for h in states]).cpu().numpy() if states else None

    context = out_weight = out_bias = attended = None
    n_layers, H = A.shape[:2]
    if sandwiched and len(residuals) == n_layers:
        attended = torch.stack(residuals).numpy()  # x_l + norm(attention output)
    if (
        len(projections) == n_layers
        and len(captured) == n_layers
        and all(p.in_features % H == 0 for p in projections)
    ):
        context = torch.stack(captured).numpy()
        out_weight = torch.stack([p.weight.detach().float().cpu() for p in projections]).numpy()
        if all(p.bias is not None for p in projections):
            out_bias = torch.stack([p.bias.detach().float().cpu() for p in projections]).numpy()

    return Trace(
        tokens=display_tokens(tokenizer, ids),
        attentions=A,
        hidden_states=hidden,
        context=context,
        out_weight=out_weight,
        out_bias=out_bias,
        attended=attended,
        model=name,
        text=text,
        special=[bool(s) for s in special_mask],
        offsets=[(int(a), int(b)) for a, b in offsets] if offsets is not None else None,
    )


# ---------------------------------------------------------------------------------------------
# attnlab layers


def trace_layer(
    layer: Any,
    x: Any,
    tokens: Sequence[str] | None = None,
    *,
    residual: bool = True,
    name: str | None = None,
    **kwargs: Any,
) -> Trace:
    """Run one attnlab self-attention layer (``attnlab.nn.MultiHeadAttention``, ...) on ``x``.

    Args:
        layer: called as ``layer(x, return_weights=True, **kwargs)`` and must return
            ``(output (B, L, D), weights (B, H, L, L) or (B, L, L))``.
        x: ``(L, D)`` or ``(1, L, D)`` token vectors.
        tokens: ``L`` labels.
        residual: "after" is ``x + output`` (a transformer's residual stream) when True, else
            ``output`` (seed 001's bare self-attention, whose output replaces ``x``).
        name: for titles (default: the layer's class name).

    Returns:
        A one-layer :class:`Trace`; with an ``o_proj`` it also knows each head's write.
    """
    import torch

    x = torch.as_tensor(x)
    if x.dim() == 2:
        x = x.unsqueeze(0)  # (L, D) -> (B=1, L, D)
    if x.dim() != 3 or x.shape[0] != 1:
        raise ValueError(f"x must be (L, D) or (1, L, D); got {tuple(x.shape)}")
    captured: list[Any] = []
    proj = getattr(layer, "o_proj", None)
    hook = None
    if isinstance(proj, torch.nn.Linear):
        hook = proj.register_forward_pre_hook(
            lambda _m, args: captured.append(args[0].detach()[0].float().cpu())
        )
    try:
        with torch.no_grad():
            result = layer(x, return_weights=True, **kwargs)
    finally:
        if hook is not None:
            hook.remove()
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError("layer(x, return_weights=True) must return (output, weights)")
    out, weights = result
    W = weights.detach().float()[0]
    if W.dim() == 2:
        W = W.unsqueeze(0)  # (L, L) -> (H=1, L, L)
    x0 = x[0].float()
    out0 = out.detach()[0].float()
    if out0.shape != x0.shape:
        raise ValueError(
            f"the layer maps width {x0.shape[-1]} to {out0.shape[-1]}: before and after must "
            "share one space to be drawn together; use d_v == d_in"
        )
    after = x0 + out0 if residual else out0
    context = out_weight = out_bias = None
    if captured and residual:
        context = captured[0][None].numpy()
        out_weight = proj.weight.detach().float()[None].numpy()
        out_bias = proj.bias.detach().float()[None].numpy() if proj.bias is not None else None
    return Trace(
        tokens=check_tokens(tokens, x0.shape[0], "tokens"),
        attentions=W[None].numpy(),
        hidden_states=torch.stack([x0, after]).numpy(),
        context=context,
        out_weight=out_weight,
        out_bias=out_bias,
        model=name or type(layer).__name__,
        text=" ".join(tokens) if tokens is not None else "",
    )


# ---------------------------------------------------------------------------------------------
# attnlab translators


def trace_translation(result: Any, *, name: str = "translator") -> Trace:
    """The cross-attention of one translated sentence as a :class:`Trace` (``kind="cross"``).

    Args:
        result: one item of ``attnlab.translate.load_run(run_dir).translate(texts,
            return_attention=True)``, or any object or mapping with ``source_tokens`` (``S``),
            ``target_tokens`` (``T``), ``attention`` (``[T, S]`` for an RNN, ``[layers, H, T,
            S]`` for a Transformer) and optionally ``source`` (the text).
        name: the translator's name, for titles.

    Raises:
        ValueError: the result has no attention (an attention-free model, or
            ``return_attention=False``).
    """

    def get(key: str, default: Any = None) -> Any:
        if isinstance(result, dict):
            return result.get(key, default)
        return getattr(result, key, default)

    attention = get("attention")
    if attention is None:
        raise ValueError(
            f"{name} returned no attention: translate with return_attention=True, and use a "
            "model that has attention (not the attention-free RNN baseline)"
        )
    A = to_numpy(attention, "attention", np.float32)
    if A.ndim == 2:  # [T, S]: one attention of an RNN decoder
        A, names = A[None, None], ["attention"]
    elif A.ndim == 4:  # [layers, H, T, S]
        names = [f"decoder layer {i}" for i in range(A.shape[0])]
    else:
        raise ValueError(f"attention must be [T, S] or [layers, H, T, S]; got shape {A.shape}")

    def visible(tokens: Any) -> list[str]:  # character models: show spaces as "␣"
        return [t if t.strip() else "␣" for t in map(str, tokens)]

    return Trace(
        tokens=visible(get("target_tokens")),
        key_tokens=visible(get("source_tokens")),
        attentions=A,
        model=name,
        text=str(get("source", "") or ""),
        layer_names=names,
        kind="cross",
    )


# ---------------------------------------------------------------------------------------------
# comparisons and word-level weights


def cosine_distance(a: np.ndarray, b: np.ndarray) -> float:
    """``1 - cos(a, b)``: 0 for the same direction, 1 orthogonal, 2 opposite."""
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0 or nb == 0:
        return math.nan
    return float(1.0 - np.dot(a, b) / (na * nb))


def word_distances(traces: Sequence[Trace], word: str) -> np.ndarray:
    """How far ``word``'s contextual vectors in other sentences are from those in the first.

    Math:
        With :math:`v^{(k)}_l` the mean of the word's token vectors in sentence :math:`k` at
        ``hidden_states[l]``, the cosine distance is
        :math:`d_{k,l} = 1 - \\cos(v^{(0)}_l, v^{(k)}_l)`. Layer 0 is the embedding layer:
        the word's distance there comes only from position (and, for causal models, nothing
        else), so the growth over the layers is what context adds.

    Args:
        traces: two or more traces of the same model (the first is the reference).
        word: a word that occurs in every text (its first occurrence is used).

    Returns:
        ``[len(traces) - 1, layers + 1]`` cosine distances.
    """
    if len(traces) < 2:
        raise ValueError("word_distances needs at least two traces (two sentences)")
    states = [t._require_movement() for t in traces]
    n = {s.shape[0] for s in states}
    if len(n) != 1:
        raise ValueError("the traces come from models with different numbers of layers")
    ref = traces[0]
    out = np.zeros((len(traces) - 1, n.pop()))
    for k, other in enumerate(traces[1:]):
        ia, ib = ref.word_tokens(word), other.word_tokens(word)
        for layer in range(out.shape[1]):
            a = states[0][layer, ia].mean(axis=0)
            b = states[k + 1][layer, ib].mean(axis=0)
            out[k, layer] = cosine_distance(a.astype(np.float64), b.astype(np.float64))
    return out


def merge_subwords(
    weights: Any, query_groups: Sequence[Sequence[int]], key_groups: Sequence[Sequence[int]]
) -> np.ndarray:
    """Subword attention ``[L, S]`` to word attention ``[T, W]``.

    A word's weight as a key is the *sum* over its subwords (the attention it receives); as a
    query, the *mean* over its subwords (so rows still sum to 1).

    Args:
        weights: ``[L, S]`` subword attention.
        query_groups: for each query word, its subword positions.
        key_groups: for each key word, its subword positions.

    Example:
        >>> w = np.array([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]])
        >>> merge_subwords(w, [[0, 1]], [[0, 1], [2]])  # 2 subwords -> 1 word, each side
        array([[0.475, 0.525]])
    """
    W = attention_map(weights)
    out = np.zeros((len(query_groups), len(key_groups)))
    for t, rows in enumerate(query_groups):
        if not rows:
            raise ValueError(f"query word {t} has no subword positions")
        row = W[list(rows)].mean(axis=0)
        for s, cols in enumerate(key_groups):
            out[t, s] = row[list(cols)].sum()
    return out
