"""Mask builders: values, alignment, combinators, the picture, and the NumPy twins."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnlab.functional as AF
import attnlab.reference as R
from attnlab import masks


def test_causal_alignments():
    tl = masks.causal_mask(3, 5, alignment="top_left")
    br = masks.causal_mask(3, 5, alignment="bottom_right")
    assert tl.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]
    assert br.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert torch.equal(masks.causal_mask(4), torch.ones(4, 4, dtype=torch.bool).tril())
    # bottom-right with L > S: the first L - S queries see nothing
    assert masks.causal_mask(4, 2, alignment="bottom_right").sum(-1).tolist() == [0, 0, 1, 2]


def test_sliding_window():
    m = masks.sliding_window_mask(5, window=3)
    assert m.sum(-1).tolist() == [1, 2, 3, 3, 3]
    assert m[4].tolist() == [False, False, True, True, True]
    both = masks.sliding_window_mask(5, window=2, causal=False)
    assert both[2].tolist() == [False, True, True, True, False]
    br = masks.sliding_window_mask(2, 6, window=3, alignment="bottom_right")
    assert br.tolist() == [[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1]]
    # a window covering everything is the causal mask
    assert torch.equal(masks.sliding_window_mask(6, window=6), masks.causal_mask(6))


def test_padding_right_and_left():
    r = masks.padding_mask([2, 4], 5)
    assert r.shape == (2, 1, 1, 5)
    assert r[:, 0, 0].tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 0]]
    left = masks.padding_mask([2, 4], 5, side="left")
    assert left[:, 0, 0].tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 1, 1]]
    kpm = torch.tensor([[True, False]])
    assert masks.expand_key_padding(kpm).shape == (1, 1, 1, 2)


def test_combinators_and_additive():
    c = masks.causal_mask(4)
    p = masks.padding_mask([3], 4)
    both = masks.and_masks(c, p)
    assert both.shape == (1, 1, 4, 4)
    assert both[0, 0, 3].tolist() == [True, True, True, False]
    either = masks.or_masks(c, ~masks.causal_mask(4))
    assert either.all()
    bias = masks.to_additive(c)
    assert bias.dtype == torch.float32
    assert torch.all(bias[c] == 0) and torch.all(bias[~c] == float("-inf"))
    assert torch.equal(masks.to_bool(bias), c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_to_bool_reads_the_dtype_min_as_masked(dtype):
    # before: Hugging Face's and torch's mask value, finfo(dtype).min, read as "may attend":
    # to_bool gave all True, show() drew every cell attendable, and attention through the
    # converted mask let every query read the padding
    keep = masks.padding_mask([2, 4], 4)[:, 0, 0, :]  # (2, 4)
    bias = torch.zeros(2, 4, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)
    assert torch.equal(masks.to_bool(bias), keep)
    assert masks.to_bool(torch.tensor([-1e9, -1e4, 0.0, float("-inf")])).tolist() == [
        True,
        True,
        True,
        False,
    ]  # smaller biases still may attend
    picture = masks.show(bias).splitlines()[1:]  # the two rows, after the header
    assert [row.split() for row in picture] == [["■", "■", "·", "·"], ["■", "■", "■", "■"]]


def test_mask_prints_as_picture_and_stays_a_plain_tensor():
    m = masks.causal_mask(3, 5, alignment="bottom_right")
    text = repr(m)
    assert text.splitlines()[1:] == ["  ■ ■ ■ · ·", "  ■ ■ ■ ■ ·", "  ■ ■ ■ ■ ■"]
    assert str(m) == text and "True = may attend" in text
    out = m & torch.ones(3, 5, dtype=torch.bool)
    assert type(out) is torch.Tensor  # operations return ordinary tensors
    big = masks.causal_mask(100)
    assert "…" in repr(big) and len(repr(big).splitlines()) < 30
    assert "Additive bias" in masks.show(masks.to_additive(m))


@pytest.mark.parametrize(
    "L,S,alignment",
    [(4, 4, None), (3, 6, "bottom_right"), (3, 6, "top_left"), (6, 3, "bottom_right")],
)
def test_numpy_twins(L, S, alignment):
    np.testing.assert_array_equal(
        masks.causal_mask(L, S, alignment=alignment).numpy(),
        R.causal_mask(L, S, alignment=alignment),
    )
    for causal in (True, False):
        np.testing.assert_array_equal(
            masks.sliding_window_mask(L, S, window=2, alignment=alignment, causal=causal).numpy(),
            R.sliding_window_mask(L, S, window=2, alignment=alignment, causal=causal),
        )
    for side in ("left", "right"):
        np.testing.assert_array_equal(
            masks.padding_mask([1, 3], 4, side=side).numpy(),
            R.padding_mask([1, 3], 4, side=side),
        )


def test_restrict_limits_bool_masks_and_biases_to_the_allowed_keys():
    allowed = torch.tensor([True, True, False])
    causal = masks.causal_mask(2, 3, alignment="bottom_right")  # rows: keys 0-1, keys 0-2
    got = masks.restrict(causal, allowed)
    assert got.dtype == torch.bool
    assert got.tolist() == [[True, True, False], [True, True, False]]
    bias = torch.tensor([[0.5, -1.0, 2.0], [0.0, 3.0, 1.0]])
    limited = masks.restrict(bias, allowed)
    assert limited[:, :2].tolist() == bias[:, :2].tolist()  # kept where allowed
    assert torch.isneginf(limited[:, 2]).all()
    assert masks.restrict(None, allowed) is allowed and masks.restrict(bias, None) is bias


def test_document_mask_is_block_diagonal_and_equals_the_oracle():
    m = masks.document_mask([2, 0, 3])
    np.testing.assert_array_equal(m.numpy(), R.document_mask([2, 0, 3]))
    assert m.tolist()[1] == [True, True, False, False, False]
    assert m.tolist()[4] == [False, False, True, True, True]
    start, end = m.key_range  # (1, T): each query's document span
    assert start.tolist() == [[0, 0, 2, 2, 2]] and end.tolist() == [[2, 2, 5, 5, 5]]
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        masks.document_mask([2, -1])


def test_structure_carried_by_masks_describes_the_same_mask():
    """The key ranges and bands kernels use instead of the mask say exactly what it says."""
    pad = masks.padding_mask([3, 5], 6, side="left")
    start, end = pad.key_range
    j = torch.arange(6)
    same = (j >= start[:, None]) & (j < end[:, None])
    assert torch.equal(pad[:, 0, 0], same)
    for alignment, (L, S) in (("top_left", (4, 7)), ("bottom_right", (4, 7))):
        for causal in (True, False):
            m = masks.sliding_window_mask(L, S, window=3, alignment=alignment, causal=causal)
            offset, lo, hi = m.band
            d = torch.arange(S)[None, :] - (torch.arange(L)[:, None] + offset)
            assert torch.equal(m.as_subclass(torch.Tensor), (d >= lo) & (d <= hi))
    assert not hasattr(masks.and_masks(pad, pad), "key_range")  # operations drop it
    # uint8 lengths with S beyond 255: left padding's S - length wrapped (a RuntimeError)
    left = masks.padding_mask(torch.tensor([5, 200], dtype=torch.uint8), 300, side="left")
    assert left.sum((1, 2, 3)).tolist() == [5, 200] and left[1, 0, 0, 100:].all()
    # lengths of any integer type give a band of Python ints (a numpy or 0-d tensor length
    # reached the Triton kernels' arguments and crashed them)
    for L, S in ((np.int64(4), np.int64(7)), (torch.tensor(4), torch.tensor(7))):
        band = masks.sliding_window_mask(L, S, window=3, alignment="bottom_right").band
        assert band == (3, -2, 0) and all(type(x) is int for x in band)


def test_explain_says_why_the_triton_kernels_do_not_serve_cpu_tensors():
    import attnlab

    q = torch.randn(1, 2, 5, 8)
    d = attnlab.explain(q, q, q, masks.padding_mask([3], 5))
    assert d.path == "fused" and "not the Triton kernels: CPU tensors" in str(d)
    d = attnlab.explain(q, q, q, return_weights=True)
    assert d.path == "weights" and "TRITON_INTERPRET=1" in str(d)


def test_the_remembered_structure_is_dropped_when_the_mask_changes_in_place():
    """Kernels skip key blocks from a mask's remembered structure (tests/triton/ checks the
    results); once the mask is changed in place, in any way, it has none."""
    for build in (
        lambda: masks.padding_mask([5, 3]),
        lambda: masks.sliding_window_mask(6, window=2),
        lambda: masks.document_mask([2, 4]),
    ):
        m = build()
        assert masks.structure(m) != (None, None)
        clone = m.clone()  # (a plain tensor: no structure of its own)
        assert masks.structure(clone) == (None, None)
        m.view(-1)[0] = True  # a write through a view
        assert masks.structure(m) == (None, None)
        m = build()
        m &= m  # same values, but written: the mask alone now says what it masks
        assert masks.structure(m) == (None, None)


def test_masks_built_under_inference_mode_work_and_are_read_by_their_values():
    """Under torch.inference_mode() tensors have no version counter, so building a structured
    mask raised (RuntimeError from its version check). It now builds, and its structure is not
    trusted (a change could not be seen): the call reads its values, with the same result."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 6, 8, generator=g)
    k = torch.randn(2, 2, 6, 8, generator=g)
    builders = {
        "padding": lambda: masks.padding_mask([3, 6], 6),
        "window": lambda: masks.sliding_window_mask(6, 6, window=2),
        "documents": lambda: masks.document_mask([2, 4]),
    }
    for name, build in builders.items():
        want = AF.scaled_dot_product_attention(q, k, k, build())
        with torch.inference_mode():
            mask = build()
            assert masks.structure(mask) == (None, None), name
            got = AF.scaled_dot_product_attention(q, k, k, mask)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_structure_is_never_trusted_after_a_change_it_cannot_see():
    # before: padding_mask kept the caller's lengths (a later edit of them changed the ranges
    # kernels skip by); copy.copy of a changed mask and writes through .data brought the old
    # structure back; writes through .numpy() went unseen
    import copy

    lengths = torch.tensor([3, 8])
    m = masks.padding_mask(lengths, max_length=8)
    lengths[0] = 8
    assert masks.structure(m)[0][1].tolist() == [3, 8]
    array = np.array([3, 8])
    m = masks.padding_mask(array, max_length=8)
    array[0] = 8
    assert masks.structure(m)[0][1].tolist() == [3, 8]

    m = masks.padding_mask([3, 8], max_length=8)
    m[0, ..., 5] = True
    c = copy.copy(m)
    assert masks.structure(c) == (None, None)
    assert torch.equal(masks.plain(c), masks.plain(m))
    m = masks.padding_mask([3, 8], max_length=8)
    m.data[0, ..., 3:] = True
    assert masks.structure(m) == (None, None)
    assert m[0, 0, 0].tolist() == [True] * 8
    m = masks.padding_mask([3, 8], max_length=8)
    with pytest.raises(ValueError, match="read-only"):
        m.numpy()[0, 0, 0, 5] = True
    assert masks.structure(m) != (None, None)
    # the tensor of plain() or .data shares the memory: a NumPy write through it bypasses the
    # version counters, so handing it out forgets the structure (before: the Triton kernels
    # skipped the keys it opened, 1.36 off the oracle)
    for reach in (masks.plain, lambda m: m.data):
        m = masks.padding_mask([3, 8], max_length=8)
        reach(m).numpy()[0, 0, 0, 5] = True
        assert masks.structure(m) == (None, None)
        assert m[0, 0, 0].tolist() == [True] * 3 + [False] * 2 + [True] + [False] * 2
    m = masks.padding_mask([3, 8], max_length=8)
    masks.plain(m.clone())  # a copy: the mask keeps its structure
    assert masks.structure(m)[0][1].tolist() == [3, 8]


def test_a_mask_read_through_dlpack_has_its_values():
    # before: a Mask has no storage of its own; np.from_dlpack read garbage, torch's crashed
    m = masks.causal_mask(5, 7, alignment="bottom_right")
    want = masks.plain(m).numpy()
    assert np.array_equal(np.from_dlpack(m), want)
    assert np.array_equal(torch.from_dlpack(m).numpy(), want)


@pytest.mark.parametrize("op", ["t_", "unsqueeze_", "transpose_", "squeeze_"])
def test_an_in_place_reshape_of_a_mask_is_refused(op):
    # before: the wrapper kept its old shape over data of the new one: later calls failed with
    # errors naming the old shape
    m = masks.causal_mask(2, 3, alignment="top_left")
    args = {"t_": (), "unsqueeze_": (0,), "transpose_": (0, 1), "squeeze_": ()}[op]
    with pytest.raises(TypeError, match=rf"{op} \(an in-place reshape\).*\(2, 3\)"):
        getattr(m, op)(*args)
    assert m.shape == masks.plain(m).shape == (2, 3)
    out_of_place = getattr(m, op.rstrip("_"))(*args)
    assert type(out_of_place) is torch.Tensor
