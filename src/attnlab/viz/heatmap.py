"""Attention weights as heatmaps: one map, a grid of layers x heads, and translation alignments.

Reading a heatmap: row ``i`` is query token ``i`` (the one attending), column ``j`` key token
``j`` (the one attended to), and cell ``(i, j)`` the weight ``w_ij``; every row sums to 1. The
colour scale starts at 0 and ends at the largest weight shown (the colour bar says which), so a
map of 500 tokens, whose weights are mostly tiny, is not drawn uniformly dark.

Legend: ``L`` query tokens, ``S`` key tokens, ``T`` target words, ``S`` source words.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ._arrays import (
    attention_map,
    block_mean,
    check_drawable,
    check_tokens,
    label_step,
    layer_stack,
    short,
)
from ._mpl import SAVE_DPI, figure_and_axes, literal_text, new_figure, set_wrapped_title, wrap_text
from .aside import aside_note, set_aside

__all__ = ["plot_attention", "plot_attention_grid", "plot_alignment"]

CMAP = "viridis"  # perceptually uniform: brighter = more weight, also in grey print
LABEL_PT = 8.0  # token label size
X_ROTATION = 60  # degrees; labels 1.25 / sin(60°) line heights apart never overlap


def _cell_inches(n: int, budget: float = 7.0, lo: float = 0.012, hi: float = 0.4) -> float:
    return min(hi, max(lo, budget / max(n, 1)))


def _axes_points(ax: Any) -> tuple[float, float]:
    """The width and height of ``ax`` in points (1/72 inch)."""
    fig = ax.figure
    box = ax.get_position()
    w, h = fig.get_size_inches()
    return box.width * w * 72, box.height * h * 72


def set_token_ticks(
    ax: Any,
    x_tokens: Sequence[str] | None,
    y_tokens: Sequence[str] | None,
    *,
    fontsize: float = LABEL_PT,
    length_pt: tuple[float, float] | None = None,
    x_positions: Sequence[int] | None = None,
) -> None:
    """Label the columns with ``x_tokens`` and the rows with ``y_tokens``.

    When there are more tokens than fit, every ``k``-th is labelled (with its position, so the
    reader can still count), and x labels are rotated, so labels never overlap. ``x_positions``
    are the columns' positions in the text when some were left out (tokens set aside).
    """
    width_pt, height_pt = length_pt or _axes_points(ax)
    if x_tokens is not None:
        n = len(x_tokens)
        slant = math.sin(math.radians(X_ROTATION))
        step = label_step(n, width_pt * slant, fontsize)
        ticks = list(range(0, n, step))
        where = list(range(n)) if x_positions is None else list(x_positions)
        labels = [
            short(x_tokens[i]) if step == 1 else f"{short(x_tokens[i])} ·{where[i]}" for i in ticks
        ]
        ax.set_xticks(
            ticks,
            labels,
            rotation=X_ROTATION,
            ha="right",
            rotation_mode="anchor",
            fontsize=fontsize,
        )
    else:
        ax.set_xticks([])
    if y_tokens is not None:
        n = len(y_tokens)
        step = label_step(n, height_pt, fontsize)
        ticks = list(range(0, n, step))
        labels = [short(y_tokens[i]) if step == 1 else f"{short(y_tokens[i])} ·{i}" for i in ticks]
        ax.set_yticks(ticks, labels, fontsize=fontsize)
    else:
        ax.set_yticks([])


@literal_text
def plot_attention(
    weights: Any,
    query_tokens: Sequence[str] | None = None,
    key_tokens: Sequence[str] | None = None,
    *,
    ax: Any = None,
    title: str | None = None,
    vmax: float | None = None,
    annotate: bool | None = None,
    colorbar: bool = True,
    scale: str = "auto",
    cmap: str = CMAP,
    aside: Sequence[bool] | None = None,
) -> Any:
    """Draw one attention map as a heatmap with token labels.

    Args:
        weights: ``[L, S]`` (leading dims of size 1, such as ``B = 1`` or one head, are
            dropped). Take one head with ``weights[0, h]`` or average heads with
            ``weights[0].mean(0)``.
        query_tokens: ``L`` labels for the rows (the attending tokens); default positions.
        key_tokens: ``S`` labels for the columns; default ``query_tokens`` when ``S == L``
            (self-attention), else positions.
        ax: draw into these axes instead of a new figure.
        title: e.g. ``"minilm · layer 5 · head 3"``.
        vmax: top of the colour scale; default the largest weight.
        annotate: write each weight in its cell; default when the map is at most 16 x 16.
        colorbar: add a colour bar.
        scale: ``"linear"`` colours, or ``"sqrt"`` (colour ∝ √weight, so the small weights of
            long inputs stay visible; the colour bar keeps the true values). ``"auto"``: sqrt
            above 64 tokens.
        cmap: a matplotlib colour map name.
        aside: ``S`` key flags: those columns are left out and every row is renormalised over
            the other keys (:func:`attnlab.viz.aside.set_aside`); the title says so.

    Returns:
        The :class:`matplotlib.figure.Figure`.

    Example:
        >>> w = np.array([[0.9, 0.1], [0.3, 0.7]])
        >>> fig = plot_attention(w, ["a", "b"], title="two tokens")
        >>> fig.axes[0].images[0].get_array().shape
        (2, 2)
    """
    W = attention_map(weights)
    L, S = W.shape
    kept = S if aside is None else S - int(np.asarray(aside, bool).sum())
    check_drawable(W, "weights", vmax, kept)
    query_tokens = check_tokens(query_tokens, L, "query_tokens")
    if key_tokens is None and S == L:
        key_tokens = query_tokens
    key_tokens = check_tokens(key_tokens, S, "key_tokens")
    positions = None  # the kept columns' positions in the text
    if aside is not None:
        flags = np.asarray(aside, bool)
        W = set_aside(W, flags)[:, ~flags]  # (L, S) -> (L, S - set aside); checks the flags
        positions = np.flatnonzero(~flags).tolist()
        note = aside_note(key_tokens, flags)
        key_tokens = [t for t, a in zip(key_tokens, flags, strict=True) if not a]
        title = f"{title}\n{note}" if title else note
        S = W.shape[1]

    cell = _cell_inches(max(L, S))
    fig, ax = figure_and_axes(ax, 2.2 + S * cell + (1.0 if colorbar else 0), 1.9 + L * cell)
    top = float(W.max()) if vmax is None else float(vmax)
    top = top if top > 0 else 1.0
    if scale == "auto":
        scale = "sqrt" if max(L, S) > 64 else "linear"
    if scale not in ("linear", "sqrt"):
        raise ValueError(f"scale must be 'linear', 'sqrt' or 'auto'; got {scale!r}")
    from matplotlib.colors import Normalize, PowerNorm

    norm = PowerNorm(0.5, vmin=0.0, vmax=top) if scale == "sqrt" else Normalize(0.0, top)
    image = ax.imshow(W, cmap=cmap, norm=norm, interpolation="nearest", aspect="auto")
    set_token_ticks(
        ax,
        key_tokens,
        query_tokens,
        length_pt=(S * cell * 72, L * cell * 72),
        x_positions=positions,
    )
    ax.set_xlabel("key: attended to")
    ax.set_ylabel("query: attending")
    if title:
        set_wrapped_title(ax, title)
    if annotate is None:
        annotate = L <= 16 and S <= 16
    if annotate:
        _annotate(ax, W, top)
    if colorbar:
        label = "attention weight" + (" (√ colour scale)" if scale == "sqrt" else "")
        fig.colorbar(image, ax=ax, label=label, shrink=0.9)
    return fig


def _annotate(ax: Any, W: np.ndarray, top: float) -> None:
    for i, j in np.ndindex(W.shape):
        w = W[i, j]
        if w == 0:  # masked (a causal model's future): left blank, so the mask's shape shows
            continue
        text = f"{w:.2f}".lstrip("0") if 0 <= w < 1 else ("1" if w == 1 else f"{w:.3g}")
        # viridis is dark below ~60% of its range: write white there, black above
        colour = "black" if top > 0 and w / top > 0.6 else "white"
        ax.text(j, i, text, ha="center", va="center", fontsize=6.5, color=colour)


@literal_text
def plot_attention_grid(
    attentions: Any,
    tokens: Sequence[str] | None = None,
    key_tokens: Sequence[str] | None = None,
    *,
    title: str | None = None,
    layer_names: Sequence[str] | None = None,
    include_mean: bool = True,
    vmax: float | None = None,
    max_cells: int = 96,
    cmap: str = CMAP,
    aside: Sequence[bool] | None = None,
) -> Any:
    """Draw every head of every layer as a small heatmap: rows are layers, columns heads.

    The panels are tiled into one image (one artist, so 30 layers x 10 panels draw in a
    moment) with one shared colour scale. Inside each panel rows are queries and columns keys,
    as in :func:`plot_attention`; maps longer than ``max_cells`` tokens are shrunk by averaging
    blocks of cells (the title says so).

    Args:
        attentions: ``[layers, H, L, S]`` (a batch dim of size 1 is dropped), e.g.
            ``torch.stack(model(..., output_attentions=True).attentions)[:, 0]``.
        tokens: ``L`` query labels, written beside the first panel of the first row when
            they fit.
        key_tokens: ``S`` key labels; default ``tokens`` when ``S == L``.
        title: figure title, e.g. the model and the sentence.
        layer_names: one row label per layer; default ``"layer 0"``, ``"layer 1"``, ...
        include_mean: add a last column with the head average of each layer.
        vmax: top of the shared colour scale; default the largest weight shown.
        max_cells: panels larger than this are averaged down to it (and to what a panel's
            pixels hold in a figure saved at ``SAVE_DPI``: a cell never falls between pixels).
        cmap: a matplotlib colour map name.
        aside: ``S`` key flags: those columns are left out of every panel and each row is
            renormalised over the other keys (the mean column: the mean of the heads,
            renormalised); the title says so.

    Returns:
        The :class:`matplotlib.figure.Figure`; ``fig.axes[0].images[0]`` is the tiled image
        (white gaps between panels are masked cells).
    """
    A = layer_stack(attentions)
    n_layers, H, L, S = A.shape
    tokens = check_tokens(tokens, L, "tokens")
    if key_tokens is None and S == L:
        key_tokens = tokens
    key_tokens = check_tokens(key_tokens, S, "key_tokens")
    if layer_names is None:
        layer_names = [f"layer {i}" for i in range(n_layers)]
    elif len(layer_names) != n_layers:
        raise ValueError(f"layer_names has {len(layer_names)} names for {n_layers} layers")

    flags, note = None, ""
    if aside is not None:
        flags = np.asarray(aside, bool)
        if flags.shape != (S,):
            raise ValueError(f"aside must be {S} flags, one per key; got shape {flags.shape}")
        note = aside_note(key_tokens, flags)
        key_tokens = [t for t, a in zip(key_tokens, flags, strict=True) if not a]
    check_drawable(A, "attentions", vmax, len(key_tokens))
    ncols = H + include_mean
    thumb = min(1.4, max(0.8, 11.0 / ncols))  # inches per panel
    # a panel's cells and the gap after it get at least a pixel each when saved: drawn
    # "nearest" into fewer pixels than cells, whole key columns (a head's only target) vanished
    cells = min(max_cells, max(1, int((thumb * SAVE_DPI - 1) / 1.12)))
    panels = np.stack([_panels(A[i], include_mean, flags, cells) for i in range(n_layers)])
    S_shown = len(key_tokens)  # [layers, cols, pl, ps] above, averaged down from (L, S_shown)
    pl, ps = panels.shape[2:]
    gap = max(1, round(0.12 * max(pl, ps)))
    mosaic = np.full((n_layers * (pl + gap) - gap, ncols * (ps + gap) - gap), np.nan)
    for li in range(n_layers):
        for col in range(ncols):
            r, c = li * (pl + gap), col * (ps + gap)
            mosaic[r : r + pl, c : c + ps] = panels[li, col]

    # token labels beside the first panel, when readable, and only where a cell is one token
    # (a panel averaged down has cells of several)
    labelled = max(L, S_shown) <= 24 and (pl, ps) == (L, S_shown)
    left, right = (1.1 if labelled else 0.3), 1.9
    width = left + ncols * thumb + right
    shrunk = ""
    if max(L, S_shown) > max_cells:
        shrunk = f" (each panel averaged down from {L} x {S_shown} to {pl} x {ps} cells)"
    heading = "\n".join(x for x in ((title or "") + shrunk, note) if x)
    heading = wrap_text(heading, width - 0.2, 10) if heading else ""  # (the figure's width)
    heading_lines = heading.count("\n") + 1 if heading else 0
    top_in, bottom = 0.45 + 0.2 * heading_lines, (0.9 if labelled else 0.3)
    height = top_in + n_layers * thumb + bottom
    fig = new_figure(width, height)
    ax = fig.add_axes(
        (left / width, bottom / height, ncols * thumb / width, n_layers * thumb / height)
    )
    top = float(np.nanmax(panels)) if vmax is None else float(vmax)
    image = ax.imshow(
        mosaic,
        cmap=_cmap_with_gaps(cmap),
        vmin=0.0,
        vmax=top if top > 0 else 1.0,
        interpolation="nearest",
        aspect="auto",
    )

    def centres(n: int, size: int) -> list[float]:
        return [(size + gap) * i + (size - 1) / 2 for i in range(n)]

    names = [f"head {h}" for h in range(H)] + (["mean of heads"] if include_mean else [])
    ax.set_xticks(centres(ncols, ps), names, fontsize=8)
    ax.xaxis.tick_top()
    layers_axis = ax.secondary_yaxis("right")
    layers_axis.set_yticks(centres(n_layers, pl), layer_names, fontsize=8)
    layers_axis.tick_params(length=0)
    if labelled:  # the first panel's query rows on the left, the last row's keys at the bottom
        size = 5.5
        step = label_step(pl, thumb * 72, size)
        ax.set_yticks(
            list(range(0, pl, step)),
            [short(tokens[i], 12) for i in range(0, pl, step)],
            fontsize=size,
        )
        step = label_step(ps, thumb * 72, size)
        keys_axis = ax.secondary_xaxis("bottom")
        keys_axis.set_xticks(
            list(range(0, ps, step)),
            [short(key_tokens[i], 12) for i in range(0, ps, step)],
            fontsize=size,
            rotation=90,
        )
        keys_axis.tick_params(length=0)
        keys_axis.spines["bottom"].set_visible(False)
    else:
        ax.set_yticks([])
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    for side in layers_axis.spines.values():
        side.set_visible(False)
    bar = min(3.0, n_layers * thumb)
    cax = fig.add_axes(
        (1 - (right - 0.95) / width, 1 - (top_in + bar) / height, 0.16 / width, bar / height)
    )
    fig.colorbar(image, cax=cax, label="attention weight")
    if heading:
        fig.suptitle(heading, y=1 - 0.12 / height, va="top", fontsize=10)
    return fig


def _panels(A: np.ndarray, include_mean: bool, aside: np.ndarray | None, cells: int) -> np.ndarray:
    """One layer's panels ``[H, L, S]`` -> ``[H (+1), <= cells, <= cells]``: the heads (and their
    mean), set-aside keys dropped and rows renormalised, then averaged down to ``cells``."""
    P = np.concatenate([A, A.mean(axis=0, keepdims=True)]) if include_mean else A
    if aside is not None:
        P = set_aside(P, aside)[..., ~aside]
    return block_mean(P, cells, cells)


def _cmap_with_gaps(name: str) -> Any:
    """The colour map ``name`` with NaN (the gaps between panels) drawn white."""
    import matplotlib

    return matplotlib.colormaps[name].with_extremes(bad="white")


def _links(links: Iterable[Sequence[int]] | None) -> set[tuple[int, int]]:
    return {(int(i), int(j)) for i, j in (links or ())}


@literal_text
def plot_alignment(
    weights: Any,
    source_words: Sequence[str],
    target_words: Sequence[str],
    reference: Any = None,
    *,
    predicted: str | float | None = "argmax",
    units: str = "words",
    ax: Any = None,
    title: str | None = None,
    cmap: str = "Greys",
) -> Any:
    """Draw translation attention with reference word alignments overlaid.

    Rows are target words (the decoder's queries), columns source words. Reference links
    ``(source index, target index)`` are drawn as squares: solid red for *sure* links, dashed
    orange for *possible* ones. The links the attention itself predicts are dots; with a
    reference, the title gives their alignment error rate (AER, :func:`attnlab.data.aer`).

    Args:
        weights: ``[T, S]`` word-level attention (sum subword attention into words first:
            :func:`attnlab.viz.merge_subwords`). Average heads or pick one before.
        source_words: ``S`` labels.
        target_words: ``T`` labels.
        reference: an :class:`attnlab.data.Alignment`, a ``(sure, possible)`` pair of link
            sets, or ``None``.
        predicted: ``"argmax"`` marks each target word's strongest source word, a float marks
            every weight at or above it, ``None`` marks nothing
            (:func:`attnlab.data.attention_to_links`).
        units: what the rows and columns are, for the axis labels (``"tokens"`` for subwords).
        ax: draw into these axes.
        title: the title; the AER is appended when there is a reference.
        cmap: colour map of the weights (greys leave the link colours readable).

    Returns:
        The :class:`matplotlib.figure.Figure`.
    """
    from attnlab.data.alignment import aer, attention_to_links

    W = attention_map(weights)
    T, S = W.shape
    check_drawable(W, "weights", None, S)  # (as the other heatmaps: no cells, negatives)
    target_words = check_tokens(target_words, T, "target_words")
    source_words = check_tokens(source_words, S, "source_words")
    if reference is None:
        sure, possible = set(), set()
    elif hasattr(reference, "sure"):
        sure, possible = _links(reference.sure), _links(reference.possible)
    else:
        sure, possible = (_links(x) for x in reference)
    possible |= sure
    for i, j in possible:
        if not (0 <= i < S and 0 <= j < T):
            raise ValueError(
                f"reference link ({i}, {j}) is outside the {S} source x {T} target words; links "
                "are (source index, target index) into attnlab.data.words(...) of each sentence"
            )

    cell = _cell_inches(max(T, S), budget=8.0, lo=0.15)
    fig, ax = figure_and_axes(ax, 2.4 + S * cell + 1.0, 2.0 + T * cell)
    image = ax.imshow(
        W,
        cmap=cmap,
        vmin=0.0,
        vmax=max(float(W.max()), 1e-12),
        interpolation="nearest",
        aspect="auto",
    )
    from matplotlib.patches import Rectangle

    for i, j in sorted(possible - sure):
        ax.add_patch(
            Rectangle((i - 0.45, j - 0.45), 0.9, 0.9, fill=False, ec="tab:orange", lw=1.4, ls="--")
        )
    for i, j in sorted(sure):
        ax.add_patch(Rectangle((i - 0.45, j - 0.45), 0.9, 0.9, fill=False, ec="tab:red", lw=1.8))
    if predicted is not None:
        threshold = None if predicted == "argmax" else float(predicted)
        links = sorted(attention_to_links(W, threshold=threshold))
        if links:
            ax.plot(
                [i for i, _ in links],
                [j for _, j in links],
                "o",
                color="tab:blue",
                markersize=4,
                label="attention's links",
            )
        if reference is not None:
            score = aer(links, sure, possible)
            title = f"{title} · AER {score:.2f}" if title else f"AER {score:.2f}"
    set_token_ticks(ax, source_words, target_words, length_pt=(S * cell * 72, T * cell * 72))
    ax.set_xlabel(f"source {units}")
    ax.set_ylabel(f"target {units}")
    if reference is not None:
        from matplotlib.lines import Line2D

        handles = [
            Line2D([], [], color="tab:red", lw=1.8, label="sure link"),
            Line2D([], [], color="tab:orange", lw=1.4, ls="--", label="possible link"),
        ]
        if predicted is not None:
            handles.append(
                Line2D(
                    [],
                    [],
                    color="tab:blue",
                    marker="o",
                    ls="",
                    markersize=4,
                    label="attention's link",
                )
            )
        ax.legend(
            handles=handles,
            loc="upper left",
            bbox_to_anchor=(1.02, -0.02),
            fontsize=7,
            frameon=False,
        )
    if title:
        set_wrapped_title(ax, title)
    fig.colorbar(image, ax=ax, label="attention weight", shrink=0.8)
    return fig
