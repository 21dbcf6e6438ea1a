#!/usr/bin/env python3
"""Build the English -> Spanish Bible corpus shipped in ``attnlab/data/bible_data/``.

Sources (Debian packages, public domain, read directly by ``sword_osis.py``, no libsword)::

    apt-get install -y --no-install-recommends sword-text-kjv sword-text-sparv
    /usr/share/sword/modules/texts/ztext/engKJV2006eb   King James Version 1769 (Strong's tagged)
    /usr/share/sword/modules/texts/ztext/spaRV1909eb    Reina-Valera 1909       (Strong's tagged)

Usage::

    python scripts/build_bible_corpus.py            # rewrite the shipped files
    python scripts/build_bible_corpus.py --check    # rebuild in a temp dir; exit 1 if it differs
    python scripts/build_bible_corpus.py --out DIR  # write (or --check) somewhere else

Pipeline (every step deterministic; the same modules give the same bytes):

1. Verse ids from the KJV versification; entry i of KJV is paired with entry i of RV1909.
2. Clean text (sword_osis.verse_text): notes, headings, tags, pilcrows and stray USFM markers
   dropped; Psalm titles and epistle subscriptions kept (text in both Bibles); white space
   collapsed.
3. Spanish typography undone: the chapter-opening word(s) set in capitals ("EN el principio")
   are re-cased from how the words are written elsewhere, and the Hebrew letter names opening
   the stanzas of Psalm 119 ("ALEPH.") are removed (KJV has them as headings, dropped in 2).
4. Pairs dropped: empty on either side; misaligned: RV1909 numbers some chapters differently
   (Num 13, Num 30, 1Sam 24, 1Kgs 22, 1Chr 21, 2Chr 33, Job 39-40, Hos 12, Jonah 2, ...) and the
   module shifts its text against the KJV slots, so a pair whose Spanish shares clearly more
   Strong's numbers with a nearby English verse than with its own is dropped; lopsided: the
   Spanish has under 0.4x or at least 2x the tokens of the English (verses split differently).
5. Splits: test = the 1,000 verse ids with the smallest SHA-256, validation = the next 1,000.
6. Reference alignments for test and validation from shared Strong's numbers (see align()).
"""

from __future__ import annotations

import argparse
import filecmp
import gzip
import hashlib
import io
import json
import re
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))  # use this checkout's tokeniser, installed or not

from attnlab.data.alignment import Alignment  # noqa: E402
from attnlab.data.text import is_word, words  # noqa: E402
from sword_osis import (  # noqa: E402  (sys.path first)
    all_numbers,
    module_version,
    read_bible,
    tagged_text,
    verse_text,
)

SWORD = Path("/usr/share/sword")
MODULES = SWORD / "modules" / "texts" / "ztext"
ENGLISH, SPANISH = "engKJV2006eb", "spaRV1909eb"
OUT = REPO / "src" / "attnlab" / "data" / "bible_data"
OUTPUTS = ("ids.tsv.gz", "en.txt.gz", "es.txt.gz", "alignments.tsv.gz", "stats.json")
N_TEST, N_VALIDATION = 1000, 1000
ALIGNED_SPLITS = ("test", "validation")
MISALIGNED_WINDOW, MISALIGNED_MARGIN = 6, 0.2
LENGTH_RATIO = (0.4, 2.0)  # kept: low <= Spanish tokens / English tokens < high

# Words that, inside a multi-word Strong's group, are taken as grammar rather than the
# translation of the number (articles, "and", "of", auxiliaries, subject pronouns). Used only to
# pick sure links; see align().
FUNCTION_WORDS = {
    "en": set(
        "a an the and of to unto in that it is was be been shall will shalt wilt hath have had "
        "did do doth dost hast i thou he she we ye they".split()
    ),
    "es": set("el la los las lo un una unos unas de del al a á y e en que se".split()),
}


# --- Spanish typography --------------------------------------------------------------------

_SENTENCE_END = set(".:?!¿¡")
_PUNCTUATION = "¿¡.,;:?!"
_STANZA_LETTER = re.compile(r"[A-Z]+\.? ")  # "ALEPH. ", "BETH " opening Ps 119:1, 9, 17, ...


