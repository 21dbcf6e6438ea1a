"""weights_out=: the weights written into a caller's reusable buffer (issue 10, item 3)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnlab.functional as AF
import attnlab.reference as R


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 5, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 7, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 7, 6, generator=g, dtype=torch.float64)
    mask = torch.rand(2, 1, 5, 7, generator=g) > 0.3
    mask[1, 0, 2] = False  # a dead row: weights 0
    return q, k, v, mask


@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_weights_out_is_filled_returned_and_equals_the_oracle(average, causal):
    q, k, v, mask = inputs()
    want_out, want_w = R.scaled_dot_product_attention(
        q.numpy(), k.numpy(), v.numpy(), mask.numpy(), is_causal=causal, return_weights=True
    )
    want_w = want_w.mean(1) if average else want_w
    buf = torch.full(want_w.shape, 7.0, dtype=torch.float64)  # stale values must not survive
    for _ in range(2):  # reused
        with torch.no_grad():
            out, w = AF.scaled_dot_product_attention(
                q,
                k,
                v,
                mask,
                is_causal=causal,
                return_weights="average" if average else True,
                weights_out=buf,
            )
        assert w is buf
        np.testing.assert_allclose(w.numpy(), want_w, rtol=0, atol=1e-12)
        np.testing.assert_allclose(out.numpy(), want_out, rtol=0, atol=1e-12)


def test_weights_out_misuse_is_refused():
    q, k, v, _ = inputs()
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"shape \(2, 4, 5, 7\).*torch.empty"):
            AF.scaled_dot_product_attention(
                q, k, v, return_weights=True, weights_out=torch.empty(2, 4, 7, 5, dtype=q.dtype)
            )
        with pytest.raises(ValueError, match="contiguous torch.float64"):
            AF.scaled_dot_product_attention(
                q, k, v, return_weights=True, weights_out=torch.empty(2, 4, 5, 7)
            )
        with pytest.raises(ValueError, match="only used with return_weights"):
            AF.scaled_dot_product_attention(q, k, v, weights_out=torch.empty(2, 4, 5, 7))
        with pytest.raises(ValueError, match="inference"):
            AF.scaled_dot_product_attention(
                q,
                k,
                v,
                return_weights=True,
                dropout_p=0.1,
                weights_out=torch.empty(2, 4, 5, 7, dtype=q.dtype),
            )
    for needs_grad in range(3):  # (before: only the query's gradient was looked at, and a
        # key's or value's was silently dropped from the weights written into the buffer)
        args = [t.detach().requires_grad_(i == needs_grad) for i, t in enumerate((q, k, v))]
        with pytest.raises(ValueError, match="inference"):
            AF.scaled_dot_product_attention(
                *args, return_weights=True, weights_out=torch.empty(2, 4, 5, 7, dtype=q.dtype)
            )


@pytest.mark.parametrize("return_weights", [True, "average"])
def test_weights_out_has_the_shape_of_the_weights_it_stands_for_with_one_head(return_weights):
    """With H = 1, per-head weights are (B, 1, L, S) and averaged ones (B, L, S): weights_out
    takes the shape the call returns without it (per head, it asked for (B, L, S) before)."""
    q, k, v, _ = inputs()
    q, k, v = q[:, :1], k[:, :1], v[:, :1]
    with torch.no_grad():
        out, want = AF.scaled_dot_product_attention(q, k, v, return_weights=return_weights)
        buf = torch.empty_like(want)
        got_out, got = AF.scaled_dot_product_attention(q, k, v, return_weights=return_weights,
                                                       weights_out=buf)  # fmt: skip
    assert got is buf and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_out, out, rtol=0, atol=0)
