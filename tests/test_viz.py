"""attnlab.viz without models or a browser: the pictures hold the values they claim to show.

Every figure test reads numbers back out of the figure (image arrays, arrow offsets, line
widths, rendered pixels), not only that it was drawn.
"""

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("matplotlib")

from attnlab.viz import (  # noqa: E402
    Trace,
    build_explorer,
    fit_pca,
    merge_subwords,
    plot_alignment,
    plot_attention,
    plot_attention_grid,
    plot_head_movements,
    plot_movement,
    plot_trajectories,
    plot_word_distances,
    save_figure,
    trace_layer,
    trace_translation,
    word_distances,
)
from attnlab.viz._mpl import SAVE_DPI  # noqa: E402
from attnlab.viz.explorer import explorer_data, quantize_rows  # noqa: E402
from attnlab.viz.movement import MAX_PULL_WIDTH  # noqa: E402

SENTENCE = "Write a poem about a man fishing on a river bank".split()


def random_weights(rng, *shape):
    """Rows that sum to 1, with distinct values (so argmax is unique)."""
    w = rng.random(shape) ** 3 + 1e-3
    return w / w.sum(-1, keepdims=True)


def rendered(fig):
    """The figure's pixels as an (h, w, 3) float array."""
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].astype(float)


# ---------------------------------------------------------------------------------------------
# import cost


def test_import_attnlab_viz_does_not_import_matplotlib_or_torch():
    code = (
        "import sys, attnlab, attnlab.viz, attnlab.viz.projection, attnlab.viz.explorer\n"
        "print(sorted(m for m in ('matplotlib', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------
# heatmaps


def test_heatmap_image_is_the_weights_and_the_brightest_cell_is_the_max():
    rng = np.random.default_rng(0)
    W = random_weights(rng, 11, 11)
    fig = plot_attention(W, SENTENCE, title="t")
    ax = fig.axes[0]
    np.testing.assert_array_equal(ax.images[0].get_array(), W)
    assert [t.get_text() for t in ax.get_yticklabels()] == SENTENCE
    # the rendered pixel at each cell's centre: the brightest (viridis: yellow) is the max weight
    pixels = rendered(fig)
    height = pixels.shape[0]
    luminance = np.zeros_like(W)
    for i, j in np.ndindex(W.shape):
        x, y = ax.transData.transform((j + 0.3, i + 0.3))  # off-centre: avoid the cell's number
        luminance[i, j] = pixels[int(height - y), int(x)] @ [0.299, 0.587, 0.114]
    assert np.unravel_index(luminance.argmax(), W.shape) == np.unravel_index(W.argmax(), W.shape)
    # and brighter means more weight everywhere (viridis' luminance rises monotonically)
    order = np.argsort(W, axis=None)
    assert (np.diff(luminance.ravel()[order]) >= -1.0).all()


def test_heatmap_takes_tensors_with_batch_dims_and_checks_tokens():
    W = torch.softmax(torch.randn(1, 1, 4, 6), -1)
    fig = plot_attention(W, list("abcd"), list("uvwxyz"))
    np.testing.assert_allclose(fig.axes[0].images[0].get_array(), W[0, 0].numpy(), rtol=1e-6)
    with pytest.raises(ValueError, match="query_tokens has 3 tokens"):
        plot_attention(W, list("abc"))
    with pytest.raises(ValueError, match="one attention map"):
        plot_attention(torch.rand(2, 4, 4))


def test_heatmap_labels_never_overlap_for_long_inputs():
    rng = np.random.default_rng(1)
    tokens = [f"token{i}" for i in range(300)]
    fig = plot_attention(random_weights(rng, 300, 300), tokens)
    from matplotlib.colors import PowerNorm

    norm = fig.axes[0].images[0].norm  # long maps: colour ∝ √weight, the bar keeps true values
    assert isinstance(norm, PowerNorm) and norm.gamma == 0.5
    assert "√" in fig.axes[1].get_ylabel()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    ys = [t for t in ax.get_yticklabels() if t.get_text()]
    assert 5 < len(ys) < 300  # thinned, with positions
    boxes = [t.get_window_extent(renderer) for t in ys]
    for a, b in zip(boxes, boxes[1:], strict=False):
        assert not a.overlaps(b), (a, b)
    # x labels are slanted: parallel text lines, apart by (tick spacing) x sin(angle) across
    xs = [t for t in ax.get_xticklabels() if t.get_text()]
    assert 5 < len(xs) < 300
    angle = np.radians(xs[0].get_rotation())
    anchors = [ax.transData.transform((tick, 0))[0] for tick in ax.get_xticks()]
    height = xs[0].get_fontsize() * fig.dpi / 72  # one line of text, in pixels
    assert min(np.diff(anchors)) * np.sin(angle) >= 1.2 * height


def test_grid_tiles_every_layer_and_head_and_the_mean():
    rng = np.random.default_rng(2)
    A = random_weights(rng, 3, 4, 5, 5)  # [layers, H, L, S]
    fig = plot_attention_grid(A, list("abcde"), title="grid")
    mosaic = fig.axes[0].images[0].get_array()
    gap = max(1, round(0.12 * 5))
    for layer in range(3):
        for col in range(5):
            r, c = layer * (5 + gap), col * (5 + gap)
            expected = A[layer, col] if col < 4 else A[layer].mean(0)
            np.testing.assert_allclose(mosaic[r : r + 5, c : c + 5], expected)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()][-1] == "mean of heads"


