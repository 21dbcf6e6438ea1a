"""How self-attention moves token vectors: seed 001's picture, for real models.

Self-attention replaces each token's vector by a weighted mix of all tokens' values, so in a
transformer each token's vector moves: "bank" in "Write a poem about a man fishing on a river
bank" moves toward the region of "river" and "fishing". To see it, the vectors before and after
attention are projected to 2-D with **one** PCA fitted on both sets (:func:`fit_pca`; two
separate fits would give two unrelated planes), and an arrow goes from each token's old position
to its new one. For one *focus* token, a line goes to every other token, as wide as the weight
with which the focus token attends to it: the pull of each token on the focus token.

A 2-D projection keeps only part of the geometry (the axis labels say how much of the variance):
use it to see directions and who pulls whom, and :func:`word_distances` for exact distances.

Legend: ``L`` tokens, ``D`` model width, ``H`` heads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._arrays import check_tokens, short, split_occurrence, squeeze_batch, to_numpy
from ._mpl import figure_and_axes, literal_text, new_figure, set_wrapped_title, wrap_text
from .aside import aside_note, set_aside
from .projection import PCA, fit_pca

__all__ = ["plot_movement", "plot_head_movements", "plot_trajectories", "plot_word_distances"]

BEFORE = "#9a9a9a"
AFTER = "#1f5fa8"
FOCUS = "#c0392b"
PULL = "#e67e22"
MAX_PULL_WIDTH = 9.0  # points, for the strongest pull
SUPTITLE_SIZE = 10.0  # points, plot_head_movements' title


def _vectors(x: Any, name: str) -> np.ndarray:
    return squeeze_batch(to_numpy(x, name), name, 2, "token vectors [L, D]")


def _focus_index(focus: int | str | None, tokens: list[str]) -> int | None:
    """The focus token's index: an index as given, or a token string's **first** occurrence
    (``"bank#2"``: its second), as :meth:`Trace.find_focus` reads a word."""
    if focus is None:
        return None
    if isinstance(focus, str):
        word, occurrence = split_occurrence(focus)
        matches = [i for i, t in enumerate(tokens) if t.lower() == word.lower()]
        if len(matches) <= occurrence:
            found = f"{len(matches)} time" + ("" if len(matches) == 1 else "s")
            raise ValueError(
                f"focus token {focus!r}: expected a token of {tokens[:20]}"
                + (
                    f" used at least {occurrence + 1} times; {word!r} is there {found}"
                    if matches
                    else ""
                )
                + ". Fix: pass one of the tokens (WORD#N for its N-th use) or a token index"
            )
        return matches[occurrence]
    if not -len(tokens) <= focus < len(tokens):
        raise ValueError(f"focus {focus} is out of range for {len(tokens)} tokens")
    return focus % len(tokens)


def pull_widths(
    weights_row: np.ndarray, max_width: float = MAX_PULL_WIDTH, focus: int | None = None
) -> np.ndarray:
    """Line widths proportional to the weights, the largest drawn ``max_width`` points wide.

    ``focus``: the token whose row this is; its weight on itself is no line, so it does not
    set the scale (as in the explorer page): a focus that keeps 0.8 on itself would have made
    every drawn line thin."""
    drawn = weights_row if focus is None else np.delete(weights_row, focus)
    top = float(drawn.max()) if drawn.size else 0.0
    return weights_row * (max_width / top) if top > 0 else np.zeros_like(weights_row)


def _draw_movement(
    ax: Any,
    P0: np.ndarray,
    P1: np.ndarray,
    tokens: list[str],
    row: np.ndarray | None,
    focus: int | None,
    *,
    max_labels: int,
    show_legend: bool,
    fontsize: float = 7.5,
    limits: np.ndarray | None = None,
) -> None:
    """Draw positions ``P0 -> P1`` ``[L, 2]``, and the pulls ``row`` ``[L]`` on ``focus``.

    ``limits`` ``[[x0, y0], [x1, y1]]`` fixes the view; tokens outside it (far-out tokens left
    out of the fit) get a label where their pull line leaves the chart."""
    from matplotlib import patheffects
    from matplotlib.collections import LineCollection
    from matplotlib.lines import Line2D

    halo = [patheffects.withStroke(linewidth=2.5, foreground="white")]
    L = len(tokens)
    if row is not None and focus is not None:
        widths = pull_widths(row, focus=focus)
        others = [j for j in range(L) if j != focus]
        segments = [[P0[focus], P0[j]] for j in others]
        lines = LineCollection(
            segments, linewidths=widths[others], colors=PULL, alpha=0.55, capstyle="round", zorder=1
        )
        lines.set_gid("pulls")
        ax.add_collection(lines)
    crowded = L > 60  # hundreds of tokens: lighter marks, so the focus and its pulls stand out
    ax.scatter(
        P0[:, 0],
        P0[:, 1],
        s=8 if crowded else 22,
        facecolors="white",
        edgecolors=BEFORE,
        linewidths=0.8 if crowded else 1.2,
        zorder=2,
    )
    ax.scatter(P1[:, 0], P1[:, 1], s=6 if crowded else 18, color=AFTER, zorder=3)
    moves = P1 - P0
    arrows = ax.quiver(
        P0[:, 0],
        P0[:, 1],
        moves[:, 0],
        moves[:, 1],
        angles="xy",
        scale_units="xy",
        scale=1,
        color=AFTER,
        alpha=0.15 if crowded else 0.45,
        width=0.002 if crowded else 0.003,
        headwidth=4,
        headlength=5,
        zorder=2,
    )
    arrows.set_gid("moves")
    if focus is not None:
        ax.annotate(
            "",
            xy=P1[focus],
            xytext=P0[focus],
            zorder=5,
            arrowprops={"arrowstyle": "-|>", "color": FOCUS, "lw": 2.2},
        )
        ax.scatter(*P1[focus], s=40, color=FOCUS, zorder=6)

    # Labels: every token when few; else the focus and the tokens that pull it most.
    if L <= max_labels:
        labelled = list(range(L))
    else:
        labelled = [] if focus is None else [focus]
        if row is not None and focus is not None:
            labelled += [int(j) for j in np.argsort(-row, kind="stable")[:8] if j != focus]
    for j in labelled:
        is_focus = j == focus
        ax.annotate(
            short(tokens[j]),
            P0[j],
            xytext=(5, -11) if is_focus else (4, 3),
            textcoords="offset points",
            fontsize=fontsize + (1.5 if is_focus else 0),
            color=FOCUS if is_focus else "#333333",
            path_effects=halo,
            fontweight="bold" if is_focus else "normal",
            zorder=7,
        )
    if focus is not None and row is not None:
        # the three strongest pulls get their weight, written near the pulling token (a pull
        # of 0, such as a token set aside, gets no number)
        strongest = [int(j) for j in np.argsort(-row, kind="stable")[:4] if j != focus][:3]
        for j in [j for j in strongest if row[j] >= 0.005]:
            at = P0[focus] + 0.7 * (P0[j] - P0[focus])
            ax.annotate(
                f"{row[j]:.2f}",
                at,
                fontsize=fontsize - 0.5,
                color="#a04000",
                ha="center",
                va="center",
                path_effects=halo,
                zorder=7,
            )
    if limits is None:
        ax.autoscale_view()
        ax.margins(0.08)
    else:
        lo, hi = limits
        ax.set_xlim(lo[0], hi[0])
        ax.set_ylim(lo[1], hi[1])
        centre = (lo + hi) / 2
        for j in range(L):
            if np.all((P0[j] >= lo) & (P0[j] <= hi)):
                continue
            start = P0[focus] if focus is not None and j != focus else centre
            at = _exit_point(start, P0[j], lo, hi)
            weight = f", {row[j]:.2f}" if row is not None and focus is not None else ""
            ax.annotate(
                f"{short(tokens[j])} (off chart{weight})",
                at,
                fontsize=fontsize - 0.5,
                color="#555555",
                ha="center",
                va="center",
                path_effects=halo,
                annotation_clip=False,
                zorder=7,
            )
    if show_legend:
        handles = [
            Line2D([], [], ls="", marker="o", mfc="white", mec=BEFORE, label="before attention"),
            Line2D([], [], ls="", marker="o", color=AFTER, label="after attention"),
        ]
        if row is not None and focus is not None:
            handles.append(
                Line2D(
                    [],
                    [],
                    color=PULL,
                    lw=3,
                    alpha=0.7,
                    label=f"pull on “{short(tokens[focus])}” (width ∝ weight)",
                )
            )
        ax.legend(handles=handles, loc="best", fontsize=7, framealpha=0.85)


def view_limits(points: Sequence[np.ndarray], margin: float = 0.08) -> np.ndarray:
    """``[[x0, y0], [x1, y1]]``: the box around ``[.., 2]`` points, with a margin."""
    pts = np.concatenate([np.asarray(p).reshape(-1, 2) for p in points])
    lo, hi = pts.min(axis=0), pts.max(axis=0)
    pad = np.maximum((hi - lo) * margin, 1e-9)
    return np.stack([lo - pad, hi + pad])


def _exit_point(a: np.ndarray, b: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Where the segment from ``a`` (inside the box) to ``b`` (outside) leaves the box,
    pulled 4 % back inside so a label there is visible."""
    a = np.clip(a, lo, hi)
    d = b - a
    t = 1.0
    for k in range(2):
        if d[k] > 0 and b[k] > hi[k]:
            t = min(t, (hi[k] - a[k]) / d[k])
        elif d[k] < 0 and b[k] < lo[k]:
            t = min(t, (lo[k] - a[k]) / d[k])
    return a + d * t * 0.96


