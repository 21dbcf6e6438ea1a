"""Build hooks of the documentation site (mkdocs.yml names this file; it is not a page).

While a page that executes code is rendered, the working directory is that page's folder in
the built site, so a figure saved by a page's code (``viz.save_figure(fig, "name.png")``) lands
next to the page and ``![...](name.png)`` shows it.
"""

from __future__ import annotations

import os
from pathlib import Path

_EXEC = 'exec="on"'
_previous: list[str] = []


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
    return html
