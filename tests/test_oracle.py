"""Every torch function against its float64 NumPy twin, over grids of shapes, heads and masks."""

from __future__ import annotations

import itertools
import re
from unittest import mock

import numpy as np
import pytest
import torch

import attnlab.functional as AF
import attnlab.functional.additive as additive_module
import attnlab.functional.sdpa as sdpa_module
import attnlab.reference as R
from attnlab import masks
from conftest import assert_close_to_oracle, naive_sdpa, np64

F64 = torch.float64

# (B, H, Hkv, L, S, E, Ev): MHA, GQA, MQA, decode steps (L=1), L > S, tiny.
SHAPES = [
    (1, 1, 1, 1, 1, 4, 4),
    (2, 4, 4, 5, 5, 8, 8),
    (2, 6, 2, 4, 9, 8, 3),
    (1, 8, 1, 7, 3, 16, 16),
    (3, 4, 2, 1, 10, 8, 8),
    (2, 3, 3, 6, 6, 5, 7),
]
MASKS = ["none", "bool", "padding", "additive"]
CAUSAL = [False, True, "top_left", "bottom_right"]


def make_qkv(shape, dtype=F64, seed=0, layout=4):
    B, H, Hkv, L, S, E, Ev = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, E, generator=g, dtype=F64)
    k = torch.randn(B, Hkv, S, E, generator=g, dtype=F64)
    v = torch.randn(B, Hkv, S, Ev, generator=g, dtype=F64)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    if layout == 3:  # (B, L, E): single head
        q, k, v = q[:, 0], k[:, 0], v[:, 0]
    elif layout == 2:  # (L, E)
        q, k, v = q[0, 0], k[0, 0], v[0, 0]
    return q, k, v


def make_mask(kind, shape, seed=0):
    B, H, Hkv, L, S, E, Ev = shape
    g = torch.Generator().manual_seed(seed + 1)
    if kind == "none":
        return None
    if kind == "bool":  # random, with one fully masked query row
        m = torch.rand(B, 1, L, S, generator=g) > 0.3
        m[0, 0, 0] = False
        return m
    if kind == "padding":
        lengths = torch.randint(1, S + 1, (B,), generator=g)
        return masks.padding_mask(lengths, S)
    bias = torch.randn(B, H, L, S, generator=g, dtype=F64)
    bias[torch.rand(B, H, L, S, generator=g) < 0.2] = float("-inf")
    return bias


def causal_ok(causal, shape):
    return causal is not True or shape[3] == shape[4]


CASES = [
    (s, m, c)
    for s, m, c in itertools.product(SHAPES, MASKS, CAUSAL)
    if causal_ok(c, s) and not (c is True and s[3] == 1 and m != "none")
]


PATHS = ["fused", "weights", "weights-grad", "eager", "average"]


def run_path(path, q, k, v, mask=None, **kwargs):
    """Call sdpa so that it takes ``path``; returns (output, weights or None)."""
    if path in ("eager", "weights-grad"):  # weights that need autograd
        q = q.clone().requires_grad_()
    return_weights = {"fused": False, "average": "average"}.get(path, True)
    # the eager path serves weights with autograd in dtypes the blocked backward does not take
    dtypes = () if path == "eager" else sdpa_module.GRAD_WEIGHTS_DTYPES
    with mock.patch.object(sdpa_module, "GRAD_WEIGHTS_DTYPES", dtypes):
        assert AF.explain(
            q, k, v, mask, return_weights=return_weights, is_causal=kwargs.get("is_causal", False)
        ).path == ({"average": "weights", "weights-grad": "weights"}.get(path, path))
        out = AF.scaled_dot_product_attention(
            q, k, v, mask, return_weights=return_weights, **kwargs
        )
    return (out, None) if path == "fused" else out


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape,mask_kind,causal", CASES)
def test_sdpa_matches_oracle(shape, mask_kind, causal, path):
    q, k, v = make_qkv(shape)
    mask = make_mask(mask_kind, shape)
    out, weights = run_path(path, q, k, v, mask, is_causal=causal)
    want = R.scaled_dot_product_attention(
        np64(q),
        np64(k),
        np64(v),
        np64(mask),
        is_causal=causal,
        return_weights={"fused": False, "average": "average"}.get(path, True),
    )
    if weights is None:
        assert_close_to_oracle(out, want)
    else:
        assert_close_to_oracle(out, want[0])
        assert_close_to_oracle(weights, want[1])


@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize(
    "mask_kind,causal", [("bool", "bottom_right"), ("additive", False), ("padding", "top_left")]
)
@pytest.mark.parametrize(
    "nbytes,said",
    [(1, "blocks of 1 head(s) x 1 query rows"), (4 * 9 * 11 * 8, "blocks of 4 head(s) x 9 query")],
)
def test_weights_path_in_many_blocks(mask_kind, causal, average, nbytes, said, monkeypatch):
    """Blocks of one query row each, or of one batch row (its kv groups folded into rows, the
    mask on the unfolded view), must give exactly the same weights as one block of both batch
    rows."""
    import attnlab.functional._weights as weights_module

    shape = (2, 4, 2, 9, 11, 8, 4)
    q, k, v = make_qkv(shape)
    mask = make_mask(mask_kind, shape)
    rw = "average" if average else True
    explained = str(AF.explain(q, k, v, mask, return_weights=rw))
    assert "in one block (the whole (B, H, L, S) scores" in explained
    whole = AF.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, return_weights=rw)
    monkeypatch.setattr(weights_module, "WEIGHTS_BLOCK_BYTES", nbytes)
    assert said in str(AF.explain(q, k, v, mask, return_weights=rw))
    rows = AF.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, return_weights=rw)
    torch.testing.assert_close(rows, whole, rtol=0, atol=1e-15)  # GEMV vs GEMM rounding
    want = R.scaled_dot_product_attention(
        np64(q), np64(k), np64(v), np64(mask), is_causal=causal, return_weights=rw
    )
    assert_close_to_oracle(rows[1], want[1])