@literal_text
def plot_movement(
    before: Any,
    after: Any,
    tokens: Sequence[str] | None = None,
    weights: Any = None,
    focus: int | str | None = None,
    *,
    ax: Any = None,
    title: str | None = None,
    pca: PCA | None = None,
    fit_on: Sequence[bool] | None = None,
    max_labels: int = 40,
    aside: Sequence[bool] | None = None,
) -> Any:
    """Draw token vectors before and after attention, in one 2-D projection.

    Args:
        before: ``[L, D]`` token vectors entering attention.
        after: ``[L, D]`` the same tokens after it (``x + attention(x)`` in a transformer,
            :meth:`Trace.after_attention`; or the bare output of seed 001's self-attention).
        tokens: ``L`` labels.
        weights: ``[L, L]`` attention weights; with ``focus``, row ``focus`` gives the pulls.
        focus: the token whose pulls are drawn: an index or a token string (its first
            occurrence, as :meth:`Trace.find_focus`; ``"bank#2"``: the second); ``None`` draws
            no pulls.
        ax: draw into these axes.
        title: e.g. ``"minilm · layer 2 · mean of heads"``.
        pca: a projection to use (e.g. shared by several panels); default
            ``fit_pca(before[fit_on], after[fit_on])``.
        fit_on: ``L`` flags, the tokens the PCA is fitted on (default all). Leave out tokens
            that are far from the rest (``[CLS]``, an attention sink) so they do not take
            both axes; they are still drawn.
        max_labels: label every token up to this many, else only the focus and its pullers.
        aside: ``L`` flags: tokens whose pull is set aside; the other pulls are the focus row
            renormalised without them (:func:`attnlab.viz.aside.set_aside`). The vectors are
            the model's, untouched; the title says what was set aside.

    Returns:
        The :class:`matplotlib.figure.Figure`. Its axes hold a ``quiver`` (gid ``"moves"``)
        with one arrow per token from before to after, and a ``LineCollection`` (gid
        ``"pulls"``) whose widths are proportional to the focus row of ``weights``.

    Example:
        >>> rng = np.random.default_rng(0)
        >>> x = rng.normal(size=(4, 8)); w = np.full((4, 4), 0.25)
        >>> fig = plot_movement(x, 0.5 * x + 0.5 * (w @ x), list("abcd"), w, focus="d")
    """
    X0, X1 = _vectors(before, "before"), _vectors(after, "after")
    if X0.shape != X1.shape:
        raise ValueError(f"before {X0.shape} and after {X1.shape} must have the same [L, D] shape")
    L = X0.shape[0]
    tokens = check_tokens(tokens, L, "tokens")
    idx = _focus_index(focus, tokens)
    row = None
    if weights is not None:
        W = squeeze_batch(to_numpy(weights, "weights"), "weights", 2, "[L, L] weights")
        if W.shape != (L, L):
            raise ValueError(f"weights must be [L, L] = [{L}, {L}] self-attention; got {W.shape}")
        row = W[idx] if idx is not None else None
        if row is not None and aside is not None:
            row = set_aside(row, aside).astype(np.float64)
    if aside is not None:
        note = aside_note(tokens, aside)
        title = f"{title}\n{note}" if title else note
    keep = np.ones(L, bool) if fit_on is None else np.asarray(fit_on, bool)
    if pca is None:
        pca = fit_pca(X0[keep], X1[keep])
    P0, P1 = pca(X0), pca(X1)
    # far-out tokens left out of the fit stay out of the view too (they are labelled at the edge)
    limits = None if keep.all() else view_limits([P0[keep], P1[keep]])
    fig, ax = figure_and_axes(ax, 7.5, 6.0)
    _draw_movement(
        ax, P0, P1, tokens, row, idx, max_labels=max_labels, show_legend=True, limits=limits
    )
    ax.set_xlabel(pca.axis_label(0))
    ax.set_ylabel(pca.axis_label(1))
    if title:
        set_wrapped_title(ax, title)  # (a long model name or token ran off the figure)
    return fig