def test_grid_averages_long_maps_down_keeping_the_mass():
    rng = np.random.default_rng(3)
    A = random_weights(rng, 1, 2, 200, 200)
    fig = plot_attention_grid(A, max_cells=50)
    mosaic = np.ma.filled(fig.axes[0].images[0].get_array(), np.nan)
    block = mosaic[:50, :50]
    # each cell is the mean of a 4 x 4 block of weights, so a row of 50 cells holds the mass
    # of 4 weight rows (4 x 1) divided by 16 cells per block
    np.testing.assert_allclose(block.sum(1), 4 / 16, rtol=1e-9)
    assert "averaged down from 200 x 200" in fig._suptitle.get_text()


@pytest.mark.parametrize("heads,length", [(12, 96), (16, 90), (4, 200), (2, 30)])
def test_every_grid_cell_gets_a_pixel_in_the_saved_figure(heads, length, tmp_path):
    """Drawn "nearest" into fewer pixels than cells, the grid dropped whole key columns: 6 x 12
    heads of 96 tokens, each with all its weight on one key, showed 5-10 heads attending to
    nothing. Now every cell spans at least a pixel, and no head's panel is all dark."""
    from matplotlib.image import imread

    from attnlab.viz import save_figure

    rng = np.random.default_rng(0)
    A = np.zeros((3, heads, length, length))
    for layer in range(3):
        for h in range(heads):
            A[layer, h, :, rng.integers(0, length)] = 1.0
    fig = plot_attention_grid(A, include_mean=False)
    ax = fig.axes[0]
    mosaic = np.ma.filled(ax.images[0].get_array(), np.nan)  # NaN: the gaps between panels
    box = ax.get_position()  # (figure fractions)
    x0, y0 = box.x0 * fig.get_figwidth() * SAVE_DPI, (1 - box.y1) * fig.get_figheight() * SAVE_DPI
    sx = box.width * fig.get_figwidth() * SAVE_DPI / mosaic.shape[1]  # pixels per cell
    sy = box.height * fig.get_figheight() * SAVE_DPI / mosaic.shape[0]
    assert sx >= 1 and sy >= 1, (mosaic.shape, sx, sy)
    image = imread(save_figure(fig, tmp_path / "grid.png"))[..., :3]
    dark = np.array(ax.images[0].cmap(0.0)[:3])

    def starts(filled):  # the first cell of each panel along one axis
        return np.flatnonzero(filled & ~np.r_[False, filled[:-1]])

    rows, cols = starts(~np.isnan(mosaic).all(1)), starts(~np.isnan(mosaic).all(0))
    size = cols[1] - cols[0] - 1 if len(cols) > 1 else mosaic.shape[1]  # (cells, a bound)
    assert len(rows) == 3 and len(cols) == heads
    for r in rows:
        for c in cols:
            block = image[
                int(y0 + r * sy) : int(np.ceil(y0 + (r + size) * sy)),
                int(x0 + c * sx) : int(np.ceil(x0 + (c + size) * sx)),
            ]
            assert (np.abs(block - dark).max(-1) > 0.2).any(), f"panel at cell ({r}, {c})"


def test_a_dollar_sign_is_drawn_as_written(tmp_path):
    """A `$` was read as matplotlib maths: "I paid $5 and $6" lost its dollars and italicised
    "and", and a token "$$" crashed the save."""
    tokens = ["I", "paid", "$5", "and", "$6", "$$"]
    A = np.full((1, 1, 6, 6), 1 / 6)
    for fig in (
        plot_attention(A[0, 0], tokens, title="I paid $5 and $6"),
        plot_attention_grid(A, tokens, title="I paid $5 and $6"),
        plot_word_distances({"A vs B: “$5 and $6”": [0.1, 0.2]}, word="$$"),
    ):
        save_figure(fig, tmp_path / "f.png")  # (raised ParseException on "$$")
        texts = [t for t in fig.findobj(lambda a: hasattr(a, "get_parse_math"))]
        assert any("$5 and $6" in t.get_text() for t in texts)
        assert not any(t.get_parse_math() for t in texts if "$" in t.get_text())


def test_grid_labels_tokens_only_where_a_cell_is_one_token():
    """Averaged down (max_cells below the token count), a cell holds several tokens: the
    panels were labelled t0..t4 as if each row were one token."""
    rng = np.random.default_rng(4)
    A = random_weights(rng, 1, 2, 20, 20)
    tokens = [f"t{i}" for i in range(20)]
    labels = lambda fig: [t.get_text() for t in fig.axes[0].get_yticklabels() if t.get_text()]  # noqa: E731
    assert labels(plot_attention_grid(A, tokens, max_cells=5)) == []
    shown = labels(plot_attention_grid(A, tokens))  # (every other one, at this size)
    assert shown[:2] == ["t0", "t2"] and set(shown) <= set(tokens)


def test_cell_labels_write_weights_of_one_and_more_as_they_are():
    W = np.array([[0.25, 0.75], [1.0, 2.5]])
    fig = plot_attention(W, ["a", "b"], annotate=True)
    assert [t.get_text() for t in fig.axes[0].texts] == [".25", ".75", "1", "2.5"]


