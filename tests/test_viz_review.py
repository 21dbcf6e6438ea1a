"""A review of the pictures, the explorer page and ``attnlab show``: each test fails on the code
before its fix.

1. the overview's thumbnails share one colour scale, and with many heads keep every cell and wrap;
2. long token labels fit (or are elided with the whole token as a tooltip);
3. a long movement title is wrapped inside its figure;
4. a focus word means its first use in every picture ("bank#2": the second);
5. options a run would ignore are refused, naming the option and the fix;
6. "24/7" (a text with a slash) is refused with a fix that works;
7. a failed run leaves its output folder as it was.
"""

import base64
import json
import os
import shlex
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: no Hub, ever

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from attnlab.viz import Trace, build_explorer, movement, write_explorer  # noqa: E402
from attnlab.viz.explorer import explorer_data  # noqa: E402
from browser.chromium import browser, open_page, skip_reason  # noqa: E402


def weights(layers, H, L, seed=0, power=4):
    rng = np.random.default_rng(seed)
    A = rng.random((layers, H, L, L)) ** power
    return A / A.sum(-1, keepdims=True)


@pytest.fixture(scope="module")
def context(tmp_path_factory):
    if skip_reason() is not None:
        pytest.skip(skip_reason())
    with browser(tmp_path_factory.mktemp("chromium-profile")) as ctx:
        yield ctx


YELLOW = np.array([253, 231, 37]) / 255  # the page's colour map at its top
TEAL = np.array([33, 145, 140]) / 255  # ... halfway up


def element_pixels(page, selector, path):
    """The element as the screen shows it: ``[h, w, 3]`` floats in 0..1."""
    import matplotlib.image

    page.locator(selector).screenshot(path=str(path))
    pixels = matplotlib.image.imread(str(path))[..., :3]
    # the element's box may start at a fraction of a pixel: the screenshot then holds one more
    # column or row of the white page around it, which no colour of the map is
    cols, rows = (pixels < 0.97).any(-1).any(0), (pixels < 0.97).any(-1).any(1)
    return pixels[rows.argmax() : len(rows) - rows[::-1].argmax(),
                  cols.argmax() : len(cols) - cols[::-1].argmax()]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# 1. the overview


def test_thumbnails_share_one_colour_scale_for_the_whole_page():
    """Each thumbnail was scaled to its own largest cell: a head spreading its weight evenly
    was as bright as a head putting all of it on one key."""
    L = 8
    A = np.full((2, 2, L, L), 1.0 / L)  # layer 0 head 0 and layer 1: uniform
    A[0, 1] = 0.0
    A[0, 1, :, 0] = 1.0  # layer 0 head 1: everything on the first token
    data = explorer_data(Trace(tokens=[f"t{i}" for i in range(L)], attentions=A))
    ov = data["overview"]

    def thumb(layer):
        raw = base64.b64decode(ov["thumbs"]["none"][layer])
        return np.frombuffer(raw, np.uint8).reshape(2, L, L)

    assert thumb(0)[1][:, 0].tolist() == [255] * L  # the page's largest weight: the top
    expected = int(np.floor(255 / L + 0.5))  # 1/8 of the top, in every uniform thumbnail
    assert (thumb(0)[0] == expected).all() and (thumb(1) == expected).all()
    assert ov["top"]["none"] == 1.0
    # set aside the first token: every row renormalised, the same one scale for all
    assert ov["top"]["first"] == pytest.approx(1 / (L - 1), abs=1e-4)