@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive", "padding"])
def test_decode_weights_read_each_kv_head_once_for_its_group(mask_kind, average, monkeypatch):
    """One query row a head against a cache (decoding with weights): the whole call is one
    block, each kv group's query heads folded into rows of its kv head. Its weights and output
    equal the block loop's (one head and row a block) and the float64 oracle; a row with no
    attendable key is 0 (the bool mask kills batch row 0)."""
    import attnlab.functional._weights as weights_module

    shape = (3, 6, 2, 1, 13, 8, 5)  # B, H, Hkv, L, S, E, Ev: groups of 3
    q, k, v = make_qkv(shape)
    mask = make_mask(mask_kind, shape)
    rw = "average" if average else True
    assert "3 query heads as rows of its kv head" in str(
        AF.explain(q, k, v, mask, return_weights=rw)
    )
    got = AF.scaled_dot_product_attention(
        q, k, v, mask, is_causal="bottom_right", return_weights=rw
    )
    monkeypatch.setattr(weights_module, "WEIGHTS_BLOCK_BYTES", 1)
    rows = AF.scaled_dot_product_attention(
        q, k, v, mask, is_causal="bottom_right", return_weights=rw
    )
    for a, b in zip(got, rows, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-15)  # GEMV vs GEMM rounding
    want = R.scaled_dot_product_attention(
        np64(q), np64(k), np64(v), np64(mask), is_causal="bottom_right", return_weights=rw
    )
    for a, b in zip(got, want, strict=True):
        assert_close_to_oracle(a, b)
    if mask_kind == "bool":
        assert not got[0][0].any() and not (got[1][0, 0] if average else got[1][0]).any()


@pytest.mark.parametrize("layout", [2, 3])
@pytest.mark.parametrize("return_weights", [False, True])
def test_sdpa_optional_leading_dims(layout, return_weights):
    shape = (2, 1, 1, 5, 7, 8, 3)
    q, k, v = make_qkv(shape, layout=layout)
    mask = torch.rand(5, 7, generator=torch.Generator().manual_seed(3)) > 0.4
    got = AF.scaled_dot_product_attention(
        q, k, v, mask, is_causal="bottom_right", return_weights=return_weights
    )
    want = R.scaled_dot_product_attention(
        np64(q),
        np64(k),
        np64(v),
        np64(mask),
        is_causal="bottom_right",
        return_weights=return_weights,
    )
    pairs = zip(got, want, strict=True) if return_weights else [(got, want)]
    for g, w in pairs:
        assert_close_to_oracle(g, w)


@pytest.mark.parametrize("scale", [None, 1.0, 0.37])
def test_sdpa_scale(scale):
    q, k, v = make_qkv(SHAPES[2])
    for rw in (False, True):
        got = AF.scaled_dot_product_attention(q, k, v, scale=scale, return_weights=rw)
        want = R.scaled_dot_product_attention(np64(q), np64(k), np64(v), scale=scale)
        assert_close_to_oracle(got[0] if rw else got, want)


@pytest.mark.parametrize("shape", SHAPES[1:4])
def test_score_functions(shape):
    q, k, v = make_qkv(shape)
    assert_close_to_oracle(AF.dot_product_scores(q, k), R.dot_product_scores(np64(q), np64(k)))
    assert_close_to_oracle(
        AF.scaled_dot_product_scores(q, k, 0.3), R.scaled_dot_product_scores(np64(q), np64(k), 0.3)
    )
    g = torch.Generator().manual_seed(5)
    E = shape[5]
    W = torch.randn(E, E, generator=g, dtype=F64)
    assert_close_to_oracle(AF.general_scores(q, k, W), R.general_scores(np64(q), np64(k), np64(W)))


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("shape", SHAPES[1:5])
def test_attention_over_scores(shape, mask_kind):
    q, k, v = make_qkv(shape)
    mask = make_mask(mask_kind, shape)
    scores = AF.scaled_dot_product_scores(q, k)
    got = AF.attention(scores, v, mask, return_weights=True)
    want = R.attention(np64(scores), np64(v), np64(mask), return_weights=True)
    assert_close_to_oracle(got[0], want[0])
    assert_close_to_oracle(got[1], want[1])


ADDITIVE_SHAPES = [  # leading dims, L, S, Dq, Dk, Dv, A
    ((), 1, 1, 3, 3, 2, 4),
    ((2,), 3, 4, 5, 5, 6, 10),
    ((2,), 7, 5, 4, 6, 3, 8),
    ((2, 3), 4, 6, 5, 7, 2, 8),
]