def test_set_aside_renormalises_rows_and_leaves_dead_rows_at_zero():
    from attnlab.viz.aside import aside_note, set_aside

    rng = np.random.default_rng(30)
    W = random_weights(rng, 2, 6, 6)  # [H, L, S]
    W[:, 0] = 0
    W[:, 0, 0] = 1.0  # a decoder's first query sees only itself
    flags = np.array([True, False, False, False, False, True])
    got = set_aside(W, flags)
    assert got.dtype == np.float32 and got.shape == W.shape
    assert (got[..., flags] == 0).all()
    kept = W[..., ~flags]
    expected = kept / np.where(kept.sum(-1, keepdims=True) > 0, kept.sum(-1, keepdims=True), 1)
    np.testing.assert_allclose(got[..., ~flags], expected, rtol=1e-6)
    np.testing.assert_allclose(got.sum(-1)[:, 1:], 1.0, rtol=1e-6)
    assert (got[:, 0] == 0).all()  # nothing left to share: 0, never uniform, never NaN
    with pytest.raises(ValueError, match="aside must be one flag per key: 6 flags; got shape"):
        set_aside(W, flags[:4])
    assert aside_note(list("abcdef"), flags) == "“a”, “f” set aside, rows renormalised"
    assert aside_note(list("abcdef"), None) == ""


def test_heatmap_and_grid_drop_the_set_aside_columns_and_say_so():
    rng = np.random.default_rng(31)
    A = random_weights(rng, 2, 3, 5, 5)
    tokens = ["[CLS]", "a", "b", "c", "[SEP]"]
    flags = [True, False, False, False, True]
    fig = plot_attention(A[1, 2], tokens, title="one head", aside=flags)
    ax = fig.axes[0]
    shown = ax.images[0].get_array()
    expected = A[1, 2][:, 1:4] / A[1, 2][:, 1:4].sum(-1, keepdims=True)
    np.testing.assert_allclose(shown, expected, rtol=1e-6)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b", "c"]
    assert [t.get_text() for t in ax.get_yticklabels()] == tokens  # every row is kept
    assert ax.get_title().startswith("one head\n“[CLS]”")  # (wrapped to the axes' width)
    assert (
        " ".join(ax.get_title().split()) == "one head “[CLS]”, “[SEP]” set aside, rows renormalised"
    )
    grid = plot_attention_grid(A, tokens, title="grid", aside=flags)
    mosaic = np.ma.filled(grid.axes[0].images[0].get_array(), np.nan)
    gap = max(1, round(0.12 * 5))
    for layer in range(2):
        for col in range(4):  # three heads, then the mean of the heads, renormalised
            W = A[layer, col] if col < 3 else A[layer].mean(0)
            panel = mosaic[layer * (5 + gap) : layer * (5 + gap) + 5, col * (3 + gap) :][:, :3]
            np.testing.assert_allclose(panel, W[:, 1:4] / W[:, 1:4].sum(-1, keepdims=True), 1e-6)
    assert "“[CLS]”, “[SEP]” set aside" in grid._suptitle.get_text()
    with pytest.raises(ValueError, match="aside must be 5 flags"):
        plot_attention_grid(A, tokens, aside=flags[:3])
    # a long map labels every k-th column with its position in the text, not in the picture
    big = random_weights(rng, 200, 200)
    first = np.zeros(200, bool)
    first[0] = True
    ax = plot_attention(big, [f"t{i}" for i in range(200)], aside=first).axes[0]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels[0] == "t1 ·1" and all(t.split(" ·")[0] == f"t{t.split('·')[1]}" for t in labels)


def test_an_alignment_plot_refuses_what_it_would_draw_wrong():
    """Scores passed for weights were drawn as all 0 (no error), an empty map failed in NumPy."""
    W = np.full((2, 3), 1 / 3)
    with pytest.raises(ValueError, match="must be attention weights, >= 0"):
        plot_alignment(W - 0.5, ["a", "b", "c"], ["x", "y"])
    with pytest.raises(ValueError, match="has no cell to draw"):
        plot_alignment(np.zeros((0, 3)), ["a", "b", "c"], [])


def test_alignment_overlay_marks_sure_and_possible_links_and_scores_aer():
    from matplotlib.patches import Rectangle

    from attnlab.data import Alignment, aer, attention_to_links

    W = np.array([[0.8, 0.1, 0.1], [0.1, 0.2, 0.7], [0.3, 0.6, 0.1]])  # [T, S]
    ref = Alignment(frozenset({(0, 0), (2, 1)}), frozenset({(0, 0), (2, 1), (1, 2)}))
    fig = plot_alignment(W, ["the", "old", "man"], ["el", "hombre", "viejo"], ref, title="x")
    ax = fig.axes[0]
    rects = [p for p in ax.patches if isinstance(p, Rectangle)]
    solid = sorted(
        (round(r.get_x() + 0.45), round(r.get_y() + 0.45))
        for r in rects
        if r.get_linestyle() != "--"
    )
    dashed = sorted(
        (round(r.get_x() + 0.45), round(r.get_y() + 0.45))
        for r in rects
        if r.get_linestyle() == "--"
    )
    assert solid == [(0, 0), (2, 1)] and dashed == [(1, 2)]
    links = attention_to_links(W)
    assert f"AER {aer(links, ref.sure, ref.possible):.2f}" in ax.get_title()
    dots = ax.lines[0].get_xydata()
    assert sorted(map(tuple, dots.astype(int))) == sorted(links)
    with pytest.raises(ValueError, match="outside the 3 source x 3 target words"):
        plot_alignment(W, list("abc"), list("xyz"), (set(), {(5, 0)}))


