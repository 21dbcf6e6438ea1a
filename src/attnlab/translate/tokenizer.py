"""Subword (BPE) and character tokenizers, trained on the training split and saved with a run.

One vocabulary is shared by the source and the target language (a *joint* vocabulary), so the
model can tie its source embedding, target embedding and output projection, and names that pass
through untranslated ("Abram", "1990") keep their ids.

* ``bpe``: byte-level BPE from Hugging Face ``tokenizers``. Byte-level means no character is
  ever unknown and decoding gives back the text exactly (spaces included), which sacrebleu needs:
  BLEU and chrF are computed on detokenized text.
* ``char``: one token per character, for the dates task (30-odd symbols, and attention maps that
  read letter by letter). Every whitespace character (a tab, a no-break space U+00A0, an
  ideographic space U+3000, a line break) is read as a plain space, in training and in encoding:
  words it separates stay separate when decoded, and its token keeps its span.

Both give the character span of every token (``offsets``), which maps subword attention back to
the words of :func:`attnlab.data.words` for the alignment error rate.

Special ids are fixed: ``PAD = 0``, ``BOS = 1``, ``EOS = 2``, ``UNK = 3``.
"""

from __future__ import annotations

import json
import os
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence

PAD, BOS, EOS, UNK = 0, 1, 2, 3
SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
KINDS = ("bpe", "char")

Span = tuple[int, int]