def test_many_heads_keep_every_cell_on_whole_pixels_and_wrap_into_rows(context, tmp_path):
    """With 20 heads or more, a 32-cell thumbnail was squeezed into 30 css px with
    ``image-rendering: pixelated``: two of its rows and columns were not drawn at all."""
    L, H = 32, 24
    A = np.full((1, H, L, L), 1.0 / L)
    A[0, 0] = 0.0
    A[0, 0, :, 0::2] = 2.0 / L  # head 0: stripes, every other key
    trace = Trace(tokens=[f"w{i}" for i in range(L)], attentions=A, model="many heads")
    path = write_explorer(trace, tmp_path / "many.html")
    with open_page(context, path) as seen:
        page = seen.page
        sel = "#overview .thumb[data-layer='0'][data-head='0'] canvas"
        stripes = element_pixels(page, sel, tmp_path / "stripes.png")
        profile = stripes[stripes.shape[0] // 2].mean(-1)  # one row of pixels, left to right
        bright = profile > (profile.max() + profile.min()) / 2
        runs = 1 + int(np.count_nonzero(bright[1:] != bright[:-1]))
        assert runs == L  # 16 bright and 16 dark stripes: no cell dropped
        box = page.locator(sel).bounding_box()
        assert box["width"] % L == 0 and box["width"] >= L  # whole pixels per cell
        # one colour scale: the stripes reach the top (yellow); the uniform head, half of it,
        # is the middle of the colour map (teal), not yellow as its own maximum made it
        uniform = element_pixels(
            page, "#overview .thumb[data-layer='0'][data-head='1'] canvas", tmp_path / "u.png"
        )
        np.testing.assert_allclose(stripes[:, bright].mean(1)[0], YELLOW, atol=0.03)
        np.testing.assert_allclose(uniform.mean((0, 1)), TEAL, atol=0.03)
        # 24 heads wrap into rows that fit the window
        per_row = int(page.get_attribute("#overview", "data-per-row"))
        assert 1 < per_row < H
        panel = page.locator("#overview-panel").bounding_box()
        assert panel["x"] + panel["width"] <= 1500  # the browser window's width
        top = {h: page.locator(f"#overview .thumb[data-head='{h}']").bounding_box()["y"]
               for h in (0, per_row - 1, per_row)}  # fmt: skip
        assert top[0] == top[per_row - 1] < top[per_row]
        legend = page.text_content("#overview-legend")
        assert "one scale for every thumbnail on the page" in legend
        assert "yellow = 0.063" in legend  # 2 / 32, the stripes' weight
        assert seen.errors == []


# ---------------------------------------------------------------------------------------------
# 2. labels


LONG = ["a", "supercalifragilisticexpialidocious", "WWWWWWWWWWWWWWWWWWWWWWWW", "b", "c", "d"]
HEATMAP_EDGES = """() => {
  const c = document.getElementById("heatmap"), ctx = c.getContext("2d");
  const left = ctx.getImageData(0, 0, 2, c.height).data;
  const bottom = ctx.getImageData(0, c.height - 2, c.width, 2).data;
  const ink = (d) => { let n = 0; for (let p = 3; p < d.length; p += 4) n += d[p] > 0; return n; };
  return [ink(left), ink(bottom)];
}"""
HEADVIEW_LABELS = """() => {
  const svg = document.getElementById("headview"), width = +svg.getAttribute("width");
  return [...svg.querySelectorAll("text.tok")].map((t) => {
    const b = t.getBBox(), title = t.parentNode.querySelector("title");
    return { text: t.textContent, x0: b.x, x1: b.x + b.width, width: width,
             title: title ? title.textContent : null };
  });
}"""


def test_long_token_labels_fit_or_are_elided_with_the_whole_token_as_tooltip(context, tmp_path):
    """The heatmap measured its labels at 11 px and drew them at 12 px (a long one ran past the
    canvas's edge); the head view cut at 16 characters whatever their width (wide ones ran
    out of the picture), with no way to read the whole token."""
    trace = Trace(tokens=LONG, attentions=weights(1, 2, len(LONG)), model="labels")
    path = write_explorer(trace, tmp_path / "labels.html")
    with open_page(context, path) as seen:
        page = seen.page
        assert page.evaluate(HEATMAP_EDGES) == [0, 0]  # no label reaches the canvas's edge
        for label in page.evaluate(HEADVIEW_LABELS):
            assert 0 <= label["x0"] and label["x1"] <= label["width"], label
            if label["text"] in LONG:
                assert label["title"] is None
            else:  # elided: its first characters and "…", the whole token as a tooltip
                assert label["text"].endswith("…") and label["title"] in LONG
                assert label["title"].startswith(label["text"][:-1])
        # hovering a query's label on the heatmap shows the whole token
        g = page.evaluate("() => window.attnlabExplorer.heatmap")
        box = page.locator("#heatmap").bounding_box()
        page.mouse.move(box["x"] + g["left"] - 20, box["y"] + g["top"] + 2.5 * g["cell"])
        assert page.get_attribute("#heatmap", "title") == "query 2: " + LONG[2]
        assert page.text_content("#readout") == "query 2: " + LONG[2]
        assert seen.errors == []


# ---------------------------------------------------------------------------------------------
# 3. titles


def inside(fig, text):
    fig.canvas.draw()
    box = text.get_window_extent(fig.canvas.get_renderer())
    return box.x0 >= 0 and box.x1 <= fig.bbox.width and box.y1 <= fig.bbox.height


def test_long_movement_titles_are_wrapped_inside_the_figure():
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(4, 8)), np.full((4, 4), 0.25)
    title = (
        "my-fine-tuned-bert-base-multilingual-cased-checkpoint-12000 · layer 3 · head 7 "
        "(previous-token): token vectors before → after head 7 alone,\npulls on “bank”"
    )
    fig = movement.plot_movement(x, x + 1, list("abcd"), w, focus="d", title=title)
    text = fig.axes[0].title
    assert inside(fig, text)
    assert text.get_text().count("\n") >= 2  # wrapped, not only at the given line break
    assert text.get_text().replace("\n", " ") == title.replace("\n", " ")  # no word lost
    fig = movement.plot_head_movements(x, np.stack([x + 1, x - 1]), list("abcd"),
                                       np.stack([w, w]), focus="d", title=title)  # fmt: skip
    assert inside(fig, fig._suptitle)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    lowest = fig._suptitle.get_window_extent(renderer).y0
    assert all(ax.get_window_extent(renderer).y1 <= lowest for ax in fig.axes if ax.get_visible())
    fig = movement.plot_trajectories(rng.normal(size=(3, 4, 8)), list("abcd"), title=title)
    assert inside(fig, fig.axes[0].title)


