"""One self-contained HTML page to explore a :class:`~attnlab.viz.Trace` in any browser.

The page needs no network and no server: its JavaScript, CSS and data are inline (no CDN, no
external font, no ``src``/``href`` to anything). It opens on an **overview** of every layer x
head: one thumbnail heatmap each, labelled with the head's pattern (previous-token, sink,
diagonal, broad, content: :func:`attnlab.viz.head_patterns`, computed from the full weights);
click one to open it below (click a layer's name for the mean of its heads). Then, for the
chosen layer and head (or the mean of the heads):

* a **head view**: query tokens on the left, key tokens on the right, a line for each weight
  (hover a left token: what it attends to; a right token: what attends to it; click pins it);
* the **heatmap** on a canvas, with the focus token's row outlined and the weight under the mouse
  (linear or square-root colours);
* the **embedding movement**: the tokens before and after attention in one 2-D projection, with
  the pulls on the focus token as lines whose width is proportional to its weights (for
  self-attention traces with hidden states).

"Set aside" renormalises every row without the special tokens or without the first token:
attention to ``[CLS]``/``[SEP]`` (BERT) or to a decoder's first token (an "attention sink") is
often a no-op that hides how the rest of the row is shared. The page says when it is on.

Storage (the file stays small, and long inputs stay responsive):

* The keys the page can set aside (the special tokens and the first token: a few columns) are
  stored exactly, as float32. Every other weight is quantised to 8 bits **per row**:
  ``w ≈ q / 255 * rowmax`` with ``q`` in 0..255 and ``rowmax`` (float32) the largest of the
  row's other weights, so the error of every weight is at most ``rowmax / 510`` (0.2 % of the
  row's largest weight, more of a smaller one's). Weights below ``rowmax / 510`` read as 0.
  Quantising relative to the other weights, not to a sink's 0.9, is what keeps a row
  renormalised without the sink accurate.
* When ``layers x H x L x S`` is over ``max_bytes``, each row keeps only its ``k`` strongest
  other weights (``k`` as large as the budget allows, at least 4) besides the exact columns; the
  page says so, and how much of the other weights' attention they hold on average. The rest
  read as 0; they are the weakest of their row. Each row's true sum is stored too, so a row
  with keys set aside is divided by what it really gives the other keys.
* Each layer's data is a separate base64 string, decoded only when that layer is shown.
* Movement coordinates are 16-bit integers scaled to each layer's largest coordinate.
* Overview thumbnails are each head's map averaged down to at most :data:`THUMB_CELLS` cells a
  side (blocks of cells averaged), once for each "set aside" choice (renormalised at full size,
  then averaged down), 8 bits on **one colour scale for the whole page**: relative to the
  largest thumbnail cell of any layer and head (the legend gives that weight), so heads and
  layers compare by colour. Each cell is drawn a whole number of screen pixels wide (no cell is
  dropped or doubled by scaling); with many heads a layer's thumbnails wrap onto several rows.
* At most ``maxLines`` (1500) lines are drawn at once, the strongest first; the heatmap is drawn
  at one canvas pixel per cell and scaled by the browser.

Example:
    >>> from attnlab.viz import Trace, build_explorer
    >>> t = Trace(tokens=["a", "b"], attentions=np.array([[[[1.0, 0.0], [0.4, 0.6]]]]))
    >>> html = build_explorer(t)
    >>> html.startswith("<!DOCTYPE html>") and "http://" not in html.split("<script")[0]
    True
"""

from __future__ import annotations

import base64
import html as html_lib
import json
from pathlib import Path
from typing import Any

import numpy as np

from attnlab._files import atomic_write_text

from ._arrays import block_mean, short
from ._explorer_assets import CSS, JS
from .aside import aside_flags, set_aside
from .patterns import HeadPattern, head_patterns
from .projection import fit_pca
from .trace import Trace, default_fit_on

__all__ = ["build_explorer", "write_explorer", "explorer_data", "quantize_rows"]

LEVELS = 255  # 8-bit weights
DEFAULT_MAX_BYTES = 3_000_000  # raw weight bytes (base64 adds a third)
MIN_TOP_K = 4
THUMB_CELLS = 32  # overview thumbnails: at most 32 x 32 cells (blocks of cells averaged)


def _b64(arr: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(arr).tobytes()).decode("ascii")