@pytest.mark.parametrize("chunk_bytes", [None, 1], ids=["one-block", "row-by-row"])
@pytest.mark.parametrize("causal", [False, "bottom_right"])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
@pytest.mark.parametrize("dims", ADDITIVE_SHAPES)
@pytest.mark.parametrize("tanh", ["tanh", "sigmoid"])
def test_additive_attention(dims, mask_kind, causal, chunk_bytes, tanh, monkeypatch):
    monkeypatch.setenv(additive_module.TANH_ENV, tanh)
    if chunk_bytes is not None:  # force one query row per block: exercises the block loop
        monkeypatch.setattr(additive_module, "CHUNK_BYTES", chunk_bytes)
    lead, L, S, Dq, Dk, Dv, A = dims
    g = torch.Generator().manual_seed(7)
    q = torch.randn(*lead, L, Dq, generator=g, dtype=F64)
    k = torch.randn(*lead, S, Dk, generator=g, dtype=F64)
    v = torch.randn(*lead, S, Dv, generator=g, dtype=F64)
    w_q, w_k = (
        torch.randn(A, Dq, generator=g, dtype=F64),
        torch.randn(A, Dk, generator=g, dtype=F64),
    )
    w_s, b = torch.randn(A, generator=g, dtype=F64), torch.randn(A, generator=g, dtype=F64)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(L, S, generator=g) > 0.3
        mask[0] = False
    elif mask_kind == "additive":
        mask = torch.randn(L, S, generator=g, dtype=F64)
    got = AF.additive_attention(
        q, k, v, w_q, w_k, w_s, mask, bias=b, is_causal=causal, return_weights=True
    )
    want = R.additive_attention(
        *(np64(t) for t in (q, k, v, w_q, w_k, w_s)),
        np64(mask),
        bias=np64(b),
        is_causal=causal,
        return_weights=True,
    )
    assert_close_to_oracle(got[0], want[0])
    assert_close_to_oracle(got[1], want[1])
    scores = AF.additive_scores(q, k, w_q, w_k, w_s, b)
    assert_close_to_oracle(scores, R.additive_scores(*(np64(t) for t in (q, k, w_q, w_k, w_s, b))))


def test_concat_scores_is_concatenation():
    g = torch.Generator().manual_seed(8)
    q, k = (
        torch.randn(2, 3, 4, generator=g, dtype=F64),
        torch.randn(2, 5, 6, generator=g, dtype=F64),
    )
    W, w = torch.randn(7, 10, generator=g, dtype=F64), torch.randn(7, generator=g, dtype=F64)
    got = AF.concat_scores(q, k, W, w)
    assert_close_to_oracle(got, R.concat_scores(np64(q), np64(k), np64(W), np64(w)))


@pytest.mark.parametrize("mode", ["argmax", "sample", "topk"])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "padding"])
@pytest.mark.parametrize("shape", SHAPES[1:5])
def test_hard_attention(shape, mask_kind, mode):
    q, k, v = make_qkv(shape)
    mask = make_mask(mask_kind, shape)
    B, H, _, L, S, _, _ = shape
    noise = torch.randn(B, H, L, S, generator=torch.Generator().manual_seed(9), dtype=F64)
    kwargs = {"mode": mode, "top_k": 2 if mode == "topk" else None}
    if mode == "sample":
        kwargs["noise"] = noise
    got = AF.hard_attention(q, k, v, mask, return_weights=True, **kwargs)
    if mode == "sample":
        kwargs["noise"] = np64(noise)
    want = R.hard_attention(np64(q), np64(k), np64(v), np64(mask), return_weights=True, **kwargs)
    assert_close_to_oracle(got[0], want[0])
    assert_close_to_oracle(got[1], want[1])


def test_gumbel_sampling_follows_softmax():
    """Sampled hard attention picks key j with probability softmax(scores)_j."""
    scores = torch.tensor([[1.0, 0.0, -1.0, 2.0]])
    n = 20000
    g = torch.Generator().manual_seed(10)
    picks = AF.hard_attention_weights(scores.expand(n, 4), mode="sample", generator=g)
    freq = picks.mean(0)
    p = torch.softmax(scores[0], -1)
    # 4.5 standard errors of a binomial frequency: fails by chance ~1e-5 of the time
    assert torch.all((freq - p).abs() <= 4.5 * (p * (1 - p) / n).sqrt())


# --- 16-bit inputs: errors at most twice those of a naive same-dtype control ---------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("return_weights", [False, True], ids=["fused", "eager"])
@pytest.mark.parametrize(
    "shape,mask_kind",
    [(SHAPES[1], "bool"), (SHAPES[2], "padding"), ((2, 4, 2, 64, 64, 32, 32), "none")],
)
def test_low_precision_against_control(shape, mask_kind, return_weights, dtype):
    q64, k64, v64 = make_qkv(shape)
    mask = make_mask(mask_kind, shape)
    want = R.scaled_dot_product_attention(np64(q64), np64(k64), np64(v64), np64(mask))
    q, k, v = (t.to(dtype) for t in (q64, k64, v64))
    got = AF.scaled_dot_product_attention(q, k, v, mask, return_weights=return_weights)
    got = got[0] if return_weights else got
    assert got.dtype == dtype
    control = naive_sdpa(q, k, v, mask)
    err = np.abs(np64(got) - want).max()
    err_control = np.abs(np64(control) - want).max()
    assert err <= 2 * err_control + torch.finfo(dtype).eps, (err, err_control)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_softmax_and_additive(dtype):
    g = torch.Generator().manual_seed(11)
    s64 = torch.randn(4, 6, 50, generator=g, dtype=F64) * 4
    mask = torch.rand(4, 6, 50, generator=g) > 0.2
    want = R.masked_softmax(np64(s64), np64(mask))
    s = s64.to(dtype)
    got = AF.masked_softmax(s, mask)
    assert got.dtype == dtype
    control = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)  # naive, same dtype
    assert np.abs(np64(got) - want).max() <= 2 * np.abs(np64(control) - want).max()
    # additive: float32 accumulation inside, compared with the naive formula in dtype
    q, k, v = (torch.randn(2, n, 8, generator=g, dtype=F64) for n in (5, 7, 7))
    w_q, w_k = (torch.randn(16, 8, generator=g, dtype=F64) for _ in range(2))
    w_s = torch.randn(16, generator=g, dtype=F64)
    want = R.additive_attention(*(np64(t) for t in (q, k, v, w_q, w_k, w_s)))
    lo = [t.to(dtype) for t in (q, k, v, w_q, w_k, w_s)]
    got = AF.additive_attention(*lo)
    qa, ka = lo[0] @ lo[3].T, lo[1] @ lo[4].T
    naive_scores = torch.tanh(qa[:, :, None] + ka[:, None]) @ lo[5]
    control = torch.softmax(naive_scores, -1) @ lo[2]
    assert got.dtype == dtype
    assert np.abs(np64(got) - want).max() <= 2 * np.abs(np64(control) - want).max()