# ---------------------------------------------------------------------------------------------
# projection and movement


def test_pca_matches_numpy_svd_and_is_deterministic_with_a_sign_convention():
    rng = np.random.default_rng(4)
    for shape in [(22, 384), (600, 40), (5, 3)]:
        X = rng.normal(size=shape) * np.linspace(3, 0.5, shape[1])
        pca = fit_pca(X)
        _, s, Vt = np.linalg.svd(X - X.mean(0), full_matrices=False)
        cos = np.abs((pca.components * Vt[:2]).sum(1))
        np.testing.assert_allclose(cos, 1.0, atol=1e-9)
        np.testing.assert_allclose(pca.explained, s[:2] ** 2 / (s**2).sum(), rtol=1e-9)
        for row in pca.components:  # the sign convention: largest coordinate positive
            assert row[np.argmax(np.abs(row))] > 0
        again = fit_pca(X.copy())
        np.testing.assert_array_equal(again.components, pca.components)
        # the same cloud, mirrored, gets the same axes: the picture does not flip
        np.testing.assert_allclose(fit_pca(-X).components, pca.components, atol=1e-9)


def test_pca_is_fitted_on_all_sets_together():
    rng = np.random.default_rng(5)
    before, after = rng.normal(size=(6, 8)), rng.normal(size=(6, 8)) + 5
    pca = fit_pca(before, after)
    stacked = fit_pca(np.concatenate([before, after]))
    np.testing.assert_array_equal(pca.components, stacked.components)
    np.testing.assert_allclose(pca.mean, np.concatenate([before, after]).mean(0))
    with pytest.raises(ValueError, match="same last dim"):
        fit_pca(before, rng.normal(size=(6, 7)))


def test_movement_arrows_go_from_before_to_after_and_pulls_are_proportional_to_weights():
    rng = np.random.default_rng(6)
    x = rng.normal(size=(11, 16))
    W = random_weights(rng, 11, 11)
    W[10, 10] = 4 * W[10].max()  # the focus keeps most of its weight on itself
    W[10] /= W[10].sum()
    after = x + 0.5 * (W @ x)
    fig = plot_movement(x, after, SENTENCE, W, focus="bank", title="m")
    ax = fig.axes[0]
    pca = fit_pca(x, after)
    (arrows,) = [c for c in ax.collections if c.get_gid() == "moves"]
    np.testing.assert_allclose(arrows.get_offsets(), pca(x))
    np.testing.assert_allclose(np.c_[arrows.U, arrows.V], pca(after) - pca(x))
    (pulls,) = [c for c in ax.collections if c.get_gid() == "pulls"]
    focus = 10
    others = [j for j in range(11) if j != focus]
    widths = np.asarray(pulls.get_linewidths())
    ratio = widths / W[focus, others]
    np.testing.assert_allclose(ratio, ratio[0])  # proportional
    # the widest drawn line is MAX_PULL_WIDTH, as in the explorer: the focus's weight on itself
    # draws no line and sets no scale (it made every line thin when it was the largest)
    assert widths.max() == pytest.approx(MAX_PULL_WIDTH)
    # each pull line starts at the focus token's old position and ends at the other token's
    P0 = pca(x)
    for seg, j in zip(pulls.get_segments(), others, strict=True):
        np.testing.assert_allclose(seg, [P0[focus], P0[j]])


def test_movement_keeps_far_out_tokens_out_of_the_view():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(6, 8))
    x[0] *= 500  # an "attention sink" with a huge vector
    W = random_weights(rng, 6, 6)
    keep = [False, True, True, True, True, True]
    fig = plot_movement(x, x + 0.1, list("abcdef"), W, focus=5, fit_on=keep)
    ax = fig.axes[0]
    P0 = fit_pca(x[1:], x[1:] + 0.1)(x)
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    inside = (P0[:, 0] >= x0) & (P0[:, 0] <= x1) & (P0[:, 1] >= y0) & (P0[:, 1] <= y1)
    assert inside.tolist() == keep
    assert any(t.get_text().startswith("a (off chart, ") for t in ax.texts)


def test_head_movements_share_one_projection_and_draw_one_panel_per_head():
    rng = np.random.default_rng(8)
    x = rng.normal(size=(5, 8))
    writes = rng.normal(size=(3, 5, 8)) * 0.1
    W = random_weights(rng, 3, 5, 5)
    fig = plot_head_movements(
        x, x + writes, list("abcde"), W, focus=4, layer_after=x + writes.sum(0), title="heads"
    )
    axes = [a for a in fig.axes if a.get_visible()]
    assert [a.get_title() for a in axes] == ["head 0", "head 1", "head 2", "all heads"]
    pca = fit_pca(x, x + writes.sum(0))
    for h, ax in enumerate(axes[:3]):
        (arrows,) = [c for c in ax.collections if c.get_gid() == "moves"]
        np.testing.assert_allclose(arrows.get_offsets(), pca(x))
        np.testing.assert_allclose(np.c_[arrows.U, arrows.V], pca(x + writes[h]) - pca(x))
        (pulls,) = [c for c in ax.collections if c.get_gid() == "pulls"]
        ratio = np.asarray(pulls.get_linewidths()) / W[h, 4, :4]
        np.testing.assert_allclose(ratio, ratio[0])


