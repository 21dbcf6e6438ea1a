"""Weights that need gradients take the blocked weights path (issue 10, item 3).

The backward reads the returned per-head weights (averaged weights: recomputes each block's from
the row log-sum-exp); it must equal autograd through the readable eager formula, and gradcheck in
float64, including rows with no key and grouped-query heads.
"""

from __future__ import annotations

import pytest
import torch

import attnlab.functional as AF
import attnlab.functional._memory as M
import attnlab.functional._weights as W
from attnlab.functional import sdpa


def make(L=5, S=7, H=4, Hkv=2, mask_kind="bool", dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, H, L, 8, generator=g, dtype=dtype).requires_grad_()
    k = torch.randn(2, Hkv, S, 8, generator=g, dtype=dtype).requires_grad_()
    v = torch.randn(2, Hkv, S, 6, generator=g, dtype=dtype).requires_grad_()
    mask = None
    if mask_kind:
        keep = torch.rand(2, 1, L, S, generator=g) > 0.3
        keep[1, 0, 2] = False  # a row with no key
        mask = keep
        if mask_kind == "float":
            mask = torch.where(keep, torch.randn(2, 1, L, S, generator=g, dtype=dtype), -torch.inf)
    return q, k, v, mask


@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_gradients_equal_autograd_through_the_eager_formula(average, causal, mask_kind):
    L, S = (7, 5) if causal == "bottom_right" else (5, 7)  # bottom-right, L > S: dead rows
    q, k, v, mask = make(L, S, mask_kind=mask_kind)
    rw = "average" if average else True
    assert AF.explain(q, k, v, mask, is_causal=causal, return_weights=rw).path == "weights"
    out, w = AF.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, return_weights=rw)
    ref_out, ref_w = sdpa._eager(q, k, v, mask, causal or None, 8**-0.5, 0.0)
    ref_w = ref_w.mean(1) if average else ref_w
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-13)
    torch.testing.assert_close(w, ref_w, rtol=0, atol=1e-13)
    g = torch.Generator().manual_seed(1)
    d_out, d_w = (
        torch.randn(out.shape, generator=g, dtype=out.dtype),
        torch.randn(w.shape, generator=g, dtype=w.dtype),
    )
    got = torch.autograd.grad((out * d_out).sum() + (w * d_w).sum(), (q, k, v))
    want = torch.autograd.grad((ref_out * d_out).sum() + (ref_w * d_w).sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        assert torch.isfinite(a).all()


@pytest.mark.parametrize("average", [False, True])
def test_gradcheck_small_blocks(monkeypatch, average):
    monkeypatch.setattr(W, "WEIGHTS_BLOCK_BYTES", 8 * 7 * 2)  # blocks of 2 query rows
    q, k, v, mask = make(L=5, S=7, H=2, Hkv=1)
    rw = "average" if average else True
    assert "blocks of 1 head(s) x 2 query rows" in str(AF.explain(q, k, v, mask, return_weights=rw))

    def fn(q, k, v):
        return AF.scaled_dot_product_attention(
            q, k, v, mask, is_causal="bottom_right", return_weights=rw
        )

    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_only_the_weights_used():
    q, k, v, mask = make()
    _, w = AF.scaled_dot_product_attention(q, k, v, mask, return_weights=True)
    w.square().sum().backward()
    qe, ke, ve = (t.detach().clone().requires_grad_() for t in (q, k, v))
    sdpa._eager(qe, ke, ve, mask, None, 8**-0.5, 0.0)[1].square().sum().backward()
    for a, b in ((q, qe), (k, ke)):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)
    assert ve.grad is None and (v.grad == 0).all()  # values do not reach the weights


def test_16_bit_and_graded_masks_keep_the_eager_path():
    q, k, v, _ = make(dtype=torch.bfloat16)
    decision = AF.explain(q, k, v, return_weights=True)
    assert decision.path == "eager" and "torch.bfloat16" in str(decision)
    q, k, v, _ = make()
    bias = torch.zeros(5, 7, dtype=torch.float64, requires_grad=True)
    assert AF.explain(q, k, v, bias, return_weights=True).path == "eager"


def test_per_head_backward_reads_the_returned_weights():
    q, k, v, mask = make()
    decision = AF.explain(q, k, v, mask, return_weights=True)
    assert "the backward reads the returned weights" in str(decision)
    assert "recomputes" in str(AF.explain(q, k, v, mask, return_weights="average"))
    out, w = AF.scaled_dot_product_attention(q, k, v, mask, return_weights=True)
    w.mul_(2)  # the weights the backward reads: torch's version check must catch the change
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (out.sum() + w.sum()).backward()


def test_large_fresh_weights_ask_for_huge_pages(monkeypatch):
    calls = []
    monkeypatch.setattr(M, "_madvise", lambda start, n, advice: calls.append((start, n, advice)))
    like = torch.empty(0)
    small = M.empty(1, M.MIN_BYTES // 4 - 1, like=like)
    assert calls == [] and small.shape == (1, M.MIN_BYTES // 4 - 1)
    big = M.empty(3, M.MIN_BYTES // 4 + 5, like=like)  # > 8 MiB of float32
    ((start, n, advice),) = calls
    lo, hi = big.data_ptr(), big.data_ptr() + big.numel() * 4
    assert advice == 14 and start % M.HUGE_PAGE == 0 and n % M.HUGE_PAGE == 0
    assert (
        lo <= start
        and start + n <= hi
        and start - lo < M.HUGE_PAGE
        and hi - start - n < M.HUGE_PAGE
    )
    big.fill_(1.5)  # the memory is the tensor's own, usable as any
    assert big.dtype == torch.float32 and bool(big.eq(1.5).all())


def test_the_weights_path_returns_huge_page_weights(monkeypatch):
    calls = []
    monkeypatch.setattr(M, "_madvise", lambda start, n, advice: calls.append((start, n)))
    q, k, v = (torch.randn(1, 2, 1024, 8) for _ in range(3))  # weights: 8 MiB of float32
    out, w = AF.scaled_dot_product_attention(q, k, v, return_weights=True)
    ((start, n),) = calls
    assert w.data_ptr() <= start < start + n <= w.data_ptr() + w.numel() * 4
    torch.testing.assert_close(w, torch.softmax(q @ k.transpose(-2, -1) / 8**0.5, -1))
