"""Properties that hold for every input (hypothesis draws the inputs)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnlab.functional as AF
import attnlab.reference as R

F64 = torch.float64


@st.composite
def attention_inputs(draw, gqa=True):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 3))
    G = draw(st.integers(1, 3)) if gqa else 1
    L, S = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    E, Ev = draw(st.integers(1, 6)), draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    scale = draw(st.floats(0.1, 3.0))
    q = torch.randn(B, Hkv * G, L, E, generator=g, dtype=F64) * scale
    k = torch.randn(B, Hkv, S, E, generator=g, dtype=F64) * scale
    v = torch.randn(B, Hkv, S, Ev, generator=g, dtype=F64)
    density = draw(st.floats(0.0, 1.0))
    mask = torch.rand(B, 1, L, S, generator=g) < density
    return q, k, v, mask


@given(attention_inputs(), st.booleans())
def test_rows_sum_to_one_masked_weights_zero_dead_rows_zero(inputs, fused_output):
    q, k, v, mask = inputs
    out, w = AF.scaled_dot_product_attention(q, k, v, mask, return_weights=True)
    if fused_output:
        out = AF.scaled_dot_product_attention(q, k, v, mask)
    full = mask.expand_as(w)
    alive = full.any(-1)
    assert torch.all(w[~full] == 0)  # masked: exactly 0
    torch.testing.assert_close(w.sum(-1)[alive], torch.ones_like(w.sum(-1)[alive]))
    assert torch.all(w.sum(-1)[~alive] == 0)  # fully masked rows: weights 0 ...
    assert torch.all(out[~alive] == 0)  # ... and output 0
    assert torch.isfinite(out).all()


@given(attention_inputs(), st.floats(-50, 50))
def test_softmax_shift_invariance(inputs, shift):
    q, k, _, mask = inputs
    s = AF.scaled_dot_product_scores(q, k)
    torch.testing.assert_close(AF.masked_softmax(s + shift, mask), AF.masked_softmax(s, mask))


@given(attention_inputs(), st.data())
def test_permuting_key_value_pairs_changes_nothing(inputs, data):
    q, k, v, mask = inputs
    S = k.shape[2]
    perm = torch.tensor(data.draw(st.permutations(range(S))))
    out = AF.scaled_dot_product_attention(q, k, v, mask)
    permuted = AF.scaled_dot_product_attention(q, k[:, :, perm], v[:, :, perm], mask[..., perm])
    torch.testing.assert_close(permuted, out, rtol=1e-12, atol=1e-12)


@given(attention_inputs(), st.sampled_from(["top_left", "bottom_right"]), st.booleans())
def test_future_tokens_never_change_causal_outputs(inputs, alignment, return_weights):
    q, k, v, _ = inputs
    L, S = q.shape[2], k.shape[2]
    offset = S - L if alignment == "bottom_right" else 0
    out = AF.scaled_dot_product_attention(
        q, k, v, is_causal=alignment, return_weights=return_weights
    )
    out = out[0] if return_weights else out
    k2, v2 = k.clone(), v.clone()
    for i in range(L):  # scramble every key/value that query i must not see, then compare row i
        future = slice(max(0, i + offset + 1), S)
        k2[:, :, future] += 100.0
        v2[:, :, future] -= 100.0
        out2 = AF.scaled_dot_product_attention(
            q, k2, v2, is_causal=alignment, return_weights=return_weights
        )
        out2 = out2[0] if return_weights else out2
        torch.testing.assert_close(out2[:, :, i], out[:, :, i], rtol=1e-12, atol=1e-12)
        k2.copy_(k)
        v2.copy_(v)


@given(attention_inputs(), st.booleans())
def test_gqa_equals_mha_on_repeated_heads(inputs, return_weights):
    """GQA with Hkv heads == MHA whose kv heads are repeated (repeat_interleave) to H."""
    q, k, v, mask = inputs
    G = q.shape[1] // k.shape[1]
    gqa = AF.scaled_dot_product_attention(q, k, v, mask, return_weights=return_weights)
    kr, vr = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    mha = AF.scaled_dot_product_attention(q, kr, vr, mask, return_weights=return_weights)
    for a, b in zip(*((gqa, mha) if return_weights else ([gqa], [mha])), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@given(attention_inputs(gqa=False))
def test_padding_a_batch_leaves_real_tokens_unchanged(inputs):
    """Appending padded keys (masked out) does not change the output."""
    q, k, v, mask = inputs
    pad = 3
    kp = torch.cat([k, torch.randn_like(k[:, :, :1]).expand(-1, -1, pad, -1) * 50], 2)
    vp = torch.cat([v, torch.randn_like(v[:, :, :1]).expand(-1, -1, pad, -1) * 50], 2)
    mp = torch.cat([mask, torch.zeros(*mask.shape[:-1], pad, dtype=torch.bool)], -1)
    out = AF.scaled_dot_product_attention(q, k, v, mask)
    padded = AF.scaled_dot_product_attention(q, kp, vp, mp)
    torch.testing.assert_close(padded, out, rtol=1e-12, atol=1e-12)


@given(st.integers(1, 6), st.integers(1, 6), st.integers(1, 4), st.integers(0, 1000))
def test_reference_softmax_matches_definition(L, S, n, seed):
    """The oracle itself against the textbook definition, on rows that are not fully masked."""
    rng = np.random.default_rng(seed)
    s = rng.normal(size=(n, L, S)) * 3
    mask = rng.random((n, L, S)) < 0.7
    mask[..., 0] = True
    w = R.masked_softmax(s, mask)
    e = np.exp(s) * mask
    np.testing.assert_allclose(w, e / e.sum(-1, keepdims=True), rtol=1e-12, atol=1e-15)


@given(attention_inputs(), st.sampled_from(["argmax", "sample", "topk"]))
def test_hard_attention_properties(inputs, mode):
    q, k, v, mask = inputs
    top_k = 2 if mode == "topk" else None
    out, w = AF.hard_attention(q, k, v, mask, mode=mode, top_k=top_k, return_weights=True)
    full = mask.expand_as(w)
    alive = full.any(-1)
    assert torch.all(w[~full] == 0)
    assert torch.all(out[~alive] == 0) and torch.all(w.sum(-1)[~alive] == 0)
    torch.testing.assert_close(w.sum(-1)[alive], torch.ones_like(w.sum(-1)[alive]))
    nonzero = (w > 0).sum(-1)[alive]
    if mode in ("argmax", "sample"):
        assert torch.all(nonzero == 1)  # exactly one key chosen
        assert torch.all((w == 0) | (w == 1))
    else:
        assert torch.all(nonzero <= 2)
