"""attnlab's Triton attention kernels through the interpreter, against the float64 oracle.

Shapes are small but cross several 32 x 32 tiles (the interpreter's tile size) and several
decode splits; lengths are odd, L != S, GQA 4/2 and 4/1 and 6/2, E != Ev. float32 results are
held to a control: the naive formula in float32, against the same oracle (conftest.py's rule:
error <= 2x the control's, plus a rounding floor); bfloat16 likewise against naive bfloat16.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnlab
from attnlab import masks, reference
from attnlab.kernels import triton_attention as ta
from attnlab.kernels import triton_decode as td
from conftest import naive_sdpa, np64

F64 = torch.float64
SHAPES = [  # (B, H, Hkv, L, S, E, Ev)
    (2, 4, 2, 37, 53, 24, 40),
    (1, 4, 1, 45, 33, 16, 16),
    (2, 6, 2, 3, 97, 32, 8),  # a decode-like call: G*L = 9 rows per kv head
]


def inputs(B, H, Hkv, L, S, E, Ev, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, E, generator=g, dtype=F64)
    k = torch.randn(B, Hkv, S, E, generator=g, dtype=F64)
    v = torch.randn(B, Hkv, S, Ev, generator=g, dtype=F64)
    return [t.to(dtype) for t in (q, k, v)]


def make_mask(kind, B, H, L, S, seed=1):
    g = torch.Generator().manual_seed(seed)
    if kind == "bool":  # (B, 1, L, S) with a row that may attend nothing
        m = torch.rand(B, 1, L, S, generator=g) > 0.3
        m[0, 0, L // 2] = False
        return m
    if kind == "float":  # (1, H, L, S) bias with -inf entries
        bias = torch.randn(1, H, L, S, generator=g, dtype=F64)
        return bias.masked_fill(torch.rand(1, H, L, S, generator=g) > 0.7, float("-inf"))
    return None


def oracle(q, k, v, mask, alignment, scale=None):
    return reference.scaled_dot_product_attention(
        np64(q), np64(k), np64(v), np64(mask), is_causal=alignment or False, scale=scale,
        return_weights=True,
    )  # fmt: skip


def control(q, k, v, mask, alignment, dtype):
    """The naive formula in ``dtype`` and its error against the oracle (the tolerance)."""
    L, S = q.shape[-2], k.shape[-2]
    if alignment is not None:
        keep = masks.causal_keep(L, S, alignment, q.device)
        mask = keep if mask is None else masks.restrict(mask, keep)
    cast = mask.to(dtype) if mask is not None and mask.is_floating_point() else mask
    return naive_sdpa(q.to(dtype), k.to(dtype), v.to(dtype), cast)


def err(a, b) -> float:
    return float(np.abs(a.detach().double().numpy() - b).max()) if a.numel() else 0.0


FLOOR = {torch.float32: 1e-6, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
@pytest.mark.parametrize("alignment", [None, "top_left", "bottom_right"])
def test_forward_and_weights_match_the_oracle(shape, mask_kind, alignment):
    B, H, Hkv, L, S, E, Ev = shape
    mask = make_mask(mask_kind, B, H, L, S)
    q, k, v = inputs(*shape)
    m = mask.float() if mask is not None and mask.is_floating_point() else mask
    ref_out, ref_w = oracle(q, k, v, mask, alignment)
    tol = 2 * err(control(q, k, v, m, alignment, torch.float32), ref_out) + FLOOR[torch.float32]
    out, lse = ta.attention_forward(q, k, v, m, alignment)
    assert err(out, ref_out) <= tol
    w = ta.attention_weights(q, k, lse, m, alignment)
    assert err(w, ref_w) <= tol
    avg = ta.attention_weights(q, k, lse, m, alignment, average=True)
    assert avg.shape == (B, 1, L, S) and err(avg, ref_w.mean(1, keepdims=True)) <= tol
    dead = ~np.asarray(ref_w.sum(-1) > 0)  # rows with no attendable key: exactly 0, lse +inf
    assert (out.numpy()[dead] == 0).all() and (w.numpy()[dead] == 0).all()
    lse = ta.row_lse(lse)  # (B, H, L) from the (max, log-sum) statistics
    assert np.isposinf(lse.numpy()[dead]).all() and np.isfinite(lse.numpy()[~dead]).all()
    ref_lse = ta.reference(q.double(), k.double(), v.double(), m, alignment)[1]
    assert (lse.double() - ref_lse)[~torch.as_tensor(dead)].abs().max() < 1e-5


@pytest.mark.parametrize("shape", SHAPES[1:], ids=str)
@pytest.mark.parametrize("alignment", [None, "bottom_right"])
def test_bfloat16_is_within_twice_a_bfloat16_control(shape, alignment):
    q, k, v = inputs(*shape, dtype=torch.bfloat16)
    ref_out, ref_w = oracle(q, k, v, None, alignment)
    ctrl = control(q, k, v, None, alignment, torch.bfloat16)
    tol = 2 * err(ctrl, ref_out) + 1e-3
    out, lse = ta.attention_forward(q, k, v, None, alignment)
    assert out.dtype == torch.bfloat16 and err(out, ref_out) <= tol
    w = ta.attention_weights(q, k, lse, None, alignment)
    assert err(w, ref_w) <= 2**-8  # weights in [0, 1]: one bf16 rounding


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_as_key_ranges_equals_the_mask(side):
    B, H, Hkv, L, S, E, Ev = 3, 4, 2, 21, 70, 16, 24
    q, k, v = inputs(B, H, Hkv, L, S, E, Ev)
    pad = masks.padding_mask([70, 33, 0], side=side)
    ref_out, ref_w = oracle(q, k, v, pad, None)
    out, lse = ta.attention_forward(q, k, v, None, None, None, pad.key_range)
    assert err(out, ref_out) < 2e-6
    w = ta.attention_weights(q, k, lse, None, None, None, pad.key_range)
    assert err(w, ref_w) < 1e-6 and (out[2] == 0).all() and (w[2] == 0).all()


@pytest.mark.parametrize("shape", [(2, 6, 2, 1, 150, 24, 40), (2, 8, 1, 3, 97, 32, 32)], ids=str)
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_decode_kernel_merges_its_splits_exactly(shape, mask_kind):
    B, H, Hkv, L, S, E, Ev = shape
    assert td._splits(B, Hkv, S, 32, torch.device("cpu")) == 3  # the merge is crossed
    q, k, v = inputs(*shape)
    mask = make_mask(mask_kind, B, H, L, S)
    m = mask.float() if mask is not None and mask.is_floating_point() else mask
    ref_out, ref_w = oracle(q, k, v, mask, "bottom_right")
    out, none = td.decode_attention(q, k, v, m, "bottom_right")
    assert none is None and err(out, ref_out) < 2e-6
    out_w, w = td.decode_attention(q, k, v, m, "bottom_right", return_weights=True)
    assert torch.equal(out_w, out) and err(w, ref_w) < 1e-6
    _, avg = td.decode_attention(q, k, v, m, "bottom_right", return_weights="average")
    assert err(avg, ref_w.mean(1, keepdims=True)) < 1e-6


@pytest.mark.parametrize("weights", [False, True, "average"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_kernel_equals_its_readable_merge(weights, dtype):
    """Random partials of 4 splits (2 rows with no key in any split, one split with none for
    all rows, a NaN row): the one-launch merge equals the torch ops it replaced (merge_splits),
    NaN where NaN, 0 for rows with no key."""
    B, H, Hkv, L, S, Ev, nsplit = 2, 6, 2, 2, 600, 24, 4  # 600 keys: three weights blocks
    G, R = H // Hkv, H // Hkv * L
    g = torch.Generator().manual_seed(0)
    acc = torch.randn(B, Hkv, nsplit, R, Ev, generator=g)
    mx = torch.randn(B, Hkv, nsplit, R, generator=g) * 3
    sm = torch.rand(B, Hkv, nsplit, R, generator=g) * 5 + 1
    scores = torch.randn(B, H, L, S, generator=g) * 3 - 1
    mx[:, :, 2] = float("-inf")  # a split that saw no key
    sm[:, :, 2], acc[:, :, 2] = 0.0, 0.0
    mx[0, 1, :, 4], sm[0, 1, :, 4], acc[0, 1, :, 4] = float("-inf"), 0.0, 0.0  # dead row
    scores[0, 1 * G + 4 // L, 4 % L] = float("-inf")
    mx[1, 0, 1, 3] = float("nan")  # a NaN row
    want = td.merge_splits(acc, mx, sm, scores, H, L, dtype, weights)
    BR = max(16, R)
    out = torch.empty(B, H, L, Ev, dtype=dtype)
    w = torch.empty(B, H, L, S, dtype=dtype) if weights is True else scores.clone()
    blocks = -(-S // td.MERGE_BLOCK_S) if weights else 1
    td._merge_kernel[(blocks * B * Hkv,)](
        acc, mx, sm, scores, out, w, H, Hkv, G, L, S, Ev, nsplit, blocks,
        WEIGHTS=bool(weights), BLOCK_R=BR, BLOCK_P=4, BLOCK_EV=32, BLOCK_S=td.MERGE_BLOCK_S,
    )  # fmt: skip
    # (bfloat16: one ulp apart, for the interpreter truncates float32 -> bfloat16 where torch
    # rounds to nearest)
    tol = {"rtol": 1e-6 if dtype == torch.float32 else 2**-7, "atol": 1e-6, "equal_nan": True}
    torch.testing.assert_close(out, want[0], **tol)
    assert out[0, 1 * G + 4 // L, 4 % L].eq(0).all()  # the dead row
    assert out[1, 0 * G + 3 // L, 3 % L].isnan().all()  # the NaN row
    if weights:
        got = w.mean(1, keepdim=True).to(dtype) if weights == "average" else w
        torch.testing.assert_close(got, want[1], **tol)


def test_decode_weights_of_a_row_a_huge_bias_covers_are_uniform():
    """Before: the merge wrote exp(s - lse) with lse = top + log(total), and finfo.min on every
    key of a row made top + log(total) == top: weights 1 each (the row summed to S), where the
    oracle (and the CPU path) give 1/S; the output, mean(V), was already right."""
    B, H, Hkv, L, S, E = 1, 4, 2, 2, 100, 16  # three splits
    q, k, v = inputs(B, H, Hkv, L, S, E, E, seed=5)
    bias = torch.zeros(L, S)
    bias[0] = torch.finfo(torch.float32).min  # row 0: every key
    bias[1, :30] = torch.finfo(torch.float32).min  # row 1: some keys (gone)
    ref_out, ref_w = oracle(q, k, v, bias, None)
    out, w = td.decode_attention(q, k, v, bias, None, return_weights=True)
    assert err(w, ref_w) < 1e-6 and err(out, ref_out) < 2e-6
    torch.testing.assert_close(w[0, :, 0].sum(-1), torch.ones(H))  # (was S)
    _, avg = td.decode_attention(q, k, v, bias, None, return_weights="average")
    assert err(avg, ref_w.mean(1, keepdims=True)) < 1e-6


@pytest.mark.parametrize("grad", [False, True])
def test_a_row_a_huge_bias_covers_gets_uniform_weights_and_gradients(grad):
    """Before: the forward kept lse = m + log(l), and finfo.min on every key of a row made it
    m: the weights kernels wrote exp(s - lse) = 1 for each key (the row summed to S, not 1)
    and the backward rebuilt P the same way (dV S times too large there)."""
    B, H, Hkv, L, S, E = 1, 4, 2, 40, 70, 16  # several 32 x 32 tiles
    q, k, v = inputs(B, H, Hkv, L, S, E, E, seed=6)
    bias = torch.zeros(L, S)
    bias[3] = torch.finfo(torch.float32).min  # every key
    bias[35, :50] = torch.finfo(torch.float32).min  # some keys
    ref_out, ref_w = oracle(q, k, v, bias, None)
    out, stats = ta.attention_forward(q, k, v, bias)
    assert err(out, ref_out) < 2e-6
    for average in (False, True):
        w = ta.attention_weights(q, k, stats, bias, average=average)
        want = ref_w.mean(1, keepdims=True) if average else ref_w
        assert err(w, want) < 1e-6, average
    if grad:
        from attnlab.functional.sdpa import _eager
        from attnlab.kernels.triton_backward import attention_backward

        up = torch.randn(B, H, L, E, generator=torch.Generator().manual_seed(1))
        got = attention_backward(q, k, v, out, stats, up, bias, None, E**-0.5, None, None)
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        ref = _eager(*leaves, bias.double(), None, E**-0.5, 0.0)[0]
        want = torch.autograd.grad(ref, leaves, up.double())
        for a, b in zip(got, want, strict=True):
            assert (a.double() - b).abs().max() < 1e-5


def test_decode_kernel_with_a_partly_filled_cache():
    """A static cache: keys past each row's fill are garbage the range must exclude."""
    B, H, Hkv, L, S, E = 2, 4, 2, 1, 128, 16
    q, k, v = inputs(B, H, Hkv, L, S, E, E)
    k[:, :, 90:] = 1e4  # unfilled slots: would dominate every score if read
    fill = torch.tensor([90, 40])
    start = torch.zeros(2, dtype=torch.long)
    out, w = td.decode_attention(q, k, v, None, None, None, (start, fill), return_weights=True)
    for b, n in enumerate(fill.tolist()):
        ref_out, ref_w = oracle(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], None, None)
        assert err(out[b : b + 1], ref_out) < 2e-6 and err(w[b : b + 1, ..., :n], ref_w) < 1e-6
        assert (w[b, ..., n:] == 0).all()


