"""User pair files (attnlab.data.tsv): every kind of bad line, with its line number."""

import pytest

from attnlab.data import Pair, load_pairs


def write(tmp_path, data: bytes, name="pairs.tsv"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


BAD_FILE = (
    b"Hello\tHola\n"  # 1 ok
    b"\n"  # 2 blank
    b"no tab here\n"  # 3 no tab
    b"\tsolo target\n"  # 4 empty source
    b"solo source\t  \n"  # 5 empty target
    b"caf\xe9\tcaf\xc3\xa9\n"  # 6 Latin-1 byte, not UTF-8
    b"a\tb\tc\td\n"  # 7 too many columns
    b"Good night\tBuenas noches\tgn\n"  # 8 ok, id from column 3
    b"Again\tOtra vez\tgn\n"  # 9 repeated id
    b"  Thanks \t Gracias\r\n"  # 10 ok: spaces stripped, CRLF accepted
)


def test_each_bad_line_is_reported_with_its_number(tmp_path):
    pairs, problems = load_pairs(write(tmp_path, BAD_FILE))
    assert pairs == [
        Pair("Hello", "Hola", "pairs.tsv:1"),
        Pair("Good night", "Buenas noches", "gn"),
        Pair("Thanks", "Gracias", "pairs.tsv:10"),
    ]
    reasons = {p.line: p.reason for p in problems}
    assert sorted(reasons) == [2, 3, 4, 5, 6, 7, 9]
    assert reasons[2] == "blank line"
    assert reasons[3].startswith("no tab")
    assert reasons[4] == "empty source"
    assert reasons[5] == "empty target"
    assert reasons[6] == "not valid UTF-8 (byte 0xe9 at byte 4)"
    assert reasons[7].startswith("4 tab-separated columns, expected 2 or 3")
    assert reasons[9] == "id 'gn' already used on line 8"
    assert problems[4].line == 6 and problems[4].text == "caf\\xe9\tcafé"  # bad byte shown


def test_raise_mode_names_file_lines_reason_and_fix(tmp_path):
    path = write(tmp_path, BAD_FILE)
    with pytest.raises(ValueError) as info:
        load_pairs(path, on_error="raise")
    message = str(info.value)
    assert str(path) in message
    assert "7 bad line(s) out of 10" in message
    assert "line 2: blank line" in message
    assert "line 3: no tab" in message
    assert "... and 2 more" in message  # only the first 5 are quoted
    assert "on_error='skip'" in message and "--skip-bad-lines" in message


def test_clean_file_in_raise_mode(tmp_path):
    path = write(tmp_path, "\ufeffone\tuno\ntwo\tdos".encode())  # BOM, no final newline
    pairs, problems = load_pairs(path, on_error="raise")
    assert [(p.source, p.target) for p in pairs] == [("one", "uno"), ("two", "dos")]
    assert problems == []


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist; expected a UTF-8 text file"):
        load_pairs(tmp_path / "nope.tsv")
    with pytest.raises(FileNotFoundError, match="is a directory"):
        load_pairs(tmp_path)


@pytest.mark.parametrize("on_error", ["skip", "raise"])
def test_no_valid_pair_is_an_error_in_both_modes(tmp_path, on_error):
    with pytest.raises(ValueError, match="no valid 'source<TAB>target' pair in 0 line"):
        load_pairs(write(tmp_path, b""), on_error="skip")
    with pytest.raises(ValueError, match=r"(no valid|bad line).*\n.*line 1: no tab"):
        load_pairs(write(tmp_path, b"just one column\n"), on_error=on_error)


def test_bad_on_error_value(tmp_path):
    with pytest.raises(ValueError, match="on_error must be one of"):
        load_pairs(write(tmp_path, b"a\tb\n"), on_error="ignore")


def test_decomposed_text_is_read_as_nfc_the_form_the_tokenizer_writes(tmp_path):
    """Before: a reference in NFD ("e" + combining acute) stayed NFD while every translation
    comes out NFC (the tokenizer normalises), so a perfect translation scored below 100."""
    import unicodedata

    nfd = unicodedata.normalize("NFD", "café\tqué\tid1\n")
    assert nfd != unicodedata.normalize("NFC", nfd)
    path = tmp_path / "d.tsv"
    path.write_text(nfd, encoding="utf-8")
    (pair,), problems = load_pairs(path)
    assert not problems and (pair.source, pair.target) == ("café", "qué")
    assert unicodedata.is_normalized("NFC", pair.source + pair.target)


def test_old_mac_line_ends_are_lines(tmp_path):
    """Before: a file whose lines end in "\\r" alone (old Mac) was one line, its pairs joined:
    "a<TAB>b\\rc<TAB>d" gave the single pair ("a", "b\\rc") with the id "d"."""
    path = write(tmp_path, b"one\tuno\rtwo\tdos\r\rthree\ttres\tt3\r")
    pairs, problems = load_pairs(path)
    assert pairs == [
        Pair("one", "uno", "pairs.tsv:1"),
        Pair("two", "dos", "pairs.tsv:2"),
        Pair("three", "tres", "t3"),
    ]
    assert [(p.line, p.reason) for p in problems] == [(3, "blank line")]


def test_a_carriage_return_inside_a_line_is_a_bad_line_not_a_joined_pair(tmp_path):
    """A "\\n" file with some "\\r" line ends: the lines a "\\r" joins are one bad line (with
    its number, the reason and the fix), never a pair whose target and id are other lines."""
    path = write(tmp_path, b"one\tuno\ntwo\tdos\rthree\ttres\nfour\tcuatro\r\n")
    pairs, problems = load_pairs(path)
    assert pairs == [Pair("one", "uno", "pairs.tsv:1"), Pair("four", "cuatro", "pairs.tsv:3")]
    (problem,) = problems
    assert problem.line == 2 and problem.text == "two\tdos\rthree\ttres"
    assert problem.reason.startswith("a carriage return (\\r) inside the line")
    assert "save the file with \\n line ends" in problem.reason
    with pytest.raises(ValueError, match=r"pairs\.tsv: 1 bad line\(s\).*\n.*line 2: a carriage"):
        load_pairs(path, on_error="raise")
