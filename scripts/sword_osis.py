"""Read SWORD zText Bible modules and their OSIS markup without libsword.

Used by ``build_bible_corpus.py``. A zText module is three files per testament (``ot``/``nt``)::

    <testament>.bzs  one 12-byte record per compressed block:
                     offset in .bzz, compressed size, uncompressed size   (3 x uint32 LE)
    <testament>.bzz  the zlib-compressed blocks, back to back
    <testament>.bzv  one 10-byte record per index entry:
                     block number, offset in the uncompressed block (uint32 LE), size (uint16 LE);
                     size 0 = empty entry

Each entry is a fragment of OSIS XML (not always well formed, so it is scanned with regular
expressions, not parsed).
"""

from __future__ import annotations

import functools
import html
import re
import struct
import zlib
from collections import Counter
from pathlib import Path

from attnlab.data.text import is_word, word_spans

# The 66 books of the KJV versification (OSIS ids) and their chapter counts. The verse counts
# are read from the modules and checked against the totals below.
BOOKS = {
    "Gen": 50, "Exod": 40, "Lev": 27, "Num": 36, "Deut": 34, "Josh": 24, "Judg": 21, "Ruth": 4,
    "1Sam": 31, "2Sam": 24, "1Kgs": 22, "2Kgs": 25, "1Chr": 29, "2Chr": 36, "Ezra": 10,
    "Neh": 13, "Esth": 10, "Job": 42, "Ps": 150, "Prov": 31, "Eccl": 12, "Song": 8, "Isa": 66,
    "Jer": 52, "Lam": 5, "Ezek": 48, "Dan": 12, "Hos": 14, "Joel": 3, "Amos": 9, "Obad": 1,
    "Jonah": 4, "Mic": 7, "Nah": 3, "Hab": 3, "Zeph": 3, "Hag": 2, "Zech": 14, "Mal": 4,
    "Matt": 28, "Mark": 16, "Luke": 24, "John": 21, "Acts": 28, "Rom": 16, "1Cor": 16,
    "2Cor": 13, "Gal": 6, "Eph": 6, "Phil": 4, "Col": 4, "1Thess": 5, "2Thess": 3, "1Tim": 6,
    "2Tim": 4, "Titus": 3, "Phlm": 1, "Heb": 13, "Jas": 5, "1Pet": 5, "2Pet": 3, "1John": 5,
    "2John": 1, "3John": 1, "Jude": 1, "Rev": 22,
}  # fmt: skip
VERSES_PER_TESTAMENT = {"ot": 23145, "nt": 7957}


def read_ztext(module_dir: Path, testament: str) -> list[str]:
    """All index entries of one testament (``"ot"`` or ``"nt"``), as OSIS XML strings."""
    bzs, bzv, bzz = (module_dir.joinpath(f"{testament}.bz{ext}").read_bytes() for ext in "svz")
    blocks = []
    for offset, csize, usize in struct.iter_unpack("<III", bzs):
        block = zlib.decompress(bzz[offset : offset + csize])
        if len(block) != usize:
            raise ValueError(f"{module_dir}/{testament}.bzz: block at {offset} has wrong size")
        blocks.append(block)
    return [
        blocks[b][off : off + size].decode("utf-8") if size else ""
        for b, off, size in struct.iter_unpack("<IIH", bzv)
    ]


# --- Verse ids -----------------------------------------------------------------------------------
# Index layout per testament: [0] testament heading, [1] module heading, then for every book a
# book heading entry followed, for every chapter, by a chapter heading entry and the verses.
# Headings carry <div type="book" osisID="Gen" sID=...> and <chapter osisID="Gen.1" sID=...>.

_BOOK_START = re.compile(r'<div\b(?=[^>]*\btype="book")(?=[^>]*\bsID=)[^>]*\bosisID="([^"]+)"')
_CHAPTER_START = re.compile(r'<chapter\b(?=[^>]*\bsID=)[^>]*\bosisID="([^".]+)\.(\d+)"')


def verse_ids(entries: list[str], testament: str) -> dict[int, str]:
    """Map index position -> verse id (``"Gen.1.1"``) using the heading entries, and check it."""
    ids: dict[int, str] = {}
    book, chapter, verse = None, 0, 0
    for pos in range(2, len(entries)):
        book_start = _BOOK_START.findall(entries[pos])
        chapter_start = _CHAPTER_START.findall(entries[pos])
        if book_start:
            book, chapter = book_start[0], 0
        elif chapter_start:
            if chapter_start[0] != (book, str(chapter + 1)):
                raise ValueError(f"entry {pos}: {chapter_start[0]} out of order after {book}")
            chapter, verse = chapter + 1, 0
        else:
            if book is None or chapter == 0:
                raise ValueError(f"entry {pos}: verse before the first book/chapter heading")
            verse += 1
            ids[pos] = f"{book}.{chapter}.{verse}"

    chapter_ids = dict.fromkeys(vid.rsplit(".", 1)[0] for vid in ids.values())  # ordered set
    chapters_per_book = list(Counter(c.split(".")[0] for c in chapter_ids).items())
    expected = list(BOOKS.items())[:39] if testament == "ot" else list(BOOKS.items())[39:]
    if chapters_per_book != expected or len(ids) != VERSES_PER_TESTAMENT[testament]:
        raise ValueError(
            f"{testament}: derived {len(chapters_per_book)} books / {len(chapter_ids)} chapters /"
            f" {len(ids)} verses, not the KJV versification; has the module format changed?"
        )
    return ids


# --- OSIS XML -> text + Strong's numbers per word ---------------------------------------------

