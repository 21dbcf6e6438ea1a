"""Gradients: torch.autograd.gradcheck in float64 for every function, and the surrogates."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck

import attnlab.functional as AF
import attnlab.functional.additive as additive_module

F64 = torch.float64


def leaf(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=F64, requires_grad=True)


def dead_row_mask(L, S):
    m = torch.rand(L, S, generator=torch.Generator().manual_seed(1)) > 0.3
    m[0] = False  # a fully masked row: its gradient must be finite (zero)
    return m


@pytest.mark.parametrize("return_weights", [False, True], ids=["fused", "eager"])
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_sdpa_gradcheck(return_weights, causal):
    q, k, v = leaf(2, 4, 3, 5, seed=1), leaf(2, 2, 4, 5, seed=2), leaf(2, 2, 4, 3, seed=3)
    mask = dead_row_mask(3, 4)

    def f(q, k, v):
        out = AF.scaled_dot_product_attention(
            q, k, v, mask, is_causal=causal, return_weights=return_weights
        )
        return out if not return_weights else (out[0], out[1])

    assert gradcheck(f, (q, k, v))


def test_sdpa_gradcheck_additive_bias():
    q, k, v = leaf(1, 2, 3, 4, seed=1), leaf(1, 2, 5, 4, seed=2), leaf(1, 2, 5, 2, seed=3)
    bias = leaf(1, 2, 3, 5, seed=4)
    assert gradcheck(
        lambda q, k, v, b: AF.scaled_dot_product_attention(q, k, v, b), (q, k, v, bias)
    )


def test_masked_softmax_gradcheck_and_dead_rows_have_zero_gradient():
    s = leaf(3, 4, 6)
    mask = torch.rand(3, 4, 6, generator=torch.Generator().manual_seed(2)) > 0.4
    mask[:, 0] = False
    assert gradcheck(lambda s: AF.masked_softmax(s, mask), (s,))
    AF.masked_softmax(s, mask).pow(2).sum().backward()
    assert torch.isfinite(s.grad).all()
    assert torch.all(s.grad[:, 0] == 0) and torch.all(s.grad[~mask] == 0)


def test_score_functions_gradcheck():
    q, k = leaf(2, 3, 4, seed=1), leaf(2, 5, 4, seed=2)
    W, W2, w = leaf(4, 4, seed=3), leaf(6, 8, seed=4), leaf(6, seed=5)
    assert gradcheck(AF.dot_product_scores, (q, k))
    assert gradcheck(lambda q, k: AF.scaled_dot_product_scores(q, k, 0.7), (q, k))
    assert gradcheck(AF.general_scores, (q, k, W))
    assert gradcheck(AF.concat_scores, (q, k, W2, w))


@pytest.mark.parametrize("chunk_bytes", [None, 1], ids=["one-block", "row-by-row"])
@pytest.mark.parametrize("tanh", ["tanh", "sigmoid"])
def test_additive_gradcheck(chunk_bytes, tanh, monkeypatch):
    """The hand-written backward (recomputing tanh block by block) is the true gradient."""
    monkeypatch.setenv(additive_module.TANH_ENV, tanh)
    if chunk_bytes is not None:
        monkeypatch.setattr(additive_module, "CHUNK_BYTES", chunk_bytes)
    q, k, v = leaf(2, 3, 4, seed=1), leaf(2, 5, 3, seed=2), leaf(2, 5, 2, seed=3)
    w_q, w_k, w_s, b = leaf(6, 4, seed=4), leaf(6, 3, seed=5), leaf(6, seed=6), leaf(6, seed=7)
    mask = dead_row_mask(3, 5)

    def f(q, k, v, w_q, w_k, w_s, b):
        return AF.additive_attention(q, k, v, w_q, w_k, w_s, mask, bias=b, return_weights=True)

    assert gradcheck(f, (q, k, v, w_q, w_k, w_s, b))


def test_additive_broadcast_leading_dims_gradcheck():
    q, k = leaf(1, 3, 4, seed=1), leaf(2, 5, 3, seed=2)  # one query sequence, two key batches
    w_q, w_k, w_s = leaf(6, 4, seed=4), leaf(6, 3, seed=5), leaf(6, seed=6)
    assert gradcheck(AF.additive_scores, (q, k, w_q, w_k, w_s))


def test_attention_over_scores_gradcheck():
    s, v = leaf(2, 4, 3, 5, seed=1), leaf(2, 2, 5, 3, seed=2)
    mask = dead_row_mask(3, 5)
    assert gradcheck(lambda s, v: AF.attention(s, v, mask, return_weights=True), (s, v))


def test_topk_hard_attention_gradcheck():
    q, k, v = leaf(1, 2, 3, 4, seed=1), leaf(1, 2, 6, 4, seed=2), leaf(1, 2, 6, 2, seed=3)
    assert gradcheck(lambda q, k, v: AF.hard_attention(q, k, v, mode="topk", top_k=3), (q, k, v))


@pytest.mark.parametrize("mode", ["argmax", "sample"])
def test_straight_through_gradient_is_the_softmax_gradient(mode):
    """Forward is one-hot; backward is the gradient of softmax((scores + noise) / tau)."""
    s = leaf(3, 7)
    noise = torch.randn(3, 7, generator=torch.Generator().manual_seed(4), dtype=F64)
    tau = 0.5 if mode == "sample" else 1.0
    kw = {"noise": noise, "tau": tau} if mode == "sample" else {}
    upstream = torch.randn(3, 7, generator=torch.Generator().manual_seed(5), dtype=F64)
    w = AF.hard_attention_weights(s, mode=mode, **kw)
    assert torch.all((w == 0) | (w == 1)) and torch.all(w.sum(-1) == 1)
    (g,) = torch.autograd.grad((w * upstream).sum(), s)
    x = (s + noise) / tau if mode == "sample" else s
    (want,) = torch.autograd.grad((torch.softmax(x, -1) * upstream).sum(), s)
    torch.testing.assert_close(g, want)
