"""The interpreter contract: with TRITON_INTERPRET=1 set before attnlab is imported, Triton
kernels serve CPU tensors (and ``explain()`` will say so)."""

import torch

from attnlab.kernels import _triton


def test_interpreter_is_on_and_serves_cpu_tensors():
    assert _triton.INTERPRET
    assert _triton.unfit(torch.zeros(2), torch.zeros(2)) is None
    assert "interpreter" in _triton.where()


def test_mixed_devices_are_refused_with_a_reason():
    assert "meta" in _triton.unfit(torch.zeros(1), torch.zeros(1, device="meta"))


def test_key_padding_alone_goes_to_sdpa_where_it_was_measured_faster(monkeypatch):
    """On CUDA, key padding alone (no weights, no window) in training takes torch's SDPA with
    the dense mask (measured faster on an H100 and an H200), except causal from 4,096 query
    rows; without gradients, weights and windows keep the kernels (measured faster). The rule
    is keyed by device type, so CPU tensors under the interpreter stand in for CUDA ones."""
    import attnlab
    from attnlab import masks
    from attnlab.functional import _triton as dispatch

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 16, generator=g) for _ in range(3))
    pad = masks.padding_mask([9, 4])
    window = masks.sliding_window_mask(9, 9, window=3)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    expected = attnlab.scaled_dot_product_attention(qg, kg, vg, pad)  # the kernels (interpreter)
    expected.backward(torch.ones_like(expected))
    want = [x.grad for x in (qg, kg, vg)]
    assert attnlab.explain(qg, kg, vg, pad).path == "triton"

    monkeypatch.setattr(dispatch, "SDPA_SERVES_PADDING_ON", ("cpu", "cuda"))
    said = attnlab.explain(qg, kg, vg, pad)
    assert said.path == "fused" and any("key padding alone" in r for r in said.reasons)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    got = attnlab.scaled_dot_product_attention(qg, kg, vg, pad)
    got.backward(torch.ones_like(got))
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-6)
    for x, w in zip((qg, kg, vg), want, strict=True):
        torch.testing.assert_close(x.grad, w, rtol=0, atol=1e-5)
    assert attnlab.explain(q, k, v, pad).path == "triton"  # no gradient: the kernels
    assert attnlab.explain(qg, kg, vg, pad, is_causal=True).path == "fused"
    long = [torch.zeros(1, 2, 4096, 16, requires_grad=True) for _ in range(3)]
    long_pad = masks.padding_mask([4000], 4096)
    assert attnlab.explain(*long, long_pad).path == "fused"
    assert attnlab.explain(*long, long_pad, is_causal=True).path == "triton"
    assert attnlab.explain(q, k, v, pad, return_weights=True).path == "triton"
    assert attnlab.explain(q, k, v, window).path == "triton"
    assert attnlab.explain(q, k, v, masks.document_mask([5, 4])).path == "triton"


def test_a_structured_masks_ranges_reach_the_kernels_without_a_copy_per_call():
    """The kernels read int32 ranges: a padding or document mask keeps them so, and a call
    passes views of them (before: two conversions, two launches, at every call)."""
    from attnlab import masks
    from attnlab.kernels import triton_attention as ta

    q = torch.zeros(2, 4, 9, 16)
    for mask in (masks.padding_mask(torch.tensor([9, 4])), masks.document_mask([5, 4])):
        start, end = mask.key_range
        _, s, e, *_ = ta._range_args(mask.key_range, q)
        assert s.data_ptr() == start.data_ptr() and e.data_ptr() == end.data_ptr()
