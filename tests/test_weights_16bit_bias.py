"""The weights path (``return_weights`` without autograd) with a float mask in 16 bits: the
bias is added to the scores in float32, as the fused kernel does (a review's repro: a float16
row of -65504, Hugging Face's padding bias, absorbed the scores and gave uniform weights where
the fused path and the float64 oracle give softmax(scores))."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnlab.functional as AF
import attnlab.reference as R


def inputs(dtype, L):
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(2, 4, L, 8, generator=g) * 2).to(dtype)
    k = (torch.randn(2, 2, 7, 8, generator=g) * 2).to(dtype)
    v = torch.randn(2, 2, 7, 6, generator=g).to(dtype)
    low = torch.finfo(dtype).min
    bias = torch.randn(2, 1, L, 7, generator=g)  # graded (ALiBi-like) rows
    bias[0, 0, -1] = low  # a row all at the dtype's limit: softmax(scores) in float64
    bias[1, 0, -1, :4] = low  # keys 0-3 at the limit: keys 4-6 share the weight
    if L > 1:
        bias[1, 0, 0] = -torch.inf  # a row with no key: 0
        bias[0, 0, 0, 2:] = -torch.inf
    return q, k, v, bias.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("L", [1, 5])  # (a decode step's one block, and the block loop)
@pytest.mark.parametrize("average", [False, True])
def test_a_bias_at_the_dtypes_limit_keeps_the_scores(dtype, L, average):
    q, k, v, bias = inputs(dtype, L)
    with torch.no_grad():
        out, w = AF.scaled_dot_product_attention(q, k, v, bias, return_weights=True)
        out_avg, w_avg = AF.scaled_dot_product_attention(q, k, v, bias, return_weights="average")
    want_out, want_w = R.scaled_dot_product_attention(
        *(t.double().numpy() for t in (q, k, v, bias)), return_weights=True
    )
    # 16-bit scores (|s| < 16) round at 2^-11 (float16) / 2^-8 (bfloat16) of 16 relative, and
    # a weight (<= 1) at eps: 8 eps bounds the weights; before, the limit rows were uniform
    # (an error of 0.5 and more)
    eps = torch.finfo(dtype).eps
    got_w = w_avg if average else w  # (B, L, S) averaged
    want = want_w.mean(1) if average else want_w
    np.testing.assert_allclose(got_w.double().numpy(), want, rtol=0, atol=8 * eps)
    # the output: within twice torch's own fused kernel's error, a few eps at least
    fused = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(2, 1), v.float().repeat_interleave(2, 1),
        bias.float(),
    ).to(dtype)  # fmt: skip
    live = ~np.isinf(bias.double().numpy()).all(-1, keepdims=True)  # (rows with a key)
    control = np.abs(np.where(live, fused.double().numpy() - want_out, 0)).max()
    got_out = out_avg if average else out
    error = np.abs(got_out.double().numpy() - want_out).max()
    assert error <= max(2 * control, 4 * eps * np.abs(want_out).max()), (error, control)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("L", [3, 24])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("average", [False, True])
def test_a_causal_rows_max_is_over_the_keys_it_may_attend(dtype, L, alignment, average):
    """is_causal with a bias that grows on future keys (ALiBi's slope * j): each row was shifted
    by its max over every key, hidden ones too, so its visible scores were far from 0 when
    rounded to 16 bits (weights 30x the error of the same triangle given as -inf)."""
    g = torch.Generator().manual_seed(1)
    S = 24
    q, k, v = (torch.randn(1, 2, n, 16, generator=g).to(dtype) for n in (L, S, S))
    bias = (0.5 * torch.arange(S, dtype=torch.float32)).expand(L, S).to(dtype)
    offset = S - L if alignment == "bottom_right" else 0
    triangle = torch.ones(L, S, dtype=torch.bool).tril(offset)
    with torch.no_grad():
        got = AF.scaled_dot_product_attention(
            q, k, v, bias, is_causal=alignment, return_weights="average" if average else True
        )
        same = AF.scaled_dot_product_attention(
            q, k, v, bias.masked_fill(~triangle, -torch.inf),
            return_weights="average" if average else True,
        )  # fmt: skip
    for x, y in zip(got, same, strict=True):  # (the same function: the same numbers)
        torch.testing.assert_close(x, y, rtol=0, atol=0)
