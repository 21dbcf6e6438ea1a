"""A real headless browser for tests: Debian's chromium, driven by the ``playwright`` package.

Nothing is downloaded: playwright launches the system browser (``apt-get install chromium``)
with a fresh profile, and :func:`open_page` records console errors, page errors and every
network request, so tests can assert that a page needs nothing but itself.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def skip_reason() -> str | None:
    """Why browser tests cannot run here, or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install playwright)"
    if shutil.which(CHROMIUM) is None:
        return f"no browser at {CHROMIUM} (apt-get install -y chromium)"
    return None


@contextmanager
def browser(profile_dir: Path) -> Iterator[Any]:
    """A persistent chromium context with a fresh profile in ``profile_dir``."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(profile_dir),
            executable_path=CHROMIUM,
            args=ARGS,
            headless=True,
            viewport={"width": 1500, "height": 1000},
        )
        try:
            yield context
        finally:
            context.close()


@dataclass
class Page:
    page: Any
    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)


@contextmanager
def open_page(context: Any, path: Path, *, ready: str = "body[data-ready='1']") -> Iterator[Page]:
    """Open the local file ``path``; wait for ``ready``; collect errors and requests."""
    page = context.new_page()
    seen = Page(page)
    page.on("console", lambda m: seen.errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: seen.errors.append(str(e)))
    page.on("request", lambda r: seen.requests.append(r.url))
    try:
        page.goto(path.resolve().as_uri())
        page.wait_for_selector(ready, state="attached", timeout=30_000)
        yield seen
    finally:
        page.close()