def test_trajectories_follow_the_focus_token_through_the_layers():
    rng = np.random.default_rng(9)
    states = rng.normal(size=(4, 5, 8))
    fig = plot_trajectories(states, list("abcde"), focus="c", normalize=False)
    ax = fig.axes[0]
    P = fit_pca(states)(states)
    focus_line = [ln for ln in ax.lines if ln.get_linewidth() == 2][0]
    np.testing.assert_allclose(focus_line.get_xydata(), P[:, 2])


def test_word_distance_plot_has_one_curve_per_comparison():
    fig = plot_word_distances({"A-B": [0.0, 0.2, 0.3], "A-C": [0.0, 0.1, 0.1]}, word="bank")
    lines = fig.axes[0].lines
    assert [ln.get_ydata().tolist() for ln in lines] == [[0.0, 0.2, 0.3], [0.0, 0.1, 0.1]]
    assert "bank" in fig.axes[0].get_ylabel()


# ---------------------------------------------------------------------------------------------
# deterministic files


def png_text_chunks(data: bytes) -> dict[str, str]:
    """The tEXt/iTXt/zTXt chunks and any tIME chunk of a PNG file."""
    out, pos = {}, 8
    while pos < len(data):
        length = int.from_bytes(data[pos : pos + 4], "big")
        kind = data[pos + 4 : pos + 8].decode("ascii")
        body = data[pos + 8 : pos + 8 + length]
        if kind in ("tEXt", "iTXt", "zTXt"):
            key, _, value = body.partition(b"\0")
            out[key.decode()] = value.decode("latin-1")
        elif kind == "tIME":
            out["tIME"] = body.hex()
        pos += 12 + length
    return out


def test_png_bytes_depend_only_on_the_input(tmp_path):
    rng = np.random.default_rng(10)
    W = random_weights(rng, 11, 11)
    x = rng.normal(size=(11, 16))
    paths = []
    for run in range(2):
        paths.append(save_figure(plot_attention(W, SENTENCE), tmp_path / f"heat{run}.png"))
        paths.append(
            save_figure(
                plot_movement(x, x + W @ x, SENTENCE, W, focus=10), tmp_path / f"move{run}.png"
            )
        )
    assert paths[0].read_bytes() == paths[2].read_bytes()
    assert paths[1].read_bytes() == paths[3].read_bytes()
    data = paths[0].read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks = png_text_chunks(data)
    assert "tIME" not in chunks and "Software" not in chunks and "Creation Time" not in chunks
    with pytest.raises(ValueError, match="end it in .png"):
        save_figure(plot_attention(W), tmp_path / "x.jpg")


# ---------------------------------------------------------------------------------------------
# traces from attnlab layers and translators


def two_layer_trace(seed=0, L=11, D=16, H=4):
    """A Trace of two stacked attnlab MultiHeadAttention layers on random token vectors."""
    from attnlab.nn import MultiHeadAttention

    torch.manual_seed(seed)
    layers = [MultiHeadAttention(D, H).eval() for _ in range(2)]
    x = torch.randn(L, D)
    tokens = SENTENCE if L == 11 else [f"t{i}" for i in range(L)]
    t1 = trace_layer(layers[0], x, tokens)
    t2 = trace_layer(layers[1], t1.hidden_states[1], tokens)
    return (
        Trace(
            tokens=tokens,
            attentions=np.concatenate([t1.attentions, t2.attentions]),
            hidden_states=np.concatenate([t1.hidden_states, t2.hidden_states[1:]]),
            context=np.concatenate([t1.context, t2.context]),
            out_weight=np.concatenate([t1.out_weight, t2.out_weight]),
            out_bias=np.concatenate([t1.out_bias, t2.out_bias]),
            model="attnlab MultiHeadAttention x 2",
            text=" ".join(tokens),
        ),
        layers,
        x,
    )


def test_trace_layer_records_weights_and_each_heads_write():
    trace, (mha, _), x = two_layer_trace()
    with torch.no_grad():
        out, w = mha(x[None], return_weights=True)
    np.testing.assert_allclose(trace.attentions[0], w[0].numpy(), atol=1e-6)
    np.testing.assert_allclose(trace.after_attention(0), (x + out[0]).numpy(), atol=1e-5)
    writes = trace.head_writes(0)  # [H, L, D]
    np.testing.assert_allclose(
        writes.sum(0) + mha.o_proj.bias.detach().numpy(), out[0].numpy(), atol=1e-5
    )
    np.testing.assert_allclose(trace.after_head(0, 2), x.numpy() + writes[2], atol=1e-6)
    assert trace.word_tokens("bank") == [10]
    assert trace.find_focus(None) == 10 and trace.find_focus("river") == 9


def test_trace_layer_of_seed_self_attention_moves_tokens_to_the_weighted_average():
    from attnlab.nn import SelfAttention

    torch.manual_seed(1)
    layer = SelfAttention(8, 4, 8).eval()
    x = torch.randn(5, 8)
    trace = trace_layer(layer, x, list("abcde"), residual=False)
    W = trace.weights(0)
    np.testing.assert_allclose(
        trace.after_attention(0), W @ layer.v_proj(x).detach().numpy(), atol=1e-5
    )
    with pytest.raises(ValueError, match="use d_v == d_in"):
        trace_layer(SelfAttention(8, 4, 6), x)


