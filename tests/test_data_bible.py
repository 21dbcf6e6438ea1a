"""The shipped English -> Spanish Bible corpus (no SWORD modules needed)."""

import hashlib
import json
from importlib import resources

import pytest

from attnlab.data import Pair, load_alignments, load_bible, words
from attnlab.data.text import is_word


@pytest.fixture(scope="module")
def splits():
    return {name: load_bible(name) for name in ("train", "validation", "test")}


def test_split_sizes(splits):
    assert {name: len(pairs) for name, pairs in splits.items()} == {
        "train": 28_890,
        "validation": 1_000,
        "test": 1_000,
    }


def test_splits_are_disjoint_and_deterministic(splits):
    ids = {name: {p.id for p in pairs} for name, pairs in splits.items()}
    assert sum(map(len, ids.values())) == len(set().union(*ids.values())) == 30_890
    assert load_bible("test") == splits["test"]
    assert load_bible("test") is not load_bible("test")  # callers may mutate their list


def test_split_rule_is_the_documented_hash(splits):
    everything = [p.id for pairs in splits.values() for p in pairs]
    ranked = sorted(everything, key=lambda v: hashlib.sha256(v.encode()).hexdigest())
    assert {p.id for p in splits["test"]} == set(ranked[:1000])
    assert {p.id for p in splits["validation"]} == set(ranked[1000:2000])


@pytest.mark.parametrize(
    ("verse", "split"),
    [("Gen.1.1", "train"), ("Rev.22.21", "train"), ("Gen.3.19", "test"),
     ("Exod.6.3", "test"), ("Ps.119.1", "validation"), ("Gen.4.16", "validation")],
)  # fmt: skip
def test_known_verses_in_known_splits(splits, verse, split):
    assert verse in {p.id for p in splits[split]}


def test_first_and_last_verse_text(splits):
    train = splits["train"]
    assert train[0] == Pair(
        "In the beginning God created the heaven and the earth.",
        "En el principio crió Dios los cielos y la tierra.",
        "Gen.1.1",
    )
    assert train[-1] == Pair(
        "The grace of our Lord Jesus Christ be with you all. Amen.",
        "La gracia de nuestro Señor Jesucristo sea con todos vosotros. Amén.",
        "Rev.22.21",
    )


def test_cleaning(splits):
    by_id = {p.id: p for pairs in splits.values() for p in pairs}
    # Psalm titles are verse text in both; the chapter-opening capitals of RV1909 are undone.
    assert by_id["Ps.3.1"].source.startswith("A Psalm of David, when he fled from Absalom")
    assert "su hijo. ¡Oh Jehová, cuánto" in by_id["Ps.3.1"].target
    # Psalm 119's stanza letters are headings in KJV (dropped) and dropped from RV1909 too.
    assert by_id["Ps.119.1"].target.startswith("Bienaventurados los perfectos de camino;")
    # Stray USFM markup ("\\nd") is gone; divine names keep their capitals.
    assert "but by my name JEHOVAH was I not known" in by_id["Exod.6.3"].source
    # Epistle subscriptions are kept on both sides.
    assert by_id["Heb.13.25"].source.endswith("Written to the Hebrews from Italy by Timothy.")
    assert by_id["Heb.13.25"].target.endswith("desde Italia con Timoteo.")
    # Empty and misaligned verses are dropped.
    for gone in ("Job.38.39", "Num.13.1", "Job.39.30", "Hos.12.1"):
        assert gone not in by_id
    for pair in by_id.values():
        for text in (pair.source, pair.target):
            assert text == " ".join(text.split()), pair.id  # collapsed, stripped
            assert not set(text) & set("<>\\¶\t"), pair.id


def test_alignment_of_a_known_verse():
    pair = next(p for p in load_bible("test") if p.id == "Gen.3.19")
    en, es = words(pair.source), words(pair.target)
    alignment = load_alignments("test")["Gen.3.19"]
    sure = {(en[i], es[j]) for i, j in alignment.sure}
    assert {("sweat", "sudor"), ("face", "rostro"), ("bread", "pan"), ("ground", "tierra")} <= sure
    # "dust ... dust" / "polvo ... polvo": which goes with which is unknown -> possible only.
    dust = {(i, j) for i, j in alignment.possible if en[i] == "dust"}
    assert len(dust) == 4 and not dust & alignment.sure
    # Article + noun: the article is possible, the noun sure ("the ground" / "la tierra").
    ground = en.index("ground")
    assert (ground, es.index("tierra")) in alignment.sure
    assert (ground, es.index("la")) in alignment.possible - alignment.sure


@pytest.mark.parametrize("split", ["test", "validation"])
def test_alignments_index_words_of_the_shipped_text(split):
    pairs = load_bible(split)
    alignments = load_alignments(split)
    assert set(alignments) == {p.id for p in pairs}
    n_sure = 0
    for pair in pairs:
        en, es = words(pair.source), words(pair.target)
        a = alignments[pair.id]
        assert a.sure <= a.possible
        for i, j in a.possible:
            assert is_word(en[i]) and is_word(es[j]), (pair.id, i, j)  # never punctuation
        n_sure += len(a.sure)
    stats = json.loads(
        resources.files("attnlab.data").joinpath("bible_data", "stats.json").read_text()
    )
    assert n_sure == stats["alignments"][split]["links_sure"]


def test_unknown_split_messages():
    with pytest.raises(ValueError, match="expected one of"):
        load_bible("dev")
    with pytest.raises(ValueError, match=r"\['validation', 'test'\]"):
        load_alignments("train")


def test_the_exact_duplicates_the_docstring_counts():
    """attnlab.data.bible's docstring counts the test verses train repeats: 13 English texts,
    8 Spanish ones, 5 whole pairs (validation: 14, 15, 13)."""
    train = load_bible("train")
    sources, targets = {p.source for p in train}, {p.target for p in train}
    pairs = {(p.source, p.target) for p in train}
    for split, expected in (("test", (13, 8, 5)), ("validation", (14, 15, 13))):
        held = load_bible(split)
        found = (
            sum(p.source in sources for p in held),
            sum(p.target in targets for p in held),
            sum((p.source, p.target) in pairs for p in held),
        )
        assert found == expected, split