class Tokenizer:
    """Text <-> ids, with token spans. Build with :meth:`train`, restore with :meth:`load`."""

    def __init__(self, kind: str, *, hf=None, chars: Sequence[str] = ()):
        if kind not in KINDS:
            raise ValueError(f"tokenizer kind must be one of {KINDS}, got {kind!r}")
        self.kind = kind
        self._hf = hf  # tokenizers.Tokenizer for "bpe"
        if hf is not None:
            # "<s>", "</s>", "<pad>", "<unk>" written in a sentence are text (HTML's <s> is a
            # strikethrough), not the special ids: matched in the text, they put an EOS or a
            # PAD (which the loss skips) in the middle of a target
            hf.encode_special_tokens = True
        self._chars = list(chars)  # id - len(SPECIALS) -> character, for "char"
        self._char_ids = {c: i + len(SPECIALS) for i, c in enumerate(self._chars)}

    # ----------------------------------------------------------------------------- building
    @classmethod
    def train(cls, texts: Iterable[str], kind: str = "bpe", vocab_size: int = 8000) -> Tokenizer:
        """Learn a vocabulary from ``texts`` (source and target sentences of the training split).

        Args:
            texts: training sentences.
            kind: ``"bpe"`` or ``"char"``.
            vocab_size: BPE vocabulary size, specials included (ignored for ``"char"``).
        """
        texts = list(texts)
        if kind == "char":
            counts = Counter(ch for text in texts for ch in _normalize(text))
            return cls("char", chars=sorted(counts))
        if kind != "bpe":
            raise ValueError(f"tokenizer kind must be one of {KINDS}, got {kind!r}")
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

        hf = HFTokenizer(models.BPE(unk_token="<unk>"))
        hf.normalizer = normalizers.NFC()
        # GPT-2 style: split words from punctuation, map bytes to printable symbols, mark a
        # preceding space with "Ġ". trim_offsets keeps that space out of the token spans.
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        hf.decoder = decoders.ByteLevel()
        hf.post_processor = processors.ByteLevel(trim_offsets=True)
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(SPECIALS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf.train_from_iterator(texts, trainer)
        return cls("bpe", hf=hf)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Read a tokenizer written by :meth:`save`, checked first.

        Raises:
            attnlab.translate.checkpoint.RunFileError: (a ``ValueError``) the file is missing,
                empty, not UTF-8 JSON, or not a tokenizer of attnlab's two kinds with the
                special tokens at their fixed ids; the message names the file.
        """
        from attnlab.translate.checkpoint import RunFileError, read_bytes, read_json

        raw = read_bytes(path)
        data = read_json(path, raw)
        if not isinstance(data, dict):
            raise RunFileError(
                path,
                "not a tokenizer: expected a JSON object (attnlab's char tokenizer or a "
                f"Hugging Face tokenizers file), found a {type(data).__name__}",
            )
        if "attnlab_tokenizer" in data:
            chars = data.get("chars")
            if data["attnlab_tokenizer"] != "char" or not isinstance(chars, list):
                raise RunFileError(
                    path,
                    "not a char tokenizer: expected 'attnlab_tokenizer': 'char' and a list 'chars'",
                )
            if not all(isinstance(c, str) and len(c) == 1 for c in chars):
                raise RunFileError(path, "'chars' must be single characters")
            if len(set(chars)) != len(chars):
                raise RunFileError(path, "'chars' lists a character twice")
            return cls("char", chars=chars)
        if not isinstance(data.get("model"), dict) or "vocab" not in data["model"]:
            raise RunFileError(
                path,
                "not a tokenizer: neither attnlab's char tokenizer nor a Hugging Face "
                "tokenizers file (no 'attnlab_tokenizer', no 'model' with a 'vocab')",
            )
        from tokenizers import Tokenizer as HFTokenizer

        try:
            hf = HFTokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception type
            raise RunFileError(
                path, f"not a usable Hugging Face tokenizer ({' '.join(str(e).split())[:160]})"
            ) from None
        for i, special in enumerate(SPECIALS):
            if hf.token_to_id(special) != i:
                raise RunFileError(
                    path,
                    f"special token {special!r} must have id {i}, has "
                    f"{hf.token_to_id(special)}: not a tokenizer written by attnlab",
                )
        return cls("bpe", hf=hf)

    def to_json(self) -> str:
        if self.kind == "char":
            return json.dumps(
                {"attnlab_tokenizer": "char", "chars": self._chars}, ensure_ascii=False
            )
        return self._hf.to_str()

    def save(self, path: str | os.PathLike[str]) -> None:
        from attnlab.translate.checkpoint import atomic_write_text

        atomic_write_text(path, self.to_json())

    # ----------------------------------------------------------------------------- using
    @property
    def vocab_size(self) -> int:
        if self.kind == "char":
            return len(SPECIALS) + len(self._chars)
        return self._hf.get_vocab_size()

    def encode(self, text: str) -> tuple[list[int], list[Span]]:
        """Token ids of ``text`` (no BOS/EOS) and the character span of each token in ``text``."""
        if self.kind == "char":
            ids, spans = [], []
            # NFC may merge a letter and a combining accent; spans are kept in NFC positions,
            # which equal the original ones for text that is already NFC (nearly all text).
            for i, ch in enumerate(_normalize(text)):
                ids.append(self._char_ids.get(ch, UNK))
                spans.append((i, i + 1))
            return ids, spans
        enc = self._hf.encode(text, add_special_tokens=False)
        return list(enc.ids), [tuple(o) for o in enc.offsets]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self.kind == "char":
            return [self.encode(t)[0] for t in texts]
        return [list(e.ids) for e in self._hf.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens are dropped, the text is stripped."""
        ids = [int(i) for i in ids if int(i) >= len(SPECIALS)]
        if self.kind == "char":
            return "".join(self._chars[i - len(SPECIALS)] for i in ids).strip()
        return self._hf.decode(ids).strip()

    def token_strings(self, ids: Iterable[int]) -> list[str]:
        """One readable string per id (for plots): a subword as text, specials by name."""
        out = []
        for i in ids:
            i = int(i)
            if i < len(SPECIALS):
                out.append(SPECIALS[i])
            elif self.kind == "char":
                out.append(self._chars[i - len(SPECIALS)])
            else:
                out.append(self._hf.decode([i]))
        return out


def _normalize(text: str) -> str:
    """NFC, and every whitespace character a plain space (one for one: spans keep their places).

    A tab or a no-break space between two words was dropped, and the words came back glued
    together ("10\u00a0mai" decoded as "10mai"); a space keeps them apart.
    """
    return "".join(" " if ch.isspace() else ch for ch in unicodedata.normalize("NFC", text))