_PIECE = re.compile(r"<(/?)([A-Za-z]+)([^>]*?)(/?)>|([^<]+)")
_USFM_MARKER = re.compile(r"\\\+?[a-z]+\d*\*?")  # stray "\nd" left over from USFM conversion
_SPACES = re.compile(r"\s+")
_LEMMA = re.compile(r'\blemma="([^"]*)"')
NO_NUMBERS: frozenset[str] = frozenset()


@functools.cache
def strong_numbers(lemma: str) -> frozenset[str]:
    """``'strong:H0413 H0589'`` -> ``{'H413', 'H589'}`` (leading zeros dropped)."""
    numbers = set()
    for item in lemma.replace("strong:", " ").split():
        if item[:1] in ("H", "G") and item[1:].isdigit():
            numbers.add(item[0] + str(int(item[1:])))
    return frozenset(numbers)


# Titles kept as verse text: canonical ones (Psalm titles) and the KJV's epistle subscriptions
# ("Written to the Romans from Corinthus, ..."), a plain <title> right after the book's last
# chapter end; RV1909 has the subscriptions as ordinary text of the last verse.
_KEPT_TITLE = 'canonical="true"'
_SUBSCRIPTION = re.compile(r'(<chapter eID="[^"]*"/>\s*(?:<div[^>]*/>\s*)*<title)>')
_DROPPED = re.compile(r"<note\b.*?</note>|<title\b(?![^>]*canonical=\"true\")[^>]*>.*?</title>",
                      re.DOTALL)  # fmt: skip
_TAG = re.compile(r"<[^>]*>")


def _mark_kept_titles(xml: str) -> str:
    return _SUBSCRIPTION.sub(rf"\1 {_KEPT_TITLE}>", xml)


def verse_text(xml: str) -> str:
    """Clean verse text of one OSIS entry.

    Drops notes, other titles (book titles, the Hebrew letters of Psalm 119), tags, pilcrows
    and stray USFM markers; keeps canonical Psalm titles and epistle subscriptions (verse text
    in both Bibles); collapses white space.
    """
    text = html.unescape(_TAG.sub("", _DROPPED.sub("", _mark_kept_titles(xml))))
    return " ".join(_USFM_MARKER.sub(" ", text).replace("¶", " ").split())


def tagged_text(xml: str) -> tuple[str, list[frozenset[str]]]:
    """:func:`verse_text` and, per token of :func:`attnlab.data.words`, its Strong's numbers.

    Walks the XML piece by piece (10x slower than :func:`verse_text`, so used only for the
    aligned splits; the build checks that both give the same text). A word token gets the
    numbers of every ``<w>`` element it overlaps; punctuation tokens get none.
    """
    clean = ""
    tagged: list[tuple[int, int, frozenset[str]]] = []  # (start, end, numbers) in clean
    skip = 0  # depth inside <note> or a dropped <title>
    title_skips: list[bool] = []
    lemmas: list[frozenset[str]] = []
    for m in _PIECE.finditer(_mark_kept_titles(xml)):
        closing, name, attrs, selfclosing, text = m.groups()
        if text is not None:
            if skip:
                continue
            text = _USFM_MARKER.sub(" ", html.unescape(text)).replace("¶", " ")
            text = _SPACES.sub(" ", text)
            if text.startswith(" ") and (not clean or clean.endswith(" ")):
                text = text[1:]  # collapse white space across pieces, none at the start
            if lemmas and lemmas[-1]:
                tagged.append((len(clean), len(clean) + len(text), lemmas[-1]))
            clean += text
        elif selfclosing:
            continue
        elif name == "note":
            skip += -1 if closing else 1
        elif name == "title":
            if closing:
                skip -= title_skips.pop()
            else:
                title_skips.append(_KEPT_TITLE not in attrs)
                skip += title_skips[-1]
        elif name == "w":
            if closing:
                lemmas.pop()
            else:
                lemma = _LEMMA.search(attrs)
                lemmas.append(strong_numbers(lemma.group(1)) if lemma else NO_NUMBERS)
    if skip or lemmas:
        raise ValueError(f"unbalanced <note>, <title> or <w> in: {xml[:200]!r}")
    clean = clean.rstrip(" ")

    # Give each token the union of the numbers of the tagged pieces it overlaps. Both lists are
    # sorted by position, so one forward walk suffices.
    numbers = []
    k = 0
    for start, end in word_spans(clean):
        while k < len(tagged) and tagged[k][1] <= start:
            k += 1
        found = NO_NUMBERS
        j = k
        while j < len(tagged) and tagged[j][0] < end:
            found = found | tagged[j][2]
            j += 1
        numbers.append(found if found and is_word(clean[start:end]) else NO_NUMBERS)
    return clean, numbers


def read_bible(module_dir: Path) -> list[tuple[str, str]]:
    """``(verse id, OSIS XML)`` for all 31,102 KJV-versification verses, in canonical order."""
    verses = []
    for testament in ("ot", "nt"):
        entries = read_ztext(module_dir, testament)
        verses += [(vid, entries[pos]) for pos, vid in verse_ids(entries, testament).items()]
    return verses


def all_numbers(xml: str) -> frozenset[str]:
    """Every Strong's number tagged anywhere in an entry (notes included; cheap)."""
    return frozenset().union(*map(strong_numbers, _LEMMA.findall(xml)))


def module_version(conf: Path) -> str:
    """The ``Version=`` line of a SWORD module's .conf file."""
    found = re.search(r"^Version=(.+)$", conf.read_text(encoding="utf-8"), re.MULTILINE)
    return found.group(1).strip() if found else "unknown"
