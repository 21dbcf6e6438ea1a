"""Evaluate a trained translator on a task's split: BLEU, chrF, exact match, alignment error rate.

For a Transformer the alignment is scored for every cross-attention head (``layer.head``), for
each layer's head average, and for the average of all heads of all layers.
"""

from __future__ import annotations

import time

import numpy as np

from attnlab.data import words
from attnlab.translate.batching import fixed_sample
from attnlab.translate.metrics import (
    alignment_scores,
    bleu_chrf,
    exact_match,
    links_from_attention,
    token_to_word,
    word_attention,
)


def translate_split(translator, pairs, *, beam_size=None, progress=True):
    """Translations of ``pairs``' sources (:class:`~attnlab.translate.run.Translation`), and
    the seconds it took."""
    start = time.perf_counter()
    out = translator.translate(
        [p.source for p in pairs], beam_size=beam_size, return_attention=False, progress=progress
    )
    return out, time.perf_counter() - start


HEAD_SELECTION_PAIRS = 200  # validation pairs (a fixed random sample) the best head is chosen on


def alignment_error(
    translator,
    pairs,
    references,
    *,
    target_units: str = "words",
    progress=True,
    choose_on: tuple[str, list, dict] | None = None,
) -> dict | None:
    """AER of the model's cross-attention against reference links (see metrics module).

    ``target_units``: ``"words"`` (reference target indices count :func:`words`) or
    ``"chars"`` (they count characters: the dates task; then every target character is its own
    unit, and the source side is still summed into words).

    Returns None for a model without attention. For an RNN: ``{"aer", "aer_referenced"}``.
    For a Transformer additionally ``"heads"``: ``{"0.1": {...}, ...}`` (layer.head),
    ``"layers"``: per-layer head averages, and the top-level scores are the all-head average;
    ``"best_head"``: the head with the lowest referenced AER on ``choose_on`` = ``(name, pairs,
    references)`` of another split (validation), and its scores here -- chosen on the pairs it
    is scored on, the figure would be a best-of-N on the test set. Without ``choose_on``, on
    these pairs, and ``"chosen_on"`` says so.
    """
    pairs = [p for p in pairs if p.id in references]
    if not pairs:
        return None
    forced = translator.forced_attention(pairs, progress=progress)
    if forced[0][2] is None:
        return None
    first = forced[0][2]
    multi = first.ndim == 4  # (layers, heads, T, S)
    n_layers, n_heads = (first.shape[0], first.shape[1]) if multi else (1, 1)
    keys = ["avg"]
    if multi:
        keys += [f"layer{i}" for i in range(n_layers)]
        keys += [f"{i}.{h}" for i in range(n_layers) for h in range(n_heads)]
    links: dict[str, dict[str, set]] = {k: {} for k in keys}
    for pair, (src_spans, tgt_spans, attn) in zip(pairs, forced, strict=True):
        src_map = token_to_word(src_spans, pair.source)
        n_src = len(words(pair.source))
        if target_units == "chars":  # (start, end) spans of single characters: unit = start
            tgt_map = np.array([a if b > a else -1 for a, b in tgt_spans], dtype=np.int64)
            n_tgt = len(pair.target)
        else:
            tgt_map = token_to_word(tgt_spans, pair.target)
            n_tgt = len(words(pair.target))
        W = word_attention(attn, src_map, tgt_map, n_src, n_tgt)  # (..., n_tgt, n_src)
        if not multi:
            links["avg"][pair.id] = links_from_attention(W)
            continue
        links["avg"][pair.id] = links_from_attention(W.mean(axis=(0, 1)))
        for i in range(n_layers):
            links[f"layer{i}"][pair.id] = links_from_attention(W[i].mean(axis=0))
            for h in range(n_heads):
                links[f"{i}.{h}"][pair.id] = links_from_attention(W[i, h])
    result = alignment_scores(links["avg"], references)
    if multi:
        result["layers"] = {
            k: alignment_scores(links[k], references) for k in keys if k.startswith("layer")
        }
        result["heads"] = {k: alignment_scores(links[k], references) for k in keys[1 + n_layers :]}
        heads, chosen_on = result["heads"], "these pairs"
        if choose_on is not None:
            name, other_pairs, other_refs = choose_on
            other = alignment_error(
                translator, other_pairs, other_refs, target_units=target_units, progress=progress
            )
            if other is not None and "heads" in other:
                heads, chosen_on = other["heads"], f"{name} ({len(other_pairs):,} pairs)"
        best = min(heads, key=lambda k: heads[k]["aer_referenced"])
        result["best_head"] = {"head": best, "chosen_on": chosen_on, **result["heads"][best]}
    return result


