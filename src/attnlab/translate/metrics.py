"""Scores: BLEU and chrF (sacrebleu, on detokenized text), exact match, and attention as word
alignment (alignment error rate).

**Subword attention -> word alignment.** The reference links join *words* of
:func:`attnlab.data.words`; the model attends over *subword tokens*. A token belongs to the word
whose character span it overlaps (token spans come from the tokenizer). Then, following the
usual convention (e.g. Zenkel et al. 2019, Garg et al. 2019):

* source side: the attention a target token gives a source word is the **sum** over the word's
  subwords (attention is a distribution over source tokens; summing keeps it one over words);
* target side: a target word's attention is the **average** of its subwords' rows;
* each target word is linked to its highest-attention source word (argmax).

The attention row used for target token ``t`` is the one computed while *predicting* ``t``
(teacher forcing on the reference translation), as in Bahdanau et al. (2015) and Luong et al.
(2015). AER is reported twice: ``referenced`` (the headline figure) drops links of target
words the reference says nothing about (:func:`attnlab.data.keep_referenced`); ``aer`` scores
every predicted link, over all target words. In the Bible corpus untagged words have no
reference link at all, so they can only add errors: a perfect aligner's ``aer`` is ~24% on the
test split (~11% on dates), its ``referenced`` AER ~0.
"""

from __future__ import annotations

import numpy as np

from attnlab.data import Alignment, attention_to_links, corpus_aer, keep_referenced
from attnlab.data.text import word_spans

# scripts written without spaces between words: (first, last) code points
_HAN = ((0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0x20000, 0x2FA1F))
_KANA = ((0x3040, 0x30FF), (0x31F0, 0x31FF), (0xFF66, 0xFF9F))
_OTHER_UNSPACED = (
    (0x0E00, 0x0EFF),
    (0x1000, 0x109F),
    (0x1780, 0x17FF),
)  # Thai, Lao, Myanmar, Khmer


def _share(letters: list[str], ranges) -> float:
    return sum(any(a <= ord(ch) <= b for a, b in ranges) for ch in letters) / len(letters)


def bleu_tokenizer(references: list[str]) -> str:
    """The sacrebleu tokenizer BLEU needs for these references, as sacrebleu's command line
    picks one by the target language (attnlab reads the script instead: a ``--data`` file
    names no language).

    ``13a`` (sacrebleu's default, WMT's) splits at spaces and punctuation: a language written
    without spaces would be one token per sentence, and BLEU ~0 for near-perfect translations.
    Where most letters are Chinese characters: ``zh`` (each character a token, as WMT scores
    Chinese); where Japanese kana or Thai, Lao, Khmer or Myanmar letters are common: ``char``
    (every character; ``ja-mecab`` would need MeCab). chrF counts characters whatever the
    script.
    """
    letters = [ch for r in references for ch in r if ch.isalpha()]
    if not letters:
        return "13a"
    han, kana = _share(letters, _HAN), _share(letters, _KANA)
    other = _share(letters, _OTHER_UNSPACED)
    if han + kana + other < 0.5:
        return "13a"
    return "zh" if kana < 0.1 and han >= other else "char"


def bleu_chrf(hypotheses: list[str], references: list[str]) -> dict:
    """Corpus BLEU and chrF (sacrebleu: BLEU tokenized by :func:`bleu_tokenizer`, ``13a``
    for spaced scripts; chrF with n=6, beta=2); the signatures say which."""
    import sacrebleu

    bleu = sacrebleu.BLEU(tokenize=bleu_tokenizer(references))
    chrf = sacrebleu.CHRF()
    b = bleu.corpus_score(hypotheses, [references])
    c = chrf.corpus_score(hypotheses, [references])
    return {
        "bleu": round(b.score, 2),
        "chrf": round(c.score, 2),
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
    }


def exact_match(hypotheses: list[str], references: list[str]) -> float:
    """Percentage of hypotheses equal to their reference (after stripping spaces)."""
    if not references:
        return float("nan")
    hits = sum(h.strip() == r.strip() for h, r in zip(hypotheses, references, strict=True))
    return round(100.0 * hits / len(references), 2)


def token_to_word(token_spans: list[tuple[int, int]], text: str) -> np.ndarray:
    """For each token span, the index of the :func:`words` token it overlaps most; -1 if none.

    A token with an empty span (a bare space piece of byte-level BPE) goes to the next word.
    """
    spans = word_spans(text)
    out = np.full(len(token_spans), -1, dtype=np.int64)
    j = 0
    for t, (start, end) in enumerate(token_spans):
        while j < len(spans) and spans[j][1] <= start:
            j += 1
        best, best_overlap = -1, 0
        k = j
        while k < len(spans) and spans[k][0] < max(end, start + 1):
            overlap = min(end, spans[k][1]) - max(start, spans[k][0])
            if overlap > best_overlap:
                best, best_overlap = k, overlap
            k += 1
        if best < 0 and end <= start and j < len(spans):
            best = j  # an empty span (a lone space token): it belongs to the next word
        out[t] = best
    return out


def word_attention(
    attn: np.ndarray, src_map: np.ndarray, tgt_map: np.ndarray, n_src: int, n_tgt: int
) -> np.ndarray:
    """Token attention (..., T_tok, S_tok) -> word attention (..., n_tgt, n_src).

    ``src_map`` / ``tgt_map``: word index of each source / target token (-1: no word, e.g. EOS);
    they may be shorter than the attention's axes (extra positions are ignored).
    """
    S_tok, T_tok = attn.shape[-1], attn.shape[-2]
    src_onehot = np.zeros((S_tok, n_src))  # sum over a source word's subwords
    for s, w in enumerate(src_map[:S_tok]):
        if w >= 0:
            src_onehot[s, w] = 1.0
    tgt_avg = np.zeros((n_tgt, T_tok))  # average over a target word's subwords
    for t, w in enumerate(tgt_map[:T_tok]):
        if w >= 0:
            tgt_avg[w, t] = 1.0
    counts = tgt_avg.sum(axis=1, keepdims=True)
    tgt_avg = np.divide(tgt_avg, counts, out=np.zeros_like(tgt_avg), where=counts > 0)
    return tgt_avg @ attn @ src_onehot


def alignment_scores(predicted: dict[str, set], references: dict[str, Alignment]) -> dict:
    """Raw and referenced corpus AER (percent) of predicted links, keyed by sentence id."""
    refs = {k: references[k] for k in predicted}
    raw = corpus_aer(predicted, refs)
    kept = {k: keep_referenced(v, refs[k]) for k, v in predicted.items()}
    return {"aer": round(100 * raw, 2), "aer_referenced": round(100 * corpus_aer(kept, refs), 2)}


def links_from_attention(word_attn: np.ndarray) -> set:
    return attention_to_links(word_attn)
