"""Build hooks of the documentation site (mkdocs.yml names this file; it is not a page).

While a page that executes code is rendered, the working directory is that page's folder in
the built site, so a figure saved by a page's code (``viz.save_figure(fig, "name.png")``) lands
next to the page and ``![...](name.png)`` shows it.

Math is typeset when the site builds: ``pymdownx.arithmatex`` (generic mode) leaves each
``\\( ... \\)`` and ``\\[ ... \\]`` in an element of class ``arithmatex``, and
``latex2mathml`` turns it into MathML, which browsers render themselves: the site loads no
script and no font from elsewhere, and reads the same offline.
"""

from __future__ import annotations

import html
import os
import re
from pathlib import Path

from latex2mathml.converter import convert

_EXEC = 'exec="on"'
_previous: list[str] = []
_MATH = re.compile(r'<(span|div) class="arithmatex">(.*?)</\1>', re.S)
_DELIMITERS = {"span": ("\\(", "\\)"), "div": ("\\[", "\\]")}


def on_page_markdown(markdown, page, config, files, **kwargs):
    if _EXEC in markdown:
        out = Path(config.site_dir) / Path(page.file.dest_uri).parent
        out.mkdir(parents=True, exist_ok=True)
        _previous.append(os.getcwd())
        os.chdir(out)
    return markdown


def on_page_content(html, page, config, files, **kwargs):
    if _previous:
        os.chdir(_previous.pop())
    return _MATH.sub(lambda m: _mathml(m, page), html)


def _mathml(match: re.Match, page) -> str:
    """An arithmatex element with its LaTeX as MathML (inline in a span, a block in a div)."""
    tag, body = match.group(1), html.unescape(match.group(2)).strip()
    opening, closing = _DELIMITERS[tag]
    if not (body.startswith(opening) and body.endswith(closing)):
        raise ValueError(f"{page.file.src_uri}: math not in {opening} ... {closing}: {body!r}")
    latex = body[len(opening) : -len(closing)]
    try:
        mathml = convert(latex, display="block" if tag == "div" else "inline")
    except Exception as error:  # (latex2mathml raises its own kinds for unknown commands)
        raise ValueError(f"{page.file.src_uri}: cannot typeset {latex!r}: {error}") from error
    return f'<{tag} class="arithmatex">{mathml}</{tag}>'
