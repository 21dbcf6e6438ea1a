"""matplotlib, imported on first use, and deterministic PNG output.

Figures are built with :class:`matplotlib.figure.Figure` directly, never through ``pyplot``: no
global figure registry (nothing leaks in long runs), no GUI backend, safe in threads and under
pytest. In Jupyter a returned ``Figure`` still displays inline.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attnlab._files import atomic_save_png


def require_matplotlib() -> Any:
    """Import matplotlib or raise an ImportError that names the fix."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "attnlab's plots need matplotlib; fix: pip install 'attnlab[viz]' "
            "(or pip install matplotlib)"
        ) from None
    return matplotlib


def literal_text(draw: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a drawing function so that the text it writes is drawn as written: a ``$`` in a
    token or a sentence is a dollar sign, not the start of matplotlib maths ("$5 and $6" lost
    its dollars and italicised "and"; "$$" crashed the save). Text made outside is untouched."""

    @functools.wraps(draw)
    def drawing(*args: Any, **kwargs: Any) -> Any:
        import matplotlib

        with matplotlib.rc_context({"text.parse_math": False}):
            return draw(*args, **kwargs)

    return drawing


def new_figure(width: float, height: float, **kwargs: Any) -> Any:
    """A fresh ``Figure`` of ``width`` x ``height`` inches, not registered with pyplot."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), **kwargs)
    FigureCanvasAgg(fig)  # an Agg canvas: fig.canvas.draw() and buffer_rgba() work headless
    return fig


def figure_and_axes(ax: Any, width: float, height: float) -> tuple[Any, Any]:
    """``(fig, ax)``: the caller's axes, or a new figure with one axes."""
    if ax is not None:
        return ax.figure, ax
    fig = new_figure(width, height, layout="constrained")
    return fig, fig.add_subplot()


def wrap_text(text: str, width_inches: float, fontsize: float | str) -> str:
    """``text`` with line breaks added so that no line is wider than ``width_inches`` at
    ``fontsize`` (points, or a name such as ``"large"``): a title longer than its figure is
    wrapped instead of running off it. Lines break at spaces; a word wider than a whole line
    is cut. The widths are measured with matplotlib's own text layout (Agg), not guessed from
    the number of characters, so wide letters and CJK wrap as early as they must."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import RendererAgg
    from matplotlib.font_manager import FontProperties

    prop = FontProperties(size=fontsize)
    renderer = RendererAgg(1, 1, 72)  # 72 pixels per inch: widths in points
    limit = max(width_inches, 0.5) * 72

    def fits(line: str) -> bool:
        return renderer.get_text_width_height_descent(line, prop, ismath=False)[0] <= limit

    lines: list[str] = []
    for paragraph in text.split("\n"):
        line = ""
        for word in paragraph.split(" "):
            trial = f"{line} {word}" if line else word
            if fits(trial):
                line = trial
                continue
            if line:
                lines.append(line)
            while len(word) > 1 and not fits(word):  # one word wider than the line: cut it
                cut = max(k for k in range(1, len(word)) if k == 1 or fits(word[:k]))
                lines.append(word[:cut])
                word = word[cut:]
            line = word
        lines.append(line)
    return "\n".join(lines)


def set_wrapped_title(ax: Any, title: str, **kwargs: Any) -> Any:
    """``ax.set_title(title, **kwargs)``, wrapped to the width of the axes (a title is centred
    on its axes; their width before the layout is done, which the layout only widens)."""
    import matplotlib

    fontsize = kwargs.get("fontsize", matplotlib.rcParams["axes.titlesize"])
    width = ax.get_position().width * float(ax.figure.get_figwidth())
    return ax.set_title(wrap_text(title, width, fontsize), **kwargs)


SAVE_DPI = 110  # pixels per inch of a saved figure (figures size their images by it)


def save_figure(fig: Any, path: str | os.PathLike, *, dpi: int = SAVE_DPI) -> Path:
    """Write ``fig`` as a PNG whose bytes depend only on the figure.

    matplotlib writes a ``Software`` text chunk naming its version into PNGs; it is dropped, and
    no time stamp is written, so the same input gives the same file (byte for byte, on the same
    matplotlib and fonts).

    Returns:
        The path written.
    """
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"save_figure writes PNG files; got {str(path)!r}. Fix: end it in .png")
    return atomic_save_png(fig, path, dpi=dpi, metadata={"Software": None})
