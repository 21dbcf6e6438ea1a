"""Layers against the NumPy oracle (composed with the layers' own weights) and against torch."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch import nn

import attnlab.reference as R
from attnlab import masks
from attnlab.functional import RotaryScaling, rotary_angles
from attnlab.nn import (
    AdditiveAttention,
    DotProductAttention,
    LuongAttention,
    MultiHeadAttention,
    SelfAttention,
)
from conftest import assert_close_to_oracle, np64

F64 = torch.float64


def linear_np(layer: nn.Linear, x: np.ndarray) -> np.ndarray:
    out = x @ np64(layer.weight).T
    return out if layer.bias is None else out + np64(layer.bias)


def mha_oracle(layer, query, key=None, value=None, mask=None, is_causal=False, positions=None):
    """Multi-head attention written out in NumPy with the layer's weights: the specification."""
    x = np64(query)
    src = x if key is None else np64(key)
    val = src if value is None else np64(value)
    B, L, _ = x.shape
    S = src.shape[1]
    H, Hkv, E = layer.num_heads, layer.num_kv_heads, layer.head_dim
    q = linear_np(layer.q_proj, x).reshape(B, L, H, E).transpose(0, 2, 1, 3)
    k = linear_np(layer.k_proj, src).reshape(B, S, Hkv, E).transpose(0, 2, 1, 3)
    v = linear_np(layer.v_proj, val).reshape(B, S, Hkv, E).transpose(0, 2, 1, 3)
    if layer.rope_base is not None:
        pos = np.arange(L) if positions is None else np.asarray(positions)
        q = R.apply_rotary(q, pos, layer.rope_base, layer.rope_scaling)
        k = R.apply_rotary(k, pos, layer.rope_base, layer.rope_scaling)
    out, w = R.scaled_dot_product_attention(
        q, k, v, np64(mask), is_causal=is_causal, return_weights=True
    )
    out = out.transpose(0, 2, 1, 3).reshape(B, L, H * E)
    return linear_np(layer.o_proj, out), w


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1), (6, 3)])
@pytest.mark.parametrize("rope", [False, True, "linear", "llama3"])
@pytest.mark.parametrize("causal", [False, True])
def test_self_attention_layer_matches_oracle(heads, kv_heads, rope, causal):
    torch.manual_seed(0)
    # llama3 with c = 64: the fastest pair (wavelength 2 pi) in the blended band, the rest slow
    scaling = {
        "linear": RotaryScaling("linear", 3.0),
        "llama3": RotaryScaling("llama3", 4.0, 1.0, 16.0, 64),
    }
    layer = MultiHeadAttention(
        24,
        heads,
        num_kv_heads=kv_heads,
        is_causal=causal,
        rope=rope is not False,
        rope_scaling=scaling.get(rope),
    ).double()
    x = randn(2, 7, 24)
    pad = masks.padding_mask([7, 4], 7)  # (B, 1, 1, S)
    out, w = layer(x, key_mask=pad[:, 0, 0], return_weights=True)
    want, want_w = mha_oracle(layer, x, mask=pad, is_causal=causal)
    assert_close_to_oracle(out, want)
    assert_close_to_oracle(w, want_w)
    avg = layer(x, key_mask=pad[:, 0, 0], return_weights=True, average_weights=True)[1]
    assert_close_to_oracle(avg, want_w.mean(1))


def test_cross_attention_with_other_widths_and_precomputed_kv():
    torch.manual_seed(1)
    layer = MultiHeadAttention(16, 4, num_kv_heads=2, head_dim=6, kdim=10, vdim=12).double()
    x, src, val = randn(2, 5, 16), randn(2, 8, 10, seed=1), randn(2, 8, 12, seed=2)
    attn_mask = torch.rand(5, 8, generator=torch.Generator().manual_seed(3)) > 0.3
    out = layer(x, key=src, value=val, mask=attn_mask)
    want, _ = mha_oracle(layer, x, src, val, mask=attn_mask)
    assert_close_to_oracle(out, want)
    kv = layer.project_kv(src, val)
    assert kv[0].shape == (2, 2, 8, 6)
    torch.testing.assert_close(layer(x, kv=kv, mask=attn_mask), out, rtol=0, atol=1e-14)


