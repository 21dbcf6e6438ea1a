"""The Triton attention backward (dK/dV and dQ kernels) through the interpreter.

Gradients are compared with autograd of the readable reference in float64
(``triton_attention.reference``, itself checked against the NumPy oracle in the forward tests);
the tolerance is a control: autograd of the naive formula in the kernel's dtype, against the
same float64 gradients, times two, plus a rounding floor.
"""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab.kernels import triton_attention as ta
from attnlab.kernels.triton_backward import TritonAttention

F64 = torch.float64
SHAPES = [(2, 4, 2, 37, 53, 24, 40), (1, 4, 1, 45, 33, 16, 16)]  # (B, H, Hkv, L, S, E, Ev)


def grads(fn, q, k, v, g, dtype):
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    fn(*leaves).backward(g.to(dtype))
    return [t.grad.double() for t in leaves]


def check(q, k, v, mask, alignment, key_range, dtype, floor, band=None):
    g = torch.randn(
        *q.shape[:-1], v.shape[-1], dtype=F64, generator=torch.Generator().manual_seed(5)
    )
    cast = lambda m, d: m.to(d) if m is not None and m.is_floating_point() else m  # noqa: E731
    exact = grads(
        lambda *t: ta.reference(*t, cast(mask, F64), alignment, None, key_range, band)[0],
        q, k, v, g, F64,
    )  # fmt: skip
    naive = grads(
        lambda *t: ta.reference(*t, cast(mask, dtype), alignment, None, key_range, band)[0],
        q, k, v, g, dtype,
    )  # fmt: skip
    got = grads(
        lambda *t: TritonAttention.apply(*t, cast(mask, dtype), alignment, None, key_range, band),
        q, k, v, g, dtype,
    )  # fmt: skip
    for name, e, n, a in zip("qkv", exact, naive, got, strict=True):
        tol = 2 * (n - e).abs().max().item() + floor
        assert (a - e).abs().max().item() <= tol, (name, (a - e).abs().max().item(), tol)
        assert torch.isfinite(a).all()