def test_trace_checks_layers_heads_and_words():
    trace, _, _ = two_layer_trace()
    with pytest.raises(ValueError, match="layer 2 is out of range: .* has 2 layers"):
        trace.weights(2)
    with pytest.raises(ValueError, match="head 4 is out of range"):
        trace.weights(0, 4)
    with pytest.raises(ValueError, match="'boat' is not in"):
        trace.find_focus("boat")
    np.testing.assert_allclose(trace.weights(-1), trace.attentions[1].mean(0))


def test_a_trace_takes_numpy_indices_and_flags_and_refuses_hidden_states_a_layer_short():
    """NumPy integers for layer, head and focus reached the explorer's JSON (a TypeError);
    special flags as an array raised "truth value ... ambiguous"; hidden_states without the
    embeddings (Hugging Face's hidden_states[1:]) made every before() a layer late and the last
    layer's movement zero."""
    trace, _, _ = two_layer_trace()
    got = (trace.check_layer(np.int64(-1)), trace.check_head(np.int64(2)))
    assert got == (1, 2) and all(type(x) is int for x in got)
    assert type(trace.find_focus(np.int64(3))) is int
    build_explorer(trace, focus=np.int64(3), layer=np.int64(1), head=np.int64(0))  # JSON
    flags = np.zeros(len(trace.tokens), bool)
    flags[0] = True
    flagged = Trace(tokens=trace.tokens, attentions=trace.attentions, special=flags)
    assert flagged.special[:2] == [True, False]
    with pytest.raises(ValueError, match=r"\[layers \+ 1, L, D\] = \[3, 11, D\].*Fix"):
        Trace(tokens=trace.tokens, attentions=trace.attentions,
              hidden_states=trace.hidden_states[1:])  # fmt: skip


def test_word_distances_are_cosine_distances_of_the_words_vectors():
    rng = np.random.default_rng(11)

    def make(text, states):
        words = text.split()
        spans, pos = [], 0
        for w in words:
            pos = text.index(w, pos)
            spans.append((pos, pos + len(w)))
            pos += len(w)
        return Trace(
            tokens=words,
            attentions=np.full((2, 1, len(words), len(words)), 1 / len(words)),
            hidden_states=states,
            text=text,
            offsets=spans,
        )

    a = make("river bank", rng.normal(size=(3, 2, 4)))
    b = make("the bank deposit", rng.normal(size=(3, 3, 4)))
    D = word_distances([a, b], "Bank")
    for layer in range(3):
        u, v = a.hidden_states[layer, 1], b.hidden_states[layer, 1]
        expected = 1 - u @ v / np.linalg.norm(u) / np.linalg.norm(v)
        assert D[0, layer] == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ValueError, match="'fish' is not in"):
        word_distances([a, b], "fish")


def test_trace_translation_reads_rnn_and_transformer_results():
    rng = np.random.default_rng(12)
    rnn = {
        "source": "the old man",
        "source_tokens": ["the", "old", "man", "</s>"],
        "target_tokens": ["el", "viejo", "</s>"],
        "attention": random_weights(rng, 3, 4),
    }
    t = trace_translation(rnn, name="rnn")
    assert t.attentions.shape == (1, 1, 3, 4) and t.kind == "cross" and not t.has_movement
    assert t.keys == rnn["source_tokens"] and t.layer_names == ["attention"]
    np.testing.assert_allclose(t.attentions[0, 0], rnn["attention"], rtol=1e-6)

    class Result:  # the shape of attnlab.translate's Translation
        source = "the old man"
        source_tokens = ["the", "old", "man", "</s>"]
        target_tokens = ["el", "hombre", "viejo", "</s>"]
        attention = random_weights(rng, 2, 4, 4, 4)

    t = trace_translation(Result(), name="transformer")
    assert t.layer_names == ["decoder layer 0", "decoder layer 1"] and t.num_heads == 4
    np.testing.assert_allclose(t.attentions, Result.attention, rtol=1e-6)
    with pytest.raises(ValueError, match="returned no attention"):
        trace_translation({**rnn, "attention": None})


def test_merge_subwords_sums_keys_and_averages_queries():
    rng = np.random.default_rng(13)
    W = random_weights(rng, 5, 6)
    words = merge_subwords(W, [[0, 1], [2], [3, 4]], [[0], [1, 2, 3], [4, 5]])
    np.testing.assert_allclose(words.sum(1), 1.0)
    assert words[0, 1] == pytest.approx((W[0, 1:4].sum() + W[1, 1:4].sum()) / 2)


# ---------------------------------------------------------------------------------------------
# the explorer page (its behaviour in a browser: test_viz_browser.py)


def page_data(html: str) -> dict:
    block = re.search(
        r'<script id="attnlab-data" type="application/json">(.*?)</script>', html, re.S
    )
    assert block is not None
    return json.loads(block.group(1))


def decode_dense(data: dict, layer: int) -> np.ndarray:
    """What the page's JavaScript computes, in NumPy: [H, L, S] weights of one layer."""
    import base64

    H, L, S = data["num_heads"], len(data["query_tokens"]), len(data["key_tokens"])
    enc, exact = data["layers"][layer], data["encoding"]["exact"]
    q = np.frombuffer(base64.b64decode(enc["w"]), np.uint8).reshape(H, L, S)
    rowmax = np.frombuffer(base64.b64decode(enc["rowmax"]), "<f4").reshape(H, L)
    W = q / 255 * rowmax[..., None]
    if exact:  # the keys the page can set aside, stored as float32
        W[..., exact] = np.frombuffer(base64.b64decode(enc["exact"]), "<f4").reshape(H, L, -1)
    return W