def test_gqa_layer_equals_mha_with_repeated_kv_weights():
    torch.manual_seed(2)
    gqa = MultiHeadAttention(32, 8, num_kv_heads=2).double()
    mha = MultiHeadAttention(32, 8, num_kv_heads=8).double()
    with torch.no_grad():
        mha.q_proj.load_state_dict(gqa.q_proj.state_dict())
        mha.o_proj.load_state_dict(gqa.o_proj.state_dict())
        for src, dst in ((gqa.k_proj, mha.k_proj), (gqa.v_proj, mha.v_proj)):
            # kv head j serves query heads 4j..4j+3: repeat each head's rows 4 times
            w = src.weight.view(2, 4, 32).repeat_interleave(4, 0).reshape(32, 32)
            b = src.bias.view(2, 4).repeat_interleave(4, 0).reshape(32)
            dst.weight.copy_(w)
            dst.bias.copy_(b)
    x = randn(3, 9, 32)
    torch.testing.assert_close(gqa(x, is_causal=True), mha(x, is_causal=True))


def test_rope_sees_relative_positions_only():
    torch.manual_seed(3)
    layer = MultiHeadAttention(32, 4, rope=True, is_causal=True).double()
    x = randn(2, 6, 32)
    a = layer(x, position_ids=torch.arange(6))
    b = layer(x, position_ids=torch.arange(6) + 1000)  # shift every position
    torch.testing.assert_close(a, b, rtol=0, atol=1e-9)
    c = layer(x, position_ids=torch.tensor([0, 1, 2, 3, 4, 6]))  # change a distance: changes
    assert (c - a).abs().max() > 1e-3


def test_rope_angles_computed_once_equal_position_ids():
    """A model passes every layer the angles it computed once: the same numbers, bit for bit,
    in float64 and (with float32 angles) in bfloat16; per-row positions too."""
    torch.manual_seed(3)
    layer = MultiHeadAttention(32, 4, num_kv_heads=2, rope=500.0, is_causal=True).double()
    x = randn(2, 6, 32)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]])
    for p in (torch.arange(6) + 3, pos):
        angles = rotary_angles(p, layer.head_dim, layer.rope_base, torch.float64)
        want = layer(x, position_ids=p)
        assert torch.equal(layer(x, rope_angles=angles), want)
        oracle, _ = mha_oracle(layer, x, is_causal=True, positions=np64(p))
        if p.dim() == 1:
            assert_close_to_oracle(want, oracle)
    # (1, L): Hugging Face's default position_ids, shared by every row; the layer's check
    # accepted (1, L, E) angles and the rotation refused them before
    shared = torch.arange(6)[None] + 3
    angles = rotary_angles(shared, layer.head_dim, layer.rope_base, torch.float64)
    want = layer(x, position_ids=torch.arange(6) + 3)
    assert torch.equal(layer(x, rope_angles=angles), want)
    assert torch.equal(layer(x, position_ids=shared), want)
    layer16, x16 = layer.to(torch.bfloat16), x.to(torch.bfloat16)
    angles = rotary_angles(pos, layer.head_dim, layer.rope_base)  # float32, as the layer's own
    assert torch.equal(layer16(x16, rope_angles=angles), layer16(x16, position_ids=pos))


@pytest.mark.parametrize("rope", [0, 0.0, 1, -10000.0, float("nan"), float("inf"), "10000"])
def test_a_rope_base_that_is_no_base_is_refused(rope):
    """Before: 0, a negative or a NaN base built a layer whose every output was NaN or inf, and
    rope=1 (for True) gave base 1.0, every frequency 1; a falsy base skipped the
    self-attention-only check."""
    with pytest.raises(ValueError, match=r"rope must be True .* finite number > 1.*got"):
        MultiHeadAttention(16, 2, rope=rope)


