"""Word alignments: the reference format, the alignment error rate, and attention -> links.

A link ``(i, j)`` says that source word ``i`` and target word ``j`` translate each other. Indices
are 0-based positions in the lists returned by :func:`attnlab.data.words`. For the Bible corpus
the source is English and the target is Spanish.

Pharaoh text format, one sentence per line, links separated by spaces::

    0-0 1-0 3-2 5?4
    ^^^         ^^^
    sure link   possible (but not sure) link, written with "?" instead of "-"

Reference alignments have two kinds of links (Och & Ney 2003): *sure* links S, which a good
aligner must find, and *possible* links P (S is a subset of P), which it may predict without
penalty. ``Alignment.possible`` always includes the sure links.

Legend: ``T`` target words, ``S`` source words (in the attention matrix).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

Link = tuple[int, int]  # (source word index, target word index)


@dataclass(frozen=True, slots=True)
class Alignment:
    """Reference links of one sentence pair.

    Attributes:
        sure: links a good aligner must find.
        possible: links it may predict without penalty; a superset of ``sure``.
    """

    sure: frozenset[Link]
    possible: frozenset[Link]

    def __post_init__(self) -> None:
        if not self.sure <= self.possible:
            missing = sorted(self.sure - self.possible)[:5]
            raise ValueError(
                f"every sure link must also be possible; these are not: {missing}. "
                "Build the Alignment with possible = possible | sure."
            )

    def to_pharaoh(self) -> str:
        """Format as ``"i-j"`` (sure) and ``"i?j"`` (possible only), sorted."""
        return format_links(self.sure, self.possible)


def format_links(sure: Iterable[Link], possible: Iterable[Link] = ()) -> str:
    """Write links in Pharaoh format: ``i-j`` for sure links, ``i?j`` for possible-only ones.

    Example:
        >>> format_links({(0, 0), (2, 1)}, {(0, 0), (1, 1)})
        '0-0 1?1 2-1'
    """
    sure = set(sure)
    links = sure | set(possible)
    return " ".join(f"{i}{'-' if (i, j) in sure else '?'}{j}" for i, j in sorted(links))


def parse_links(text: str) -> Alignment:
    """Read a Pharaoh line (``"0-0 1?1 2-1"``) into an :class:`Alignment`.

    Raises:
        ValueError: a link is not ``<int>-<int>`` or ``<int>?<int>``.

    Example:
        >>> a = parse_links("0-0 1?1")
        >>> sorted(a.sure), sorted(a.possible)
        ([(0, 0)], [(0, 0), (1, 1)])
    """
    sure: set[Link] = set()
    possible: set[Link] = set()
    for item in text.split():
        sep = "-" if "-" in item else "?"
        left, _, right = item.partition(sep)
        if not (left.isdigit() and right.isdigit()):
            raise ValueError(
                f"bad alignment link {item!r} in {text!r}: expected 'i-j' (sure) or 'i?j' "
                "(possible) with 0-based word indices"
            )
        link = (int(left), int(right))
        possible.add(link)
        if sep == "-":
            sure.add(link)
    return Alignment(frozenset(sure), frozenset(possible))


def aer(predicted: Iterable[Link], sure: Iterable[Link], possible: Iterable[Link]) -> float:
    """Alignment error rate of predicted links against a sure/possible reference.

    Math:
        With A the predicted links, S the sure links and P the possible links (S ⊆ P; P is taken
        as P ∪ S here, so passing only the possible-but-not-sure links also works):

        .. math:: \\mathrm{AER}(A; S, P) = 1 - \\frac{|A \\cap S| + |A \\cap P|}{|A| + |S|}

        0 is perfect: every sure link found and nothing outside P predicted. Predicting a
        possible-but-not-sure link costs nothing; missing a sure link or predicting a link outside
        P costs. If A and S are both empty the AER is 0 (nothing to find, nothing wrong).

    Args:
        predicted: links ``(source index, target index)``.
        sure: the reference's sure links.
        possible: the reference's possible links.

    Returns:
        A float in [0, 1].

    References:
        F. J. Och and H. Ney, "A Systematic Comparison of Various Statistical Alignment Models",
        Computational Linguistics 29(1), 2003, section 5.

    Example:
        >>> aer({(0, 0), (1, 2)}, sure={(0, 0), (1, 1)}, possible={(1, 2)})
        0.25
    """
    counts = _aer_counts(set(predicted), set(sure), set(possible))
    return _aer_from_counts(*counts)


def corpus_aer(
    predicted: Mapping[str, Iterable[Link]], references: Mapping[str, Alignment]
) -> float:
    """AER over a corpus: the counts of :func:`aer` summed over sentences, then divided once.

    Every sentence in ``references`` counts; a sentence missing from ``predicted`` counts as
    predicting no link. Predictions for sentences without a reference are an error.

    Raises:
        KeyError: ``predicted`` has ids that ``references`` lacks.
    """
    extra = sorted(set(predicted) - set(references))
    if extra:
        raise KeyError(
            f"{len(extra)} predicted sentence(s) have no reference alignment, e.g. {extra[:3]}; "
            "score only the ids returned by load_alignments()"
        )
    totals = [0, 0, 0, 0]
    for key, ref in references.items():
        counts = _aer_counts(set(predicted.get(key, ())), set(ref.sure), set(ref.possible))
        totals = [t + c for t, c in zip(totals, counts, strict=True)]
    return _aer_from_counts(*totals)


def keep_referenced(predicted: Iterable[Link], reference: Alignment) -> set[Link]:
    """Drop predicted links whose target word has no link at all in the reference.

    Reference alignments derived from tags (the Bible's Strong's numbers) cover only the tagged
    words; an untagged target word (a Spanish article, say) has no reference link, so any
    prediction for it would count as an error. Score ``keep_referenced(pred, ref)`` instead of
    ``pred`` to evaluate only the words the reference speaks about.

    Example:
        >>> ref = Alignment(frozenset({(0, 0)}), frozenset({(0, 0), (1, 2)}))
        >>> sorted(keep_referenced({(0, 0), (3, 1), (1, 2)}, ref))  # target 1 has no reference
        [(0, 0), (1, 2)]
    """
    covered = {j for _, j in reference.possible}
    return {(i, j) for i, j in predicted if j in covered}


def _aer_counts(A: set[Link], S: set[Link], P: set[Link]) -> tuple[int, int, int, int]:
    P = P | S
    return len(A & S), len(A & P), len(A), len(S)


def _aer_from_counts(a_and_s: int, a_and_p: int, n_a: int, n_s: int) -> float:
    if n_a + n_s == 0:
        return 0.0
    return 1.0 - (a_and_s + a_and_p) / (n_a + n_s)


def attention_to_links(weights, *, threshold: float | None = None) -> set[Link]:
    """Turn a word-level attention matrix into alignment links.

    Args:
        weights: ``[T, S]`` array (NumPy array or CPU tensor; anything ``np.asarray`` takes):
            row ``t`` is how much target word ``t`` attends to each source word. Sum subword
            attention into words before calling this.
        threshold: ``None`` (default) links each target word to its highest-weight source word
            (ties: the lowest index). A float links every cell with weight ``>= threshold``
            instead, so a target word may get zero, one or several links.

    Returns:
        Links ``(source index, target index)``, the order :func:`aer` and the reference use.
        A row that is all zeros (a fully masked or padding word) gives no link.

    Raises:
        ValueError: ``weights`` is not 2-D or holds NaN.

    Example:
        >>> w = np.array([[0.9, 0.1, 0.0],
        ...               [0.2, 0.3, 0.5]])  # 2 target words, 3 source words
        >>> sorted(attention_to_links(w))
        [(0, 0), (2, 1)]
        >>> sorted(attention_to_links(w, threshold=0.3))
        [(0, 0), (1, 1), (2, 1)]
    """
    W = np.asarray(weights, dtype=np.float64)
    if W.ndim != 2:
        raise ValueError(
            f"expected a 2-D [target words, source words] matrix, got shape {W.shape}; "
            "select one batch element and one head (or average heads) first"
        )
    if np.isnan(W).any():
        raise ValueError("attention weights contain NaN; check masking of padded positions")
    live = W.max(axis=1, initial=0.0) > 0  # [T]: rows with some weight
    if threshold is None:
        best = W.argmax(axis=1) if W.shape[1] else np.zeros(W.shape[0], dtype=int)  # [T]
        return {(int(best[t]), t) for t in range(W.shape[0]) if live[t]}
    tgt, src = np.nonzero((W >= threshold) & live[:, None])
    return {(int(s), int(t)) for t, s in zip(tgt, src, strict=True)}