# --- the dispatch: under the interpreter, CPU tensors take the Triton kernels ---------------


def test_dispatch_runs_the_weights_through_triton_and_explains_it():
    q, k, v = inputs(2, 4, 2, 40, 45, 16, 16)
    d = attnlab.explain(q, k, v, is_causal="bottom_right", return_weights="average")
    assert d.path == "triton" and "interpreter" in str(d) and "averaged" in str(d)
    out, w = attnlab.scaled_dot_product_attention(
        q, k, v, is_causal="bottom_right", return_weights="average"
    )
    ref_out, ref_w = oracle(q, k, v, None, "bottom_right")
    assert err(out, ref_out) < 2e-6 and err(w, ref_w.mean(1)) < 1e-6


def test_dispatch_keeps_padding_from_lengths_and_explains_it():
    q, k, v = inputs(2, 4, 4, 20, 50, 16, 16)
    pad = masks.padding_mask([50, 17])
    d = attnlab.explain(q, k, v, pad)
    assert d.path == "triton" and "key ranges" in str(d)
    out = attnlab.scaled_dot_product_attention(q, k, v, pad)
    assert err(out, oracle(q, k, v, pad, None)[0]) < 2e-6


def test_dispatch_fills_a_weights_out_buffer():
    q, k, v = inputs(1, 2, 2, 33, 40, 16, 16)
    buf = torch.full((1, 2, 33, 40), float("nan"))
    with torch.no_grad():
        out, w = attnlab.scaled_dot_product_attention(q, k, v, return_weights=True, weights_out=buf)
    assert w is buf and err(buf, oracle(q, k, v, None, None)[1]) < 1e-6


