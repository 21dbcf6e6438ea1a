"""Use a trained run directory: :func:`load_run` -> :class:`Translator`.

Example:
    >>> tr = load_run("runs/dates-rnn-bahdanau")                      # doctest: +SKIP
    >>> out = tr.translate(["mardi 1 février 2005"], beam_size=4)     # doctest: +SKIP
    >>> out[0].text, out[0].attention.shape                          # doctest: +SKIP
    ('2005-02-01', (11, 21))
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from attnlab.translate import checkpoint as ckpt
from attnlab.translate.batching import length_sorted_chunks, source_tensor
from attnlab.translate.decoding import decode, length_limits
from attnlab.translate.models import build_model, count_parameters
from attnlab.translate.tokenizer import SPECIALS, Tokenizer


@dataclass
class Translation:
    """One translated sentence.

    Attributes:
        source: the input text.
        source_tokens: the source subwords as text, then ``"</s>"`` (the attention's columns).
        target_tokens: the generated subwords, then ``"</s>"`` if the model ended the sentence
            (the attention's rows).
        text: the translation, detokenized.
        attention: cross-attention, ``(T, S)`` for an RNN, ``(layers, heads, T, S)`` for a
            Transformer, ``T = len(target_tokens)``, ``S = len(source_tokens)``; None when not
            requested, or for the attention-free RNN.
        score: the decoder's score (log-probability, length-normalised for beam search).
    """

    source: str
    source_tokens: list[str]
    target_tokens: list[str]
    text: str
    attention: np.ndarray | None
    score: float


class UsageError(ValueError):
    """A run directory that cannot be used, with the fix in the message."""


def check_run_dir(run_dir: str | os.PathLike[str]) -> Path:
    path = Path(run_dir)
    if not path.exists():
        raise UsageError(
            f"run directory {str(path)!r} does not exist; train one with: "
            f"attnlab train --out {path}"
        )
    if not path.is_dir() or not (path / ckpt.CONFIG).is_file():
        raise UsageError(
            f"{str(path)!r} is not a run directory (no {ckpt.CONFIG}); pass the folder that "
            "`attnlab train` wrote (it prints it at the end)"
        )
    return path


def read_config(run_dir: str | os.PathLike[str]) -> dict:
    path = check_run_dir(run_dir)
    return json.loads((path / ckpt.CONFIG).read_text(encoding="utf-8"))


class Translator:
    """A trained model with its tokenizer, ready to translate.

    Args:
        run_dir: a folder written by ``attnlab train``.
        device: ``"cpu"`` or ``"cuda"``.
    """

    def __init__(self, run_dir: str | os.PathLike[str], device: str = "cpu"):
        self.run_dir = check_run_dir(run_dir)
        self.config = read_config(self.run_dir)
        if not (self.run_dir / ckpt.TOKENIZER).is_file():
            raise UsageError(
                f"{self.run_dir} has no {ckpt.TOKENIZER}: training stopped before it was written; "
                f"train again with: attnlab train --out {self.run_dir} --resume"
            )
        self.tokenizer = Tokenizer.load(self.run_dir / ckpt.TOKENIZER)
        self.device = torch.device(device)
        self.model = build_model(self.config["model"], self.tokenizer.vocab_size)
        weights = self.run_dir / ckpt.WEIGHTS
        if not weights.is_file():
            latest = ckpt.latest_checkpoint(self.run_dir)
            if latest is None:
                raise UsageError(
                    f"{self.run_dir} has no trained weights yet; finish training with: "
                    f"attnlab train --out {self.run_dir} --resume"
                )
            weights = latest / ckpt.WEIGHTS  # an interrupted run: use its last checkpoint
        ckpt.load_model_state(self.model, ckpt.load_tensors(weights))
        self.model.to(self.device).eval()
        self.decode_options = dict(self.config.get("decode", {}))

    @property
    def num_parameters(self) -> int:
        return count_parameters(self.model)

    def _src_tensors(self, id_lists):
        src, lengths = source_tensor(id_lists)
        return src.to(self.device), lengths.to(self.device)

    @torch.no_grad()
    def translate(
        self,
        texts: list[str] | str,
        *,
        beam_size: int | None = None,
        return_attention: bool = True,
        batch_size: int = 32,
        progress: bool = False,
    ) -> list[Translation]:
        """Translate sentences.

        Args:
            texts: sentences (or one string).
            beam_size: 1 = greedy; default from the run's config (4).
            return_attention: also return the cross-attention maps (slower: the attention
                kernels must then materialise their weights).
            batch_size: sentences decoded together (sorted by length first).
            progress: show a progress bar.
        """
        if isinstance(texts, str):
            texts = [texts]
        beam = beam_size or self.decode_options.get("beam_size", 4)
        lp = self.decode_options.get("length_penalty", 0.6)
        encoded = [self.tokenizer.encode(t) for t in texts]
        results: list[Translation | None] = [None] * len(texts)
        chunks = length_sorted_chunks([len(ids) for ids, _ in encoded], batch_size)
        if progress:
            from tqdm.auto import tqdm

            chunks = tqdm(chunks, desc="translating", unit="batch", leave=False)
        for chunk in chunks:
            src, lengths = self._src_tensors([encoded[i][0] for i in chunk])
            hyps = decode(
                self.model,
                src,
                lengths,
                beam_size=beam,
                limits=length_limits(lengths),
                return_attention=return_attention,
                length_penalty=lp,
            )
            for i, hyp in zip(chunk, hyps, strict=True):
                ids, spans = encoded[i]
                source_tokens = [texts[i][a:b] for a, b in spans] + [SPECIALS[2]]
                target_tokens = self.tokenizer.token_strings(hyp.tokens) + (
                    [SPECIALS[2]] if hyp.eos else []
                )
                attention = None
                if hyp.attention is not None:
                    attention = hyp.attention.float().numpy()[..., : len(source_tokens)]
                results[i] = Translation(
                    texts[i],
                    source_tokens,
                    target_tokens,
                    self.tokenizer.decode(hyp.tokens),
                    attention,
                    hyp.score,
                )
        return results  # type: ignore[return-value]

    @torch.no_grad()
    def forced_attention(self, pairs, *, batch_size: int = 32, progress: bool = False):
        """Cross-attention while reading the *reference* translation (teacher forcing).

        Yields, per pair in order: ``(source spans, target spans, attention)`` with attention
        ``(T, S)`` (RNN) or ``(layers, heads, T, S)`` (Transformer), ``T`` = target tokens + EOS,
        ``S`` = source tokens + EOS; None for the attention-free RNN.
        """
        from attnlab.translate.batching import pad
        from attnlab.translate.tokenizer import BOS

        src_enc = [self.tokenizer.encode(p.source) for p in pairs]
        tgt_enc = [self.tokenizer.encode(p.target) for p in pairs]
        chunks = length_sorted_chunks([len(s[0]) for s in src_enc], batch_size)
        out = [None] * len(pairs)
        if progress:
            from tqdm.auto import tqdm

            chunks = tqdm(chunks, desc="attention", unit="batch", leave=False)
        for chunk in chunks:
            src, lengths = self._src_tensors([src_enc[i][0] for i in chunk])
            tgt_in = pad([[BOS] + tgt_enc[i][0] for i in chunk]).to(self.device)
            _, attn = self.model(src, lengths, tgt_in, return_attention=True)
            for row, i in enumerate(chunk):
                S, T = len(src_enc[i][0]) + 1, len(tgt_enc[i][0]) + 1
                a = None if attn is None else attn[row][..., :T, :S].float().cpu().numpy()
                out[i] = (src_enc[i][1], tgt_enc[i][1], a)
        return out


def load_run(run_dir: str | os.PathLike[str], device: str = "cpu") -> Translator:
    """Load a run directory written by ``attnlab train`` (see :class:`Translator`)."""
    return Translator(run_dir, device=device)
