"""Attention dropout, and which path scaled_dot_product_attention takes."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import attnlab.functional as AF
import attnlab.reference as R
from attnlab.kernels import cpu_flash

F64 = torch.float64


def qkv(seed=0, B=2, H=4, Hkv=2, L=6, S=9, E=8):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, H, L, E, generator=g, dtype=F64),
        torch.randn(B, Hkv, S, E, generator=g, dtype=F64),
        torch.randn(B, Hkv, S, E, generator=g, dtype=F64),
    )


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_drops_and_rescales(p):
    q, k, v = qkv()
    soft = AF.scaled_dot_product_attention(q, k, v, return_weights=True)[1]
    torch.manual_seed(0)
    out, w = AF.scaled_dot_product_attention(q, k, v, dropout_p=p, return_weights=True)
    kept = w != 0
    torch.testing.assert_close(w[kept], soft[kept] / (1 - p))  # survivors scaled by 1/(1-p)
    frac = 1 - kept.double().mean().item()
    n = w.numel()
    assert abs(frac - p) < 5 * (p * (1 - p) / n) ** 0.5  # drop rate is p
    G = q.shape[1] // k.shape[1]
    torch.testing.assert_close(out, w @ v.repeat_interleave(G, 1))  # these weights made out


@pytest.mark.parametrize("gap", [2**-30, 2**-34])
def test_dropout_a_hair_below_one_drops_everything_on_the_blocked_kernel(gap):
    # before: p within 2^-33 of 1 wrapped the kernel's int32 threshold: every weight was kept
    # and scaled by 1 / (1 - p) ~ 1e10
    q, k, v = qkv(L=64, S=64)
    q, k, v = q.float(), k.float(), v.float()
    p = 1 - gap
    assert AF.explain(q, k, v, dropout_p=p).path == "cpu_flash"
    torch.manual_seed(0)
    out = AF.scaled_dot_product_attention(q, k, v, dropout_p=p)
    assert (out == 0).all()


def test_dropout_is_unbiased_and_off_by_default():
    q, k, v = qkv(L=3, S=5)
    clean = AF.scaled_dot_product_attention(q, k, v)
    torch.manual_seed(1)
    n = 4000
    mean = sum(AF.scaled_dot_product_attention(q, k, v, dropout_p=0.3) for _ in range(n)) / n
    # expectation equals the clean output; tolerance: 6 standard errors per element
    draws = torch.stack(
        [AF.scaled_dot_product_attention(q, k, v, dropout_p=0.3) for _ in range(200)]
    )
    se = draws.std(0) / n**0.5
    assert torch.all((mean - clean).abs() <= 6 * se + 1e-12)
    # dropout_p=0 is deterministic and equals the oracle
    np.testing.assert_allclose(
        clean.numpy(), R.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy()), atol=1e-12
    )


def test_reference_dropout_property():
    q, k, v = (t.numpy() for t in qkv())
    soft = R.scaled_dot_product_attention(q, k, v, return_weights=True)[1]
    out, w = R.scaled_dot_product_attention(q, k, v, dropout_p=0.25, return_weights=True)
    kept = w != 0
    np.testing.assert_allclose(w[kept], soft[kept] / 0.75)
    assert 0.15 < 1 - kept.mean() < 0.35


def test_dispatch_paths_and_reasons(monkeypatch):
    q, k, v = qkv()
    assert AF.explain(q, k, v).path == "fused"
    assert "enable_gqa" in str(AF.explain(q, k, v))
    d = AF.explain(q, k, v, return_weights=True)
    assert d.path == "weights" and "one block" in str(d)
    with torch.no_grad():  # no graph needed: still the weights path
        assert AF.explain(q.requires_grad_(), k, v, return_weights=True).path == "weights"
    d = AF.explain(q, k, v, return_weights=True)  # q requires grad now: the blocked backward
    assert d.path == "weights" and "backward reads the returned weights" in str(d)
    d = AF.explain(q.bfloat16(), k.bfloat16(), v.bfloat16(), return_weights=True)
    assert d.path == "eager" and "autograd for torch.bfloat16" in str(d)
    q = q.detach()
    d = AF.explain(q, k, v, dropout_p=0.1)
    assert d.path == "eager" and "dropout" in str(d)
    d = AF.explain(q, k, v, dropout_p=0.1, return_weights=True)
    assert d.path == "eager" and "dropped" in str(d)
    assert "bool mask" in str(AF.explain(q, k, v, is_causal="bottom_right"))

    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    AF.scaled_dot_product_attention(q, k, v, is_causal="top_left")
    assert len(calls) == 1 and calls[0].get("is_causal") and calls[0].get("enable_gqa")
    AF.scaled_dot_product_attention(q, k, v, return_weights=True)
    AF.scaled_dot_product_attention(q.requires_grad_(), k, v, return_weights=True)
    assert len(calls) == 1  # the weights and eager paths compute the output themselves
    q2, k2, v2 = qkv(L=7, S=7)
    AF.scaled_dot_product_attention(q2, k2, v2, is_causal="bottom_right")  # L == S
    assert calls[-1].get("is_causal") and calls[-1].get("attn_mask") is None  # no dense mask
    q3 = q2[:, :, :1]
    AF.scaled_dot_product_attention(q3, k2, v2, is_causal="bottom_right")  # one decode step
    assert not calls[-1].get("is_causal") and calls[-1].get("attn_mask") is None  # sees every key


def test_dispatch_is_logged(caplog):
    q, k, v = qkv()
    with caplog.at_level(logging.DEBUG, logger="attnlab.dispatch"):
        AF.scaled_dot_product_attention(q, k, v, dropout_p=0.2)
    assert any("eager" in r.getMessage() for r in caplog.records)


PLAIN_CALLS = {  # name: (shape of q, of k and v, dtype, kwargs, served by the hot path)
    "plain": ((2, 4, 6, 8), (2, 4, 6, 8), torch.float32, {}, True),
    "causal": ((1, 2, 5, 8), (1, 2, 5, 8), torch.float32, {"is_causal": True}, True),
    "gqa causal": ((2, 4, 6, 8), (2, 2, 6, 8), torch.float32, {"is_causal": True}, True),
    "scale": ((1, 2, 5, 8), (1, 2, 7, 8), torch.bfloat16, {"scale": 0.3}, True),
    "causal scale gqa": ((1, 4, 5, 8), (1, 1, 5, 8), F64, {"is_causal": True, "scale": 2.0}, True),
    "dropout 0 int": ((1, 2, 3, 4), (1, 2, 3, 4), torch.float16, {"dropout_p": 0}, True),
    "scale<0 causal": ((1, 2, 5, 8), (1, 2, 5, 8), F64, {"is_causal": True, "scale": -0.5}, False),
    "int scale": ((1, 2, 5, 8), (1, 2, 5, 8), F64, {"scale": 1}, False),
    "bottom_right": ((1, 2, 3, 8), (1, 2, 7, 8), F64, {"is_causal": "bottom_right"}, False),
    "3-D": ((2, 5, 8), (2, 7, 8), F64, {}, False),
    "empty S": ((1, 2, 3, 8), (1, 2, 0, 8), F64, {}, False),
    "no heads": ((1, 0, 3, 8), (1, 0, 3, 8), F64, {}, False),
    "mask": ((1, 2, 3, 8), (1, 2, 3, 8), F64, {"attn_mask": torch.ones(3, 3).bool()}, False),
}


@pytest.mark.parametrize("assumed", [False, True])
@pytest.mark.parametrize("nan", [False, True])
@pytest.mark.parametrize("name", PLAIN_CALLS)
def test_the_hot_path_gives_the_general_routes_result(name, nan, assumed, monkeypatch):
    from attnlab.functional import sdpa

    q_shape, kv_shape, dtype, kwargs, hot = PLAIN_CALLS[name]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(q_shape, generator=g).to(dtype)
    k, v = (torch.randn(kv_shape, generator=g).to(dtype) for _ in range(2))
    if nan and k.numel():
        k[..., -1, 0] = float("nan")  # (the last key: masked for the first causal rows)
        q[..., 0, 1] = float("inf")
    served = []
    hot_path = sdpa._plain_fused
    monkeypatch.setattr(sdpa, "_plain_fused", lambda *a: served.append(hot_path(*a)) or served[-1])
    with AF.assume_finite(assumed):
        got = AF.scaled_dot_product_attention(q, k, v, **kwargs)
        want = sdpa.attention_with(q, k, v, **kwargs)  # (the general route)
    assert (bool(served) and served[0] is not None) == hot
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_hot_path_trains_as_the_general_route(dtype):
    from attnlab.functional import sdpa
    from attnlab.kernels import choice

    q, k, v = (t.to(dtype).requires_grad_() for t in qkv(L=5, S=5))
    # training on CPU whose kernel is chosen by measurement (16-bit; float32 where the kernel's
    # float32 products go through brgemm): the general route decides
    assert (sdpa._plain_fused(q, k, v, True, None) is None) == choice.chooses(dtype)
    grads = []
    for call in (AF.scaled_dot_product_attention, sdpa.attention_with):
        out = call(q, k, v, is_causal=True)
        grads.append((out, *torch.autograd.grad(out.float().square().sum(), (q, k, v))))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_hot_path_leaves_what_it_does_not_decide(caplog):
    q, k, v = (t.float() for t in qkv(L=4, S=4))
    with caplog.at_level(logging.DEBUG, logger="attnlab.dispatch"):  # the dispatch is logged
        AF.scaled_dot_product_attention(q, k, v)
    assert any("fused" in r.getMessage() for r in caplog.records)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # cast as torch's autocast casts
        assert AF.scaled_dot_product_attention(q, k, v).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="is_causal=True is ambiguous"):
        AF.scaled_dot_product_attention(q, k[:, :, :3], v[:, :, :3], is_causal=True)
    with pytest.raises(ValueError, match="scale must be a finite number"):
        AF.scaled_dot_product_attention(q, k, v, scale=float("inf"))
    with pytest.raises(ValueError, match="dropout_p must be a probability"):
        AF.scaled_dot_product_attention(q, k, v, dropout_p=torch.tensor([0.0]))
    torch.testing.assert_close(  # (a 0-d tensor leaves the hot path, and is taken as torch does)
        AF.scaled_dot_product_attention(q, k, v, dropout_p=torch.tensor(0.0)),
        AF.scaled_dot_product_attention(q, k, v),
    )
    with pytest.raises(TypeError, match="share one dtype"):
        AF.scaled_dot_product_attention(q, k.double(), v)


def test_fused_path_compiles_without_graph_breaks():
    q, k, v = (t.float() for t in qkv(L=4, S=4))
    f = torch.compile(
        lambda q, k, v: AF.scaled_dot_product_attention(q, k, v, is_causal=True),
        backend="aot_eager",
        fullgraph=True,
    )
    torch.testing.assert_close(f(q, k, v), AF.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_explain_checks_casts_and_reasons_as_the_call(monkeypatch):
    # before: explain decided on float32 inputs under autocast (the call casts them to bf16),
    # named "eager" for H = 0 (nothing runs), answered inputs the call refuses, said
    # "enable_gqa" where kv heads are repeated, a block of 4 heads where the call takes 3,
    # and "is_causal" where a scale <= 0 makes it a bool mask
    from attnlab.functional import additive as additive_module

    q, k, v = (t.float().requires_grad_() for t in qkv(L=8, S=8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert AF.explain(q, k, v, return_weights=True).path == "eager"  # bf16 weights, grad
    h0 = torch.randn(2, 0, 5, 8)
    assert AF.explain(h0, h0, h0).path == "empty"
    q0, k0, v0 = (t.detach() for t in (q, k, v))
    for kwargs, error in (
        ({"dropout_p": 1.0}, "dropout_p"),
        ({"return_weights": "foo"}, "return_weights"),
        ({"attn_mask": torch.ones(3, 8, dtype=torch.bool)}, "does not broadcast"),
        ({"attn_mask": torch.full((8, 8), 1e39, dtype=F64)}, "outside torch.float32's range"),
    ):
        for call in (AF.explain, AF.scaled_dot_product_attention):
            with pytest.raises(ValueError, match=error):
                call(q0, k0, v0, **kwargs)
    monkeypatch.setenv("ATTNLAB_CPU_TRAINING_KERNEL", "torch")
    said = str(AF.explain(*(t.bfloat16() for t in (q, k, v))))
    assert said.startswith("fused") and "kv heads repeated" in said and "enable_gqa)" not in said
    big = torch.randn(1, 6, 512, 64), torch.randn(1, 2, 1024, 64)
    said = str(AF.explain(big[0], big[1], big[1], return_weights=True))
    assert "blocked CPU kernel (C++" in said and "writes each block's weights" in said
    monkeypatch.setattr(cpu_flash, "weights_unfit", lambda *args: "switched off")
    said = str(AF.explain(big[0], big[1], big[1], return_weights=True))
    assert "blocks of 3 head(s)" in said and "not the C++ blocked kernel: switched off" in said
    said = str(AF.explain(q0, k0, v0, is_causal=True, scale=-1.0))
    assert "passed as a bool mask" in said and "scale <= 0" in said
    w = torch.randn(16, 8), torch.randn(16, 8), torch.randn(16)
    qa, ka = torch.randn(2, 3, 8), torch.randn(2, 5, 8)
    for value, kwargs in ((torch.randn(3, 5, 4), {}), (torch.randn(2, 5, 4), {"dropout_p": 1.5})):
        for call in (additive_module.explain_additive, AF.additive_attention):
            with pytest.raises(ValueError):
                call(qa, ka, value, *w, **kwargs)


@pytest.mark.parametrize("alignment", [False, "top_left", "bottom_right"])
@pytest.mark.parametrize("mask_shape", [None, (2, 1, 1, 9), (1, 9), (2, 4, 1, 9)])
def test_one_query_row_folds_a_groups_heads_into_rows_of_its_kv_head(
    monkeypatch, alignment, mask_shape
):
    """Decode-shaped GQA on the CPU (L = 1, a mask the same for every head): torch's kernel
    gets each group's G heads as G rows of its kv head, (B, Hkv, G, E), not enable_gqa (which
    read each kv head G times: 1.3-3x slower); values within float32 rounding of the float64
    call, dead rows 0. A per-head mask, or a top-left triangle torch applies itself, keeps
    enable_gqa. explain() says which."""
    q, k, v = qkv(L=1)
    g = torch.Generator().manual_seed(1)
    mask = None if mask_shape is None else torch.rand(mask_shape, generator=g) > 0.3
    if mask_shape == (2, 1, 1, 9):
        mask[1] = False  # batch row 1: no key (dead rows)
    # the reference and the control without GQA at all (kv heads repeated: nothing folds), so
    # that a wrong fold cannot hide in both
    k4, v4 = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    want = AF.scaled_dot_product_attention(q, k4, v4, mask, is_causal=alignment)  # float64
    control = AF.scaled_dot_product_attention(
        q.float(), k4.float(), v4.float(), mask, is_causal=alignment
    )  # float32
    shapes = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(query, *args, **kwargs):
        shapes.append((tuple(query.shape), kwargs.get("enable_gqa", False)))
        return real(query, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    got = AF.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), mask, is_causal=alignment
    )
    folds = mask_shape != (2, 4, 1, 9) and not (alignment == "top_left" and mask is None)
    assert shapes == ([((2, 2, 2, 8), False)] if folds else [((2, 4, 1, 8), True)])
    said = str(AF.explain(q.float(), k.float(), v.float(), mask, is_causal=alignment))
    assert ("as rows of its kv head" in said) == folds and ("enable_gqa" in said) != folds
    err, ctl = (got.double() - want).abs().max(), (control.double() - want).abs().max()
    assert err <= 2 * ctl + 4 * torch.finfo(torch.float32).eps, (err, ctl)
    if mask_shape == (2, 1, 1, 9):
        assert got[1].abs().max() == 0