def test_a_rope_base_of_any_real_type_is_taken():
    for rope in (500000, 500000.0, np.float32(500000.0), np.int64(500000)):
        assert MultiHeadAttention(16, 2, rope=rope).rope_base == 500000.0


@pytest.mark.parametrize(
    "rope,kw,said",
    [
        (False, {"rope_angles": "angles"}, "a layer without RoPE"),
        (True, {"rope_angles": "angles", "position_ids": torch.arange(5)}, "got both"),
        (True, {"rope_angles": "short"}, "B = 2, L = 5 and E = head_dim = 8; got [(4, 8), (4, 8)]"),
        (True, {"rope_angles": "batch"}, "got [(3, 5, 8), (3, 5, 8)]"),
        (True, {"rope_angles": "one"}, "rope_angles must be (cos, sin)"),
        (True, {"rope_angles": "tensor"}, "got Tensor"),
    ],
)
def test_rope_angles_misuse_says_the_fix(rope, kw, said):
    layer = MultiHeadAttention(16, 2, rope=rope)
    angles = rotary_angles(torch.arange(5), 8)
    given = {
        "angles": angles,
        "short": rotary_angles(torch.arange(4), 8),
        "batch": rotary_angles(torch.arange(5).expand(3, 5), 8),
        "one": angles[:1],
        "tensor": angles[0],
    }
    kw = {**kw, "rope_angles": given[kw["rope_angles"]]}
    with pytest.raises(ValueError, match=re.escape(said)) as err:
        layer(torch.randn(2, 5, 16), **kw)
    assert "Fix:" in str(err.value)


def test_dropout_only_in_training():
    torch.manual_seed(4)
    layer = MultiHeadAttention(16, 2, attn_dropout=0.5, out_dropout=0.5).double()
    x = randn(2, 5, 16)
    layer.eval()
    torch.testing.assert_close(layer(x), layer(x), rtol=0, atol=0)
    layer.train()
    assert (layer(x) - layer(x)).abs().max() > 0


# --- torch.nn.MultiheadAttention -> attnlab -------------------------------------------------


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_from_torch_matches_torch(batch_first, cross, bias):
    torch.manual_seed(5)
    kdim = vdim = 10 if cross else None
    ref = nn.MultiheadAttention(16, 4, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first)
    ref.eval()
    if not batch_first:
        with pytest.raises(ValueError, match="batch_first=False"):
            MultiHeadAttention.from_torch(ref)  # (L, B, D) inputs would be misread
        ref.batch_first = True  # the fix the message names; inputs below stay (L, B, D) for ref
        ours = MultiHeadAttention.from_torch(ref)
        ref.batch_first = False
    else:
        ours = MultiHeadAttention.from_torch(ref)
    B, L, S = 3, 5, 7 if cross else 5
    x = torch.randn(B, L, 16)
    src = torch.randn(B, S, kdim or 16)
    val = torch.randn(B, S, vdim or 16)
    torch_kpm = torch.zeros(B, S, dtype=torch.bool)
    torch_kpm[1, 4:] = True  # torch: True = ignore
    torch_mask = torch.rand(L, S) > 0.7
    torch_mask[:, 0] = False  # keep every row alive (torch returns NaN on dead rows)

    def t(a):  # to torch's layout
        return a if batch_first else a.transpose(0, 1)

    for avg in (True, False):
        want, want_w = ref(
            t(x),
            t(src if cross else x),
            t(val if cross else x),
            key_padding_mask=torch_kpm,
            attn_mask=torch_mask,
            need_weights=True,
            average_attn_weights=avg,
        )
        got, got_w = ours(
            x,
            key=src if cross else None,
            value=val if cross else None,
            key_mask=masks.from_torch_mask(torch_kpm),
            mask=masks.from_torch_mask(torch_mask),
            return_weights=True,
            average_weights=avg,
        )
        torch.testing.assert_close(got, t(want), rtol=0, atol=1e-6)
        torch.testing.assert_close(got_w, want_w, rtol=0, atol=1e-6)
    # a float (additive) attn_mask means the same in both
    bias_mask = torch.randn(L, S)
    want = ref(t(x), t(src if cross else x), t(val if cross else x), attn_mask=bias_mask)[0]
    got = ours(x, key=src if cross else None, value=val if cross else None, mask=bias_mask)
    torch.testing.assert_close(got, t(want), rtol=0, atol=1e-6)


