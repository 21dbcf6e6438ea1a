"""The NaN rule's row check in Triton (attnlab.kernels.triton_nonfinite) against its torch-ops
reference and the float64 oracle's rows, through the interpreter."""

import pytest
import torch

import attnlab
from attnlab.functional import nonfinite
from attnlab.kernels import triton_nonfinite as tn
from attnlab.reference.attention import _nonfinite_rows as oracle_rows

# the interpreter computes inf - inf in NumPy, which warns: that NaN is the point
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def poisoned(B, H, Hkv, L, S, E, Ev, dtype, seed):
    """Random q, k, v with a few NaN / +inf / -inf entries, some rows and heads left clean."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, e, generator=g).to(dtype) for h, n, e in (
        (H, L, E), (Hkv, S, E), (Hkv, S, Ev)))  # fmt: skip
    for t in (q, k, v):
        for bad in (float("nan"), float("inf"), float("-inf")):
            if torch.rand(1, generator=g) < 0.5 and t.numel():
                t.view(-1)[torch.randint(t.numel(), (1,), generator=g)] = bad
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "shape",
    [(2, 4, 2, 70, 150, 16, 24), (1, 6, 1, 1, 300, 8, 8), (3, 2, 2, 130, 1, 40, 16)],
    ids=str,
)
def test_rows_equal_the_torch_reference_and_the_oracle(shape, dtype):
    for seed in range(6):
        q, k, v = poisoned(*shape, dtype, seed)
        got = tn.nonfinite_rows(q, k, v)
        assert got.shape == (*q.shape[:3], 1) and got.dtype == torch.bool
        assert torch.equal(got, nonfinite.rows_in_torch_ops(q, k, v)), seed
        assert (got.numpy() == oracle_rows(q.float().numpy(), k.float().numpy(),
                                           v.float().numpy())).all(), seed  # fmt: skip


def test_one_bad_key_reaches_exactly_the_query_heads_of_its_group():
    q, k, v = (torch.randn(2, 6, n, 8) for n in (5, 9, 9))
    k, v = k[:, :3], v[:, :3]  # G = 2: kv head 1 serves query heads 2 and 3
    v[1, 1, 7, 3] = float("inf")
    q[0, 5, 2, 0] = float("nan")
    bad = tn.nonfinite_rows(q, k, v)[..., 0]
    expected = torch.zeros(2, 6, 5, dtype=torch.bool)
    expected[1, 2:4] = True
    expected[0, 5, 2] = True
    assert torch.equal(bad, expected)


def test_strided_views_and_a_caches_verdict():
    """(B, L, H, E) storage read through transposed views; ``kv_finite`` skips K and V."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 33, 4, 16, generator=g).transpose(1, 2)  # (B, H, L, E) view
    k = torch.randn(2, 70, 2, 16, generator=g).transpose(1, 2)
    v = torch.randn(2, 70, 2, 16, generator=g).transpose(1, 2)
    k[1, 0, 69, 15] = float("nan")
    q[0, 3, 32, 0] = float("-inf")
    assert torch.equal(tn.nonfinite_rows(q, k, v), nonfinite.rows_in_torch_ops(q, k, v))
    kv_finite = torch.tensor([[True, False], [True, True]])  # the cache's verdict wins
    got = tn.nonfinite_rows(q, k, v, kv_finite)
    assert torch.equal(got, nonfinite.rows_in_torch_ops(q, k, v, kv_finite))
    assert got[0, 2:].all() and not got[1].any()


def test_the_dispatch_uses_the_kernels_for_4d_inputs_and_torch_ops_otherwise(monkeypatch):
    calls = []
    real = tn.nonfinite_rows
    monkeypatch.setattr(tn, "nonfinite_rows", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    k[0, 1, 2, 2] = float("nan")
    out = attnlab.scaled_dot_product_attention(q, k, v)
    assert calls and out[0, 1].isnan().all() and not out[0, 0].isnan().any()
    calls.clear()
    rows3 = nonfinite.nonfinite_rows(q[0], k[0], v[0])  # 3-D, called directly: torch ops
    assert not calls and torch.equal(rows3, nonfinite.rows_in_torch_ops(q[0], k[0], v[0]))
    assert rows3[1].all() and not rows3[0].any()