def casing_model(texts: list[str]) -> dict[str, str]:
    """Lowercased word -> its most frequent spelling inside a sentence (not after . : ? ! ¿ ¡,
    not all capitals), so "DAVID" -> "David" but "ACONTECIÓ" -> "aconteció"."""
    counts: dict[str, Counter] = defaultdict(Counter)
    for text in texts:
        tokens = words(text)
        for prev, token in zip(tokens, tokens[1:], strict=False):
            if prev not in _SENTENCE_END and not token.isupper():
                counts[token.lower()][token] += 1
    return {low: max(sorted(c), key=c.__getitem__) for low, c in counts.items()}


def fix_spanish(vid: str, text: str, casing: dict[str, str]) -> str:
    """Undo RV1909's chapter-opening capitals and drop Psalm 119's stanza letter names.

    Only removes whole leading tokens or changes letter case, so the tokens of the result are
    the tokens of ``text`` minus a prefix (the Strong's numbers per token stay valid).
    """
    chapter, verse = vid.rsplit(".", 1)
    if chapter == "Ps.119" and int(verse) % 8 == 1 and _STANZA_LETTER.match(text):
        text = text[_STANZA_LETTER.match(text).end() :]
    span = _capitals_run(text) if verse == "1" else None
    if span is None:
        return text
    start, end = span
    fixed = re.sub(r"\w+", lambda m: casing.get(m.group().lower(), m.group().lower()),
                   text[start:end])  # fmt: skip
    before = text[:start].rstrip()
    if not before or before[-1] in _SENTENCE_END:  # the run opens a sentence: capitalise
        first = re.search(r"\w", fixed).start()
        fixed = fixed[:first] + fixed[first].upper() + fixed[first + 1 :]
    if len(fixed) != end - start:
        raise AssertionError(f"{vid}: re-casing changed the length of {text[start:end]!r}")
    return text[:start] + fixed + text[end:]


def _capitals_run(text: str) -> tuple[int, int] | None:
    """Span of the first run of consecutive all-capital words with a word of 2+ letters
    ("EN", "Y ACONTECIÓ", "A TI", "¿HASTA"), or None."""
    run: list[tuple[int, int, int]] = []  # (start, end, letters)

    def found() -> bool:
        return any(letters > 1 for _, _, letters in run)

    for m in re.finditer(r"\S+", text):
        word = m.group().strip(_PUNCTUATION)
        if word.isalpha() and word.isupper():
            run.append((m.start(), m.end(), len(word)))
        elif found():
            break
        else:
            run = []
    return (run[0][0], run[-1][1]) if found() else None


# --- Misaligned pairs ----------------------------------------------------------------------


def misaligned(verses: list[tuple[str, frozenset[str], frozenset[str]]]) -> list[str]:
    """Ids whose Spanish matches a nearby English verse clearly better than its own.

    Args:
        verses: ``(id, English numbers, Spanish numbers)`` for every verse, in canonical order.

    A pair is misaligned when both sides carry Strong's numbers and, with J the Jaccard overlap
    of number sets, ``max_{0 < |d| <= 6} J(en[i+d], es[i]) >= J(en[i], es[i]) + 0.2``.
    """

    def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
        return len(a & b) / len(a | b) if a or b else 0.0

    bad = []
    for i, (vid, en, es) in enumerate(verses):
        if not en or not es:
            continue
        lo, hi = max(0, i - MISALIGNED_WINDOW), min(len(verses), i + MISALIGNED_WINDOW + 1)
        best_other = max(jaccard(verses[k][1], es) for k in range(lo, hi) if k != i)
        if best_other >= jaccard(en, es) + MISALIGNED_MARGIN:
            bad.append(vid)
    return bad


# --- Reference alignments ------------------------------------------------------------------