def test_decode_with_weights_takes_the_decode_kernel():
    q, k, v = inputs(2, 6, 2, 1, 90, 16, 16)
    d = attnlab.explain(q, k, v, is_causal="bottom_right", return_weights=True)
    assert d.path == "triton" and "decode" in str(d)


@pytest.mark.parametrize(
    "case, path",
    [
        ("grad", "weights"),
        ("float64", "weights"),
        ("dropout", "cpu_flash"),
        ("plain", "fused"),
    ],
)
def test_what_the_kernels_do_not_take_keeps_the_existing_paths(case, path):
    dtype = F64 if case == "float64" else torch.float32
    q, k, v = inputs(1, 2, 2, 20, 20, 8, 8, dtype=dtype)
    if case == "grad":
        q.requires_grad_(True)
    weights = case in ("grad", "float64")
    d = attnlab.explain(
        q, k, v, dropout_p=0.1 if case == "dropout" else 0.0, return_weights=weights
    )
    assert d.path == path, d
    if weights:  # the fallback's result is still right
        out, w = attnlab.scaled_dot_product_attention(q, k, v, return_weights=True)
        ref_out, ref_w = oracle(q, k, v, None, None)
        assert err(out, ref_out) < 2e-6 and err(w, ref_w) < 1e-6


def test_nan_inputs_still_propagate_through_the_kernels():
    q, k, v = inputs(1, 2, 2, 20, 20, 8, 8)
    q[0, 1, 3, 0] = float("nan")
    out, w = attnlab.scaled_dot_product_attention(q, k, v, return_weights=True)
    assert out[0, 1, 3].isnan().all() and w[0, 1, 3].isnan().all()
    assert not out[0, 0].isnan().any() and not out[0, 1, 4].isnan().any()


