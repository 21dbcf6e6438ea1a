"""Human-readable dates -> ISO dates: a small, quick translation task.

``"mardi 1 février 2005"`` -> ``"2005-02-01"``. Attention has to find the day, the month name
and the year wherever the locale puts them, the classic picture of attention as alignment.

Sources are formatted offline with Babel (CLDR data) in 5 locales and up to 7 patterns::

    locales   en_US en_GB fr_FR de_DE es_ES
    styles    full  long  medium  short        the locale's own patterns, e.g. en_US full
                                               "Tuesday, February 1, 2005"; short with a
                                               4-digit year ("01/02/2005"), not in en_US
              dmy   "d MMMM y"     1 February 2005      custom, every locale
              wdmy  "EEE d MMM y"  Tue 1 Feb 2005
              dots  "dd.MM.y"      01.02.2005

en_US has no numeric style: its month-first "2/1/2005" would read as 2 January in the day-first
locales, and a source must determine its target. 2-digit years are widened for the same reason
(1905 vs 2005).

Splits are fixed by the *date*, not by the string: the days 1900-01-01 ... 2099-12-31 are split
by the SHA-256 of the ISO date (5% test, 5% validation, 90% train), so no date, and hence no
source or target string, appears in two splits. ``seed`` only changes which pairs are drawn.
Exact strings depend on the CLDR data of the installed Babel version.

Example:
    >>> pairs = load_dates("test", n=3)
    >>> [len(p.target) for p in pairs]
    [10, 10, 10]
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import random

from .pair import Pair

LOCALES = ("en_US", "en_GB", "fr_FR", "de_DE", "es_ES")
STANDARD_STYLES = ("full", "long", "medium", "short")
CUSTOM_PATTERNS = {"dmy": "d MMMM y", "wdmy": "EEE d MMM y", "dots": "dd.MM.y"}
FIRST_DAY, LAST_DAY = dt.date(1900, 1, 1), dt.date(2099, 12, 31)
DEFAULT_SIZES = {"train": 20_000, "validation": 1_000, "test": 1_000}
_SPLIT_PERCENT = {"test": range(0, 5), "validation": range(5, 10), "train": range(10, 100)}


def load_dates(split: str = "train", n: int | None = None, *, seed: int = 0) -> list[Pair]:
    """Draw ``n`` distinct (human date, ISO date) pairs from one split.

    Args:
        split: ``"train"``, ``"validation"`` or ``"test"``.
        n: number of pairs; default 20,000 for train and 1,000 for validation and test.
        seed: the draw; the same (split, n, seed) always gives the same list (for a given
            Babel version). Keep ``seed=0`` for validation and test to compare with others.

    Returns:
        ``Pair(source="1 février 2005", target="2005-02-01", id="2005-02-01/fr_FR/long")``,
        sources distinct within the list.

    Raises:
        ValueError: unknown split, or ``n`` larger than the split can supply.
        ModuleNotFoundError: Babel is not installed (``pip install babel``).
    """
    if split not in DEFAULT_SIZES:
        raise ValueError(f"unknown split {split!r}; expected one of {list(DEFAULT_SIZES)}")
    n = DEFAULT_SIZES[split] if n is None else n
    days = split_days(split)
    capacity = len(days) * len(LOCALES) * len(CUSTOM_PATTERNS)  # a lower bound on distinct
    if not 0 <= n <= capacity:
        raise ValueError(f"n={n} is not in [0, {capacity}] for the {split} split")

    rng = random.Random(f"attnlab.dates/{split}/{seed}")  # str seeds are stable across runs
    pairs: dict[str, Pair] = {}  # source -> pair, first draw wins
    while len(pairs) < n:
        day = days[rng.randrange(len(days))]
        locale = LOCALES[rng.randrange(len(LOCALES))]
        styles = styles_for(locale)
        style = styles[rng.randrange(len(styles))]
        source = format_human(day, locale, style)
        pairs.setdefault(source, Pair(source, day.isoformat(), f"{day}/{locale}/{style}"))
    return list(pairs.values())


def styles_for(locale: str) -> tuple[str, ...]:
    """The style names drawn for a locale (en_US has no ``short``, see the module docstring)."""
    standard = tuple(s for s in STANDARD_STYLES if not (locale == "en_US" and s == "short"))
    return standard + tuple(CUSTOM_PATTERNS)


def format_human(day: dt.date, locale: str, style: str) -> str:
    """Format one date the way :func:`load_dates` does.

    Example:
        >>> format_human(dt.date(2005, 2, 1), "en_GB", "short")
        '01/02/2005'
    """
    return _formatter(locale, style)(day)


@functools.cache
def _formatter(locale: str, style: str):
    from babel.dates import format_date, get_date_format  # optional dependency: import late

    if style in CUSTOM_PATTERNS:
        pattern = CUSTOM_PATTERNS[style]
    elif style in STANDARD_STYLES:
        pattern = get_date_format(style, locale=locale).pattern
        if "yyyy" not in pattern:
            pattern = pattern.replace("yy", "y")  # 2-digit year -> full year
    else:
        raise ValueError(f"unknown style {style!r}; expected one of {styles_for(locale)}")
    return functools.partial(format_date, format=pattern, locale=locale)


@functools.cache
def split_days(split: str) -> tuple[dt.date, ...]:
    """All days from 1900-01-01 to 2099-12-31 that belong to ``split``, in order."""
    percent = _SPLIT_PERCENT[split]
    n_days = (LAST_DAY - FIRST_DAY).days + 1
    days = (FIRST_DAY + dt.timedelta(k) for k in range(n_days))
    return tuple(d for d in days if _percentile(d) in percent)


def _percentile(day: dt.date) -> int:
    digest = hashlib.sha256(day.isoformat().encode("ascii")).digest()
    return int.from_bytes(digest[:8], "big") % 100