def inputs(B, H, Hkv, L, S, E, Ev, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((B, H, L, E), (B, Hkv, S, E), (B, Hkv, S, Ev))
    return [torch.randn(*s, generator=gen, dtype=F64) for s in shapes]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
@pytest.mark.parametrize("alignment", [None, "top_left", "bottom_right"])
def test_gradients_float32(shape, mask_kind, alignment):
    B, H, Hkv, L, S, E, Ev = shape
    q, k, v = inputs(*shape)
    gen = torch.Generator().manual_seed(1)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(B, 1, L, S, generator=gen) > 0.3
        mask[0, 0, L // 2] = False  # a dead row: zero, finite gradients
    elif mask_kind == "float":
        mask = torch.randn(1, H, L, S, generator=gen, dtype=F64)
    check(q, k, v, mask, alignment, None, torch.float32, 5e-6)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("alignment", [None, "top_left"])
def test_gradients_with_padding_as_key_ranges(side, alignment):
    q, k, v = inputs(3, 4, 2, 40, 40, 16, 24)
    pad = masks.padding_mask([40, 19, 0], side=side)
    check(q, k, v, None, alignment, pad.key_range, torch.float32, 5e-6)


def test_gradients_bfloat16_against_a_bfloat16_control():
    q, k, v = inputs(2, 4, 2, 37, 53, 32, 32)
    check(q, k, v, None, "bottom_right", None, torch.bfloat16, 1e-2)


def test_training_with_padding_from_lengths_takes_the_kernels_end_to_end():
    q, k, v = inputs(2, 4, 2, 30, 30, 16, 16)
    pad = masks.padding_mask([30, 11])
    leaves = [t.float().requires_grad_(True) for t in (q, k, v)]
    d = attnlab.explain(*leaves, pad, is_causal=True)
    assert d.path == "triton" and "backward" in str(d)
    out = attnlab.scaled_dot_product_attention(*leaves, pad, is_causal=True)
    out.square().sum().backward()
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    r = attnlab.reference.scaled_dot_product_attention(
        *(t.detach().numpy() for t in ref), pad.numpy(), is_causal=True
    )
    assert abs(out.detach().double().numpy() - r).max() < 2e-6
    ta.reference(*ref, pad, "top_left")[0].square().sum().backward()
    for a, e in zip(leaves, ref, strict=True):
        assert (a.grad.double() - e.grad).abs().max() < 1e-5


def test_gradients_with_packed_documents_and_a_window():
    q, k, v = inputs(2, 4, 2, 51, 51, 16, 16)
    docs = masks.document_mask([20, 1, 30])
    check(q, k, v, None, "top_left", docs.key_range, torch.float32, 5e-6)
    window = masks.sliding_window_mask(51, 51, window=9, alignment="top_left")
    check(q, k, v, None, None, None, torch.float32, 5e-6, band=window.band)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_wide_windows_whose_middle_holds_whole_tiles(alignment, causal):
    """A band wider than the tiles: tiles in its middle are seen whole by every row and run
    without a mask (the kernels' interior loops), those on its edges with it."""
    q, k, v = inputs(1, 2, 1, 150, 170, 16, 16, seed=3)
    m = masks.sliding_window_mask(150, 170, window=70, alignment=alignment, causal=causal)
    check(q, k, v, None, None, None, torch.float32, 5e-6, band=m.band)
    check(q, k, v, None, alignment, None, torch.float32, 5e-6, band=m.band)  # and causal
    out, lse = ta.attention_forward(q.float(), k.float(), v.float(), band=m.band)
    ref, ref_lse, _ = ta.reference(q, k, v, m.as_subclass(torch.Tensor))
    assert (out.double() - ref).abs().max() < 1e-5
    assert (ta.row_lse(lse).double() - ref_lse).abs().max() < 1e-5


def test_an_infinite_key_no_row_attends_gets_finite_gradients():
    """Key 5 holds +inf and every real query scores it -inf (weight 0): its dK, dV are the
    reference's, not NaN from the rows past L of a partial query block (q = 0 there, 0 * inf)."""
    q, k, v = inputs(1, 1, 1, 33, 40, 16, 8)
    q[..., 0] = -q[..., 0].abs() - 0.1
    k[0, 0, 5, 0] = float("inf")
    leaves = [t.float().requires_grad_(True) for t in (q, k, v)]
    out = TritonAttention.apply(*leaves, None, None, None, None, None)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    dk, dv = leaves[1].grad[0, 0, 5], leaves[2].grad[0, 0, 5]
    assert torch.isfinite(out).all() and (dk == 0).all() and (dv == 0).all()


@pytest.mark.parametrize("window", [2**31 - 1, 2**31 - 40, 2**40])
def test_a_window_wider_than_int32_is_no_window(window):
    q, k, v = inputs(1, 2, 2, 40, 40, 16, 16)
    band = masks.sliding_window_mask(40, 40, window=window, causal=False).band
    check(q, k, v, None, None, None, torch.float32, 5e-6, band=band)
    out, _ = ta.attention_forward(q.float(), k.float(), v.float(), band=band)
    assert (out.double() - ta.reference(q, k, v)[0]).abs().max() < 1e-5


def test_saturated_rows_keep_their_small_bf16_gradients():
    """A row whose softmax puts nearly all its weight on one key has tiny dQ and dK: the row
    term delta = rowsum(dO * O) must cancel dP almost exactly. From the bf16-rounded output it
    was off by ~2**-9 |dO| |O|: dQ, dK errors of 100x their own size (0.023 for |dQ| 1.9e-4).
    Bound: the readable reference in bf16 (its products in fp32) times 16, for the kernels'
    bf16 rounding of P and dS in their products, which the interpreter truncates (twice a
    GPU's rounding error)."""
    torch.manual_seed(0)
    q, k = ((3 * torch.randn(1, 1, 2, 32)).bfloat16().double() for _ in range(2))
    v, g = (torch.randn(1, 1, 2, 32).bfloat16().double() for _ in range(2))
    exact = grads(lambda *t: ta.reference(*t)[0], q, k, v, g, F64)
    control = grads(lambda *t: ta.reference(*t)[0], q, k, v, g, torch.bfloat16)
    got = grads(lambda *t: TritonAttention.apply(*t, None, None, None, None), q, k, v, g,
                torch.bfloat16)  # fmt: skip
    weights = ta.reference(q, k, v)[2]
    assert weights.max(-1).values.min() > 0.9999  # saturated rows, as claimed
    for name, e, c, a in list(zip("qk", exact, control, got, strict=False)):
        bound = 16 * (c - e).abs().max().item()
        assert (a - e).abs().max().item() <= bound, (name, (a - e).abs().max().item(), bound)