@pytest.mark.parametrize("where", ["query", "key", "value"])
@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("structure", [False, True], ids=["dense mask", "ranges+causal"])
def test_nan_rows_come_from_the_weights_kernel_as_the_oracle_says(
    where, average, structure, monkeypatch
):
    """The two-pass weights path makes the NaN rule's rows NaN through the log-sum-exp (the
    kernel writes them), not by a second pass over the weights: same rows as the oracle. With
    padding kept as key ranges and causal, whole tiles are outside every row's keys: the kernel
    writes them without scores, and a NaN row must be NaN there too."""
    from attnlab.functional import sdpa

    def second_pass(*args, **kwargs):
        raise AssertionError("the weights were filled in a second pass")

    monkeypatch.setattr(sdpa, "propagate_nonfinite", second_pass)
    q, k, v = inputs(2, 4, 2, 40, 57, 8, 8)  # G * L = 80 rows: not a decode step
    t = {"query": q, "key": k, "value": v}[where]
    t[1, 1, 5, 2] = float("nan") if where != "value" else float("inf")
    pad = masks.padding_mask([57, 20])
    bool_mask = pad.as_subclass(torch.Tensor).clone()
    mask, causal = (pad, "top_left") if structure else (bool_mask, False)
    mode = "average" if average else True
    said = attnlab.explain(q, k, v, mask, is_causal=causal, return_weights=mode)
    assert said.path == "triton" and ("key ranges" in str(said)) == structure
    out, w = attnlab.scaled_dot_product_attention(
        q, k, v, mask, is_causal=causal, return_weights=mode
    )
    ref_out, ref_w = oracle(q, k, v, bool_mask, "top_left" if causal else None)
    ref_w = ref_w.mean(1) if average else ref_w  # (B, L, S) for 4-D inputs
    assert (out.isnan().numpy() == np.isnan(ref_out)).all()
    assert (w.isnan().numpy() == np.isnan(ref_w)).all() and w.isnan().any()
    finite = ~np.isnan(ref_w)
    assert abs(w.numpy()[finite] - ref_w[finite]).max() < 1e-6


