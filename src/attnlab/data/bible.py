"""English -> Spanish Bible verses (KJV 1769 -> Reina-Valera 1909) with reference alignments.

The corpus ships inside the package (public domain, 2.6 MB gzipped); nothing is downloaded.
It is built from the Debian SWORD modules by ``scripts/build_bible_corpus.py``, whose docstring
lists every cleaning step; ``bible_data/README.md`` describes the files.

Splits, fixed forever (they depend only on the verse ids):

=========== ====== ===================================================================
split       verses chosen as
=========== ====== ===================================================================
test         1,000 the verse ids with the 1,000 smallest SHA-256 hashes of the id
validation   1,000 the next 1,000 ids in that order
train       28,890 the rest
=========== ====== ===================================================================

The splits are by verse, not by text, and the Bible repeats itself ("And the LORD spake unto
Moses, saying," 69 times in train; parallel passages such as 2 Kings 19 and Isaiah 37, Exodus
20 and Deuteronomy 5; the lists of Numbers 7 and 1 Chronicles 1). Measured on the test split
(validation in brackets):

* exact duplicates: 13 (14) verses have an English text that also stands in train, 8 (15) a
  Spanish text, 5 (13) both, as one train verse;
* near duplicates (the word-normalised texts' ``difflib`` similarity to the closest train
  verse >= 0.9, on the English or the Spanish side): 53 (53) verses, 5.3%; at >= 0.8, 89 (91),
  8.9%. 47 test verses have such an English near duplicate, and copying the Spanish of that
  train verse, with no model at all, scores BLEU 58.3 on those 47.

So the test BLEU partly rewards memorising training verses: about one test verse in twenty
can be nearly copied from train, and copying scores far above the whole test split's
recorded BLEU (22.98 for the default 15-minute run, 35.80 for ``--preset bible-long``).
Models trained on these splits compare fairly (all meet the same overlap); the absolute
figure overstates BLEU on text unlike the training verses. The splits
are kept as they are (every recorded figure depends on them), as any verse-level split would
keep these verses.

Reference word alignments exist for test and validation. They come from the Strong's numbers
both translations tag their words with: a link ``(i, j)`` joins English word ``i`` and Spanish
word ``j`` (indices into :func:`attnlab.data.words` of ``Pair.source`` / ``Pair.target``).
Sure links: the number tags one word on each side, or exactly one non-function word on each
side. Possible links: any English-Spanish pair sharing a number. Only about 45% of English words
and 96% of Spanish words carry a number, so score predictions only for target words that have
a reference link (see :func:`attnlab.data.alignment.keep_referenced`).

Example:
    >>> pairs = load_bible("test")
    >>> len(pairs), pairs[0].id
    (1000, 'Gen.3.19')
    >>> links = load_alignments("test")[pairs[0].id]
"""

from __future__ import annotations

import functools
import gzip
from importlib import resources

from .alignment import Alignment, parse_links
from .pair import Pair

SPLITS = ("train", "validation", "test")
ALIGNED_SPLITS = ("validation", "test")
_FILES = "bible_data"


def load_bible(split: str = "train") -> list[Pair]:
    """Verse pairs of one split, in canonical book/chapter/verse order.

    Args:
        split: ``"train"``, ``"validation"`` or ``"test"``.

    Returns:
        ``Pair(source=English, target=Spanish, id="Gen.1.1")`` for each verse of the split.

    Raises:
        ValueError: unknown split.
    """
    _check_split(split, SPLITS)
    return [pair for pair, pair_split in _corpus() if pair_split == split]


def load_alignments(split: str = "test") -> dict[str, Alignment]:
    """Reference alignments of the test or validation split, keyed by verse id.

    Every verse of the split has an entry (possibly with no links).

    Raises:
        ValueError: the split has no reference alignments (train) or is unknown.
    """
    _check_split(split, ALIGNED_SPLITS)
    ids = {pair.id for pair in load_bible(split)}
    return {vid: alignment for vid, alignment in _alignments().items() if vid in ids}


def _check_split(split: str, allowed: tuple[str, ...]) -> None:
    if split not in allowed:
        raise ValueError(f"unknown split {split!r} here; expected one of {list(allowed)}")


def _read_lines(name: str) -> list[str]:
    path = resources.files(__package__).joinpath(_FILES, name)
    with path.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8", newline="\n") as f:
        return f.read().split("\n")[:-1]  # every line ends in "\n"


@functools.cache
def _corpus() -> tuple[tuple[Pair, str], ...]:
    ids, english, spanish = (_read_lines(n) for n in ("ids.tsv.gz", "en.txt.gz", "es.txt.gz"))
    if ids[0] != "id\tsplit" or not len(ids) - 1 == len(english) == len(spanish):
        raise RuntimeError(
            f"attnlab's Bible data is damaged ({len(ids) - 1} ids, {len(english)} English, "
            f"{len(spanish)} Spanish lines); reinstall attnlab or rerun "
            "scripts/build_bible_corpus.py"
        )
    rows = (line.split("\t") for line in ids[1:])
    return tuple(
        (Pair(source=en, target=es, id=vid), split)
        for (vid, split), en, es in zip(rows, english, spanish, strict=True)
    )


@functools.cache
def _alignments() -> dict[str, Alignment]:
    lines = _read_lines("alignments.tsv.gz")
    return {vid: parse_links(links) for vid, links in (line.split("\t") for line in lines[1:])}
