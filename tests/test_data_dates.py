"""Human dates -> ISO dates (attnlab.data.dates); needs Babel."""

import datetime as dt

import pytest

pytest.importorskip("babel", reason="the dates task needs Babel: pip install babel")

from attnlab.data.dates import (  # noqa: E402
    LOCALES,
    format_human,
    load_dates,
    split_days,
    styles_for,
)


def test_known_strings():
    day = dt.date(2005, 2, 1)
    assert format_human(day, "en_US", "long") == "February 1, 2005"
    assert format_human(day, "en_GB", "short") == "01/02/2005"  # 4-digit year
    assert format_human(day, "fr_FR", "long") == "1 février 2005"
    assert format_human(day, "de_DE", "long") == "1. Februar 2005"
    assert format_human(day, "es_ES", "dots") == "01.02.2005"
    assert "short" not in styles_for("en_US")  # month-first numbers would be ambiguous


def test_default_sizes_and_determinism():
    test = load_dates("test")
    assert len(test) == 1000 and len({p.source for p in test}) == 1000
    assert load_dates("test") == test
    assert load_dates("validation", n=10) == load_dates("validation", n=20)[:10]
    assert load_dates("train", n=50, seed=1) != load_dates("train", n=50, seed=0)
    assert len(load_dates("train", n=200, seed=3)) == 200


def test_targets_are_iso_and_sources_format_back():
    for pair in load_dates("test") + load_dates("train", n=500):
        day = dt.date.fromisoformat(pair.target)
        assert dt.date(1900, 1, 1) <= day <= dt.date(2099, 12, 31)
        iso, locale, style = pair.id.split("/")
        assert iso == pair.target and locale in LOCALES and style in styles_for(locale)
        assert format_human(day, locale, style) == pair.source


def test_an_independent_parser_agrees():
    # en_US long ("February 1, 2005") and the dotted style parse with the standard library.
    pairs = load_dates("test") + load_dates("validation")
    checked = 0
    for pair in pairs:
        style = pair.id.rsplit("/", 1)[1]
        fmt = {"dots": "%d.%m.%Y"}.get(style)
        if pair.id.endswith("/en_US/long"):
            fmt = "%B %d, %Y"
        if fmt:
            assert dt.datetime.strptime(pair.source, fmt).date().isoformat() == pair.target
            checked += 1
    assert checked > 100


def test_no_date_or_string_shared_between_splits():
    days = {name: set(split_days(name)) for name in ("train", "validation", "test")}
    assert not days["train"] & days["test"]
    assert not days["train"] & days["validation"]
    assert not days["validation"] & days["test"]
    assert sum(map(len, days.values())) == (dt.date(2099, 12, 31) - dt.date(1900, 1, 1)).days + 1
    pairs = {name: load_dates(name) for name in days}
    for a, b in (("train", "test"), ("train", "validation"), ("validation", "test")):
        assert not {p.source for p in pairs[a]} & {p.source for p in pairs[b]}
        assert not {p.target for p in pairs[a]} & {p.target for p in pairs[b]}


def test_a_string_determines_its_date():
    # All styles of every day in 2005 and 2012 (day <= 12 makes day/month swaps possible):
    # each string maps to one date. (Checked over 1900-2099: 1.6M strings, no collision.)
    seen = {}
    for year in (2005, 2012):
        day = dt.date(year, 1, 1)
        while day.year == year:
            for locale in LOCALES:
                for style in styles_for(locale):
                    text = format_human(day, locale, style)
                    assert seen.setdefault(text, day) == day, (text, seen[text], day)
            day += dt.timedelta(1)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown split"):
        load_dates("dev")
    with pytest.raises(ValueError, match="n=10000000"):
        load_dates("test", n=10_000_000)
    with pytest.raises(ValueError, match="unknown style"):
        format_human(dt.date(2005, 2, 1), "en_US", "tiny")