def align(
    en_tokens: list[str],
    en_numbers: list[frozenset[str]],
    es_tokens: list[str],
    es_numbers: list[frozenset[str]],
) -> Alignment:
    """Reference links from shared Strong's numbers.

    For every number n tagged on both sides, with E_n / S_n the English / Spanish words
    carrying n:
      * every pair in E_n x S_n is a possible link;
      * a pair is a sure link when n is carried by exactly one word on each side, or, failing
        that, when exactly one word on each side is not a function word (so "earth" <-> "y la
        tierra" gives the sure link earth-tierra, and earth-y, earth-la are only possible).
    A number carried by two content words on either side (God ... God / Dios ... Dios) gives
    possible links only: which occurrence translates which is not known.
    """
    en_by_number, es_by_number = defaultdict(list), defaultdict(list)
    for i, numbers in enumerate(en_numbers):
        for n in numbers:
            en_by_number[n].append(i)
    for j, numbers in enumerate(es_numbers):
        for n in numbers:
            es_by_number[n].append(j)
    sure, possible = set(), set()
    for n in sorted(set(en_by_number) & set(es_by_number)):
        E, S = en_by_number[n], es_by_number[n]
        possible.update((i, j) for i in E for j in S)
        if len(E) > 1 or len(S) > 1:
            E = [i for i in E if en_tokens[i].lower() not in FUNCTION_WORDS["en"]]
            S = [j for j in S if es_tokens[j].lower() not in FUNCTION_WORDS["es"]]
        if len(E) == 1 and len(S) == 1:
            sure.add((E[0], S[0]))
    return Alignment(frozenset(sure), frozenset(possible))


# --- Splits --------------------------------------------------------------------------------


def assign_splits(ids: list[str]) -> dict[str, str]:
    """Test: the 1,000 ids with the smallest SHA-256 of the id; validation: the next 1,000."""
    ranked = sorted(ids, key=lambda vid: hashlib.sha256(vid.encode("utf-8")).hexdigest())
    split = dict.fromkeys(ids, "train")
    split.update(dict.fromkeys(ranked[:N_TEST], "test"))
    split.update(dict.fromkeys(ranked[N_TEST : N_TEST + N_VALIDATION], "validation"))
    return split


# --- Build ---------------------------------------------------------------------------------


def build(out: Path) -> dict:
    """Write the corpus files (:data:`OUTPUTS`) into ``out``; return the statistics."""
    en_bible, es_bible = read_bible(MODULES / ENGLISH), read_bible(MODULES / SPANISH)
    if [vid for vid, _ in en_bible] != [vid for vid, _ in es_bible]:
        raise ValueError("KJV and RV1909 index layouts differ")
    ids = [vid for vid, _ in en_bible]
    en_xml, es_xml = dict(en_bible), dict(es_bible)
    en_text = {vid: verse_text(xml) for vid, xml in en_bible}
    raw_es = {vid: verse_text(xml) for vid, xml in es_bible}
    casing = casing_model(list(raw_es.values()))
    es_text = {vid: fix_spanish(vid, text, casing) for vid, text in raw_es.items()}

    empty = [vid for vid in ids if not en_text[vid] or not es_text[vid]]
    shifted = misaligned([(v, all_numbers(en_xml[v]), all_numbers(es_xml[v])) for v in ids])
    low, high = LENGTH_RATIO
    lopsided = [
        vid
        for vid in ids
        if vid not in empty
        and not low <= len(words(es_text[vid])) / len(words(en_text[vid])) < high
    ]
    dropped = set(empty) | set(shifted) | set(lopsided)
    kept = [vid for vid in ids if vid not in dropped]
    split = assign_splits(kept)

    align_lines = ["id\tlinks"]
    counts = {name: Counter() for name in ALIGNED_SPLITS}
    for vid in kept:
        if split[vid] not in ALIGNED_SPLITS:
            continue
        en_tokens, es_tokens = words(en_text[vid]), words(es_text[vid])
        en_check, en_numbers = tagged_text(en_xml[vid])
        es_check, es_numbers = tagged_text(es_xml[vid])
        es_check = fix_spanish(vid, es_check, casing)
        es_numbers = es_numbers[len(es_numbers) - len(es_tokens) :]  # fix_spanish drops a prefix
        if (en_check, es_check) != (en_text[vid], es_text[vid]):
            raise AssertionError(f"{vid}: verse_text and tagged_text disagree")
        alignment = align(en_tokens, en_numbers, es_tokens, es_numbers)
        align_lines.append(f"{vid}\t{alignment.to_pharaoh()}")
        _count(counts[split[vid]], alignment, (en_tokens, en_numbers), (es_tokens, es_numbers))

    out.mkdir(parents=True, exist_ok=True)
    _write_gzip(out / "ids.tsv.gz", ["id\tsplit"] + [f"{vid}\t{split[vid]}" for vid in kept])
    _write_gzip(out / "en.txt.gz", [en_text[vid] for vid in kept])
    _write_gzip(out / "es.txt.gz", [es_text[vid] for vid in kept])
    _write_gzip(out / "alignments.tsv.gz", align_lines)
    stats = {
        "sources": {m: module_version(SWORD / "mods.d" / f"{m}.conf") for m in (ENGLISH, SPANISH)},
        "verses": {"versification": len(ids), "kept": len(kept)},
        "splits": dict(sorted(Counter(split.values()).items())),
        "dropped_empty": empty,
        "dropped_misaligned": [vid for vid in shifted if vid not in empty],
        "dropped_length_ratio": [vid for vid in lopsided if vid not in shifted],
        "alignments": {name: dict(sorted(c.items())) for name, c in counts.items()},
    }
    (out / "stats.json").write_text(json.dumps(stats, indent=1) + "\n", encoding="utf-8")
    return stats


