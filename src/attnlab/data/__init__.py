"""Data for attnlab's translation examples. Nothing here imports torch.

* :func:`load_bible` / :func:`load_alignments`: English -> Spanish Bible verses (KJV 1769 ->
  Reina-Valera 1909, public domain, shipped in the package) with fixed splits and reference
  word alignments for the test and validation splits.
* :func:`load_dates`: human-readable dates in 5 locales -> ISO dates (needs Babel).
* :func:`load_pairs`: your own ``source<TAB>target`` file, with bad lines reported.
* :func:`words`: the word tokenisation every alignment index refers to.
* :func:`aer`, :func:`corpus_aer`, :func:`attention_to_links`: score attention as alignment.
"""

from .alignment import (
    Alignment,
    aer,
    attention_to_links,
    corpus_aer,
    format_links,
    keep_referenced,
    parse_links,
)
from .bible import load_alignments, load_bible
from .dates import load_dates
from .pair import Pair
from .text import words
from .tsv import Problem, load_pairs

__all__ = [
    "Alignment",
    "Pair",
    "Problem",
    "aer",
    "attention_to_links",
    "corpus_aer",
    "format_links",
    "keep_referenced",
    "load_alignments",
    "load_bible",
    "load_dates",
    "load_pairs",
    "parse_links",
    "words",
]