def quantize_rows(W: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantise ``[..., S]`` rows of weights to 8 bits relative to each row's maximum.

    Returns:
        ``(q uint8 [..., S], rowmax float32 [...])`` with ``W ≈ q / 255 * rowmax[..., None]``.

    Example:
        >>> q, m = quantize_rows(np.array([[0.5, 0.25, 0.25]]))
        >>> q.tolist(), m.tolist()
        ([[255, 128, 128]], [0.5])
    """
    W = np.asarray(W, dtype=np.float64)
    rowmax = W.max(axis=-1, initial=0.0)  # (no columns left to quantise: rowmax 0)
    scale = np.where(rowmax > 0, LEVELS / np.where(rowmax > 0, rowmax, 1.0), 0.0)
    # round half up: np.round rounds half to even, which would be platform-independent too, but
    # floor(x + 0.5) is what the docs above promise and what the page inverts.
    q = np.floor(W * scale[..., None] + 0.5).clip(0, LEVELS).astype(np.uint8)
    return q, rowmax.astype("<f4")


def _encode_layers(
    A: np.ndarray, max_bytes: int, exact: list[int]
) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """Per-layer base64 payloads of ``A [layers, H, L, S]``: the ``exact`` key columns as
    float32, the others dense or top-k per row, 8 bits relative to their row's largest."""
    n_layers, H, L, S = A.shape
    rest = np.setdiff1d(np.arange(S), exact)  # the quantised columns
    meta: dict[str, Any] = {"levels": LEVELS, "exact": list(exact)}
    dense_bytes = n_layers * H * L * S
    if dense_bytes <= max_bytes or rest.size <= MIN_TOP_K:
        meta["kind"] = "dense"
        layers = []
        for layer in A:
            q, rowmax = quantize_rows(layer[..., rest])  # [H, L, S - exact]
            full = np.zeros((H, L, S), np.uint8)
            full[..., rest] = q  # the exact columns' bytes stay 0
            entry = {"w": _b64(full), "rowmax": _b64(rowmax)}
            if exact:
                entry["exact"] = _b64(layer[..., exact].astype("<f4"))  # [H, L, exact]
            layers.append(entry)
        return meta, layers
    per_k = n_layers * H * L * 3  # 2 bytes of index + 1 byte of weight per kept entry
    k = int(min(rest.size, max(MIN_TOP_K, max_bytes // per_k)))
    meta |= {"kind": "topk", "k": k}
    layers, kept_mass = [], []
    for layer in A:  # [H, L, S]
        others = layer[..., rest]
        # the k largest of each row's other weights (argpartition is deterministic)
        pick = np.sort(np.argpartition(-others, k - 1, axis=-1)[..., :k], axis=-1)  # [H, L, k]
        kept = np.take_along_axis(others, pick, axis=-1)
        q, rowmax = quantize_rows(kept)
        entry = {"w": _b64(q), "idx": _b64(rest[pick].astype("<u2")), "rowmax": _b64(rowmax)}
        if exact:
            entry["exact"] = _b64(layer[..., exact].astype("<f4"))
        # each row's true sum: set aside, a row is divided by what it really gives the other
        # keys, not by the part of it that was kept
        entry["total"] = _b64(layer.sum(-1).astype("<f4"))  # [H, L]
        layers.append(entry)
        totals = others.sum(-1)
        live = totals > 0  # rows that give the other keys nothing hold nothing to keep
        kept_mass.append(kept.sum(-1)[live] / totals[live] if live.any() else np.ones(1))
    # the share of each row's attention to the other keys that the kept weights hold, on average
    meta["kept"] = round(float(np.concatenate([m.ravel() for m in kept_mass]).mean()), 3)
    return meta, layers


def _movement(trace: Trace) -> list[dict[str, Any]] | None:
    """Per layer: before, after the whole attention sublayer, and after each head, in 2-D."""
    if not trace.has_movement:
        return None
    out = []
    for layer in range(trace.num_layers):
        before, after = trace.before(layer), trace.after_attention(layer)
        keep = default_fit_on(trace, layer)
        pca = fit_pca(before[keep], after[keep])
        sets = [before, after]
        if trace.has_head_writes:
            sets += list(before[None] + trace.head_writes(layer))
        P = np.stack([pca(x) for x in sets])  # [2 + H, L, 2]
        scale = float(np.abs(P).max()) or 1.0
        out.append(
            {
                "pts": _b64(np.floor(P / scale * 32767 + 0.5).clip(-32767, 32767).astype("<i2")),
                "sets": len(sets),
                "unfitted": [int(i) for i in np.flatnonzero(~keep)],
                "explained": [round(float(e), 3) for e in pca.explained],
            }
        )
    return out


def _asides(trace: Trace) -> dict[str, np.ndarray | None]:
    """The "set aside" choices the page offers for ``trace``, with their key flags."""
    choices: dict[str, np.ndarray | None] = {"none": None}
    if trace.kind != "self":
        return choices
    if any(trace.special):
        choices["special"] = aside_flags(trace, "special")
    choices["first"] = aside_flags(trace, "first")
    return choices


def _thumbnails(trace: Trace, asides: dict[str, np.ndarray | None]) -> dict[str, Any]:
    """Per "set aside" choice, per layer: ``[H, rows, cols]`` uint8 thumbnails, base64, all on
    **one colour scale for the whole page**: 8 bits relative to the largest thumbnail cell of
    any layer and head (``top``, per choice), so that the same colour is the same weight in
    every thumbnail and heads and layers compare by colour. (Each thumbnail scaled to its own
    maximum made a head that spreads its weight look as bright as one that puts it all on one
    key.)"""
    n_layers, H, L, S = trace.attentions.shape
    smalls: dict[str, list[np.ndarray]] = {name: [] for name in asides}
    for layer in trace.attentions:  # [H, L, S]
        for name, flags in asides.items():
            shown = layer if flags is None else set_aside(layer, flags)
            smalls[name].append(block_mean(shown, THUMB_CELLS, THUMB_CELLS))  # [H, <= 32, <= 32]
    thumbs: dict[str, list[str]] = {}
    tops: dict[str, float] = {}
    for name, layers in smalls.items():
        top = max(float(small.max(initial=0.0)) for small in layers)
        scale = LEVELS / top if top > 0 else 0.0
        thumbs[name] = [
            _b64(np.floor(small * scale + 0.5).clip(0, LEVELS).astype(np.uint8)) for small in layers
        ]
        tops[name] = round(top, 4)
    return {
        "rows": min(L, THUMB_CELLS),
        "cols": min(S, THUMB_CELLS),
        "thumbs": thumbs,
        "top": tops,  # the weight of the brightest colour, per "set aside" choice
    }


def _labels(patterns: list[list[HeadPattern]]) -> list[list[dict[str, Any]]]:
    return [
        [{"label": p.label, "short": p.short, "score": round(p.score, 3)} for p in heads]
        for heads in patterns
    ]


def explorer_data(
    trace: Trace,
    *,
    layer: int | None = None,
    head: int | None = None,
    focus: int | str | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    aside: str | None = None,
    patterns: list[list[HeadPattern]] | None = None,
) -> dict[str, Any]:
    """Everything the page draws, as a JSON-ready dict (see the module docstring for formats).

    ``aside`` (``"special"``, ``"first"`` or None) is what the page sets aside when it opens;
    ``patterns`` are the head labels (default: :func:`attnlab.viz.head_patterns` of the trace,
    for self-attention; a translator's cross-attention gets no labels).
    """
    layer = trace.num_layers - 1 if layer is None else trace.check_layer(layer)
    head = trace.check_head(head)
    f = trace.find_focus(focus)
    if aside is not None:
        aside_flags(trace, aside)  # checks it: a clear error rather than a page that ignores it
    asides = _asides(trace)
    if patterns is None and trace.kind == "self":
        patterns = head_patterns(trace.attentions, trace.special)
    if patterns is not None and [len(h) for h in patterns] != [trace.num_heads] * trace.num_layers:
        raise ValueError(
            f"patterns must be [layer][head] for {trace.num_layers} layers x {trace.num_heads} "
            "heads. Fix: pass head_patterns(trace.attentions, trace.special)"
        )
    exact: list[int] = []  # the keys the page can set aside: stored exactly
    if trace.kind == "self":
        exact = sorted({0} | {i for i, a in enumerate(trace.special) if a})
    meta, layers = _encode_layers(trace.attentions, max_bytes, exact)
    movement = _movement(trace)
    return {
        "format": 1,
        "model": trace.model,
        "text": trace.text,
        "kind": trace.kind,
        "query_tokens": trace.tokens,
        "key_tokens": trace.keys,
        "special": [i for i, s in enumerate(trace.special) if s],
        "num_layers": trace.num_layers,
        "num_heads": trace.num_heads,
        "layer_names": trace.layer_names,
        "encoding": meta,
        "layers": layers,
        "movement": movement,
        "head_writes": trace.has_head_writes,
        "overview": _thumbnails(trace, asides),
        "patterns": None if patterns is None else _labels(patterns),
        "default": {
            "layer": layer,
            "head": -1 if head is None else head,
            "focus": f,
            "threshold": 0.1,
            "aside": aside or "none",
        },
    }


def build_explorer(trace: Trace, *, title: str | None = None, **kwargs: Any) -> str:
    """The explorer page for ``trace`` as one HTML string.

    Args:
        trace: what to show.
        title: the page title (default: the model and the text).
        **kwargs: ``layer``, ``head``, ``focus``, ``aside`` (what is shown first),
            ``max_bytes`` (the weight budget) and ``patterns`` (the head labels), passed to
            :func:`explorer_data`.

    Returns:
        The page. The same trace gives the same string.
    """
    data = explorer_data(trace, **kwargs)
    if title is None:
        text = short(trace.text, 80)
        title = f"attnlab · {trace.model} · {text}" if text else f"attnlab · {trace.model}"
    # "<" escaped inside the JSON: no "</script>" or "<!--" can end the data block early
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")
    return TEMPLATE.format(title=html_lib.escape(title), css=CSS, js=JS, data=payload)


def write_explorer(trace: Trace, path: str | Path, **kwargs: Any) -> Path:
    """Write :func:`build_explorer`'s page to ``path`` (UTF-8); returns the path."""
    return atomic_write_text(path, build_explorer(trace, **kwargs))


TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>{css}</style>
</head>
<body>
<header>
  <h1>{title}</h1>
  <div id="controls">
    <label>layer <select id="layer"></select></label>
    <label>head <select id="head"></select></label>
    <label>lines: weights &ge; <input id="threshold" type="range" min="0.01" max="0.9"
      step="0.01"><output id="threshold-value"></output></label>
    <label title="√weight makes small weights visible; the colour bar gives the values">
      colours <select id="scale"><option value="linear">linear</option>
      <option value="sqrt">&radic;weight</option></select></label>
    <label title="Attention to [CLS]/[SEP] or to a decoder's first token is often a no-op
that hides the rest; this sets it aside and renormalises each row over the other tokens">
      set aside <select id="aside"><option value="none">nothing</option>
      <option value="special">special tokens</option>
      <option value="first">the first token</option></select></label>
  </div>
  <p id="focus-info"></p>
  <p id="info"></p>
</header>
<main>
  <section class="panel" id="overview-panel">
    <h2>Every layer &times; head</h2>
    <p class="hint">Each head's weights as a thumbnail (rows: queries, columns: keys), labelled
      with the kind of head its weights show. Click one to open it; click a layer's name for
      the mean of its heads.</p>
    <p id="overview-selected"></p>
    <div id="overview"></div>
    <p class="hint" id="overview-legend"></p>
  </section>
  <section class="panel" id="headview-panel">
    <h2>Who attends to whom</h2>
    <p class="hint">Hover a token on the left: what it attends to (blue). On the right: what
      attends to it (orange). Click to pin.</p>
    <div id="headview-scroll"><svg id="headview"></svg></div>
  </section>
  <section class="panel" id="heatmap-panel">
    <h2>Heatmap</h2>
    <p class="hint">Rows: queries (attending). Columns: keys (attended to).</p>
    <div id="heatmap-wrap"><canvas id="heatmap"></canvas><canvas id="colorbar"></canvas></div>
    <p id="readout">&nbsp;</p>
  </section>
  <section class="panel" id="movement-panel">
    <h2>How attention moves the token vectors</h2>
    <p class="hint" id="movement-hint"></p>
    <svg id="movement"></svg>
  </section>
</main>
<footer id="notes"></footer>
<script id="attnlab-data" type="application/json">{data}</script>
<script>{js}</script>
</body>
</html>
"""