# --- against torch's own SDPA where they overlap ---------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "padding", "additive"])
def test_against_torch_sdpa(shape, mask_kind):
    q, k, v = (t.float() for t in make_qkv(shape))
    mask = make_mask(mask_kind, shape)
    if mask is not None and mask.is_floating_point():
        mask = mask.float()
    if mask_kind == "bool":  # torch's reference math gives NaN on fully masked rows; avoid them
        mask[0, 0, 0, 0] = True
    gqa = shape[1] != shape[2]
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    for rw in (False, True):
        got = AF.scaled_dot_product_attention(q, k, v, mask, return_weights=rw)
        torch.testing.assert_close(got[0] if rw else got, want, rtol=1e-5, atol=1e-6)
    if shape[3] == shape[4] and mask is None:
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=gqa
        )
        got = AF.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_bottom_right_matches_torch_causal_bias():
    """torch's own CausalBias (lower-right variant) agrees with attnlab's bottom-right."""
    from torch.nn.attention.bias import causal_lower_right, causal_upper_left

    q, k, v = (t.float() for t in make_qkv((2, 4, 4, 3, 8, 8, 8)))
    for alignment, bias in (("bottom_right", causal_lower_right), ("top_left", causal_upper_left)):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias(3, 8))
        got = AF.scaled_dot_product_attention(q, k, v, is_causal=alignment)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tanh", ["tanh", "sigmoid"])
def test_additive_float32_against_control(tanh, monkeypatch):
    """Either tanh rounds no worse than the naive float32 tanh formula (x2)."""
    monkeypatch.setenv(additive_module.TANH_ENV, tanh)
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(4, 64, 32, generator=g, dtype=F64) for _ in range(3))
    w_q, w_k = (torch.randn(128, 32, generator=g, dtype=F64) * 0.3 for _ in range(2))
    w_s = torch.randn(128, generator=g, dtype=F64)
    want = R.additive_scores(*(np64(t) for t in (q, k, w_q, w_k, w_s)))
    lo = [t.float() for t in (q, k, w_q, w_k, w_s)]
    got = AF.additive_scores(*lo)
    control = torch.tanh((lo[0] @ lo[2].T)[:, :, None] + (lo[1] @ lo[3].T)[:, None]) @ lo[4]
    err, err_control = (np.abs(np64(x) - want).max() for x in (got, control))
    assert err <= 2 * err_control, (err, err_control)


def test_additive_small_preactivations_keep_relative_precision(monkeypatch):
    """|x| ~ 1e-2 everywhere: torch.tanh keeps the control's relative error in the scores and
    in dw; 2 sigmoid(2x) - 1 (absolute error ~6e-8) carries several times it, which is why it is
    taken only where it is much faster (the default measures; before, it was always taken)."""
    g = torch.Generator().manual_seed(13)
    q, k = (torch.randn(2, 48, 16, generator=g, dtype=F64) for _ in range(2))
    w_q, w_k = (torch.randn(64, 16, generator=g, dtype=F64) * 2e-3 for _ in range(2))
    w_s = torch.randn(64, generator=g, dtype=F64)
    up = torch.randn(2, 48, 48, generator=g, dtype=F64)
    want = R.additive_scores(*(np64(t) for t in (q, k, w_q, w_k, w_s)))
    want_dw = np.einsum("nls,nlsa->a", np64(up), np.tanh(
        (np64(q) @ np64(w_q).T)[:, :, None] + (np64(k) @ np64(w_k).T)[:, None]
    ))  # fmt: skip
    lo = [t.float() for t in (q, k, w_q, w_k)] + [w_s.float().requires_grad_()]
    control = torch.tanh((lo[0] @ lo[2].T)[:, :, None] + (lo[1] @ lo[3].T)[:, None]) @ lo[4]
    (control_dw,) = torch.autograd.grad(control, lo[4], up.float())
    ratios = {}
    for tanh in ("tanh", "sigmoid"):
        monkeypatch.setenv(additive_module.TANH_ENV, tanh)
        got = AF.additive_scores(*lo)
        (dw,) = torch.autograd.grad(got, lo[4], up.float())
        ratios[tanh] = [
            np.abs(np64(x) - ref).max() / np.abs(np64(c) - ref).max()
            for x, c, ref in ((got, control, want), (dw, control_dw, want_dw))
        ]
    assert max(ratios["tanh"]) <= 2, ratios  # (the control's error; 1.0 when identical)
    # what the test tells apart: the scores (x28 the control's error with AVX-512, x32 with
    # AVX2); dw's margin depends on the CPU's vector tanh (x4.6 with AVX-512, x1.24 with AVX2)
    assert ratios["sigmoid"][0] > 8 and ratios["sigmoid"][1] > 1, ratios


def test_additive_tanh_setting_is_checked(monkeypatch):
    monkeypatch.setenv(additive_module.TANH_ENV, "fast")
    q = torch.randn(1, 2, 4)
    with pytest.raises(ValueError, match="ATTNLAB_CPU_TANH must be one of measure, tanh, sigmoid"):
        AF.additive_scores(q, q, torch.randn(3, 4), torch.randn(3, 4), torch.randn(3))
    monkeypatch.setenv(additive_module.TANH_ENV, "sigmoid")
    assert "2 sigmoid(2x) - 1" in str(AF.explain_additive(q, q, q, *[torch.randn(3, 4)] * 2,
                                                          torch.randn(3)))  # fmt: skip


