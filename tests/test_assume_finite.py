"""``assume_finite``: the caller's promise that inputs hold no NaN/inf, which skips the NaN rule's
checks (issue 9, item 5: what a call costs over torch's own attention).

Finite inputs give bit for bit the same results with and without the promise, on every path;
the checks are really skipped (they are made to fail here); the mode is scoped as
``torch.set_grad_enabled`` is; compiled graphs follow it; a KV cache keeps its honest record.
"""

from __future__ import annotations

import pytest
import torch

import attnlab
import attnlab.functional as AF
from attnlab.cache import DynamicCache
from attnlab.functional import nonfinite
from attnlab.functional.sdpa import attention_with
from conftest import Graphs, qkv

nan = float("nan")


@pytest.fixture(autouse=True)
def _default_mode():
    """Every test starts and ends with the NaN rule on (a failing test must not leak the mode)."""
    AF.assume_finite(False)
    yield
    AF.assume_finite(False)


MASK = torch.rand(5, 7, generator=torch.Generator().manual_seed(3)) > 0.3


def sdpa(**kwargs):
    return lambda q, k, v: AF.scaled_dot_product_attention(q, k, v, **kwargs)


def additive(q, k, v):  # (one kv head: additive attention has no grouped heads)
    g = torch.Generator().manual_seed(5)
    w_q, w_k, w = (torch.randn(*shape, generator=g) for shape in ((6, 8), (6, 8), (6,)))
    q, k, v = q[:, :2], k[:, :1].expand(-1, 2, -1, -1), v[:, :1].expand(-1, 2, -1, -1)
    return AF.additive_attention(q, k, v, w_q, w_k, w, MASK, return_weights=True)


def seeded(fn):  # the same dropout draws in both modes
    def run(q, k, v):
        torch.manual_seed(11)
        return fn(q, k, v)

    return run


# name -> (function of q, k, v, whether it runs with autograd)
PATHS = {
    "fused": (sdpa(), False),
    "fused, mask": (sdpa(attn_mask=MASK), False),
    "fused, causal": (sdpa(is_causal="bottom_right"), False),
    "weights": (sdpa(attn_mask=MASK, return_weights=True), False),
    "weights, average": (sdpa(attn_mask=MASK, return_weights="average"), False),
    "weights, autograd": (sdpa(attn_mask=MASK, return_weights=True), True),
    "cpu_flash, dropout": (seeded(sdpa(attn_mask=MASK, dropout_p=0.3)), True),
    "eager, dropout": (seeded(sdpa(attn_mask=MASK, dropout_p=0.3, return_weights=True)), True),
    "additive": (additive, True),
    "hard": (lambda q, k, v: AF.hard_attention(q, k, v, MASK, return_weights=True), False),
}


def run(name, q, k, v):
    """The path's outputs and, with autograd, the inputs' gradients."""
    fn, grad = PATHS[name]
    leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    with torch.set_grad_enabled(grad):
        got = fn(*leaves)
    got = list(got) if isinstance(got, tuple) else [got]
    if grad:
        sum(g.float().square().sum() for g in got).backward()
        got += [t.grad for t in leaves]
    return [g.detach() for g in got]


@pytest.mark.parametrize("name", PATHS)
def test_finite_inputs_give_the_same_results_with_the_promise(name):
    q, k, v = qkv()
    want = run(name, q, k, v)
    with AF.assume_finite():
        got = run(name, q, k, v)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name", PATHS)
def test_the_promise_skips_the_checks(name, monkeypatch):
    def check(*args, **kwargs):
        raise AssertionError("the inputs were checked")

    monkeypatch.setattr(nonfinite, "all_finite", check)
    monkeypatch.setattr(nonfinite, "nonfinite_rows", check)
    q, k, v = qkv()
    with pytest.raises(AssertionError, match="checked"):  # the checks run without the promise
        run(name, q, k, v)
    with AF.assume_finite():
        run(name, q, k, v)


def test_a_cache_verdict_is_not_read_under_the_promise(monkeypatch):
    q, k, v = qkv(L=1)
    finite = torch.tensor([[True, False], [True, True]])
    monkeypatch.setattr(nonfinite, "all_finite", lambda *t: True)  # (the query is finite)
    assert attention_with(q, k, v, kv_finite=finite)[0, 2:].isnan().all()  # head 1 reads kv 1
    with AF.assume_finite():
        assert torch.isfinite(attention_with(q, k, v, kv_finite=finite)).all()


def test_the_mode_is_set_by_a_call_and_scoped_by_with():
    assert not AF.is_finite_assumed()
    with AF.assume_finite():
        assert AF.is_finite_assumed()
        with AF.assume_finite(False):
            assert not AF.is_finite_assumed()
        assert AF.is_finite_assumed()
    assert not AF.is_finite_assumed()
    with pytest.raises(KeyError), AF.assume_finite():  # an exception restores it too
        raise KeyError
    assert not AF.is_finite_assumed()
    AF.assume_finite(True)  # a plain call: for the process, until changed
    assert AF.is_finite_assumed() and attnlab.assume_finite is AF.assume_finite
    AF.assume_finite(False)
    assert not AF.is_finite_assumed()