def test_quantised_weights_are_within_half_a_level_of_the_row_max():
    rng = np.random.default_rng(14)
    W = random_weights(rng, 3, 7, 9)
    q, rowmax = quantize_rows(W)
    err = np.abs(q / 255 * rowmax[..., None] - W)
    assert (err <= rowmax[..., None] / 510 + 1e-7).all()
    assert (q.max(-1) == 255).all()


def test_explorer_page_is_self_contained_and_holds_the_weights():
    trace, _, _ = two_layer_trace()
    html = build_explorer(trace)
    # no external resources: no src/href at all, no url(...), no fetch; the only URL-like
    # string is the SVG namespace name, which browsers never fetch
    assert not re.search(r"\b(src|href)\s*=", html, re.I)
    assert "url(http" not in html and "@import" not in html
    assert "fetch(" not in html and "XMLHttpRequest" not in html
    urls = set(re.findall(r"https?://[^\s\"'<>)]+", html))
    assert urls == {"http://www.w3.org/2000/svg"}
    data = page_data(html)
    assert data["encoding"]["kind"] == "dense"
    assert data["num_layers"] == 2 and data["num_heads"] == 4
    assert data["query_tokens"] == SENTENCE
    for layer in range(2):
        np.testing.assert_allclose(
            decode_dense(data, layer),
            trace.attentions[layer],
            atol=trace.attentions[layer].max() / 510 + 1e-6,
        )
    assert data["movement"] is not None and data["movement"][0]["sets"] == 2 + 4
    assert data["default"]["focus"] == 10  # "bank"
    assert build_explorer(trace) == html  # deterministic


def test_explorer_keeps_the_strongest_weights_of_each_row_when_over_budget():
    rng = np.random.default_rng(15)
    A = random_weights(rng, 2, 3, 40, 40)
    trace = Trace(tokens=[f"t{i}" for i in range(40)], attentions=A)
    data = explorer_data(trace, max_bytes=2 * 3 * 40 * 3 * 8)  # room for k = 8
    # key 0 (the first token, which the page can set aside) is kept exactly; of the others,
    # each row keeps its 8 strongest
    others = A[..., 1:]  # "kept": the share of the other keys' attention the 8 strongest hold
    kept = (np.sort(others, axis=-1)[..., -8:].sum(-1) / others.sum(-1)).mean()
    assert data["encoding"] == {
        "kind": "topk",
        "k": 8,
        "levels": 255,
        "exact": [0],
        "kept": round(kept, 3),
    }
    import base64

    idx = np.frombuffer(base64.b64decode(data["layers"][1]["idx"]), "<u2").reshape(3, 40, 8)
    strongest = 1 + np.sort(np.argsort(-A[1][..., 1:], axis=-1)[..., :8], axis=-1)
    np.testing.assert_array_equal(idx, strongest)
    exact = np.frombuffer(base64.b64decode(data["layers"][1]["exact"]), "<f4").reshape(3, 40)
    np.testing.assert_array_equal(exact, A[1][..., 0].astype(np.float32))
    assert data["movement"] is None


def test_explorer_of_a_translation_has_two_token_lists_and_no_movement():
    rng = np.random.default_rng(16)
    t = trace_translation(
        {
            "source": "the old man",
            "source_tokens": ["the", "old", "man", "</s>"],
            "target_tokens": ["el", "viejo", "</s>"],
            "attention": random_weights(rng, 2, 2, 3, 4),
        }
    )
    data = page_data(build_explorer(t))
    assert data["kind"] == "cross" and data["key_tokens"][-1] == "</s>"
    assert data["layer_names"] == ["decoder layer 0", "decoder layer 1"]
    assert data["movement"] is None


def test_explorer_keeps_rows_accurate_after_setting_a_sink_aside():
    """A sink head puts 0.95 of each row on [CLS]: the rest must survive 8 bits."""
    from attnlab.viz.aside import set_aside

    rng = np.random.default_rng(33)
    L = 12
    A = random_weights(rng, 1, 2, L, L) * 0.05
    A[..., 0] += 0.95  # rows still sum to 1
    special = [True] + [False] * (L - 2) + [True]
    data = explorer_data(Trace(tokens=[f"t{i}" for i in range(L)], attentions=A, special=special))
    assert data["encoding"]["exact"] == [0, L - 1]
    shown = set_aside(decode_dense(data, 0), np.array(special))
    truth = set_aside(A[0], np.array(special))
    # Each weight is off by at most 1/510 of the largest other weight of its row; renormalising
    # divides by a sum whose rounding errors partly cancel: here within 3/510 of the row's
    # largest. Quantised against the sink's 0.95 instead, one step is 0.95/255/0.05 = 0.075.
    bound = 3 * truth.max(-1, keepdims=True) / 510
    assert (np.abs(shown - truth) <= bound).all()
    assert np.abs(shown - truth).max() < 0.005