@pytest.mark.parametrize("scale", [-0.7, 0.0, 1e-30])
@pytest.mark.parametrize("is_causal", [True, "bottom_right", "top_left"])
def test_sdpa_causal_with_a_scale_that_is_not_positive(scale, is_causal):
    """A scale <= 0 is a number like any other (scale=0: uniform weights over the keys a row
    sees). torch's is_causal gives NaN for it; the fused path must not."""
    shape = SHAPES[2] if is_causal is not True else SHAPES[1]
    q, k, v = make_qkv(shape)
    want = R.scaled_dot_product_attention(
        np64(q), np64(k), np64(v), is_causal=is_causal, scale=scale, return_weights=True
    )
    for rw in (False, True):
        got = AF.scaled_dot_product_attention(
            q, k, v, is_causal=is_causal, scale=scale, return_weights=rw
        )
        assert_close_to_oracle(got[0] if rw else got, want[0])
    out = AF.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=is_causal,
                                          scale=scale)  # fmt: skip
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("return_weights", [True, "average"])
@pytest.mark.parametrize("shape", [SHAPES[2], SHAPES[3]])
def test_sdpa_weights_of_projections_seen_as_heads(shape, return_weights, grad):
    """Grouped-query heads from (B, L, H, E) projections seen as (B, H, L, E), a view that is
    not contiguous, as every layer makes them: the weights path folds a kv group's query heads
    into rows, which needs them contiguous (a RuntimeError from view() before)."""
    q, k, v = make_qkv(shape)
    q_view = q.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(grad)
    assert not q_view.is_contiguous()
    out, w = AF.scaled_dot_product_attention(q_view, k, v, return_weights=return_weights)
    want_out, want_w = R.scaled_dot_product_attention(np64(q), np64(k), np64(v),
                                                      return_weights=True)  # fmt: skip
    assert_close_to_oracle(out, want_out)
    assert_close_to_oracle(w, want_w.mean(1) if return_weights == "average" else want_w)
    if grad:
        out.sum().backward()
        q2 = q.clone().requires_grad_()
        AF.scaled_dot_product_attention(q2, k, v).sum().backward()
        torch.testing.assert_close(q_view.grad, q2.grad, rtol=1e-10, atol=1e-12)


# (query lead, key lead, value lead): leading dims that broadcast, as the oracle's do
BROADCAST_LEADS = [((2, 1), (2, 3), (2, 3)), ((2, 3), (1, 3), (1, 3)), ((2, 3), (2, 3), (2, 1)),
                   ((), (), ()), ((4,), (4,), (1,))]  # fmt: skip


@pytest.mark.parametrize("where", [None, "query", "key", "value"])
@pytest.mark.parametrize("leads", BROADCAST_LEADS)
def test_additive_attention_broadcasts_leading_dims_and_keeps_the_nan_rule(leads, where):
    """Leading dims broadcast (a query of one head against keys of three, one key sequence
    for every batch row, 2-D inputs); the NaN rule follows what each row reads. Before: a NaN
    crashed 2-D inputs and a broadcast query, and a value of batch 2 for 4 score matrices was
    read as grouped heads (matrix b taking value b // 2)."""
    (lq, lk, lv), (L, S, D, Dv, A) = leads, (3, 5, 4, 2, 6)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(*lead, n, d, generator=g, dtype=F64)
               for lead, n, d in ((lq, L, D), (lk, S, D), (lv, S, Dv)))  # fmt: skip
    w_q, w_k, w_s = (torch.randn(*s, generator=g, dtype=F64) for s in ((A, D), (A, D), (A,)))
    t = {"query": q, "key": k, "value": v}.get(where)
    if t is not None:
        t.view(-1)[1] = float("nan")
    got = AF.additive_attention(q, k, v, w_q, w_k, w_s, return_weights=True)
    want = R.additive_attention(*(np64(x) for x in (q, k, v, w_q, w_k, w_s)), return_weights=True)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        np.testing.assert_array_equal(a.isnan().numpy(), np.isnan(b))
        assert_close_to_oracle(torch.nan_to_num(a), np.nan_to_num(b))


def test_a_value_that_does_not_match_the_scores_is_refused():
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(4, 3, 6, generator=g), torch.randn(4, 5, 7, generator=g), None
    w_q, w_k, w_s = torch.randn(8, 6), torch.randn(8, 7), torch.randn(8)
    for v in (torch.randn(2, 5, 2), torch.randn(2, 4, 5, 2)):
        with pytest.raises(ValueError, match="value .* must have leading dims") as info:
            AF.additive_attention(q, k, v, w_q, w_k, w_s)
        assert "(4, 5, 2)" in str(info.value)  # the fix names the shape wanted
    with pytest.raises(ValueError, match="batch size B=4, or 1"):
        AF.attention(torch.randn(4, 3, 5), torch.randn(2, 5, 2))


def test_the_oracle_takes_five_dims_with_grouped_heads_and_no_keys():
    """(..., B, H, L, E) with Hkv > 1 and S = 0 are inputs the torch functions take; the
    specification must take them too (it raised, or gave an empty array, before)."""
    q, k, v = make_qkv((2, 6, 2, 4, 9, 8, 3))
    q5, k5, v5 = (t.reshape(2, 1, *t.shape[1:]).expand(2, 3, *t.shape[1:]) for t in (q, k, v))
    want = R.scaled_dot_product_attention(np64(q5), np64(k5), np64(v5), is_causal="bottom_right")
    for i in range(3):  # each slice of the extra dim is the 4-D call
        want4 = R.scaled_dot_product_attention(np64(q), np64(k), np64(v), is_causal="bottom_right")
        np.testing.assert_allclose(want[:, i], want4, rtol=0, atol=0)
    got = AF.scaled_dot_product_attention(q5, k5, v5, is_causal="bottom_right")
    assert_close_to_oracle(got, want)
    k0, v0 = k[:, :, :0], v[:, :, :0]  # S = 0: no key to attend, output 0, weights (.., L, 0)
    out, w = R.scaled_dot_product_attention(np64(q), np64(k0), np64(v0), return_weights=True)
    assert out.shape == (2, 6, 4, 3) and (out == 0).all() and w.shape == (2, 6, 4, 0)
    assert_close_to_oracle(AF.scaled_dot_product_attention(q, k0, v0), out)


