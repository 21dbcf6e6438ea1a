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