# --- masks kept as structure: packed documents and sliding windows -------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_packed_documents_as_row_ranges_equal_the_document_mask(causal):
    docs = [7, 0, 40, 1, 25]  # T = 73: documents cross tile edges; an empty one
    T = sum(docs)
    q, k, v = inputs(2, 4, 2, T, T, 16, 16)
    m = masks.document_mask(docs)
    d = attnlab.explain(q, k, v, m, is_causal=causal, return_weights=True)
    assert d.path == "triton" and "packed documents" in str(d)
    out, w = attnlab.scaled_dot_product_attention(q, k, v, m, is_causal=causal, return_weights=True)
    ref_out, ref_w = oracle(q, k, v, m.as_subclass(torch.Tensor), "top_left" if causal else None)
    assert err(out, ref_out) < 2e-6 and err(w, ref_w) < 1e-6


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("causal", [False, True])
def test_sliding_window_as_a_band_equals_the_window_mask(alignment, causal):
    L, S = 50, 90
    q, k, v = inputs(1, 4, 1, L, S, 16, 16)
    m = masks.sliding_window_mask(L, S, window=21, alignment=alignment, causal=causal)
    d = attnlab.explain(q, k, v, m, return_weights="average")
    assert d.path == "triton" and "band" in str(d)
    out, w = attnlab.scaled_dot_product_attention(q, k, v, m, return_weights="average")
    ref_out, ref_w = oracle(q, k, v, m.as_subclass(torch.Tensor), None)
    assert err(out, ref_out) < 2e-6 and err(w, ref_w.mean(1)) < 1e-6
    _, w = attnlab.scaled_dot_product_attention(q, k, v, m, return_weights=True)  # per head
    assert err(w, ref_w) < 1e-6
    # with is_causal as well: the two bands intersect
    out = attnlab.scaled_dot_product_attention(q, k, v, m, is_causal=alignment)
    both = m.as_subclass(torch.Tensor) & masks.causal_keep(L, S, alignment, "cpu")
    assert err(out, oracle(q, k, v, both, None)[0]) < 2e-6


def test_decode_with_a_window_and_weights():
    q, k, v = inputs(2, 6, 2, 1, 120, 16, 16)
    m = masks.sliding_window_mask(1, 120, window=33, alignment="bottom_right")
    out, w = attnlab.scaled_dot_product_attention(q, k, v, m, return_weights=True)
    ref_out, ref_w = oracle(q, k, v, m.as_subclass(torch.Tensor), None)
    assert err(out, ref_out) < 2e-6 and err(w, ref_w) < 1e-6
    assert (w[..., : 120 - 33] == 0).all()