@pytest.mark.parametrize("layout", [4, 3])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_sdpa_with_a_key_mask_of_one_dim(kind, layout):
    """A (S,) mask broadcasts to the scores as any other; torch's kernel wants two dims (the
    fused path raised its IndexError before)."""
    q, k, v = make_qkv(SHAPES[2], layout=layout)
    g = torch.Generator().manual_seed(4)
    keep = torch.rand(9, generator=g) > 0.4
    mask = keep if kind == "bool" else torch.zeros(9, dtype=F64).masked_fill(~keep, -torch.inf)
    want = R.scaled_dot_product_attention(np64(q), np64(k), np64(v), np64(mask))
    for rw in (False, True):
        got = AF.scaled_dot_product_attention(q, k, v, mask, return_weights=rw)
        assert_close_to_oracle(got[0] if rw else got, want)


@pytest.mark.parametrize("mode", ["argmax", "topk"])
def test_hard_attention_breaks_ties_to_the_lower_index_as_the_oracle(mode):
    """Equal scores (identical padding embeddings, E = 0) keep the first keys, as the oracle's
    stable sort does; torch's topk picked others among ties (here keys 3-5 of 6)."""
    q, k = torch.ones(1, 1, 2, 4, dtype=F64), torch.ones(1, 1, 6, 4, dtype=F64)
    v = torch.arange(6, dtype=F64).reshape(1, 1, 6, 1)
    kw = {"top_k": 3} if mode == "topk" else {}
    got_out, got_w = AF.hard_attention(q, k, v, mode=mode, return_weights=True, **kw)
    want_out, want_w = R.hard_attention(np64(q), np64(k), np64(v), mode=mode,
                                        return_weights=True, **kw)  # fmt: skip
    np.testing.assert_array_equal(got_w.numpy(), want_w)
    np.testing.assert_array_equal(got_out.numpy(), want_out)
    assert (got_w[..., :3] > 0).all() if mode == "topk" else (got_w[..., 0] == 1).all()


@pytest.mark.parametrize("mode", ["argmax", "sample", "topk"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_hard_weights_of_a_row_holding_nan_or_inf_are_nan_in_both(mode, bad):
    scores = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(2), dtype=F64)
    scores[0, 1, 2] = bad
    kw = {"top_k": 2} if mode == "topk" else {}
    if mode == "sample":
        kw["noise"] = torch.zeros_like(scores)
    got = AF.hard_attention_weights(scores, mode=mode, **kw)
    kw64 = {n: np64(x) if n == "noise" else x for n, x in kw.items()}
    want = R.hard_attention_weights(np64(scores), mode=mode, **kw64)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=0)  # (NaN where NaN)
    assert got[0, 1].isnan().all() and torch.isfinite(got[1]).all()


def test_rotary_with_positions_per_batch_row_keeps_the_inputs_shape():
    # before: x (B, L, E) with positions (B, L) gave (B, B, L, E), batch rows mixed (both twins)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, generator=g, dtype=F64)
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    want = np.stack([R.apply_rotary(x[b].numpy(), pos[b].numpy()) for b in range(2)])
    assert R.apply_rotary(x.numpy(), pos.numpy()).shape == (2, 5, 8)
    np.testing.assert_allclose(R.apply_rotary(x.numpy(), pos.numpy()), want, rtol=0, atol=1e-12)
    got = AF.apply_rotary(x, pos)
    assert got.shape == (2, 5, 8)
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-12)
    x4 = x[:, None].expand(2, 3, 5, 8)  # (B, H, L, E): every head at its row's positions
    np.testing.assert_allclose(AF.apply_rotary(x4, pos)[:, 1].numpy(), want, atol=1e-12)
    # (1, L), Hugging Face's default position_ids, is shared by every row as (L,) is
    shared = np.stack([R.apply_rotary(x[b].numpy(), pos[0].numpy()) for b in range(2)])
    np.testing.assert_allclose(R.apply_rotary(x.numpy(), pos[:1].numpy()), shared, atol=1e-12)
    np.testing.assert_allclose(AF.apply_rotary(x, pos[:1]).numpy(), shared, atol=1e-12)
    np.testing.assert_allclose(AF.apply_rotary(x4, pos[:1])[:, 2].numpy(), shared, atol=1e-12)
    for bad in (x[:1], x[0]):  # another batch size, or no batch dim at all
        with pytest.raises(ValueError, match=r"positions \(B, L\) = \(2, 5\) need"):
            AF.apply_rotary(bad, pos)
        with pytest.raises(ValueError, match=r"positions \[B, L\] need x of that batch"):
            R.apply_rotary(bad.numpy(), pos.numpy())


def test_a_bool_mask_does_not_clean_a_nan_score_it_forbids():
    # before: a NaN (or +inf) score under a bool False was replaced by -inf, while the same
    # mask as a 0 / -inf bias kept it NaN; torch's SDPA reads a bool mask as that bias
    scores = np.array([[np.nan, 1.0, 2.0], [np.inf, 1.0, 2.0], [0.5, 1.0, 2.0]])
    keep = np.array([False, True, True])
    bias = np.where(keep, 0.0, -np.inf)
    for oracle, torch_fn in (
        (R.masked_softmax, AF.masked_softmax),
        (R.hard_attention_weights, AF.hard_attention_weights),
    ):
        with np.errstate(invalid="ignore"):
            want = oracle(scores, bias)
            got = oracle(scores, keep)
        np.testing.assert_array_equal(got, want)
        assert np.isnan(got[:2]).all() and np.isfinite(got[2]).all()
        t = torch_fn(torch.from_numpy(scores), torch.from_numpy(keep))
        np.testing.assert_allclose(t.numpy(), want, rtol=1e-14, atol=0)  # (NaN where NaN)