def test_explorer_overview_thumbnails_and_labels():
    from attnlab.viz import head_patterns

    rng = np.random.default_rng(32)
    L = 40
    A = random_weights(rng, 2, 3, L, L)
    A[0, 1] = np.eye(L, k=-1)  # a previous-token head (row 0 sees nothing: all 0)
    A[1, 0] = 0
    A[1, 0, :, 0] = 1.0  # a sink head
    special = [True] + [False] * (L - 2) + [True]
    trace = Trace(tokens=[f"t{i}" for i in range(L)], attentions=A, special=special)
    data = explorer_data(trace, aside="special")
    assert data["default"]["aside"] == "special"
    labels = [[p["label"] for p in heads] for heads in data["patterns"]]
    assert labels[0][1] == "previous-token" and labels[1][0] == "first-token/sink"
    assert labels == [[p.label for p in heads] for heads in head_patterns(A, special)]
    ov = data["overview"]
    assert (ov["rows"], ov["cols"]) == (32, 32) and set(ov["thumbs"]) == {
        "none",
        "special",
        "first",
    }
    import base64

    def thumbs(name, layer):
        raw = np.frombuffer(base64.b64decode(ov["thumbs"][name][layer]), np.uint8)
        return raw.reshape(3, 32, 32).astype(float)

    # each thumbnail: blocks of the map averaged, on one scale for the page: relative to the
    # largest cell of any thumbnail (here the sink head's 1.0)
    edges = np.linspace(0, L, 33).round().astype(int)
    small = np.add.reduceat(np.add.reduceat(A[0, 2], edges[:-1], 0), edges[:-1], 1)
    small /= np.outer(np.diff(edges), np.diff(edges))
    assert ov["top"]["none"] == 1.0
    np.testing.assert_allclose(thumbs("none", 0)[2] / 255, small, atol=0.5 / 255)
    assert (thumbs("none", 1)[0][:, 0] == 255).all() and thumbs("none", 1)[0][:, 1:].max() == 0
    # the sink head with [CLS] set aside has nothing left: an all-0 thumbnail
    assert thumbs("special", 1)[0].max() == 0
    with pytest.raises(ValueError, match="added no special token"):
        explorer_data(Trace(tokens=list("ab"), attentions=np.full((1, 1, 2, 2), 0.5)),
                      aside="special")  # fmt: skip


def test_explorer_escapes_markup_in_tokens():
    t = Trace(
        tokens=["</script>", "<b>"], attentions=np.full((1, 1, 2, 2), 0.5), text="</script><b>"
    )
    html = build_explorer(t)
    assert html.count("</script>") == 2  # the data block's and the code block's own ends
    assert page_data(html)["query_tokens"] == ["</script>", "<b>"]


def test_what_a_heatmap_would_draw_wrong_is_refused_by_name():
    # before: an empty map or every key set aside gave NumPy's "zero-size array" error;
    # negative values were drawn in the colour of 0; vmax <= 0 quietly became 1
    from attnlab.viz import plot_attention, plot_attention_grid

    W = np.array([[0.9, 0.1], [0.3, 0.7]])
    cases = [
        (lambda: plot_attention(W, aside=[True, True]), "every key is set aside"),
        (lambda: plot_attention(np.zeros((0, 0))), r"no cell to draw: shape \(0, 0\)"),
        (lambda: plot_attention(np.array([[-3.0, 2.0], [1.0, -1.0]])), "minimum of -3"),
        (lambda: plot_attention(W, vmax=0.0), "vmax"),
        (lambda: plot_attention_grid(W[None, None], aside=[True, True]), "every key"),
        (lambda: plot_attention_grid(-W[None, None]), "softmax"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    with pytest.raises(ValueError, match="index the extra leading dims"):
        plot_attention(np.stack([W, W]))  # [H, L, S]: which head is not ours to guess


def test_a_trace_takes_torch_stack_of_the_attentions_as_the_grid_does():
    # before: [layers, B=1, H, L, S] was refused with advice (weights[0]) that kept layer 0 only
    rng = np.random.default_rng(0)
    stack = rng.dirichlet(np.ones(4), size=(6, 1, 2, 4))
    trace = Trace(tokens=list("abcd"), attentions=stack)
    assert trace.attentions.shape == (6, 2, 4, 4)
    np.testing.assert_allclose(trace.attentions, stack[:, 0], rtol=1e-6)


@pytest.mark.parametrize("special", [False, True])
def test_the_explorer_takes_a_text_whose_every_key_is_stored_exactly(special):
    # before: one token (or [CLS][SEP] only) left no column to quantise: "zero-size array"
    import base64

    from attnlab.viz import build_explorer

    n = 2 if special else 1
    A = np.full((1, 1, n, n), 1.0 / n)
    trace = Trace(tokens=["[CLS]", "[SEP]"][:n] if special else ["Hi"], attentions=A,
                  special=[special] * n)  # fmt: skip
    page = build_explorer(trace)
    data = json.loads(re.search(r'application/json">(.*?)</script>', page, re.S).group(1))
    exact = np.frombuffer(base64.b64decode(data["layers"][0]["exact"]), "<f4")
    np.testing.assert_allclose(exact, A.ravel())


def test_token_labels_show_invisible_characters_as_escapes():
    # before: a generated token holding a control character was drawn as a missing-glyph box
    # (matplotlib: "Glyph 11 missing from font")
    from attnlab.viz import plot_attention

    tokens = ["a\x0bb", "\u200bx", "tab\there", "été"]
    fig = plot_attention(np.full((4, 4), 0.25), tokens)
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == ["a\\x0bb", "\\u200bx", "tab\\there", "été"]
