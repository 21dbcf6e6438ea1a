"""AER, Pharaoh links and attention -> links (attnlab.data.alignment)."""

import ast
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from attnlab.data.alignment import (
    Alignment,
    aer,
    attention_to_links,
    corpus_aer,
    format_links,
    keep_referenced,
    parse_links,
)

SURE = {(0, 0), (1, 1)}
POSSIBLE = {(0, 0), (1, 1), (2, 1)}


def test_aer_perfect_is_zero():
    assert aer(SURE, SURE, POSSIBLE) == 0.0
    assert aer(POSSIBLE, SURE, POSSIBLE) == 0.0  # possible links cost nothing


def test_aer_hand_computed():
    # A = {(0,0), (2,1), (2,2)}: |A∩S| = 1, |A∩P| = 2, |A| = 3, |S| = 2 -> 1 - 3/5
    assert aer({(0, 0), (2, 1), (2, 2)}, SURE, POSSIBLE) == pytest.approx(0.4)
    # Predicting nothing finds no sure link.
    assert aer(set(), SURE, POSSIBLE) == 1.0
    # Passing only the possible-but-not-sure links gives the same answer (P is taken as P ∪ S).
    assert aer({(0, 0), (2, 1), (2, 2)}, SURE, {(2, 1)}) == pytest.approx(0.4)


def test_aer_empty_reference_and_prediction():
    assert aer(set(), set(), set()) == 0.0
    assert aer({(0, 0)}, set(), set()) == 1.0


def test_corpus_aer_sums_counts_before_dividing():
    refs = {"a": Alignment(frozenset(SURE), frozenset(POSSIBLE)), "b": parse_links("0-0")}
    pred = {"a": {(0, 0), (2, 1), (2, 2)}, "b": {(0, 0)}}
    # a: 1 + 2 over 3 + 2; b: 1 + 1 over 1 + 1 -> 1 - (3 + 2) / (5 + 2)
    assert corpus_aer(pred, refs) == pytest.approx(1 - 5 / 7)
    # A sentence without prediction counts as predicting nothing: b adds 0 over 0 + 1.
    assert corpus_aer({"a": pred["a"]}, refs) == pytest.approx(1 - 3 / 6)
    with pytest.raises(KeyError, match="no reference"):
        corpus_aer({"zzz": set()}, refs)


def test_pharaoh_round_trip():
    text = "0-0 1?1 2-1 10?3"
    a = parse_links(text)
    assert a.sure == {(0, 0), (2, 1)}
    assert a.possible == {(0, 0), (1, 1), (2, 1), (10, 3)}
    assert a.to_pharaoh() == format_links(a.sure, a.possible) == "0-0 1?1 2-1 10?3"
    assert parse_links("") == Alignment(frozenset(), frozenset())


@pytest.mark.parametrize("bad", ["0-", "a-1", "1:2", "0-1-2"])
def test_parse_links_rejects_garbage(bad):
    with pytest.raises(ValueError, match="bad alignment link"):
        parse_links(bad)


def test_sure_must_be_possible():
    with pytest.raises(ValueError, match="sure link must also be possible"):
        Alignment(frozenset({(0, 0)}), frozenset())


def test_attention_to_links_argmax_per_target_word():
    w = np.array(
        [
            [0.7, 0.2, 0.1],  # target 0 -> source 0
            [0.1, 0.1, 0.8],  # target 1 -> source 2
            [0.4, 0.4, 0.2],  # tie: lowest source index wins
            [0.0, 0.0, 0.0],  # fully masked row: no link
        ]
    )
    assert attention_to_links(w) == {(0, 0), (2, 1), (0, 2)}


def test_attention_to_links_threshold():
    w = np.array([[0.5, 0.5, 0.0], [0.1, 0.2, 0.7], [0.3, 0.3, 0.4]])
    assert attention_to_links(w, threshold=0.45) == {(0, 0), (1, 0), (2, 1)}
    assert attention_to_links(w, threshold=0.9) == set()


def test_attention_to_links_accepts_lists_and_rejects_bad_input():
    assert attention_to_links([[0.2, 0.8]]) == {(1, 0)}
    assert attention_to_links(np.zeros((2, 0))) == set()
    with pytest.raises(ValueError, match="2-D"):
        attention_to_links(np.ones((1, 2, 3)))
    with pytest.raises(ValueError, match="NaN"):
        attention_to_links([[np.nan, 1.0]])


def test_keep_referenced_drops_unreferenced_target_words():
    ref = parse_links("0-0 1?2")
    assert keep_referenced({(0, 0), (5, 1), (3, 2)}, ref) == {(0, 0), (3, 2)}


links = st.sets(st.tuples(st.integers(0, 6), st.integers(0, 6)), max_size=20)


@given(links, links, links)
def test_aer_properties(predicted, sure, extra):
    possible = sure | extra
    value = aer(predicted, sure, possible)
    assert 0.0 <= value <= 1.0
    # Predicting every sure link and nothing outside P is perfect.
    assert aer(sure | (extra & predicted), sure, possible) == 0.0


def test_data_modules_do_not_import_torch():
    # Checked on the source: importing attnlab.data also runs attnlab/__init__.py, which may.
    import attnlab.data

    for path in Path(attnlab.data.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n.split(".")[0] == "torch" for n in names), f"{path.name} imports torch"