def evaluate(
    translator,
    task,
    split: str = "test",
    *,
    beam_size=None,
    aer=True,
    progress=True,
    limit: int | None = None,
) -> dict:
    """All scores of ``translator`` on ``task``'s ``split`` (a dict, JSON-able); ``limit``:
    its first that many pairs only (``"of"`` then says how many the split holds).
    ``"finished"`` is False and ``"checkpoint_step"`` a step when the weights scored are a
    checkpoint of a run whose training has not finished (see :class:`Translator`)."""
    whole = task.split(split)
    pairs = whole[:limit]
    translations, seconds = translate_split(
        translator, pairs, beam_size=beam_size, progress=progress
    )
    hyps, refs = [t.text for t in translations], [p.target for p in pairs]
    result = {
        "split": split,
        "sentences": len(pairs),
        "of": len(whole),
        "cut_at_length_limit": sum(not t.complete for t in translations),
        "decode_seconds": round(seconds, 1),
        "beam_size": beam_size or translator.decode_options.get("beam_size", 4),
        # None: the run's final weights; else the step of the checkpoint of an unfinished run
        "checkpoint_step": getattr(translator, "checkpoint_step", None),
        "finished": getattr(translator, "finished", True),
    }
    result.update(bleu_chrf(hyps, refs))
    if task.exact_match:
        result["exact_match"] = exact_match(hyps, refs)
    if aer and split in task.alignments:
        choose_on = None  # the best head is chosen on validation pairs, not on those scored
        if split != "validation" and "validation" in task.alignments:
            validation = task.split("validation")
            chosen = [validation[i] for i in fixed_sample(len(validation), HEAD_SELECTION_PAIRS)]
            choose_on = ("validation", chosen, task.alignments["validation"])
        scores = alignment_error(
            translator,
            pairs,
            task.alignments[split],
            target_units=getattr(task, "target_units", "words"),
            progress=progress,
            choose_on=choose_on,
        )
        if scores is not None:
            result["alignment"] = scores
    result["samples"] = [
        {"source": p.source, "reference": p.target, "translation": h}
        for p, h in list(zip(pairs, hyps, strict=True))[:5]
    ]
    return result


def format_scores(res: dict, split: str, *, alignment_heading: str) -> list[str]:
    """Readable lines for an :func:`evaluate` result: BLEU, chrF, exact match, alignment."""
    timing = f", {res['decode_seconds']:.0f} s" if "decode_seconds" in res else ""
    n = res["sentences"]
    counted = f"first {n:,} of {res['of']:,}" if res.get("of", n) > n else f"{n:,}"
    cut = res.get("cut_at_length_limit", 0)
    cut_text = (
        f" ({cut:,} translation{'s' if cut != 1 else ''} cut at the length limit)" if cut else ""
    )
    lines = [
        f"{split} split ({counted} pairs, beam {res['beam_size']}{timing}){cut_text}: "
        f"BLEU {res['bleu']:.2f}  chrF {res['chrf']:.2f}"
        + (f"  exact match {res['exact_match']:.2f}%" if "exact_match" in res else ""),
        f"  sacrebleu {res['bleu_signature']}",
        f"  sacrebleu {res['chrf_signature']}",
    ]
    if "alignment" in res:
        lines.append(alignment_heading)
        lines += ["  " + line for line in format_alignment(res["alignment"])]
    return lines


ALL_WORDS = "over all target words, including words with no reference link"


def format_alignment(al: dict) -> list[str]:
    """Readable lines for an alignment result. The AER over target words with a reference link
    comes first: the one over all target words counts the words no reference links against any
    aligner (a perfect one scores ~24% on the Bible test split, ~11% on dates)."""
    lines = [f"AER {al['aer_referenced']:.1f}%  ({ALL_WORDS}: {al['aer']:.1f}%)"]
    if "heads" in al:
        lines[0] = "head average: " + lines[0]
        for k, v in al["layers"].items():
            lines.append(
                f"  {k} head average: AER {v['aer_referenced']:.1f}% / over all target words "
                f"{v['aer']:.1f}%"
            )
        row = "  per head (layer.head: AER): " + ", ".join(
            f"{k}: {v['aer_referenced']:.1f}" for k, v in al["heads"].items()
        )
        lines.append(row)
        b = al["best_head"]
        lines.append(
            f"  best head {b['head']} (chosen on {b.get('chosen_on', 'these pairs')}): AER "
            f"{b['aer_referenced']:.1f}% / over all target words {b['aer']:.1f}%"
        )
    return lines