def test_the_oracle_refuses_what_its_twins_refuse():
    # before: it answered silently (a full softmax for topk without top_k, "Left" read as
    # left padding, an all-False window, NaN for a NaN scale)
    s = np.zeros((2, 3))
    q = np.ones((2, 4))
    for call, match in (
        (lambda: R.hard_attention_weights(s, mode="topk"), "top_k"),
        (lambda: R.hard_attention_weights(s, top_k=1), "top_k is only used"),
        (lambda: R.hard_attention_weights(s, mode="sample", tau=0.0), "tau"),
        (lambda: R.padding_mask([1, 2], side="Left"), "side"),
        (lambda: R.sliding_window_mask(3, window=0), "window"),
        (lambda: R.scaled_dot_product_attention(q, q, q, scale=np.nan), "scale"),
        (lambda: R.scaled_dot_product_attention(q, q, q, dropout_p=1.0), "dropout_p"),
    ):
        with pytest.raises(ValueError, match=match):
            call()
    with pytest.raises(ValueError, match="side"):
        masks.padding_mask([1, 2], side="Left")


def test_hard_attention_with_no_keys_is_zero_in_the_oracle_too():
    # before: the oracle's argmax over an empty axis raised; the torch twin gives 0
    q, k, v = np.ones((1, 1, 2, 4)), np.ones((1, 1, 0, 4)), np.ones((1, 1, 0, 3))
    for mode in ("argmax", "sample"):
        out = R.hard_attention(q, k, v, mode=mode)
        assert out.shape == (1, 1, 2, 3) and (out == 0).all()
        twin = AF.hard_attention(*map(torch.from_numpy, (q, k, v)), mode=mode)
        np.testing.assert_array_equal(twin.numpy(), out)


def test_rotary_angles_equal_their_numpy_twin():
    # (the functional had no twin; the README says every function has one)
    pos = np.array([[0, 3, 7], [2, 5, 1000]])
    want = R.rotary_angles(pos, 8, base=500.0)
    got = AF.rotary_angles(torch.from_numpy(pos), 8, base=500.0, dtype=F64)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(g.numpy(), w, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="even"):
        R.rotary_angles(pos, 7)


SCALINGS = [
    AF.RotaryScaling("linear", 4.0),
    AF.RotaryScaling("llama3", 8.0, 1.0, 4.0, 8192),  # Llama 3.1's
    AF.RotaryScaling("llama3", 32.0, 1.0, 4.0, 8192),  # Llama 3.2's
    AF.RotaryScaling("llama3", 2.0, 0.5, 3.0, 100),
]


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: f"{s.kind}-{s.factor}")
@pytest.mark.parametrize("head_dim,base", [(128, 500000.0), (64, 10000.0), (16, 100.0)])
def test_scaled_rotary_frequencies_and_rotations_equal_their_numpy_twin(scaling, head_dim, base):
    want = R.rotary_frequencies(head_dim, base, scaling)
    got = AF.rotary_frequencies(head_dim, base, scaling, dtype=F64)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-14, atol=0)
    plain = R.rotary_frequencies(head_dim, base)
    ratio = want / plain  # 1 for fast pairs, 1 / factor for slow ones, between in the band
    assert (ratio <= 1 + 1e-15).all() and (ratio >= 1 / scaling.factor - 1e-15).all()
    assert (np.diff(ratio) <= 1e-15).all()  # never stretched less as the wavelength grows
    if scaling.kind == "linear":
        np.testing.assert_allclose(ratio, 1 / scaling.factor, rtol=1e-15)
    else:
        wavelength = 2 * np.pi / plain
        band = (wavelength >= scaling.original_context / scaling.high_freq_factor) & (
            wavelength <= scaling.original_context / scaling.low_freq_factor
        )
        assert (ratio[wavelength < scaling.original_context / scaling.high_freq_factor] == 1).all()
        assert (ratio[wavelength > scaling.original_context / scaling.low_freq_factor]
                == 1 / scaling.factor).all()  # fmt: skip
        assert ((ratio[band] > 1 / scaling.factor - 1e-15) & (ratio[band] < 1 + 1e-15)).all()
    x = np.random.default_rng(0).standard_normal((2, 3, 5, head_dim))
    pos = np.array([0, 1, 700, 9000, 131071])
    want_x = R.apply_rotary(x, pos, base, scaling)
    got_x = AF.apply_rotary(torch.from_numpy(x), torch.from_numpy(pos), base, scaling)
    np.testing.assert_allclose(got_x.numpy(), want_x, rtol=0, atol=1e-9)
    change = np.abs(want_x - R.apply_rotary(x, pos, base)).max()
    assert change > 0.1 if (ratio < 1).any() else change == 0  # (all fast: nothing stretched)
    cos, sin = AF.rotary_angles(torch.from_numpy(pos), head_dim, base, F64, scaling)
    for w, g in zip(R.rotary_angles(pos, head_dim, base, None, scaling), (cos, sin), strict=True):
        np.testing.assert_allclose(g.numpy(), w, rtol=0, atol=1e-9)


@pytest.mark.parametrize(
    "args,said",
    [
        (("yarn", 4.0), "kind"),
        (("linear", 0.0), "factor"),
        (("linear", float("nan")), "factor"),
        (("linear", True), "factor"),
        (("llama3", 8.0, 4.0, 1.0), "below"),
        (("llama3", 8.0, 1.0, 4.0, -5), "original_context"),
    ],
)
def test_rotary_scaling_refuses_what_it_cannot_compute(args, said):
    with pytest.raises(ValueError, match=said):
        AF.RotaryScaling(*args)