@pytest.mark.parametrize("mode", [True, "average"])
def test_under_assume_finite_the_weights_kernel_skips_the_nan_rule(mode, monkeypatch):
    """``attnlab.assume_finite()``: the Triton weights path neither screens the inputs nor
    sets NaN log-sum-exps (the row check would cost a read of Q, K, V on a GPU), and finite
    inputs give the same output and weights bit for bit."""
    from attnlab.functional import nonfinite

    q, k, v = inputs(*SHAPES[0])
    mask = make_mask("bool", 2, 4, 37, 53)
    assert attnlab.explain(q, k, v, mask, return_weights=mode).path == "triton"
    want = attnlab.scaled_dot_product_attention(q, k, v, mask, return_weights=mode)

    def check(*args, **kwargs):
        raise AssertionError("the inputs were checked")

    monkeypatch.setattr(nonfinite, "all_finite", check)
    monkeypatch.setattr(nonfinite, "nonfinite_rows", check)
    with attnlab.assume_finite():
        assert "assumed finite" in str(attnlab.explain(q, k, v, mask, return_weights=mode))
        got = attnlab.scaled_dot_product_attention(q, k, v, mask, return_weights=mode)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _edits():
    def setitem(m):
        m[0, ..., 40:] = False

    def through_view(m):
        m.view(-1)[:5] = False  # a view shares the mask's storage and its version counter

    def through_plain(m):
        masks.plain(m)[..., 0] = False

    def numpy_of_plain(m):  # (NumPy bypasses the version counters: plain() forgets)
        masks.plain(m).numpy()[..., 0] = False

    return {"setitem": setitem, "view": through_view, "plain": through_plain,
            "numpy of plain": numpy_of_plain,
            "logical_not_": lambda m: m.logical_not_()}  # fmt: skip


@pytest.mark.parametrize("edit", _edits())
@pytest.mark.parametrize("kind", ["padding", "window", "documents"])
def test_a_structured_mask_changed_in_place_is_read_as_it_now_is(kind, edit):
    """A mask of attnlab.masks remembers the structure it was built from, and the Triton
    kernels then skip key blocks outside it without reading the mask. Changed in place, the
    structure no longer says what it masks: the kernels read its values, as the oracle does.
    """
    B, H, L, S = 2, 2, 50, 50
    q, k, v = inputs(B, H, H, L, S, 8, 8)
    m = {
        "padding": lambda: masks.padding_mask([50, 23]),
        "window": lambda: masks.sliding_window_mask(L, window=7),
        "documents": lambda: masks.document_mask([20, 30]),
    }[kind]()
    assert masks.structure(m) != (None, None)
    assert "skip" in str(attnlab.explain(q, k, v, m, return_weights=True))
    _edits()[edit](m)
    assert masks.structure(m) == (None, None)
    assert "skip" not in str(attnlab.explain(q, k, v, m, return_weights=True))
    for weights in (True, False):
        got = attnlab.scaled_dot_product_attention(q, k, v, m, return_weights=weights)
        want = oracle(q, k, v, masks.plain(m).clone(), None)
        out = got[0] if weights else got
        np.testing.assert_allclose(out.numpy(), want[0], rtol=1e-5, atol=1e-5)
        if weights:
            np.testing.assert_allclose(got[1].numpy(), want[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("average", [False, True], ids=["per head", "averaged"])
@pytest.mark.parametrize("alignment", [None, "top_left"])
def test_torch_flash_as_the_first_pass_gives_the_oracle_weights(monkeypatch, average, alignment):
    """With torch's flash kernel as the weights' first pass (TORCH_PASS1_ON; on CPU tensors its
    CPU kernel, which returns the row log-sum-exp too), the weights kernels read its lse as
    (lse, 0) and give the oracle's weights; what it does not take keeps attnlab's forward."""
    monkeypatch.setattr(ta, "TORCH_PASS1_ON", ("cpu",))
    q, k, v = inputs(2, 4, 4, 61, 61 if alignment else 45, 16, 16)  # (L < S: the decode kernel)
    rw = "average" if average else True
    said = str(attnlab.explain(q, k, v, is_causal=alignment or False, return_weights=rw))
    assert "torch's flash kernel with row log-sum-exp" in said
    out, w = attnlab.scaled_dot_product_attention(
        q, k, v, is_causal=alignment or False, return_weights=rw
    )
    want_out, want_w = oracle(q, k, v, None, alignment)
    want_w = want_w.mean(1) if average else want_w
    np.testing.assert_allclose(np64(w), want_w, rtol=0, atol=1e-6)
    np.testing.assert_allclose(np64(out), want_out, rtol=0, atol=1e-5)
    for refused in (  # a mask, GQA, E != Ev: attnlab's own forward
        (q, k, v, make_mask("bool", 2, 4, 61, k.shape[2])),
        (q, k[:, :2], v[:, :2], None),
        (q, k, v[..., :8], None),
    ):
        said = str(attnlab.explain(*refused, return_weights=True))
        assert "triton" in said and "forward with row log-sum-exp" in said