def test_long_heatmap_titles_are_wrapped_inside_the_figure():
    from attnlab.viz import heatmap

    title = (
        "my-fine-tuned-bert-base-multilingual-cased-checkpoint-12000 · layer 3 · mean of heads "
        "on “the river bank was flooded after the storm”"
    )
    w = np.full((4, 4), 0.25)
    for fig in (
        heatmap.plot_attention(w, list("abcd"), title=title),
        heatmap.plot_alignment(w, list("abcd"), list("wxyz"), title=title),
    ):
        text = fig.axes[0].title
        assert inside(fig, text) and text.get_text().count("\n") >= 1
        assert "".join(text.get_text().split()) == "".join(title.split())  # no word lost
    tokens = [f"t{i}" for i in range(40)]
    grid = heatmap.plot_attention_grid(np.full((2, 2, 40, 40), 1 / 40), tokens, title=title)
    assert inside(grid, grid._suptitle) and grid._suptitle.get_text().count("\n") >= 1
    grid.canvas.draw()
    renderer = grid.canvas.get_renderer()
    lowest = grid._suptitle.get_window_extent(renderer).y0
    assert all(ax.get_window_extent(renderer).y1 <= lowest for ax in grid.axes[:1])


# ---------------------------------------------------------------------------------------------
# 4. the focus word


def test_a_focus_word_means_its_first_use_in_every_picture():
    """``Trace.find_focus`` took a word's first use, ``plot_movement`` its last: the same
    ``focus="bank"`` drew two different tokens."""
    tokens = ["the", "bank", "and", "the", "bank"]
    W = np.full((5, 5), 0.05)
    W[1, 0], W[4, 3] = 0.8, 0.8  # the first "bank" looks at "the", the second at "the" again
    W /= W.sum(-1, keepdims=True)
    trace = Trace(tokens=tokens, attentions=W[None, None], text="the bank and the bank")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 8))

    def pulled_by(focus):  # the token that pulls the focus hardest in the picture
        fig = movement.plot_movement(x, x + 1, tokens, W, focus=focus)
        [pulls] = [c for c in fig.axes[0].collections if c.get_gid() == "pulls"]
        idx = trace.find_focus(focus)
        others = [j for j in range(5) if j != idx]
        return others[int(np.argmax(pulls.get_linewidths()))], idx

    assert pulled_by("bank") == (0, 1)  # the first "bank", as the trace and the page read it
    assert pulled_by("bank#2") == (3, 4)
    assert explorer_data(trace, focus="bank")["default"]["focus"] == 1
    assert explorer_data(trace, focus="bank#2")["default"]["focus"] == 4
    with pytest.raises(ValueError, match="used at least 3 times; 'bank' is there 2 times.*Fix"):
        movement.plot_movement(x, x + 1, tokens, W, focus="bank#3")
    with pytest.raises(ValueError, match=r"uses count from 1\. Fix: bank#1"):
        build_explorer(trace, focus="bank#0")


# ---------------------------------------------------------------------------------------------
# the command line (5, 6, 7) on a tiny BERT saved with save_pretrained

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from attnlab import cli, pretrained  # noqa: E402
from attnlab.viz import cmd_explain  # noqa: E402
from test_show_models import TEXT, tiny_bert  # noqa: E402


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return tiny_bert(tmp_path_factory.mktemp("models") / "tiny-bert")


@pytest.fixture
def bert_as_minilm(bert_dir, monkeypatch):
    """``--model minilm`` loads the tiny BERT (the command line is the thing tested)."""
    loaded = pretrained.load_folder(bert_dir, attn_implementation="eager")
    monkeypatch.setattr(cmd_explain, "_load", lambda name, say: (*loaded, "eager"))


def error_line(capsys):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("attnlab show: error: ")
    return lines[0]