@literal_text
def plot_head_movements(
    before: Any,
    head_afters: Any,
    tokens: Sequence[str] | None = None,
    weights: Any = None,
    focus: int | str | None = None,
    *,
    layer_after: Any = None,
    title: str | None = None,
    fit_on: Sequence[bool] | None = None,
    max_labels: int = 24,
    aside: Sequence[bool] | None = None,
) -> Any:
    """One panel per head: where each head alone moves the tokens, in one shared projection.

    Args:
        before: ``[L, D]`` token vectors entering the layer.
        head_afters: ``[H, L, D]``: ``before`` plus each head's write (:meth:`Trace.after_head`).
        tokens: ``L`` labels.
        weights: ``[H, L, L]`` each head's weights, for the pulls on ``focus``.
        focus: index or token string (its first occurrence; ``"bank#2"``: the second).
        layer_after: ``[L, D]`` the vectors after all heads together; adds a last panel, and
            the shared PCA is fitted on ``before`` and ``layer_after`` (default: on ``before``
            and every head's positions).
        title: figure title.
        fit_on: ``L`` flags: the tokens the PCA is fitted on.
        max_labels: label every token up to this many.
        aside: ``L`` flags: tokens whose pull is set aside, each panel's focus row renormalised
            without them (the "all heads" panel: the mean row, renormalised).

    Returns:
        The :class:`matplotlib.figure.Figure`; all panels share their axis limits.
    """
    X0 = _vectors(before, "before")
    A = to_numpy(head_afters, "head_afters")
    if A.ndim != 3 or A.shape[1:] != X0.shape:
        raise ValueError(f"head_afters must be [H, L, D] with [L, D] = {X0.shape}; got {A.shape}")
    H, L, _ = A.shape
    tokens = check_tokens(tokens, L, "tokens")
    idx = _focus_index(focus, tokens)
    W = None
    if weights is not None:
        W = to_numpy(weights, "weights")
        if W.shape != (H, L, L):
            raise ValueError(f"weights must be [H, L, L] = [{H}, {L}, {L}]; got {W.shape}")
    keep = np.ones(L, bool) if fit_on is None else np.asarray(fit_on, bool)
    X_layer = _vectors(layer_after, "layer_after") if layer_after is not None else None
    pca = fit_pca(X0[keep], X_layer[keep]) if X_layer is not None else fit_pca(X0[keep], A[:, keep])

    def pulls(row: np.ndarray | None) -> np.ndarray | None:
        if row is None or aside is None:
            return row
        return set_aside(row, aside).astype(np.float64)

    panels = [
        (f"head {h}", A[h], pulls(None if W is None or idx is None else W[h, idx]))
        for h in range(H)
    ]
    if X_layer is not None:
        mean_row = None if W is None or idx is None else W[:, idx].mean(axis=0)
        panels.append(("all heads", X_layer, pulls(mean_row)))
    ncols = min(4, len(panels))
    nrows = -(-len(panels) // ncols)
    width = 3.3 * ncols + 0.7
    suptitle = None
    if title:
        note = "" if aside is None else f" ({aside_note(tokens, aside)})"
        suptitle = wrap_text(
            f"{title}\nhollow: before · filled: after the head's write · orange: pull "
            f"on the focus token (width ∝ weight){note}",
            width - 0.3,
            SUPTITLE_SIZE,
        )
    # room for the title: its lines (wrapped to the width), at least the old inch
    top = max(1.0, 0.3 + 1.25 * SUPTITLE_SIZE / 72 * (suptitle.count("\n") + 1)) if title else 0.4
    # fixed margins (inches) instead of constrained layout: a dozen panels lay out 5x faster
    height = 3.0 * nrows + top + 0.5
    fig = new_figure(width, height)
    axes = fig.subplots(
        nrows,
        ncols,
        sharex=True,
        sharey=True,
        squeeze=False,
        gridspec_kw={
            "left": 0.55 / width,
            "right": 1 - 0.15 / width,
            "bottom": 0.5 / height,
            "top": 1 - top / height,
            "wspace": 0.08,
            "hspace": 0.12,
        },
    )
    P0 = pca(X0)
    P1s = [pca(X1) for _, X1, _ in panels]
    limits = None if keep.all() else view_limits([P0[keep]] + [P[keep] for P in P1s])
    for k, ax in enumerate(axes.flat):
        if k >= len(panels):
            ax.set_visible(False)
            continue
        label, _, row = panels[k]
        _draw_movement(
            ax,
            P0,
            P1s[k],
            tokens,
            row,
            idx,
            max_labels=max_labels,
            show_legend=False,
            fontsize=6,
            limits=limits,
        )
        ax.set_title(label, fontsize=9)
        if k % ncols == 0:
            ax.set_ylabel("PC2", fontsize=8)
        if k + ncols >= len(panels):  # the lowest panel of its column: it carries the x axis
            ax.set_xlabel("PC1", fontsize=8)
            ax.tick_params(labelbottom=True)
        ax.tick_params(labelsize=6)
    if suptitle:
        fig.suptitle(suptitle, fontsize=SUPTITLE_SIZE)
    return fig


@literal_text
def plot_trajectories(
    states: Any,
    tokens: Sequence[str] | None = None,
    focus: int | str | None = None,
    *,
    normalize: bool = True,
    ax: Any = None,
    title: str | None = None,
    fit_on: Sequence[bool] | None = None,
    max_labels: int = 40,
) -> Any:
    """Token vectors through the whole stack: one path per token, layer by layer.

    Args:
        states: ``[layers + 1, L, D]`` (e.g. :attr:`Trace.hidden_states`).
        tokens: ``L`` labels, written at each path's end.
        focus: the token drawn in colour, with its layer numbers: an index or a token string
            (its first occurrence; ``"bank#2"``: the second).
        normalize: scale every vector to unit length first, so the picture shows directions
            (what cosine distance measures) rather than the growth of the residual stream.
        ax: draw into these axes.
        title: figure title.
        fit_on: ``L`` flags: the tokens the PCA is fitted on.
        max_labels: label every token up to this many, else only the focus.

    Returns:
        The :class:`matplotlib.figure.Figure`.
    """
    X = to_numpy(states, "states")
    if X.ndim != 3:
        raise ValueError(f"states must be [layers + 1, L, D]; got shape {X.shape}")
    n, L, _ = X.shape
    tokens = check_tokens(tokens, L, "tokens")
    idx = _focus_index(focus, tokens)
    if normalize:
        X = X / np.maximum(np.linalg.norm(X, axis=-1, keepdims=True), 1e-12)
    keep = np.ones(L, bool) if fit_on is None else np.asarray(fit_on, bool)
    pca = fit_pca(X[:, keep])
    P = pca(X)  # [layers + 1, L, 2]
    fig, ax = figure_and_axes(ax, 7.5, 6.0)
    for j in range(L):
        if j == idx:
            continue
        ax.plot(P[:, j, 0], P[:, j, 1], "-", color=BEFORE, lw=0.8, alpha=0.6)
        ax.plot(P[-1, j, 0], P[-1, j, 1], "o", color=AFTER, ms=3)
    if idx is not None:
        ax.plot(P[:, idx, 0], P[:, idx, 1], "-", color=FOCUS, lw=2, zorder=4)
        sc = ax.scatter(
            P[:, idx, 0],
            P[:, idx, 1],
            c=np.arange(n),
            cmap="viridis",
            s=36,
            zorder=5,
            edgecolors="black",
            linewidths=0.5,
        )
        fig.colorbar(sc, ax=ax, label=f"layer ({short(tokens[idx])}; 0 = embeddings)")
    labelled = range(L) if L <= max_labels else ([idx] if idx is not None else [])
    for j in labelled:
        ax.annotate(
            short(tokens[j]),
            P[-1, j],
            xytext=(4, 3),
            textcoords="offset points",
            fontsize=7.5 if j != idx else 9,
            color=FOCUS if j == idx else "#333333",
            fontweight="bold" if j == idx else "normal",
        )
    ax.set_xlabel(pca.axis_label(0))
    ax.set_ylabel(pca.axis_label(1))
    set_wrapped_title(ax, title or "token vectors through the layers")
    return fig


@literal_text
def plot_word_distances(
    distances: Mapping[str, Any] | Any,
    *,
    word: str,
    ax: Any = None,
    title: str | None = None,
) -> Any:
    """Cosine distance between one word's contextual vectors in two sentences, per layer.

    Args:
        distances: ``{label: [layers + 1] distances}`` (e.g. one entry per compared sentence,
            from :func:`word_distances`), or one array.
        word: the shared word, for the axis label.
        ax: draw into these axes.
        title: figure title.

    Returns:
        The :class:`matplotlib.figure.Figure`.
    """
    if not isinstance(distances, Mapping):
        distances = {"distance": distances}
    fig, ax = figure_and_axes(ax, 7.5, 4.2)
    for label, d in distances.items():
        d = np.asarray(d, dtype=float)
        ax.plot(np.arange(d.size), d, "o-", label=short(label, 60), lw=1.6, ms=4)
    ax.set_xlabel("layer (0 = embeddings, k = after layer k)")
    ax.set_ylabel(f"cosine distance of {word!r}")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    set_wrapped_title(ax, title or f"how far apart {word!r} ends up, layer by layer")
    return fig