def test_from_torch_fully_masked_rows_are_zero_not_nan():
    torch.manual_seed(6)
    ref = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    ours = MultiHeadAttention.from_torch(ref)
    x = torch.randn(2, 3, 8)
    torch_mask = torch.zeros(3, 3, dtype=torch.bool)
    torch_mask[1] = True  # row 1 may attend nothing
    want = ref(x, x, x, attn_mask=torch_mask, need_weights=True)[0]
    assert torch.isnan(want[:, 1]).all()  # torch's NaN
    got, w = ours(x, mask=masks.from_torch_mask(torch_mask), return_weights=True)
    assert torch.all(w[:, :, 1] == 0)
    torch.testing.assert_close(got[:, 1], ours.o_proj.bias.expand(2, 8))  # attention out 0
    torch.testing.assert_close(got[:, [0, 2]], want[:, [0, 2]], rtol=0, atol=1e-6)


def test_from_torch_rejects_unsupported():
    with pytest.raises(ValueError, match="add_bias_kv"):
        MultiHeadAttention.from_torch(
            nn.MultiheadAttention(8, 2, add_bias_kv=True, batch_first=True)
        )
    with pytest.raises(TypeError, match="nn.MultiheadAttention"):
        MultiHeadAttention.from_torch(nn.Linear(2, 2))


# --- the classic layers -----------------------------------------------------------------------


def test_additive_layer_and_precomputed_keys():
    torch.manual_seed(7)
    layer = AdditiveAttention(6, 8, 5).double()
    q, k, v = randn(2, 3, 6), randn(2, 4, 8, seed=1), randn(2, 4, 3, seed=2)
    kpm = torch.tensor([[True, True, True, False], [True, True, True, True]])
    out, w = layer(q, k, v, key_mask=kpm, return_weights=True)
    want = R.additive_attention(
        np64(q),
        np64(k),
        np64(v),
        np64(layer.q_proj.weight),
        np64(layer.k_proj.weight),
        np64(layer.score.weight[0]),
        np64(kpm[:, None, :]),
        bias=np64(layer.q_proj.bias),
        return_weights=True,
    )
    assert_close_to_oracle(out, want[0])
    assert_close_to_oracle(w, want[1])
    again = layer(q, k, v, keys_proj=layer.project_keys(k), key_mask=kpm)
    torch.testing.assert_close(again, out, rtol=0, atol=1e-14)


@pytest.mark.parametrize("score", ["dot", "general", "concat"])
def test_luong_layers(score):
    torch.manual_seed(8)
    qd = 8 if score == "dot" else 6
    layer = LuongAttention(qd, 8, score=score, attn_dim=5).double()
    q, k, v = randn(2, 3, qd), randn(2, 4, 8, seed=1), randn(2, 4, 3, seed=2)
    out, w = layer(q, k, v, return_weights=True)
    if score == "dot":
        scores = R.dot_product_scores(np64(q), np64(k))
    elif score == "general":
        scores = R.general_scores(np64(q), np64(k), np64(layer.weight.weight))
    else:
        W = np.concatenate([np64(layer.q_proj.weight), np64(layer.k_proj.weight)], axis=1)
        scores = R.concat_scores(np64(q), np64(k), W, np64(layer.score.weight[0]))
    want = R.attention(scores, np64(v), return_weights=True)
    assert_close_to_oracle(out, want[0])
    assert_close_to_oracle(w, want[1])
    again = layer(q, k, v, keys_proj=layer.project_keys(k))
    torch.testing.assert_close(again, out, rtol=0, atol=1e-14)


