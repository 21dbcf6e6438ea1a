"""Pictures: an attention heatmap (with reference links), and the comparison chart.

matplotlib is imported only here, only when a picture is drawn (``pip install matplotlib``).
"""

from __future__ import annotations

import os

import numpy as np

from attnlab._files import atomic_save_png


def _pyplot():
    try:
        import matplotlib
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            "drawing needs matplotlib: pip install matplotlib (or attnlab[viz])"
        ) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def attention_heatmap(
    path: str | os.PathLike[str],
    attention: np.ndarray,
    source_labels: list[str],
    target_labels: list[str],
    *,
    sure: set | None = None,
    possible: set | None = None,
    title: str = "",
) -> None:
    """Save a (target x source) attention heatmap as PNG.

    Args:
        attention: (T, S) weights, rows = target tokens/words, columns = source ones.
        sure, possible: reference links ``(source index, target index)`` drawn as squares
            (sure) and dots (possible).
    """
    plt = _pyplot()
    T, S = attention.shape
    source_labels = [t.replace(" ", "␣") for t in source_labels]  # a space token stays visible
    target_labels = [t.replace(" ", "␣") for t in target_labels]
    fig, ax = plt.subplots(figsize=(max(4.0, 0.32 * S + 2), max(3.0, 0.32 * T + 1.5)))
    im = ax.imshow(
        attention, cmap="Blues", vmin=0.0, vmax=max(1e-9, float(attention.max())), aspect="auto"
    )
    ax.set_xticks(range(S))
    ax.set_xticklabels(source_labels, rotation=90, fontsize=8)
    ax.set_yticks(range(T))
    ax.set_yticklabels(target_labels, fontsize=8)
    ax.set_xlabel("source")
    ax.set_ylabel("target")
    for links, marker, label in (
        (sure or set(), "s", "reference (sure)"),
        ((possible or set()) - (sure or set()), "o", "reference (possible)"),
    ):
        pts = [(i, j) for i, j in links if i < S and j < T]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.scatter(
                xs,
                ys,
                marker=marker,
                s=60 if marker == "s" else 14,
                facecolors="none",
                edgecolors="tab:red",
                linewidths=1.2,
                label=label,
            )
    if sure or possible:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=7, ncol=2, frameon=False)
    fig.colorbar(im, ax=ax, fraction=0.03, pad=0.02)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    atomic_save_png(fig, path, dpi=130)
    plt.close(fig)


def compare_chart(path: str | os.PathLike[str], rows: list[dict], title: str = "") -> None:
    """Bar charts of BLEU, chrF and AER per variant (rows as written by ``attnlab compare``)."""
    plt = _pyplot()
    fig = compare_figure(rows, title)
    atomic_save_png(fig, path, dpi=130)
    plt.close(fig)


def compare_figure(rows: list[dict], title: str = ""):
    """The figure of :func:`compare_chart`: one panel per metric, one row per variant."""
    plt = _pyplot()
    names = [r["variant"] for r in rows]
    metrics = [("bleu", "BLEU (higher is better)"), ("chrf", "chrF (higher is better)")]
    if any(r.get("aer_referenced") not in (None, "") for r in rows):
        metrics.append(("aer_referenced", "AER % (lower is better)"))
    if any(r.get("exact_match") not in (None, "") for r in rows):
        metrics.append(("exact_match", "exact match % (higher is better)"))
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 0.45 * len(names) + 1.8))
    axes = np.atleast_1d(axes)
    for ax, (key, label) in zip(axes, metrics, strict=True):
        values = [float(r[key]) if r.get(key) not in (None, "") else np.nan for r in rows]
        ax.barh(range(len(names)), values, color="tab:blue")
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names if ax is axes[0] else [""] * len(names), fontsize=8)
        # the same rows in every panel, top to bottom: a panel whose first rows have no value
        # (no attention, no AER) must not autoscale its bars out of line with the names
        ax.set_ylim(len(names) - 0.5, -0.5)
        ax.set_title(label, fontsize=9)
        for y, v in enumerate(values):
            if not np.isnan(v):
                ax.text(v, y, f" {v:.1f}", va="center", fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
