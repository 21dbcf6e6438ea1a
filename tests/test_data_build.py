"""scripts/build_bible_corpus.py: its pieces on hand-made OSIS, and --check on the real modules."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
SWORD_KJV = Path("/usr/share/sword/modules/texts/ztext/engKJV2006eb")
needs_sword = pytest.mark.skipif(
    not SWORD_KJV.is_dir(),
    reason="SWORD modules not installed (apt-get install sword-text-kjv sword-text-sparv)",
)


@pytest.fixture(scope="module")
def build():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import build_bible_corpus
    finally:
        sys.path.remove(str(SCRIPTS))
    return build_bible_corpus


@pytest.fixture(scope="module")
def osis(build):
    return sys.modules["sword_osis"]


EN_XML = (
    '<div type="x-milestone" subType="x-preverse" sID="pv1"/>¶ In the '
    '<w lemma="strong:H7225">beginning</w> <w lemma="strong:H0430">God</w> '
    'the \\nd <w lemma="strong:H3068">LORD’s</w></divineName> '
    '<title type="main">Heading</title><transChange type="added">was</transChange> '
    '<w lemma="strong:H0430">God</w>.<note placement="foot">a <w lemma="strong:H1">note</w></note>'
)
ES_XML = (
    '<w lemma="strong:H7225">EN el principio</w> <w lemma="strong:H0430">Dios</w>, '
    '<w lemma="strong:H3068 H0430">de Jehová</w> <w lemma="strong:H0430">Dios</w>.'
)


def test_osis_to_text_and_numbers(osis):
    text, numbers = osis.tagged_text(EN_XML)
    assert text == osis.verse_text(EN_XML) == "In the beginning God the LORD’s was God."
    # tokens: In the beginning God the LORD’s was God .
    assert numbers == [set(), set(), {"H7225"}, {"H430"}, set(), {"H3068"}, set(), {"H430"}, set()]
    text, numbers = osis.tagged_text(ES_XML)
    assert text == "EN el principio Dios, de Jehová Dios."
    assert numbers[5:7] == [{"H3068", "H430"}, {"H3068", "H430"}]  # two numbers on one <w>
    assert numbers[4] == set()  # the comma


def test_canonical_titles_and_subscriptions_are_kept(osis):
    xml = (
        '<title canonical="true" type="psalm">A <w lemma="strong:H4210">Psalm</w>.</title> '
        'Amen. <chapter eID="Heb.13"/> <div eID="x" type="x-p"/> <title>Written from Italy.</title>'
    )
    assert osis.verse_text(xml) == osis.tagged_text(xml)[0] == "A Psalm. Amen. Written from Italy."


def test_align_sure_and_possible(build, osis):
    en_text, en_numbers = osis.tagged_text(EN_XML)
    es_text, es_numbers = osis.tagged_text(ES_XML)
    en, es = build.words(en_text), build.words(es_text)
    a = build.align(en, en_numbers, es, es_numbers)
    # "beginning" <-> "EN el principio": one content word each side -> sure with "principio".
    assert (en.index("beginning"), es.index("principio")) in a.sure
    assert (en.index("beginning"), es.index("el")) in a.possible - a.sure
    # God twice / Dios three times: possible only.
    god = {(i, j) for i, j in a.possible if en[i] == "God"}
    assert god and not god & a.sure
    assert (en.index("LORD’s"), es.index("Jehová")) in a.sure


def test_fix_spanish(build):
    casing = build.casing_model(["y dijo David á Jehová", "vió que la luz era buena y dijo"])
    fix = build.fix_spanish
    assert fix("Gen.1.1", "EN el principio", casing) == "En el principio"
    assert fix("Gen.4.1", "Y DAVID dijo", casing) == "Y David dijo"
    assert (
        fix("Ps.3.1", "Salmo de David. ¡OH JEHOVÁ, oye", casing)
        == "Salmo de David. ¡Oh Jehová, oye"
    )
    assert fix("Ps.3.2", "OH JEHOVÁ", casing) == "OH JEHOVÁ"  # only verse 1 of a chapter
    assert fix("Ps.119.9", "BETH ¿Con qué", casing) == "¿Con qué"
    assert fix("Ps.119.1", "ALEPH. BIENAVENTURADOS los", casing) == "Bienaventurados los"


def test_misaligned_detects_a_shift(build):
    f = frozenset
    verses = [(f"v{k}", f({f"a{k}", f"b{k}"}), f({f"a{k}", f"b{k}"})) for k in range(10)]
    verses[4] = ("v4", f({"a4", "b4"}), f({"a5", "b5"}))  # Spanish of 4 is the text of 5
    verses[7] = ("v7", f(), f({"a9"}))  # no English numbers: cannot judge, kept
    assert build.misaligned(verses) == ["v4"]


@needs_sword
def test_gen_1_1_god_dios_is_a_sure_link(build):
    en = dict(build.read_bible(build.MODULES / build.ENGLISH))["Gen.1.1"]
    es = dict(build.read_bible(build.MODULES / build.SPANISH))["Gen.1.1"]
    (en_text, en_numbers), (es_text, es_numbers) = build.tagged_text(en), build.tagged_text(es)
    E, S = build.words(en_text), build.words(es_text)
    a = build.align(E, en_numbers, S, es_numbers)
    assert (E.index("God"), S.index("Dios")) in a.sure
    assert (E.index("created"), S.index("crió")) in a.sure


@needs_sword
def test_shipped_corpus_matches_a_fresh_build():
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "build_bible_corpus.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("OK")


def test_check_reports_stale_files(build, tmp_path, monkeypatch, capsys):
    def fake_build(out):  # a "fresh build" without the SWORD modules
        for name in build.OUTPUTS:
            build._write_gzip(out / name, [name, "same"])

    monkeypatch.setattr(build, "build", fake_build)
    fake_build(tmp_path)
    assert build.check(tmp_path) == 0
    build._write_gzip(tmp_path / "en.txt.gz", ["en.txt.gz", "edited"])
    (tmp_path / "stats.json").unlink()
    assert build.check(tmp_path) == 1
    err = capsys.readouterr().err
    assert "en.txt.gz: content differs" in err and "stats.json: missing" in err
    assert "python scripts/build_bible_corpus.py" in err  # says how to fix it
