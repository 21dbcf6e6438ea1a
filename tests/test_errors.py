"""Bad input: a clear ValueError/TypeError naming the argument, what was expected and received,
and the fix -- raised before any work is done."""

from __future__ import annotations

import re

import pytest
import torch

import attnlab.functional as AF
from attnlab import masks


def t(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


Q, K, V = t(2, 4, 5, 8), t(2, 2, 7, 8), t(2, 2, 7, 3)

SDPA_CASES = [
    # (description, args, kwargs, error type, phrases the message must contain)
    (
        "batch mismatch",
        (Q, t(3, 2, 7, 8), t(3, 2, 7, 3)),
        {},
        ValueError,
        ["batch size B", "query has 2", "have 3", "Fix"],
    ),
    (
        "Hkv does not divide H",
        (Q, t(2, 3, 7, 8), t(2, 3, 7, 3)),
        {},
        ValueError,
        ["Hkv must divide", "H=4, Hkv=3", "[1, 2, 4]"],
    ),
    (
        "key/value length mismatch",
        (Q, K, t(2, 2, 6, 3)),
        {},
        ValueError,
        ["same length S", "(2, 2, 7, 8)", "(2, 2, 6, 3)", "Fix"],
    ),
    (
        "query/key width mismatch",
        (Q, t(2, 2, 7, 6), V),
        {},
        ValueError,
        ["head dim E", "expected 8, got 6", "Fix"],
    ),
    ("dims mismatch", (Q, t(2, 7, 8), V), {}, ValueError, ["as many dims", "Fix"]),
    (
        "mask does not broadcast",
        (Q, K, V, t(5, 6, dtype=torch.bool)),
        {},
        ValueError,
        ["attn_mask", "(5, 6)", "(2, 4, 5, 7)", "Fix"],
    ),
    (
        "integer mask",
        (Q, K, V, t(5, 7, dtype=torch.int64)),
        {},
        TypeError,
        ["attn_mask", "torch.int64", "True = may attend", "Fix"],
    ),
    (
        "negative dropout",
        (Q, K, V),
        {"dropout_p": -0.1},
        ValueError,
        ["dropout_p", "[0, 1)", "-0.1", "Fix"],
    ),
    ("dropout of 1", (Q, K, V), {"dropout_p": 1.0}, ValueError, ["dropout_p", "1.0"]),
    (
        "integer query",
        (t(2, 4, 5, 8, dtype=torch.int64), K, V),
        {},
        TypeError,
        ["query", "floating-point", "torch.int64", "Fix"],
    ),
    ("mixed dtypes", (Q, K.double(), V), {}, TypeError, ["one dtype", "Fix"]),
    (
        "ambiguous causal",
        (Q, K, V),
        {"is_causal": True},
        ValueError,
        ["ambiguous", "L=5", "S=7", "bottom_right", "top_left"],
    ),
    ("unknown causal", (Q, K, V), {"is_causal": "diagonal"}, ValueError, ["is_causal"]),
    ("not a tensor", ([[1.0]], K, V), {}, TypeError, ["query", "torch.Tensor"]),
]


BAD_INPUT = [
    pytest.param(fn, *case[1:], id=f"{name}-{case[0]}")
    for name, fn in (("sdpa", AF.scaled_dot_product_attention), ("hard", AF.hard_attention))
    for case in SDPA_CASES
    if not (fn is AF.hard_attention and "dropout_p" in case[2])  # hard attention has no dropout
]


@pytest.mark.parametrize("fn,args,kwargs,error,phrases", BAD_INPUT)
def test_sdpa_bad_input(fn, args, kwargs, error, phrases):
    with pytest.raises(error) as info:
        fn(*args, **kwargs)
    for phrase in phrases:
        assert phrase in str(info.value), (phrase, str(info.value))


def test_additive_bad_input():
    q, k, v = t(2, 3, 5), t(2, 4, 6), t(2, 4, 2)
    w_q, w_k, w_s = t(8, 5), t(8, 6), t(8)
    with pytest.raises(ValueError, match=r"w_key must be \(A, Dk\) = \(8, 6\), got \(8, 5\)"):
        AF.additive_attention(q, k, v, w_q, t(8, 5), w_s)
    with pytest.raises(ValueError, match=r"w_query must be \(A, Dq\) = \(8, 5\)"):
        AF.additive_attention(q, k, v, t(8, 4), w_k, w_s)
    with pytest.raises(ValueError, match="same length S"):
        AF.additive_attention(q, k, t(2, 3, 2), w_q, w_k, w_s)
    with pytest.raises(ValueError, match="leading dims"):
        AF.additive_attention(q, t(3, 4, 6), t(3, 4, 2), w_q, w_k, w_s)
    with pytest.raises(TypeError, match="w_score must be a floating-point"):
        AF.additive_attention(q, k, v, w_q, w_k, t(8, dtype=torch.int32))
    with pytest.raises(ValueError, match="attn_mask"):
        AF.additive_attention(q, k, v, w_q, w_k, w_s, t(5, 5, dtype=torch.bool))


def test_tensors_on_another_device_are_refused_before_any_kernel():
    """A mask or a weight on another device than the query (a model spread over GPUs) is named
    with the fix; Triton would read another device's memory through its pointer. The meta
    device stands in for a second GPU."""
    other = torch.device("meta")
    with pytest.raises(ValueError, match=r"attn_mask must be on the device .* cpu; got attn_mask "
                       r"on meta\. Fix: .*\.to\('cpu'\)"):  # fmt: skip
        AF.scaled_dot_product_attention(Q, K, V, torch.ones(5, 7, dtype=torch.bool, device=other))
    with pytest.raises(ValueError, match="attn_mask must be on the device"):
        AF.hard_attention(Q, K, V, attn_mask=torch.ones(5, 7, dtype=torch.bool, device=other))
    with pytest.raises(ValueError, match="mask must be on the device"):
        AF.masked_softmax(t(2, 5, 7), torch.ones(5, 7, dtype=torch.bool, device=other))
    q, k, v = t(2, 3, 5), t(2, 4, 6), t(2, 4, 2)
    w_q, w_k, w_s = t(8, 5), t(8, 6), t(8)
    with pytest.raises(ValueError, match=r"query's device, cpu; got key on meta, w_key on meta\."):
        AF.additive_attention(q, k.to(other), v, w_q, w_k.to(other), w_s)
    with pytest.raises(ValueError, match="attn_mask must be on the device"):
        AF.additive_attention(
            q, k, v, w_q, w_k, w_s, torch.ones(3, 4, dtype=torch.bool, device=other)
        )
    from attnlab.kernels import _triton

    assert "several devices" in _triton.unfit(t(1), t(1).to(other))


def test_other_bad_input():
    with pytest.raises(ValueError, match=re.escape("weight must have shape (Eq, Ek) = (8, 8)")):
        AF.general_scores(t(2, 5, 8), t(2, 7, 8), t(8, 6))
    with pytest.raises(ValueError, match=re.escape("(A, Eq + Ek) = (A, 14)")):
        AF.concat_scores(t(2, 5, 8), t(2, 7, 6), t(4, 13), t(4))
    with pytest.raises(ValueError, match="top_k"):
        AF.hard_attention(Q, K, V, mode="topk")
    with pytest.raises(ValueError, match="mode must be one of"):
        AF.hard_attention(Q, K, V, mode="soft")
    with pytest.raises(ValueError, match="noise must have the scores' shape"):
        AF.hard_attention(Q, K, V, mode="sample", noise=t(2, 4, 5))
    with pytest.raises(ValueError, match="value"):
        AF.attention(t(2, 4, 5, 7), t(2, 3, 7, 2))


def test_mask_builder_errors():
    with pytest.raises(ValueError, match="alignment must be given.*bottom_right"):
        masks.causal_mask(3, 5)
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        masks.sliding_window_mask(4, window=0)
    with pytest.raises(ValueError, match=r"lengths must be <= max_length=3.*max_length >= 5"):
        masks.padding_mask([2, 5], 3)
    # before: blamed the lengths, printed an empty list as "(0,) torch.float32", and took a
    # window of True as 1
    with pytest.raises(ValueError, match=r"max_length must be an int >= 0.*got -1"):
        masks.padding_mask([0], -1)
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        masks.padding_mask([2, -1], 3)
    for build in (masks.padding_mask, masks.document_mask):
        with pytest.raises(ValueError, match="got an empty sequence"):
            build([])
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        masks.sliding_window_mask(3, window=True)
    with pytest.raises(TypeError, match="True = real token"):
        masks.expand_key_padding(t(2, 5))
    with pytest.raises(TypeError, match="to_bool"):
        masks.and_masks(masks.causal_mask(3), t(3, 3))


def test_mask_shape_check_is_torchs_broadcast_without_enlarging():
    """The written-out check accepts a mask exactly when torch.broadcast_shapes(mask, scores)
    is the scores' shape, over every small shape (0 and 1 included)."""
    from itertools import product

    from attnlab._checks import check_mask

    target = (2, 3, 1, 0)
    for dims in range(5):
        for shape in product((0, 1, 2, 3), repeat=dims):
            try:
                ok = torch.broadcast_shapes(shape, target) == torch.Size(target)
            except RuntimeError:
                ok = False
            mask = torch.ones(shape, dtype=torch.bool)
            if ok:
                check_mask(mask, target)
            else:
                with pytest.raises(ValueError, match="does not broadcast"):
                    check_mask(mask, target)


def test_broadcast_shapes_is_torchs():
    from itertools import product

    from attnlab._checks import broadcast_shapes

    shapes = [s for d in range(4) for s in product((0, 1, 2, 3), repeat=d)]
    for a, b in product(shapes, repeat=2):
        try:
            want = tuple(torch.broadcast_shapes(a, b))
        except RuntimeError:
            with pytest.raises(RuntimeError):
                broadcast_shapes(a, b)
            continue
        assert broadcast_shapes(a, b) == want, (a, b)
    assert broadcast_shapes((2, 1), (3, 1, 4), (1, 1)) == (3, 2, 4)


def test_the_fast_check_accepts_nothing_the_full_checks_refuse(monkeypatch):
    """check_qkv answers its hot case (4-D, one dtype, one device) without the full checks;
    over shapes, dtypes, dims and devices around it, what it accepts the full checks accept."""
    import itertools

    from attnlab import _checks

    fast = _checks.qkv_fit_shapes
    shapes = [(2, 4, 3, 8), (2, 2, 5, 8), (2, 2, 5, 6), (1, 2, 5, 8), (2, 3, 5, 8), (2, 0, 5, 8),
              (2, 4, 5, 8), (2, 4, 3), (4, 3, 8)]  # fmt: skip
    accepted = refused = 0
    for (qs, ks, vs), (qd, kd) in itertools.product(
        itertools.product(shapes, repeat=3),
        [
            (torch.float32, torch.float32),
            (torch.float32, torch.float16),
            (torch.int64, torch.int64),
        ],  # fmt: skip
    ):
        q, k, v = torch.zeros(qs, dtype=qd), torch.zeros(ks, dtype=kd), torch.zeros(vs, dtype=kd)
        for device in (None, "meta"):
            if device:
                v = v.to(device)
            if fast(q, k, v) is None:
                refused += 1
                continue
            accepted += 1
            monkeypatch.setattr(_checks, "qkv_fit_shapes", lambda *args: None)
            _checks.check_qkv(q, k, v)  # the full checks: must not raise
            monkeypatch.setattr(_checks, "qkv_fit_shapes", fast)
    assert accepted >= 19 and refused > 1000, (accepted, refused)  # (19 fit, as written)


def test_additive_attention_gives_each_shape_problem_its_own_fix():
    # from a review: grouped-query heads were told to fix their projection widths
    q, k = torch.randn(2, 4, 3, 6), torch.randn(2, 2, 5, 6)
    w, w_score = torch.randn(7, 6), torch.randn(7)
    with pytest.raises(ValueError) as err:
        AF.additive_attention(q, k, k, w, w, w_score)
    assert "repeat_interleave(H // Hkv, dim=-3)" in str(err.value)
    assert "W_q maps" not in str(err.value)
    with pytest.raises(ValueError) as err:
        AF.additive_attention(q, q, q, torch.randn(7, 5), w, w_score)
    assert "W_q maps" in str(err.value) and "repeat_interleave" not in str(err.value)
