"""The kernels address tensors of more than 2**31 elements correctly.

Offsets such as ``b * stride_b`` overflow 32-bit integers in tensors past 2**31 elements (a
KV cache of 128 x 8 x 32k x 128, a bool mask of 8 x 32 x 4096 x 4096): a kernel computing them
in int32 reads and writes wrapped addresses, a crash or a silently wrong result. So each
kernel takes its per-program base offsets in int64 and its in-tile offsets in int32, and the
dispatch refuses inputs whose tile offsets within one head could pass 2**31.

Testing that without gigabytes: the inputs are views whose batch rows lie 2**30 elements apart
in one lazily allocated storage (6 GiB of address space; only the pages written are backed),
so batch row 2 starts 2**31 elements in. The interpreter computes addresses with NumPy int32,
so it wraps exactly as a compiled kernel would. Each result must equal, bit for bit, the same
kernel on compact copies of the same inputs.
"""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.functional import _triton as dispatch
from attnlab.kernels import triton_additive as tadd
from attnlab.kernels import triton_attention as ta
from attnlab.kernels import triton_backward as tb
from attnlab.kernels import triton_decode as td

WIDE = 2**30  # elements between batch rows: row 2 starts at 2**31, past int32
B, H, HKV, L, S, E = 3, 4, 2, 40, 70, 16
DT = torch.float16


@pytest.fixture(scope="module")
def storage():
    store = torch.empty(B * WIDE, dtype=DT)  # address space only, until written
    yield store
    del store


def spread(t: torch.Tensor, store: torch.Tensor, at: int) -> torch.Tensor:
    """A copy of t (B, ...) in ``store`` whose batch rows lie WIDE elements apart."""
    inner = t[0].contiguous().stride()
    view = store.as_strided(t.shape, (WIDE, *inner), at)
    view.copy_(t)
    return view


def wide_inputs(store, L=L):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, n, E, generator=g).to(DT) for h, n in ((H, L), (HKV, S), (HKV, S)))
    mask = torch.rand(B, H, L, S, generator=g) > 0.2
    mask[1, 2, L - 1] = False  # a dead row
    sizes = [q[0].numel(), k[0].numel()]
    wq = spread(q, store, 0)
    wk = spread(k, store, sizes[0])
    wv = spread(v, store, sizes[0] + sizes[1])
    masks = torch.empty(B * WIDE, dtype=torch.bool)
    wm = masks.as_strided(mask.shape, (WIDE, *mask[0].stride()), 0)
    wm.copy_(mask)
    assert wq.stride(0) == WIDE and wq[2].storage_offset() >= 2**31
    return (wq, wk, wv, wm), (q, k, v, mask), masks


@pytest.mark.parametrize("alignment", [None, "bottom_right"])
def test_forward_weights_and_backward_past_two_to_the_31(storage, alignment):
    (wq, wk, wv, wm), (q, k, v, mask), _keep = wide_inputs(storage)
    out, lse = ta.attention_forward(wq, wk, wv, wm, alignment)
    ref, ref_lse = ta.attention_forward(q, k, v, mask, alignment)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert out[2].abs().sum() > 0  # batch row 2 computed, not left empty

    for average in (False, True):
        w = ta.attention_weights(wq, wk, lse, wm, alignment, average=average)
        assert torch.equal(w, ta.attention_weights(q, k, ref_lse, mask, alignment, average=average))

    grad = torch.randn_like(ref)
    got = tb.attention_backward(wq, wk, wv, out, lse, grad, wm, alignment, E**-0.5, None, None)
    want = tb.attention_backward(q, k, v, ref, ref_lse, grad, mask, alignment, E**-0.5, None, None)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_decode_kernel_past_two_to_the_31(storage):
    (wq, wk, wv, wm), (q, k, v, mask), _keep = wide_inputs(storage, L=2)
    got = td.decode_attention(wq, wk, wv, wm, "bottom_right", return_weights=True)
    want = td.decode_attention(q, k, v, mask, "bottom_right", return_weights=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0][2].abs().sum() > 0


def test_public_call_on_wide_views_equals_compact_inputs(storage):
    (wq, wk, wv, wm), (q, k, v, mask), _keep = wide_inputs(storage)
    assert attnlab.explain(wq, wk, wv, attn_mask=wm, return_weights=True).path == "triton"
    got = attnlab.scaled_dot_product_attention(wq, wk, wv, attn_mask=wm, return_weights=True)
    want = attnlab.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_weights=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_additive_kernel_reads_a_wide_mask(storage):
    N, La, Sa, A, DV = B, 20, 33, 8, 16
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(N, La, A, generator=g), torch.randn(N, Sa, A, generator=g)
    w, value = torch.randn(A, generator=g), torch.randn(N, Sa, DV, generator=g)
    mask = torch.rand(N, La, Sa, generator=g) > 0.3
    store = torch.empty(N * WIDE, dtype=torch.bool)
    wide = store.as_strided(mask.shape, (WIDE, Sa, 1), 0)
    wide.copy_(mask)
    got = tadd.additive_attention(a, b, w, value, wide)
    assert torch.equal(got, tadd.additive_attention(a, b, w, value, mask))


def test_a_head_whose_offsets_pass_int32_keeps_the_existing_path():
    """Offsets within one head stay 32-bit (registers): such inputs are refused, not wrapped."""
    q = torch.zeros(1, 1, 1, E).expand(1, 1, 50_000, E)  # stride 0: no memory
    k = torch.zeros(1, 1, 1, E).expand(1, 1, 50_000, E)
    why = dispatch.unfit(q, k, k, None, 0.0, False, return_weights=True)
    assert why is not None and "2**31" in why and "50000" in why
    assert dispatch.unfit(q, k, k, None, 0.0, False) is None  # no weights: fine

    store = torch.empty(3 * WIDE, dtype=DT)
    tall = store.as_strided((1, 1, 3, E), (0, 0, WIDE, 1))  # rows 2**30 apart within one head
    why = ta.supports(tall, tall, tall, None)
    assert why is not None and "query" in why and "2**31" in why
    d = attnlab.explain(tall, tall, tall, return_weights=True)
    assert d.path != "triton" and any("2**31" in r for r in d.reasons), d


def test_contiguous_results_past_int32_per_head_keep_the_existing_path():
    """out, dQ, dK, dV are contiguous (L or S, E or Ev) per head, addressed in int32 within it."""
    long = torch.zeros(1, 1, 1, 256).expand(1, 1, 2**23 + 1, 256)  # stride 0: no memory
    short = torch.zeros(1, 1, 4, 256)
    why = ta.supports(long, short, short, None)
    assert why is not None and "8388609 x 256" in why and "2**31" in why
    assert ta.supports(short, long, long, None) is not None  # (S, Ev) of dK, dV
    q = torch.zeros(1, 2**20, 4)
    assert tadd.supports(q, q, q, None, A=4096) is not None  # (A, L) of the projections
    assert tadd.supports(q, q, q, None, A=64) is None