def _count(c: Counter, alignment: Alignment, en: tuple, es: tuple) -> None:
    """Add one verse to the coverage statistics (words = word tokens, not punctuation)."""
    c["verses"] += 1
    c["links_sure"] += len(alignment.sure)
    c["links_possible_only"] += len(alignment.possible - alignment.sure)
    for side, (tokens, numbers), k in (("en", en, 0), ("es", es, 1)):
        c[f"{side}_words"] += sum(map(is_word, tokens))
        c[f"{side}_words_tagged"] += sum(1 for n in numbers if n)
        c[f"{side}_words_linked"] += len({link[k] for link in alignment.possible})
        c[f"{side}_words_sure"] += len({link[k] for link in alignment.sure})


def _write_gzip(path: Path, lines: list[str]) -> None:
    """UTF-8 lines, each ending in a newline, gzipped with no file name and mtime 0 in the
    header, so equal text gives equal bytes (for a given zlib)."""
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=9, mtime=0) as f:
        f.write("".join(line + "\n" for line in lines).encode("utf-8"))
    path.write_bytes(buffer.getvalue())


def check(folder: Path = OUT) -> int:
    """Rebuild into a temp dir and compare with the files in ``folder``; 0 when identical."""
    stale = []
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp))
        for name in OUTPUTS:
            new, shipped = Path(tmp) / name, folder / name
            if not shipped.exists():
                stale.append(f"{name}: missing from {folder}")
            elif filecmp.cmp(new, shipped, shallow=False):
                continue
            elif name.endswith(".gz") and _gunzip(new) == _gunzip(shipped):
                # Same text; only the compressor differs (another zlib version).
                print(f"note: {name} has identical content but different gzip bytes")
            else:
                stale.append(f"{name}: content differs")
    if stale:
        print(
            "The shipped Bible corpus does not match a fresh build:\n  "
            + "\n  ".join(stale)
            + "\nRebuild it with `python scripts/build_bible_corpus.py` and commit the result "
            "(the SWORD modules or the tokeniser in attnlab/data/text.py may have changed).",
            file=sys.stderr,
        )
        return 1
    print(f"OK: {', '.join(OUTPUTS)} in {folder} match a fresh build")
    return 0


def _gunzip(path: Path) -> bytes:
    return gzip.decompress(path.read_bytes())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="verify the files in --out")
    parser.add_argument("--out", type=Path, default=OUT, help=f"corpus folder (default {OUT})")
    args = parser.parse_args(argv)
    missing = [m for m in (ENGLISH, SPANISH) if not (MODULES / m).is_dir()]
    if missing:
        print(
            f"SWORD module(s) {missing} not found under {MODULES}. Install them with: "
            "apt-get install -y --no-install-recommends sword-text-kjv sword-text-sparv",
            file=sys.stderr,
        )
        return 2
    if args.check:
        return check(args.out)
    stats = build(args.out)
    print(json.dumps({k: v for k, v in stats.items() if not k.startswith("dropped")}, indent=1))
    dropped = {k: len(v) for k, v in stats.items() if k.startswith("dropped")}
    print(f"{dropped}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