def test_rotary_scaling_from_hugging_face_parameters():
    assert AF.RotaryScaling.from_hf(None) is None
    assert AF.RotaryScaling.from_hf({"rope_type": "default", "rope_theta": 1e4}) is None
    assert AF.RotaryScaling.from_hf({"type": "linear", "factor": 2.0}) == AF.RotaryScaling(
        "linear", 2.0
    )
    llama31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    assert AF.RotaryScaling.from_hf(llama31) == AF.RotaryScaling("llama3", 8.0, 1.0, 4.0, 8192)
    for params, said in (
        ({"rope_type": "yarn", "factor": 4.0}, "rope_type='yarn'"),
        ({"rope_type": "dynamic", "factor": 2.0}, "rope_type='dynamic'"),
        ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"rope_type": "linear"}, "needs ['factor']"),
        ({**llama31, "original_max_position_embeddings": None}, "original_max_position_emb"),
    ):
        with pytest.raises(ValueError, match=re.escape(said)):
            AF.RotaryScaling.from_hf(params)
    # Hugging Face ignores attention_factor for these kinds, and takes the config's context
    # for a llama3 dict without one
    assert AF.RotaryScaling.from_hf({**llama31, "attention_factor": 1.3}) == AF.RotaryScaling(
        "llama3", 8.0, 1.0, 4.0, 8192
    )
    short = {k: v for k, v in llama31.items() if k != "original_max_position_embeddings"}
    assert AF.RotaryScaling.from_hf(short, 4096).original_context == 4096


def test_the_oracle_refuses_what_its_torch_twins_refuse():
    # before: the oracle clipped lengths past max_length, read a negative or fractional length
    # as a mask, read an int 0/1 mask as a bias, crossed a 4-D mask's batch with 3-D inputs,
    # and raised a bare broadcast error for Hkv not dividing H -- specifications that answer
    # where the implementations refuse
    bad = [
        (lambda: R.padding_mask([5, 2], 3), ValueError, "lengths must be <= max_length=3"),
        (lambda: R.padding_mask([-1, 2]), ValueError, "integers >= 0"),
        (lambda: R.padding_mask([2.5, 1]), ValueError, "integers >= 0"),
        (lambda: R.document_mask([1.5, 2]), ValueError, "integers >= 0"),
        (lambda: R.masked_softmax(np.zeros((1, 5)), np.array([[1, 0, 0, 0, 0]])), TypeError,
         "bool .* or a float bias"),
        (lambda: R.scaled_dot_product_attention(np.zeros((2, 3, 4)), np.zeros((2, 5, 4)),
         np.zeros((2, 5, 2)), np.ones((2, 1, 3, 5), bool)), ValueError, "more dims than"),
        (lambda: R.scaled_dot_product_attention(np.zeros((1, 3, 3, 4)), np.zeros((1, 2, 5, 4)),
         np.zeros((1, 2, 5, 2))), ValueError, "Hkv=2 must divide H=3"),
    ]  # fmt: skip
    for call, error, message in bad:
        with pytest.raises(error, match=message):
            call()
    assert R.padding_mask(np.array([2, 0]), 3).ravel().tolist() == [1, 1, 0, 0, 0, 0]


def test_empty_batches_and_heads_and_zero_width_scores():
    """B = 0 with 3-D inputs read B as heads and divided by zero (a review's find), H = 0 too;
    the oracle's scores refused E = 0 (an infinite default scale) that its attention takes."""
    q, k, v = torch.randn(0, 5, 3), torch.randn(0, 4, 3), torch.randn(0, 4, 2)
    w_q, w_k, w = torch.randn(6, 3), torch.randn(6, 3), torch.randn(6)
    assert AF.attention(torch.randn(0, 5, 4), v).shape == (0, 5, 2)
    assert AF.additive_attention(q, k, v, w_q, w_k, w).shape == (0, 5, 2)
    h0 = AF.additive_attention(
        torch.randn(2, 0, 5, 3), torch.randn(2, 0, 4, 3), torch.randn(2, 0, 4, 2), w_q, w_k, w
    )
    assert h0.shape == (2, 0, 5, 2)
    q0, k0 = np.ones((2, 3, 0)), np.ones((2, 4, 0))
    np.testing.assert_array_equal(R.scaled_dot_product_scores(q0, k0), np.zeros((2, 3, 4)))
    torch.testing.assert_close(
        AF.scaled_dot_product_scores(torch.ones(2, 3, 0), torch.ones(2, 4, 0)), torch.zeros(2, 3, 4)
    )


def test_the_oracle_refuses_what_its_torch_twin_refuses():
    # from a review: the oracle broadcast one query head over 4 kv heads, took L = -2 as an
    # empty mask and L = 3.0 as 3, crashed on no lengths, and refused a NumPy integer window
    from attnlab import masks
    from attnlab.reference import masks as RM

    q, kv = np.ones((1, 1, 3, 4)), np.ones((1, 4, 5, 4))
    for call in (R.scaled_dot_product_attention, AF.scaled_dot_product_attention):
        args = (q, kv, kv) if call is R.scaled_dot_product_attention else (
            torch.ones(1, 1, 3, 4), torch.ones(1, 4, 5, 4), torch.ones(1, 4, 5, 4))  # fmt: skip
        with pytest.raises(ValueError, match="must divide"):
            call(*args)
    for twin in (RM, masks):
        for bad in (-2, 3.0):
            with pytest.raises(ValueError, match=r"query_length must be an int >= 0"):
                twin.causal_mask(bad)
        assert np.asarray(twin.padding_mask(np.array([], dtype=np.int64))).shape == (0, 1, 1, 0)
    np.testing.assert_array_equal(
        RM.sliding_window_mask(4, window=np.int64(2)),
        masks.sliding_window_mask(4, window=np.int64(2)).numpy(),
    )