@pytest.mark.parametrize("mode", [1, "yes", None])
def test_a_mode_that_is_not_a_bool_is_refused_with_the_fix(mode):
    with pytest.raises(TypeError) as info:
        AF.assume_finite(mode)
    assert "mode" in str(info.value) and repr(mode) in str(info.value)
    assert "Fix: pass a bool" in str(info.value)
    assert not AF.is_finite_assumed()  # a refused call changes nothing


def test_a_broken_promise_can_give_numbers_where_the_rule_gives_nan():
    """What the docs warn of: a NaN key that a mask keeps out of every row of a head makes the
    head NaN under the rule, and is simply not seen under the promise (the eager path's
    masked softmax, attnlab's own code)."""
    q, k, v = qkv()
    k[0, 1, 6] = nan  # kv head 1 of batch 0; key 6 masked for every query
    mask = MASK.clone()
    mask[:, 6] = False
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = AF.scaled_dot_product_attention(*leaves, mask, return_weights=True)
    assert out[0, 2:].isnan().all() and torch.isfinite(out[0, :2]).all()  # heads 2, 3 read kv 1
    with AF.assume_finite():
        out, _ = AF.scaled_dot_product_attention(*leaves, mask, return_weights=True)
    k[0, 1, 6] = 0.0
    want = AF.scaled_dot_product_attention(q, k, v, mask)
    torch.testing.assert_close(out.detach(), want, rtol=1e-6, atol=1e-6)


def test_explain_says_the_inputs_are_assumed_finite():
    q, k, v = qkv()
    w_q, w_k, w = torch.randn(6, 8), torch.randn(6, 8), torch.randn(6)
    k1, v1 = k[:, :1].expand(-1, 4, -1, -1), v[:, :1].expand(-1, 4, -1, -1)
    said = "assumed finite (assume_finite)"
    assert said not in str(AF.explain(q, k, v))
    assert said not in str(AF.explain_additive(q, k1, v1, w_q, w_k, w))
    with AF.assume_finite():
        plain = AF.explain(q, k, v)
        assert plain.path == "fused" and said in str(plain)
        assert said in str(AF.explain(q, k, v, return_weights=True))
        assert said in str(AF.explain_additive(q, k1, v1, w_q, w_k, w))


def test_a_cache_records_nonfinite_slots_under_the_promise():
    """The promise is about attention calls; a cache written under it still records a NaN
    honestly, so a later call without the promise makes the heads that read it NaN."""
    q, k, v = qkv(L=1)
    k[1, 0, 3] = nan
    cache = DynamicCache()
    with AF.assume_finite():
        keys, values = cache.update(k, v, 0)
    assert cache.kv_finite(0).tolist() == [[True, True], [False, True]]
    out = attention_with(q, keys, values, kv_finite=cache.kv_finite(0))
    assert out[1, :2].isnan().all() and torch.isfinite(out[0]).all()
    assert torch.isfinite(out[1, 2:]).all()


def test_a_compiled_graph_follows_the_mode():
    """Traced, the row check is part of the graph (no host sync); under the promise the graph
    is traced again without it, and going back reuses the first graph."""
    q, k, v = qkv()
    k[0, 1, 6] = nan
    mask = MASK.clone()
    mask[:, 6] = False

    def attend(q, k, v):
        return AF.scaled_dot_product_attention(q, k, v, mask)

    torch._dynamo.reset()
    graphs = Graphs()
    compiled = torch.compile(attend, fullgraph=True, backend=graphs)
    checked = compiled(q, k, v)
    with AF.assume_finite():
        unchecked = compiled(q, k, v)
        want = attend(q, k, v)  # (torch's kernel lets this NaN through on its own)
        torch.testing.assert_close(unchecked, want, rtol=1e-6, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(compiled(q, k, v), checked, rtol=0, atol=0, equal_nan=True)
    assert checked[0, 2:].isnan().all() and torch.isfinite(checked[0, :2]).all()
    norms = ["linalg_vector_norm" in str(gm.code) for gm in graphs.graphs]
    assert norms == [True, False]  # two graphs: the row check in the first only
    torch._dynamo.reset()


def test_kv_finite_must_be_bool():
    """A uint8 kv_finite (1 = finite) read as ~x in int8 (-2, -1) turned the NaN rule off on the
    Triton path; it is refused, with the fix."""
    q, k, v = (torch.randn(1, 2, 3, 4) for _ in range(3))
    with pytest.raises(ValueError, match=r"kv_finite must be \(B, Hkv\) = \(1, 2\) bool.*uint8"):
        attention_with(q, k, v, kv_finite=torch.tensor([[1, 0]], dtype=torch.uint8))
