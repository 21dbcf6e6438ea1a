"""The C++ blocked CPU kernel (attnlab/kernels/cpu_flash.cpp): what is particular to it.

Its results against the oracle run in tests/test_kernels_cpu.py (every case there runs in both
implementations); here: dropout draws that depend on (seed, row, column) only, results that do
not depend on the thread count, scratch reused from an earlier call, exponentials over a wide
range, and the fallback to the torch-ops blocks where it does not build.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnlab.kernels.cpu_flash as cf
from attnlab import reference
from attnlab.functional.sdpa import _eager
from attnlab.kernels import cpu_flash_native, describe, flash_attention
from conftest import make_mask, np64, skip_if_this_cpu_lacks, skip_on_this_cpu


@pytest.fixture(autouse=True)
def built():
    assert cpu_flash_native.module() is not None, cpu_flash_native.unavailable()


def inputs(B, H, Hkv, L, S, E, Ev, dtype=torch.float32, seed=0, grad=False, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, E, generator=g, dtype=torch.float64) * spread
    k = torch.randn(B, Hkv, S, E, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, S, Ev, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_(grad) for t in (q, k, v)]


def keep_pattern(monkeypatch, rows, threads, alignment=None):
    """Which weights survive dropout (V = I: the output is the dropped weights)."""
    monkeypatch.setattr(cf, "BLOCK_ROWS", rows)
    monkeypatch.setattr(cf, "BRGEMM_ROWS", min(rows, 64))
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    q, k, _ = inputs(2, 4, 2, 37, 29, 8, 8)
    eye = torch.eye(29).expand(2, 2, 29, 29)
    torch.manual_seed(7)
    return flash_attention(q, k, eye, None, alignment, 0.5, 0.3) != 0


def test_blocks_take_several_groups_when_they_hold_whole_rows(monkeypatch):
    monkeypatch.setattr(cpu_flash_native, "brgemm", lambda dtype=None: False)  # (at::bmm's)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    q, k, v = inputs(5, 8, 4, 11, 9, 8, 4)
    assert "2*11 query rows of 4 kv head(s)" in describe(q, k, v, None)  # 20 groups / (3 x 2)
    monkeypatch.setattr(cf, "BLOCK_ROWS", 5)
    assert "2*5 query rows of 1 kv head(s)" in describe(q, k, v, None)


@pytest.mark.parametrize("alignment", [None, "bottom_right"])
def test_dropout_draws_do_not_depend_on_tiling_or_threads(monkeypatch, alignment):
    base = keep_pattern(monkeypatch, 256, 1, alignment)
    assert 0.6 < base.float().mean() < 0.8 or alignment  # ~0.7 kept (causal: fewer visible)
    for rows, threads in ((1, 2), (5, 1), (16, 2)):
        assert torch.equal(keep_pattern(monkeypatch, rows, threads, alignment), base)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_results_do_not_depend_on_the_thread_count(monkeypatch, dtype, p):
    q, k, v = inputs(3, 4, 2, 40, 33, 16, 8, dtype=dtype, grad=True)
    mask = torch.rand(3, 1, 40, 33, generator=torch.Generator().manual_seed(1)) > 0.2
    up = torch.randn(3, 4, 40, 8, generator=torch.Generator().manual_seed(2)).to(dtype)
    runs = []
    for threads in (1, 2):
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
        torch.manual_seed(3)
        out = flash_attention(q, k, v, mask, "top_left", 0.25, p)
        runs.append((out, *torch.autograd.grad(out, (q, k, v), up)))
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)  # each block's (and kv head's) work is one thread's, whole


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_dead_rows_are_zero_after_a_call_that_filled_the_scratch(dtype, p):
    """The kernel reuses buffers; a row with no visible key must write its zeros (before: the
    16-bit copy of a dead row's W was left as the allocator found it -- NaN gradients)."""
    B, H, L, S = 2, 4, 48, 40
    for warm in (False, True):
        q, k, v = inputs(B, H, 2, L, S, 16, 16, dtype=dtype, seed=int(warm), grad=True)
        if warm:  # dead rows: the first L - S under bottom-right alignment, and row 45
            mask = torch.ones(L, S, dtype=torch.bool)
            mask[45] = False
            out = flash_attention(q, k, v, mask, "bottom_right", 0.25, p)
        else:  # the same shapes, every row live: the scratch holds numbers
            out = flash_attention(q, k, v, None, None, 0.25, p)
        grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        assert all(torch.isfinite(t).all() for t in (out, *grads))
    dead = [*range(L - S), 45]
    assert torch.equal(out[:, :, dead], torch.zeros_like(out[:, :, dead]))
    assert torch.equal(grads[0][:, :, dead], torch.zeros_like(grads[0][:, :, dead]))


def test_exponentials_over_a_wide_range_match_the_oracle():
    """The kernel's own 2^x (a polynomial, not libm's exp) over scores spanning ~200 units:
    float32 error within twice the readable formula's, in float32, against float64."""
    q, k, v = inputs(2, 2, 2, 64, 64, 16, 16, spread=6.0)
    want = reference.scaled_dot_product_attention(np64(q), np64(k), np64(v), scale=1.0)
    got = flash_attention(q, k, v, None, None, 1.0, 0.0).double().numpy()
    control = _eager(q, k, v, None, None, 1.0, 0.0)[0].double().numpy()
    err, err_control = np.abs(got - want).max(), np.abs(control - want).max()
    assert err <= 2 * err_control + 1e-7, (err, err_control)


def test_where_it_does_not_build_the_torch_ops_blocks_serve_and_say_why(monkeypatch):
    monkeypatch.setattr(cpu_flash_native, "_state", {})  # as in a fresh process
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert cpu_flash_native.module() is None
    assert "no C++ compiler ('/nonexistent/c++' not found)" in cpu_flash_native.unavailable()
    q, k, v = inputs(1, 2, 1, 9, 7, 8, 8)
    assert "torch ops; not the C++ one: no C++ compiler" in describe(q, k, v, None)
    want = reference.scaled_dot_product_attention(np64(q), np64(k), np64(v), scale=0.5)
    got = flash_attention(q, k, v, None, None, 0.5, 0.0)
    np.testing.assert_allclose(got.double().numpy(), want, rtol=0, atol=2e-6)

    monkeypatch.setattr(cpu_flash_native, "_state", {})
    monkeypatch.delenv("CXX")
    monkeypatch.setenv(cpu_flash_native.ENV, "0")
    assert cpu_flash_native.module() is None
    assert cpu_flash_native.unavailable() == "ATTNLAB_CPU_NATIVE=0"


SHAPES = [  # (B, H, Hkv, L, S, E, Ev): B * Hkv = 1 (the row blocks of one kv head dealt out to
    # two threads, dK, dV summed from per-thread copies), GQA 4/2, L != S, E != Ev; 20 groups
    # (batch row, kv head): with whole rows per block, several groups per block (batched
    # products), 4 per block on 2 threads (the last block takes what is left)
    (1, 4, 1, 37, 29, 8, 8),
    (2, 4, 2, 23, 31, 16, 8),
    (5, 8, 4, 11, 9, 8, 4),
]


def float32_backend(monkeypatch, backend, rows):
    """Float32 products through oneDNN's brgemm (row blocks of min(rows, 64)) or through the
    at::bmm blocks (rows of `rows`), as a CPU without float32 brgemm runs them."""
    if backend == "brgemm":
        if not cpu_flash_native.brgemm(torch.float32):
            skip_on_this_cpu("no float32 brgemm (AVX-512): at::bmm serves")
        monkeypatch.setattr(cf, "BRGEMM_ROWS", min(rows, 64))
    else:
        monkeypatch.setattr(cpu_flash_native, "brgemm", lambda dtype=None: False)
        monkeypatch.setattr(cf, "BLOCK_ROWS", rows)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
@pytest.mark.parametrize("alignment", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [5, 256], ids=["rows-of-5", "whole-rows"])
@pytest.mark.parametrize("backend", ["brgemm", "at::bmm"])
def test_float32_gradients_within_twice_the_control_error(
    monkeypatch, shape, mask_kind, alignment, threads, rows, backend
):
    """Forward and gradients in float32 against float64: error <= 2x the readable formula's in
    float32 (+ 1e-6), for several row blocks (rows of 5) or whole rows (at::bmm: then several
    groups per block; brgemm: 64), on one and two threads."""
    float32_backend(monkeypatch, backend, rows)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    q, k, v = inputs(*shape)
    assert ("brgemm" in describe(q, k, v, alignment)) == (backend == "brgemm")
    within_twice_the_control(shape, mask_kind, alignment, torch.float32, 0.3, seeds=(3, 4))


def within_twice_the_control(shape, mask_kind, alignment, dtype, scale, seeds, slack=1e-6):
    """flash_attention's output and gradients in dtype against float64: error <= 2x the
    readable formula's in dtype, + slack (an absolute one, or "ulp": one rounding step of dtype
    at the result's largest magnitude, as results rounded once to bfloat16 fall either side of a
    step by chance: up to 2.1-2.4x the control's max error over 20 seeds of two shapes, the
    medians 0.96-1.05; the at::bmm blocks' max 1.5x, the same one step), with
    no mask, a bool one (a dead row) or a float one (some -inf)."""
    B, H, Hkv, L, S, E, Ev = shape
    mask = make_mask(mask_kind, B, H, L, S, seed=seeds[0])
    up = torch.randn(B, H, L, Ev, generator=torch.Generator().manual_seed(seeds[0] + 100))

    def run(fn, dt):
        q, k, v = inputs(*shape, dtype=dt, seed=seeds[1], grad=True)
        m = mask.to(dt) if mask is not None and mask.is_floating_point() else mask
        out = fn(q, k, v, m, alignment, scale, 0.0)
        out = out[0] if isinstance(out, tuple) else out
        return (out, *torch.autograd.grad(out, (q, k, v), up.to(dt)))

    truth, ours, control = (
        run(_eager, torch.float64),
        run(flash_attention, dtype),
        run(_eager, dtype),
    )
    for name, t, o, c in zip(("out", "dq", "dk", "dv"), truth, ours, control, strict=True):
        err, err_control = (o.double() - t).abs().max(), (c.double() - t).abs().max()
        room = torch.finfo(dtype).eps * t.abs().max() if slack == "ulp" else slack
        assert err <= 2 * err_control + room, (name, float(err), float(err_control))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("backend", ["brgemm", "at::bmm"])
def test_float32_dropout_gradients_use_the_forward_mask(monkeypatch, threads, backend):
    """Gradients equal the readable formula's with the keep mask recovered from the forward
    (V = I), in float32, on one and two threads (one kv head: its row blocks dealt out)."""
    float32_backend(monkeypatch, backend, 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    B, H, Hkv, L, S, p = 1, 2, 1, 19, 13, 0.25
    q, k, _ = inputs(B, H, Hkv, L, S, 6, S, seed=8, grad=True)
    v = torch.eye(S).repeat(B, Hkv, 1, 1).requires_grad_()
    torch.manual_seed(3)
    out = flash_attention(q, k, v, None, "bottom_right", 0.5, p)
    keep = (out != 0).detach() | ~torch.ones(L, S, dtype=torch.bool).tril(S - L)
    assert 0 < (~keep).sum() < keep.numel() / 2
    up = torch.randn(B, H, L, S, generator=torch.Generator().manual_seed(9))
    got = torch.autograd.grad(out, (q, k, v), up)
    w = (
        _eager(q, k, v, None, "bottom_right", 0.5, 0.0)[1]
        * keep
        / cf._Plan(q, k, v, None, None, 0.5, p, 0).keep
    )
    ref = (w.view(B, Hkv, H // Hkv * L, S) @ v).view(B, H, L, S)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    want = torch.autograd.grad(ref, (q, k, v), up)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_inference_mode_on_several_threads(monkeypatch):
    """Before: the output, made under the caller's inference mode, was written by the pool's
    threads outside it: "Inplace update to inference tensor outside InferenceMode"."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    q, k, v = inputs(2, 4, 2, 300, 300, 16, 16)  # 2 row blocks x 4 groups: both threads work
    want = flash_attention(q, k, v, None, "top_left", 0.25, 0.0)
    with torch.inference_mode():
        got = flash_attention(q, k, v, None, "top_left", 0.25, 0.0)
        torch.manual_seed(0)
        dropped = flash_attention(q, k, v, None, None, 0.25, 0.1)
    assert torch.equal(got, want) and dropped.isfinite().all()


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_torch_func_grad_takes_the_torch_ops_blocks(monkeypatch, p):
    """Before: under torch.func.grad the backward handed C++ wrapped tensors without storage (a
    RuntimeError); the torch-ops blocks serve there, and explain() says why."""
    q, k, v = inputs(1, 4, 2, 9, 7, 8, 8, seed=2)

    def loss(q):
        torch.manual_seed(5)  # the same dropout draws in both
        return flash_attention(q, k, v, None, "bottom_right", 0.5, p).square().sum()

    got = torch.func.grad(loss)(q)
    monkeypatch.setattr(cpu_flash_native, "module", lambda: None)  # the torch-ops blocks
    leaf = q.clone().requires_grad_()
    (want,) = torch.autograd.grad(loss(leaf), leaf)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    seen = []
    torch.func.grad(lambda q: (seen.append(describe(q, k, v, None)), q.sum())[1])(q)
    assert "not the C++ one: under torch.func" in seen[0], seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_nan_row_stays_nan(dtype):
    """A query row of NaN: its output and gradients NaN, as the readable formula's (before: the
    C++ max passed over the NaN scores, and the row was taken for one with no visible key)."""
    q, k, v = inputs(1, 2, 1, 6, 5, 4, 4, dtype=dtype, grad=True)
    q.data[0, 1, 3] = float("nan")
    out = flash_attention(q, k, v, None, None, 0.5, 0.0)
    assert out[0, 1, 3].isnan().all() and not out[0, 1, :3].isnan().any()
    (dq,) = torch.autograd.grad(out, q, torch.ones_like(out))
    assert dq[0, 1, 3].isnan().all() and not dq[0, 0].isnan().any()


BRGEMM = skip_if_this_cpu_lacks(
    not cf.native_bf16() or not cpu_flash_native.brgemm(),
    "no bfloat16 brgemm (AMX or AVX512-BF16): the at::bmm path serves",
)


@pytest.mark.parametrize(
    "shape",  # (B, H, Hkv, L, S, E, Ev): row blocks of 64 and an odd tail, an odd key count,
    # Ev over one column block of a product (80); one group on two threads (its blocks dealt out)
    [(1, 4, 2, 150, 133, 64, 80), (2, 2, 1, 67, 67, 32, 32), (1, 2, 1, 130, 97, 16, 8)],
    ids=str,
)
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
@pytest.mark.parametrize("alignment", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_brgemm_gradients_within_twice_the_control_error(
    monkeypatch, shape, mask_kind, alignment, threads, dtype
):
    """bfloat16 or float32 through brgemm, forward and gradients, against float64: error <= 2x
    the readable formula's in that dtype (the control)."""
    if not cpu_flash_native.brgemm(dtype) or (dtype == torch.bfloat16 and not cf.native_bf16()):
        skip_on_this_cpu(f"no {dtype} brgemm (AVX-512): the at::bmm path serves")
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    said = describe(*inputs(*shape, dtype=dtype), alignment)
    assert "oneDNN brgemm" in said and "at::bmm" not in said  # (one product path, not both)
    slack = "ulp" if dtype == torch.bfloat16 else 1e-6
    within_twice_the_control(shape, mask_kind, alignment, dtype, 0.125, (5, 6), slack)


@BRGEMM
def test_bf16_brgemm_never_reads_a_hidden_key(monkeypatch):
    """Products over an odd count of visible keys read the packed pair (N-1, N): key N, hidden
    from the block (causal), must count as 0 there, not as 0 * its value (inf: NaN)."""
    monkeypatch.setattr(cf, "BRGEMM_ROWS", 5)  # block 0: rows 0:5, keys 0:5 of 12
    q, k, v = inputs(1, 2, 1, 12, 12, 8, 8, dtype=torch.bfloat16, grad=True)
    with torch.no_grad():
        k[:, :, 5] = float("inf")
        v[:, :, 5] = float("inf")
    out = flash_attention(q, k, v, None, "top_left", 0.5, 0.0)
    (dq,) = torch.autograd.grad(out, q, torch.ones_like(out))
    q0, k0, v0 = (t.detach()[:, :, :5] for t in (q, k, v))
    want = _eager(q0.double(), k0.double(), v0.double(), None, "top_left", 0.5, 0.0)[0]
    assert torch.isfinite(out[:, :, :5]).all() and torch.isfinite(dq[:, :, :5]).all()
    assert (out[:, :, :5].double() - want).abs().max() < 0.02


@BRGEMM
def test_brgemm_dropout_keeps_the_at_bmm_draws(monkeypatch):
    """The keep mask is a function of (seed, row, column): bfloat16 and float32 through brgemm
    drop the same weights as float32 through the at::bmm blocks (V = I: Ev = S, even for
    bfloat16's brgemm)."""
    q, k, _ = inputs(2, 4, 2, 70, 30, 8, 8)
    eye = torch.eye(30).expand(2, 2, 30, 30)
    brgemm = cpu_flash_native.brgemm
    monkeypatch.setattr(cpu_flash_native, "brgemm", lambda dtype=None: False)
    torch.manual_seed(7)
    want = flash_attention(q, k, eye, None, None, 0.5, 0.3) != 0
    monkeypatch.setattr(cpu_flash_native, "brgemm", brgemm)
    for dtype in (torch.bfloat16, torch.float32):
        if dtype == torch.float32 and not brgemm(dtype):
            continue
        x = [t.to(dtype) for t in (q, k, eye)]
        assert "brgemm" in describe(*x, None)
        torch.manual_seed(7)
        got = flash_attention(*x, None, None, 0.5, 0.3) != 0
        assert torch.equal(got, want), dtype


@BRGEMM
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_brgemm_dropout_gradients_use_the_forward_mask(monkeypatch, threads):
    """bfloat16 through brgemm with dropout: gradients of the readable formula with the keep
    mask recovered from the forward (V = I), within twice that formula's own bfloat16 error,
    against float64; row blocks of 4 (one kv head: dealt out on two threads)."""
    monkeypatch.setattr(cf, "BRGEMM_ROWS", 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    B, H, Hkv, L, S, p = 1, 2, 1, 19, 14, 0.25
    q, k, _ = inputs(B, H, Hkv, L, S, 6, S, dtype=torch.bfloat16, seed=8, grad=True)
    v = torch.eye(S).repeat(B, Hkv, 1, 1).bfloat16().requires_grad_()
    assert "brgemm" in describe(q, k, v, "bottom_right")
    torch.manual_seed(3)
    out = flash_attention(q, k, v, None, "bottom_right", 0.5, p)
    keep = (out != 0).detach() | ~torch.ones(L, S, dtype=torch.bool).tril(S - L)
    assert 0 < (~keep).sum() < keep.numel() / 2
    up = torch.randn(B, H, L, S, generator=torch.Generator().manual_seed(9))
    rate = cf._Plan(q, k, v, None, None, 0.5, p, 0).keep

    def formula(dtype):
        qq, kk, vv = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
        w = _eager(qq, kk, vv, None, "bottom_right", 0.5, 0.0)[1] * keep / rate
        ref = (w.view(B, Hkv, H // Hkv * L, S) @ vv).view(B, H, L, S)
        return (ref, *torch.autograd.grad(ref, (qq, kk, vv), up.to(dtype)))

    truth, control = formula(torch.float64), formula(torch.bfloat16)
    ours = (out, *torch.autograd.grad(out, (q, k, v), up.bfloat16()))
    for name, t, o, c in zip(("out", "dq", "dk", "dv"), truth, ours, control, strict=True):
        err, err_control = (o.double() - t).abs().max(), (c.double() - t).abs().max()
        assert err <= 2 * err_control + 1e-3 * t.abs().max(), (name, float(err), float(err_control))


def test_the_build_name_follows_every_source_file(monkeypatch, tmp_path):
    """A change to the file cpu_flash.cpp reads in (the brgemm path) is a new build, not the
    cached one of the old text."""
    before = cpu_flash_native._cpu_tag()
    header = tmp_path / "cpu_flash_brgemm.h"
    header.write_bytes(cpu_flash_native.HEADERS[0].read_bytes() + b"\n// changed\n")
    monkeypatch.setattr(cpu_flash_native, "HEADERS", [header])
    assert cpu_flash_native._cpu_tag() != before


@BRGEMM
def test_a_brgemm_forward_then_an_at_bmm_backward(monkeypatch):
    """Stats of a brgemm forward for a backward carry each row's output too; a backward that
    takes the at::bmm blocks (brgemm switched off in between) reads (m, log l) of them."""
    q, k, v = inputs(1, 2, 1, 40, 40, 16, 16, dtype=torch.bfloat16, grad=True)
    out = flash_attention(q, k, v, None, "top_left", 0.25, 0.0)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    monkeypatch.setattr(cpu_flash_native, "brgemm", lambda dtype=None: False)
    got = torch.autograd.grad(out, (q, k, v), up)
    want = torch.autograd.grad(_eager(q, k, v, None, "top_left", 0.25, 0.0)[0], (q, k, v), up)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("brgemm_now", [True, False], ids=["brgemm", "at::bmm"])
def test_the_operator_gives_stats_of_the_width_its_graph_was_traced_with(
    monkeypatch, dtype, brgemm_now
):
    """torch.compile's graph holds the operator with the stats' width of the machine it was
    traced on (and a graph may come from the disk cache of another setting): whichever product
    path serves now, the stats have that width and the gradients are right. Before, a cached
    graph traced where float32 took the at::bmm blocks (width 2) met the brgemm path's
    (2 + Ev): inductor's stride assertion failed."""
    if brgemm_now and not cpu_flash_native.brgemm(dtype):
        skip_on_this_cpu(f"no {dtype} brgemm (AVX-512)")
    if not brgemm_now:
        monkeypatch.setattr(cpu_flash_native, "brgemm", lambda dtype=None: False)
    q, k, v = inputs(2, 4, 2, 37, 30, 16, 8, dtype=dtype, grad=True)
    up = torch.randn(2, 4, 37, 8, generator=torch.Generator().manual_seed(4)).to(dtype)
    ref = _eager(q, k, v, None, "bottom_right", 0.25, 0.0)[0]
    want = torch.autograd.grad(ref, (q, k, v), up)
    seed = torch.zeros((), dtype=torch.int64)
    for width in (2, 2 + 8):
        out, stats = cf._flash_op(q, k, v, None, "bottom_right", 0.25, 0.0, seed, width)
        assert stats.shape == (2, 4, 37, width)
        got = torch.autograd.grad(out, (q, k, v), up)
        tol = {"rtol": 0.05, "atol": 0.02} if dtype == torch.bfloat16 else {}
        torch.testing.assert_close(out, ref, **tol)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, **tol)


def test_bfloat16_with_odd_head_dims_multiplies_in_float32():
    """torch's bfloat16 products here carry a NaN of one row into the next where the inner
    dimension is odd (torch.bmm itself): with an odd head dim the kernel's bfloat16 products
    made rows beside a NaN row NaN. Odd head dims take float32 products (16-bit inputs widened,
    as on CPUs without native bfloat16): only the NaN row is NaN."""
    q, k, v = inputs(1, 2, 1, 32, 29, 15, 8, dtype=torch.bfloat16)
    if cf.native_bf16():
        assert "bfloat16 inputs widened: odd head dims" in describe(q, k, v, None)
    q[0, 0, 9, 0] = float("nan")
    out = flash_attention(q, k, v, None, None, 15**-0.5, 0.0)
    assert out[0, 0].isnan().any(-1).nonzero().flatten().tolist() == [9]
    want = _eager(*(t.double() for t in (q, k, v)), None, None, 15**-0.5, 0.0)[0]
    fine = ~want.isnan()
    torch.testing.assert_close(out.double()[fine], want[fine], rtol=0, atol=2e-2)


@pytest.mark.parametrize("L", [256, 257])
def test_a_blocks_scores_stay_within_block_bytes_for_a_long_s(L):
    """At L <= BLOCK_ROWS the C++ kernel's blocks took all L rows whatever S: 256 rows x 200k
    keys grew the peak by 400 MiB, where L = 257 took 2 rows (13 MiB)."""
    S = 200_000
    q, kv = torch.zeros(1, 1, L, 4), torch.zeros(1, 1, S, 4)
    plan = cf._Plan(q, kv, kv, None, None, 1.0, 0.1, 0)
    rows = plan.native_args(brgemm=False)[4]
    assert rows >= 1 and rows * S * 4 <= cf.BLOCK_BYTES
