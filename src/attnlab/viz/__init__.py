"""Seeing attention: heatmaps, embedding movement, and a self-contained HTML explorer.

Everything here takes plain arrays and token lists, so the same pictures work for attnlab's own
layers, attnlab's trained translators and Hugging Face models run on attnlab kernels:

* :func:`plot_attention` -- one attention map ``[L, S]`` as a heatmap with token labels.
* :func:`plot_attention_grid` -- every layer x head of a model ``[layers, H, L, S]``.
* :func:`plot_alignment` -- translation attention with reference word alignments overlaid.
* :func:`plot_movement` -- token vectors before and after attention, projected to 2-D with one
  PCA fitted on both, arrows from old to new position, and for one focus token the pull of every
  other token drawn in proportion to its attention weight (seed 001's "bank" pulled toward
  "river").
* :func:`plot_head_movements` -- the same for every head of a layer, in one shared projection.
* :func:`plot_trajectories` -- token vectors through the whole stack.
* :func:`plot_word_distances` -- how far one word's contextual vectors in two sentences end up
  apart, layer by layer.
* :func:`trace_model` / :class:`Trace` -- run a Hugging Face model once and keep its tokens,
  attention weights, hidden states and per-head writes into the residual stream.
* :func:`write_explorer` -- one HTML file (no network, data inline) to explore a :class:`Trace`.

matplotlib is imported only when a ``plot_*`` function runs (``pip install attnlab[viz]``), so
``import attnlab.viz`` stays light; the explorer and :mod:`attnlab.viz.projection` need NumPy only.

Every ``plot_*`` function returns a :class:`matplotlib.figure.Figure` (it draws into ``ax`` when
given one); :func:`save_figure` writes PNGs whose bytes depend on the input only (no timestamp or
version in the metadata).
"""

from __future__ import annotations

from attnlab._lazy import lazy_exports

# public name -> module that defines it
_EXPORTS = {
    "plot_attention": "attnlab.viz.heatmap",
    "plot_attention_grid": "attnlab.viz.heatmap",
    "plot_alignment": "attnlab.viz.heatmap",
    "plot_movement": "attnlab.viz.movement",
    "plot_head_movements": "attnlab.viz.movement",
    "plot_trajectories": "attnlab.viz.movement",
    "plot_word_distances": "attnlab.viz.movement",
    "PCA": "attnlab.viz.projection",
    "fit_pca": "attnlab.viz.projection",
    "Trace": "attnlab.viz.trace",
    "trace_model": "attnlab.viz.trace",
    "trace_layer": "attnlab.viz.trace",
    "trace_translation": "attnlab.viz.trace",
    "word_distances": "attnlab.viz.trace",
    "merge_subwords": "attnlab.viz.trace",
    "build_explorer": "attnlab.viz.explorer",
    "write_explorer": "attnlab.viz.explorer",
    "save_figure": "attnlab.viz._mpl",
    "head_pattern": "attnlab.viz.patterns",
    "head_patterns": "attnlab.viz.patterns",
    "HeadPattern": "attnlab.viz.patterns",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
