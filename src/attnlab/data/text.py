"""The canonical word tokenisation of the data layer.

Word alignments (Pharaoh ``i-j`` links) are indices into the lists this function returns, so
every producer and consumer of alignments must split text with :func:`words` and nothing else.
"""

from __future__ import annotations

import re

# A word is a run of letters/digits, optionally joined by apostrophes or hyphens
# ("LORD's", "LORD’s", "Beth-el"). Every other non-space character is a token of its own
# ("¿", ",", "—").
_TOKEN = re.compile(r"\w+(?:['’-]\w+)*|[^\w\s]")
_WORD_START = re.compile(r"\w")


def words(text: str) -> list[str]:
    """Split text into words and punctuation marks.

    Args:
        text: any string.

    Returns:
        The tokens in order. Joining them with single spaces loses only the original spacing.

    Example:
        >>> words("¿Con qué limpiará el joven su camino?")
        ['¿', 'Con', 'qué', 'limpiará', 'el', 'joven', 'su', 'camino', '?']
        >>> words("the LORD’s oath, in Beth-el.")
        ['the', 'LORD’s', 'oath', ',', 'in', 'Beth-el', '.']
    """
    return _TOKEN.findall(text)


def word_spans(text: str) -> list[tuple[int, int]]:
    """Character spans ``(start, end)`` of the tokens :func:`words` returns, in the same order."""
    return [m.span() for m in _TOKEN.finditer(text)]


def is_word(token: str) -> bool:
    """True for a word token of :func:`words`, False for a punctuation token."""
    return _WORD_START.match(token) is not None
