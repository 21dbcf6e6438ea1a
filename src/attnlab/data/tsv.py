"""Your own sentence pairs: a tab-separated text file, checked line by line before training.

Format, one pair per line, UTF-8 (a leading byte-order mark is accepted, and line ends of
``\\n``, ``\\r\\n``, or ``\\r`` alone in a file that has no ``\\n``: an old Mac file)::

    source sentence<TAB>target sentence
    source sentence<TAB>target sentence<TAB>optional id

* Column 3, if present and not empty, is the pair's id; otherwise the id is ``"file.tsv:12"``
  (file name and 1-based line number).
* Spaces around each field are stripped. There is no header line: a header would be read as
  a pair.
* Bad lines are reported with their 1-based line number and a reason: blank line, no tab,
  more than 3 columns, empty source or target, bytes that are not UTF-8, a repeated id, a
  carriage return (``\\r``) inside a line (``\\r`` line ends mixed with ``\\n`` ones: the lines
  it ends would be joined into one pair).

Example:
    >>> import pathlib, tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "pairs.tsv"
    >>> _ = path.write_text("Hello\\tHola\\nno tab here\\n", encoding="utf-8")
    >>> pairs, problems = load_pairs(path)
    >>> pairs[0].target, problems[0].line, problems[0].reason
    ('Hola', 2, 'no tab: expected source<TAB>target')
"""

from __future__ import annotations

import os
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from .pair import Pair

ON_ERROR = ("skip", "raise")
_SHOWN = 5  # problems quoted in an error message


@dataclass(frozen=True, slots=True)
class Problem:
    """A line of a pair file that was not used.

    Attributes:
        line: 1-based line number.
        reason: what is wrong, in words.
        text: the start of the line as read (undecodable bytes shown as ``\\xNN``).
    """

    line: int
    reason: str
    text: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}: {self.text!r}"


def load_pairs(
    path: str | os.PathLike[str], *, on_error: str = "skip"
) -> tuple[list[Pair], list[Problem]]:
    """Read ``source<TAB>target[<TAB>id]`` lines.

    Args:
        path: the file.
        on_error: ``"skip"`` drops bad lines and returns them as problems; ``"raise"`` raises
            on the first file with any bad line.

    Returns:
        ``(pairs, problems)``: pairs in file order, and every bad line (empty if none).

    Raises:
        FileNotFoundError: no such file.
        ValueError: ``on_error="raise"`` and some line is bad; the file has no valid pair at
            all (in either mode); ``on_error`` is not "skip" or "raise".
    """
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
    path = Path(path)
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise FileNotFoundError(
            f"pair file {str(path)!r} {what}; expected a UTF-8 text file with one "
            "'source<TAB>target' pair per line"
        )

    pairs: list[Pair] = []
    problems: list[Problem] = []
    first_line_of_id: dict[str, int] = {}
    data = path.read_bytes()
    # A file with "\r" and no "\n" has old-Mac line ends: read as one line, its pairs ran
    # together ("a<TAB>b\rc<TAB>d" became target "b\rc" and id "d"). A "\r" inside a line
    # of a "\n" file is refused line by line (see _parse).
    lines = data.split(b"\r" if b"\r" in data and b"\n" not in data else b"\n")
    if lines[-1] == b"":
        lines.pop()  # the file ends with a newline: no line after it
    for number, raw in enumerate(lines, start=1):
        pair, reason = _parse(raw, number, path.name, first_line_of_id)
        if pair is not None:
            first_line_of_id[pair.id] = number
            pairs.append(pair)
        else:
            shown = raw[:80].decode("utf-8", errors="backslashreplace").rstrip("\r")
            problems.append(Problem(number, reason, shown))

    if problems and on_error == "raise":
        raise ValueError(
            f"{path}: {len(problems)} bad line(s) out of {len(lines)}:\n"
            + _describe(problems)
            + "\nFix them, or pass on_error='skip' (command line: --skip-bad-lines) to drop them."
        )
    if not pairs:
        raise ValueError(
            f"{path}: no valid 'source<TAB>target' pair in {len(lines)} line(s)"
            + (":\n" + _describe(problems) if problems else " (the file is empty)")
        )
    return pairs, problems


def _parse(
    raw: bytes, number: int, file_name: str, first_line_of_id: dict[str, int]
) -> tuple[Pair | None, str]:
    """One line -> (pair, "") or (None, reason)."""
    if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]  # UTF-8 byte-order mark
    raw = raw.removesuffix(b"\r")
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return None, f"not valid UTF-8 (byte 0x{raw[err.start]:02x} at byte {err.start + 1})"
    if "\r" in line:
        return None, (
            "a carriage return (\\r) inside the line: old-Mac \\r line ends mixed with \\n "
            "ones join lines; save the file with \\n line ends"
        )
    if not line.strip():
        return None, "blank line"
    fields = [field.strip() for field in line.split("\t")]
    if len(fields) == 1:
        return None, "no tab: expected source<TAB>target"
    if len(fields) > 3:
        return None, (
            f"{len(fields)} tab-separated columns, expected 2 or 3 (source, target, id); "
            "a tab inside a sentence must be replaced by a space"
        )
    # NFC (canonical composition): the tokenizer writes NFC, so a decomposed reference ("e"
    # + combining accent) could never be matched byte for byte; NFC is the same text
    source, target = (
        unicodedata.normalize("NFC", fields[0]),
        unicodedata.normalize("NFC", fields[1]),
    )
    if not source or not target:
        return None, "empty source" if not source else "empty target"
    pair_id = fields[2] if len(fields) == 3 and fields[2] else f"{file_name}:{number}"
    if pair_id in first_line_of_id:
        return None, f"id {pair_id!r} already used on line {first_line_of_id[pair_id]}"
    return Pair(source, target, pair_id), ""


def _describe(problems: list[Problem]) -> str:
    lines = [f"  {problem}" for problem in problems[:_SHOWN]]
    if len(problems) > _SHOWN:
        lines.append(f"  ... and {len(problems) - _SHOWN} more")
    return "\n".join(lines)