def test_dot_product_and_self_attention_layers():
    torch.manual_seed(9)
    q, k, v = randn(2, 3, 4), randn(2, 5, 4, seed=1), randn(2, 5, 2, seed=2)
    for scaled in (True, False):
        out = DotProductAttention(scaled)(q, k, v)
        want = R.scaled_dot_product_attention(
            np64(q), np64(k), np64(v), scale=None if scaled else 1.0
        )
        assert_close_to_oracle(out, want)
    sa = SelfAttention(d_in=6, d_kq=4, d_v=3).double()  # value width differs from key width
    x = randn(2, 5, 6)
    out, w = sa(x, is_causal=True, return_weights=True)
    assert out.shape == (2, 5, 3)
    want = R.scaled_dot_product_attention(
        linear_np(sa.q_proj, np64(x)),
        linear_np(sa.k_proj, np64(x)),
        linear_np(sa.v_proj, np64(x)),
        is_causal=True,
        return_weights=True,
    )
    assert_close_to_oracle(out, want[0])
    assert_close_to_oracle(w, want[1])


# --- configuration and input errors ---------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,phrases",
    [
        ({"d_model": 30, "num_heads": 4}, ["num_heads=4 must divide d_model=30", "[1, 2, 3, 5"]),
        (
            {"d_model": 32, "num_heads": 8, "num_kv_heads": 3},
            ["num_kv_heads=3 must divide num_heads=8", "[1, 2, 4, 8]"],
        ),
        ({"d_model": 32, "num_heads": 4, "attn_dropout": 1.5}, ["attn_dropout", "[0, 1)"]),
        ({"d_model": 30, "num_heads": 2, "rope": True, "head_dim": 5}, ["even head_dim"]),
        ({"d_model": 32, "num_heads": 0}, ["num_heads must be an int >= 1 (query heads); got 0"]),
    ],
)
def test_configuration_errors(kwargs, phrases):
    with pytest.raises(ValueError) as info:
        MultiHeadAttention(**kwargs)
    for p in phrases:
        assert p in str(info.value)


def test_input_errors():
    layer = MultiHeadAttention(16, 4)
    with pytest.raises(ValueError, match=r"query must be \(B, L, 16\).*transpose"):
        layer(torch.randn(5, 16))
    with pytest.raises(ValueError, match=r"key must be \(B, L, 16\)"):
        layer(torch.randn(2, 5, 16), key=torch.randn(2, 5, 12))
    with pytest.raises(ValueError, match="key_mask must be a .* True = real token"):
        layer(torch.randn(2, 5, 16), key_mask=torch.ones(2, 5))
    with pytest.raises(TypeError, match="^mask must be bool"):
        layer(torch.randn(2, 5, 16), mask=torch.ones(5, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match='score="dot" needs query_dim == key_dim'):
        LuongAttention(4, 6, score="dot")
    with pytest.raises(ValueError, match=r"keys_proj must be \(B, n, 5\)"):
        AdditiveAttention(4, 6, 5)(
            torch.randn(1, 1, 4), torch.randn(1, 3, 6), keys_proj=torch.randn(1, 3, 6)
        )


def test_self_attention_of_one_sequence_takes_its_key_mask():
    # before: x (L, d_in) with key_mask (L,) read L and d_in as (B, S) and asked for a
    # "(B, S) = (5, 4)" mask
    from attnlab.nn import SelfAttention

    torch.manual_seed(0)
    layer = SelfAttention(4, 3, 2).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    keep = torch.tensor([True, True, False, True, False])
    causal = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    for mask in (None, causal):
        out, w = layer(x, mask=mask, key_mask=keep, return_weights=True)
        batched, wb = layer(x[None], mask=mask, key_mask=keep[None], return_weights=True)
        torch.testing.assert_close(out, batched[0])
        torch.testing.assert_close(w, wb[0])
        assert (w[:, ~keep] == 0).all()
    with pytest.raises(ValueError, match=r"key_mask must be an \(S,\) = \(5,\)"):
        layer(x, key_mask=torch.ones(4, dtype=torch.bool))