def test_options_a_run_would_ignore_are_refused_with_the_fix(tmp_path, capsys, monkeypatch):
    def never(*args):
        raise cli.UserError("the model was loaded: the option was ignored")

    monkeypatch.setattr(cmd_explain, "_load", never)
    monkeypatch.setattr(cmd_explain, "_load_run", never)
    run = tmp_path / "run"  # what show takes for a translation run: checked before loading
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"attnlab_run": 1}))
    out = ["--out", str(tmp_path / "out"), "--quiet"]
    cases = [
        ([TEXT, "--word", "bank"], ["--word bank", "no --compare", "Fix: add --compare",
                                    "--focus bank"]),
        ([TEXT, "--compare", "a bank", "--layer", "2"], ["--layer 2", "Fix: leave out --layer"]),
        ([TEXT, "--compare", "a bank", "--head", "0"], ["--head 0", "Fix: leave out --head"]),
        ([TEXT, "--compare", "a bank", "--focus", "bank"], ["--focus bank",
                                                            "Fix: pass the word as --word bank"]),
        ([str(run), "12 May", "--focus", "May"], ["--focus May", "a translation run draws none",
                                                  "Fix: leave out --focus"]),
        ([str(run), "12 May", "--truncate"], ["--truncate", "Fix: leave out --truncate"]),
    ]  # fmt: skip
    for argv, parts in cases:
        assert cli.main(["show", *argv, *out]) == 2, argv
        line = error_line(capsys)
        for part in parts:
            assert part in line, (argv, line)
    assert not (tmp_path / "out").exists()


def test_a_text_with_a_slash_is_refused_with_a_fix_that_works(
    tmp_path, capsys, monkeypatch, bert_as_minilm
):
    """``attnlab show "24/7"`` is taken for a path (the shell drops the quotes) and refused;
    its fix said to quote the sentence, which changes nothing (and showed the example)."""
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()  # the fixture's progress bars
    for argv, text in [(["24/7"], "24/7"), (["24/7", "is", "a", "lot"], "24/7 is a lot")]:
        assert cli.main(["show", *argv, "--quiet"]) == 2
        line = error_line(capsys)
        assert "no such run folder: '24/7'" in line
        command = shlex.split(line[line.rindex("attnlab show ") :])
        assert command[:2] == ["attnlab", "show"]
        out = tmp_path / f"out-{len(argv)}"
        assert cli.main(["show", *command[2:], "--out", str(out), "--quiet", "--no-html"]) == 0
        capsys.readouterr()
        assert json.loads((out / "summary.json").read_text())["text"] == text


def test_a_failed_run_leaves_the_output_folder_as_it_was(tmp_path, capsys, monkeypatch, bert_dir):
    """A run that failed half-way had already removed the previous run's pictures and left
    some of its own beside them."""
    shows = tmp_path / "shows"
    out = shows / "out"
    argv = ["show", str(bert_dir), "--out", str(out), "--quiet", "--no-html"]
    assert cli.main([*argv[:2], TEXT, *argv[2:]]) == 0
    (out / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert {"heatmap.png", "trajectory.png", "summary.json", "notes.txt"} <= set(before)

    def boom(*args, **kwargs):
        raise RuntimeError("the disk is full")

    with monkeypatch.context() as m:
        m.setattr(movement, "plot_trajectories", boom)  # after four pictures are written
        with pytest.raises(RuntimeError, match="the disk is full"):
            cli.main([*argv[:2], "i made a deposit at the bank", *argv[2:]])
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
        assert [p.name for p in shows.iterdir()] == ["out"]  # no temporary folder left
        fresh = shows / "fresh"  # a new folder: not created at all
        with pytest.raises(RuntimeError, match="the disk is full"):
            cli.main([*argv[:2], TEXT, "--out", str(fresh), "--quiet"])
        assert [p.name for p in shows.iterdir()] == ["out"]
    # a kill -9 leaves a staging folder: the next run removes it (its process is gone), not a
    # running show's
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    (shows / f".out.{dead}.abc.tmp").mkdir()
    (shows / f".out.{os.getppid()}.def.tmp").mkdir()  # (pytest's parent: running)
    # a run that succeeds replaces the previous run's files; the user's stay
    assert cli.main([*argv[:2], "i made a deposit at the bank", *argv[2:]]) == 0
    assert sorted(p.name for p in shows.iterdir()) == [f".out.{os.getppid()}.def.tmp", "out"]
    (shows / f".out.{os.getppid()}.def.tmp").rmdir()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["text"] == "i made a deposit at the bank"
    assert {p.name for p in out.iterdir()} == set(before)
    assert (out / "notes.txt").read_text() == "mine"
    assert [p.name for p in shows.iterdir()] == ["out"]
