"""The one record type shared by every data loader: a sentence pair with an id."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Pair:
    """A source sentence, its translation, and a stable identifier.

    Attributes:
        source: text in the source language (for the Bible corpus: English).
        target: text in the target language (for the Bible corpus: Spanish).
        id: where the pair comes from, unique within one loader call: a verse id such as
            ``"Gen.1.1"``, a date pair id such as ``"2005-02-01/fr_FR/long"``, or for a TSV
            file the third column or ``"line 12"``.

    Example:
        >>> Pair("In the beginning", "EN el principio", "Gen.1.1").source
        'In the beginning'
    """

    source: str
    target: str
    id: str
