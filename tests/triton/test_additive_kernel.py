"""The fused additive-attention kernel (attnlab.kernels.triton_additive) through the interpreter.

Run by tests/test_triton_interpreter.py with TRITON_INTERPRET=1, on CPU tensors, through the very
kernel code that runs on a GPU. The interpreter tiles 16 query rows x 16 keys, so the odd lengths
below span several full and partial tiles in both directions.

Tolerances come from controls, never guessed: the same function computed in the same dtype by
(1) the naive formula (the (..., L, S, A) tanh, softmax, weighted sum) with autograd, and (2) the
kernel's own formulation materialised in torch (P rebuilt from the row log-sum-exp, D from the
output; :class:`FlashStyle`, which equals autograd in float64). The kernel's error against float64
may be at most twice the worse control's, plus a few ulps of the values' scale. Both controls are
needed: the FlashAttention-style backward rounds differently from autograd (over 288 float32 and
288 16-bit draws the kernel stayed within 2x of the worse control, but reached 3x of (1) alone on
small reduced gradients such as the bias's). Outputs are tied to the NumPy oracle, and gradients
to autograd of (1) in float64.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton.language as tl

import attnlab.functional as AF
import attnlab.reference as R
from attnlab.functional import additive
from attnlab.kernels import triton_additive
from conftest import check_under_cpu_autocast, np64

F64 = torch.float64
NAMES = ("query", "key", "value", "w_query", "w_key", "w_score", "bias")


def make(lead, L, S, Dq, Dk, Dv, A, seed=0):
    """Float64 leaves: query, key, value, w_query, w_key, w_score, bias (a ~ b ~ unit scale)."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((*lead, L, Dq), (*lead, S, Dk), (*lead, S, Dv), (A, Dq), (A, Dk), (A,), (A,))
    scales = (1, 1, 1, Dq**-0.5, Dk**-0.5, 1, 0.5)
    return [torch.randn(s, generator=g, dtype=F64) * c for s, c in zip(shapes, scales, strict=True)]


def scores_of(query, key, w_query, w_key, w_score, bias, mask, is_causal):
    """a, b, and the masked scores (-inf where a key may not be attended), in the inputs' dtype."""
    a = query @ w_query.T + bias  # (..., L, A)
    b = key @ w_key.T  # (..., S, A)
    L, S = a.shape[-2], b.shape[-2]
    keep = torch.ones(L, S, dtype=torch.bool)
    if is_causal:
        offset = S - L if is_causal == "bottom_right" else 0
        keep = torch.arange(S)[None, :] <= torch.arange(L)[:, None] + offset
    if mask is not None and mask.dtype == torch.bool:
        keep = keep & mask
    bias_ls = torch.zeros(keep.shape, dtype=a.dtype).masked_fill(~keep, float("-inf"))
    if mask is not None and mask.dtype != torch.bool:
        bias_ls = bias_ls + mask.to(a.dtype)  # (..., L, S)
    return a, b, bias_ls


def naive(query, key, value, w_query, w_key, w_score, bias, mask, is_causal):
    """Control 1: the textbook formula in the inputs' dtype, with autograd; dead rows 0."""
    a, b, bias_ls = scores_of(query, key, w_query, w_key, w_score, bias, mask, is_causal)
    scores = torch.tanh(a[..., :, None, :] + b[..., None, :, :]) @ w_score + bias_ls  # (.., L, S)
    alive = (scores != float("-inf")).any(-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(~alive, 0.0), -1).masked_fill(~alive, 0.0)
    return weights @ value


class FlashStyle(torch.autograd.Function):
    """Control 2: the kernel's own formulation, materialised in plain torch ops.

    The forward keeps the row log-sum-exp; the backward rebuilds P = exp(s - lse) and uses
    D = rowsum(dO * O), with O before its rounding to 16 bits, as the kernel does. Its float32
    rounding differs from autograd's (P is not renormalised), which is why it is a control too.
    In float64 it must equal autograd of :func:`naive` (checked below).
    """

    @staticmethod
    def forward(ctx, a, b, w, v, bias_ls):  # (..., L, A), (..., S, A), (A,), (..., S, Dv)
        s = torch.tanh(a[..., :, None, :] + b[..., None, :, :]) @ w + bias_ls  # (..., L, S)
        lse = torch.logsumexp(s, -1, keepdim=True)
        lse = lse.masked_fill(lse == float("-inf"), float("inf"))  # dead rows: P = 0
        wide = torch.promote_types(v.dtype, torch.float32)  # (D from this: the kernel keeps it)
        out = torch.exp(s - lse).to(wide) @ v.to(wide)
        ctx.save_for_backward(a, b, w, v, bias_ls, lse, out)
        return out.to(v.dtype)

    @staticmethod
    def backward(ctx, d_out):
        a, b, w, v, bias_ls, lse, out = ctx.saved_tensors
        t = torch.tanh(a[..., :, None, :] + b[..., None, :, :])  # (..., L, S, A)
        p = torch.exp(t @ w + bias_ls - lse)
        delta = (d_out.to(out.dtype) * out).sum(-1, keepdim=True).to(p.dtype)
        ds = p * (d_out @ v.transpose(-1, -2) - delta)
        g = ds[..., None] * w * (1 - t * t)  # (..., L, S, A)
        dw = (ds[..., None] * t).reshape(-1, w.shape[0]).sum(0)
        return g.sum(-2), g.sum(-3), dw, p.transpose(-1, -2) @ d_out, None


def flash_style(query, key, value, w_query, w_key, w_score, bias, mask, is_causal):
    a, b, bias_ls = scores_of(query, key, w_query, w_key, w_score, bias, mask, is_causal)
    return FlashStyle.apply(a, b, w_score, value, bias_ls)


def check(name, got, want, controls, dtype, ulps=4):
    """max|got - want| <= 2 max|control - want| (the worse control) + a few ulps at want's scale."""
    err = (got.detach().double() - want.double()).abs().max().item()
    ctl = max((c.detach().double() - want.double()).abs().max().item() for c in controls)
    floor = ulps * torch.finfo(dtype).eps * max(1.0, want.double().abs().max().item())
    assert err <= 2 * ctl + floor, f"{name}: error {err:.3g} > 2 x control {ctl:.3g} + {floor:.3g}"


def against_controls(leaves64, mask, causal, dtype, seed):
    """Output and gradients of the dispatch (the kernel), of both controls and of float64 autograd,
    with one upstream gradient: a list of (name, got, want, (control 1, control 2))."""
    runs = []
    for fn, dt in ((AF.additive_attention, dtype), (naive, dtype), (flash_style, dtype),
                   (naive, F64)):  # fmt: skip
        leaves = [t.to(dt).requires_grad_() for t in leaves64]
        m = mask if mask is None or mask.dtype == torch.bool else mask.to(dt)
        if fn is AF.additive_attention:
            out = fn(*leaves[:6], m, bias=leaves[6], is_causal=causal)
        else:
            out = fn(*leaves, m, causal)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=F64)
        runs.append([out, *torch.autograd.grad(out, leaves, grad.to(dt))])
    ours, ctl1, ctl2, want = runs
    controls = zip(ctl1, ctl2, strict=True)
    return list(zip(("output", *NAMES), ours, want, controls, strict=True))


def mask_of(kind, lead, L, S, seed=1):
    g = torch.Generator().manual_seed(seed)
    if kind is None:
        return None
    if kind == "bool":  # (..., L, S), with a row that may attend nothing
        mask = torch.rand(*lead, L, S, generator=g) > 0.3
        mask[..., 2, :] = False
        return mask
    if kind == "padding":  # (B, 1, 1, S) bool, True = real key: a broadcast view, not expanded
        lengths = torch.randint(1, S + 1, (lead[0],), generator=g)
        return (torch.arange(S)[None, :] < lengths[:, None])[:, None, None, :]
    if kind == "float":  # (L, S) additive bias with one row of -inf
        mask = torch.randn(L, S, generator=g, dtype=F64)
        mask[1] = float("-inf")
        return mask
    raise ValueError(kind)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Count the kernel's launches through the dispatch."""
    calls = []
    launch = triton_additive.additive_attention

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return launch(*args, **kwargs)

    monkeypatch.setattr(triton_additive, "additive_attention", spy)
    return calls


# (lead, L, S, Dq, Dk, Dv, A, mask, is_causal): odd lengths, L != S both ways, 2-D to 4-D inputs
CASES = [
    ((2,), 19, 23, 5, 6, 3, 7, None, False),
    ((2,), 23, 19, 4, 4, 20, 8, "bool", "top_left"),
    ((2,), 17, 37, 6, 3, 5, 6, "bool", "bottom_right"),
    ((1,), 37, 18, 3, 5, 4, 5, None, "bottom_right"),  # L > S: the first 19 rows see no key
    ((2, 2), 17, 17, 4, 4, 6, 4, "padding", True),
    ((), 5, 33, 4, 6, 2, 9, "float", False),
]


@pytest.mark.parametrize("kept", [True, False], ids=["scores-kept", "scores-recomputed"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-L{c[1]}-S{c[2]}-{c[7]}-{c[8]}")
def test_float32_output_and_gradients_against_the_oracle(case, kept, kernel_calls, monkeypatch):
    if not kept:  # the backward rebuilds the scores, as past the budget
        monkeypatch.setattr(triton_additive, "STORED_SCORES_BYTES", 0)
    lead, L, S, Dq, Dk, Dv, A, kind, causal = case
    leaves64 = make(lead, L, S, Dq, Dk, Dv, A)
    mask = mask_of(kind, lead, L, S)
    results = against_controls(leaves64, mask, causal, torch.float32, seed=2)
    assert len(kernel_calls) == 1  # the dispatch took the kernel
    oracle = R.additive_attention(
        *(np64(t) for t in leaves64[:6]), np64(mask), bias=np64(leaves64[6]), is_causal=causal
    )
    np.testing.assert_allclose(results[0][2].detach().numpy(), oracle, rtol=0, atol=1e-12)
    for name, got, want, controls in results:
        assert torch.isfinite(got).all(), name
        check(name, got, want, controls, torch.float32)


def test_the_flash_style_control_is_the_true_gradient_in_float64():
    lead, L, S, Dq, Dk, Dv, A, kind, causal = CASES[2]
    leaves = [t.requires_grad_() for t in make(lead, L, S, Dq, Dk, Dv, A)]
    mask = mask_of(kind, lead, L, S)
    grad = torch.randn(*lead, L, Dv, dtype=F64)
    want = torch.autograd.grad(naive(*leaves, mask, causal), leaves, grad)
    got = torch.autograd.grad(flash_style(*leaves, mask, causal), leaves, grad)
    for name, g, w in zip(NAMES, got, want, strict=True):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=0, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("hardware", [True, False], ids=["tanh.approx", "exp2-tanh"])
@pytest.mark.parametrize(
    "dtype,case",
    [(torch.bfloat16, CASES[1]), (torch.bfloat16, CASES[3]), (torch.float16, CASES[2])],
    ids=["bf16-bool-top_left", "bf16-L>S-bottom_right", "fp16-bool-bottom_right"],
)
def test_16bit_output_and_gradients_within_a_same_dtype_control(
    dtype, case, hardware, kernel_calls
):
    """Both tanh forms (the hardware one emulated here: its scale and slope are what run)."""
    lead, L, S, Dq, Dk, Dv, A, kind, causal = case
    leaves64 = make(lead, L, S, Dq, Dk, Dv, A, seed=3)
    leaves64 = [t.to(dtype).double() for t in leaves64]  # the oracle sees the 16-bit inputs
    mask = mask_of(kind, lead, L, S)
    with triton_additive.settings(HARDWARE_TANH_ON=(dtype,) if hardware else ()):
        results = against_controls(leaves64, mask, causal, dtype, seed=4)
    assert len(kernel_calls) == 1
    for name, got, want, controls in results:
        assert got.dtype == dtype and torch.isfinite(got).all(), name
        check(name, got, want, controls, dtype)


def test_rows_without_a_key_give_zero_output_and_zero_gradients(kernel_calls):
    # bottom-right causal with L > S: query i sees keys j <= i - (L - S); plus a masked-out row
    lead, L, S, Dq, Dk, Dv, A = (2,), 21, 16, 3, 4, 5, 6
    leaves = [t.float().requires_grad_() for t in make(lead, L, S, Dq, Dk, Dv, A, seed=5)]
    mask = torch.ones(L, S, dtype=torch.bool)
    mask[L - 1] = False  # the last row, which causal alone would let see every key
    out = AF.additive_attention(*leaves[:6], mask, bias=leaves[6], is_causal="bottom_right")
    assert len(kernel_calls) == 1
    dead = torch.zeros(L, dtype=torch.bool)
    dead[: L - S] = True
    dead[L - 1] = True
    assert (out[:, dead] == 0).all() and (out[:, ~dead] != 0).any(-1).all()
    out.sum().backward()
    for name, t in zip(NAMES, leaves, strict=True):
        assert torch.isfinite(t.grad).all(), name
    assert (leaves[0].grad[:, dead] == 0).all()  # no gradient reaches a dead query row


def test_a_row_finfo_min_covers_gets_the_gradients_of_uniform_weights(kernel_calls):
    """Before: the forward kept lse = m + log(l), which rounds log(l) away in a row whose scores
    finfo.min absorbed: the backward's P there was 1 per key, not 1/S (its gradients S times
    too large). Against the naive formula's autograd in float32 (which absorbs alike)."""
    lead, L, S, Dq, Dk, Dv, A = (2,), 9, 13, 4, 5, 3, 6
    leaves = [t.float().requires_grad_() for t in make(lead, L, S, Dq, Dk, Dv, A, seed=7)]
    bias = torch.zeros(L, S)
    bias[4] = torch.finfo(torch.float32).min  # row 4: every key
    bias[6, :5] = torch.finfo(torch.float32).min
    up = torch.randn(*lead, L, Dv, generator=torch.Generator().manual_seed(8))
    out = AF.additive_attention(*leaves[:6], bias, bias=leaves[6])
    assert len(kernel_calls) == 1
    got = torch.autograd.grad(out, leaves, up)
    want = torch.autograd.grad(naive(*leaves, bias, False), leaves, up)
    for name, g, w in zip(NAMES, got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=name)


def test_nan_inputs_propagate_as_the_other_paths_do(kernel_calls):
    leaves = [t.float() for t in make((2,), 9, 11, 3, 3, 2, 4, seed=6)]
    leaves[0][1, 4, 0] = float("nan")  # one query row of batch row 1
    out = AF.additive_attention(*leaves[:6], bias=leaves[6])
    assert len(kernel_calls) == 1
    assert out[1, 4].isnan().all() and not out[1, :4].isnan().any() and not out[0].isnan().any()


def test_explain_names_the_kernel_under_the_interpreter():
    leaves = [t.float() for t in make((2,), 9, 11, 3, 3, 2, 4)]
    got = additive.explain_additive(*leaves[:6], bias=leaves[6], is_causal="bottom_right")
    assert got.path == "triton", got
    assert "interpreter" in str(got) and "log-sum-exp" in str(got)


@pytest.mark.parametrize(
    "change,reason",
    [
        ("weights", "return_weights"),
        ("dropout", "dropout"),
        ("float64", "float64"),
        ("wide_value", "Dv=300"),
        ("mask_grad", "requires grad"),
    ],
)
def test_what_the_kernel_does_not_take_falls_back_and_says_why(change, reason, kernel_calls):
    lead, L, S = (2,), 5, 7
    leaves = [t.float() for t in make(lead, L, S, 3, 4, 300 if change == "wide_value" else 2, 4)]
    mask, kwargs = None, {}
    if change == "weights":
        kwargs["return_weights"] = True
    elif change == "dropout":
        kwargs["dropout_p"] = 0.5
    elif change == "float64":
        leaves = [t.double() for t in leaves]
    elif change == "mask_grad":
        mask = torch.zeros(L, S, requires_grad=True)
    got = additive.explain_additive(*leaves[:6], mask, bias=leaves[6], **kwargs)
    assert got.path == "chunked" and reason in str(got), got
    result = AF.additive_attention(*leaves[:6], mask, bias=leaves[6], **kwargs)
    assert kernel_calls == []
    if change in ("weights", "float64"):  # the chunked path's answer, checked against the oracle
        out, weights = result if change == "weights" else (result, None)
        want = R.additive_attention(
            *(np64(t) for t in leaves[:6]), bias=np64(leaves[6]), return_weights=True
        )
        tol = 1e-12 if change == "float64" else 1e-5
        np.testing.assert_allclose(out.detach().double().numpy(), want[0], rtol=0, atol=tol)
        if weights is not None:
            np.testing.assert_allclose(weights.double().numpy(), want[1], rtol=0, atol=tol)


def test_bad_input_raises_as_on_the_chunked_path():
    leaves = [t.float() for t in make((2,), 5, 7, 3, 4, 2, 4)]
    with pytest.raises(ValueError, match="ambiguous"):
        AF.additive_attention(*leaves[:6], bias=leaves[6], is_causal=True)  # L != S
    with pytest.raises(ValueError, match="w_query must be"):
        AF.additive_attention(leaves[0], leaves[1], leaves[2], leaves[4], *leaves[4:6])
    with pytest.raises(ValueError, match="does not broadcast"):
        AF.additive_attention(*leaves[:6], torch.ones(3, 7, dtype=torch.bool))
    with pytest.raises(TypeError, match="key and value must share one dtype"):
        AF.additive_attention(leaves[0], leaves[1], leaves[2].bfloat16(), *leaves[3:6])


def test_the_readable_reference_is_the_oracle():
    a, b, v = (torch.randn(2, n, m, dtype=F64) for n, m in ((5, 4), (7, 4), (7, 3)))
    w = torch.randn(4, dtype=F64)
    mask = torch.rand(2, 5, 7) > 0.4
    got = triton_additive.reference(a, b, w, v, mask, "bottom_right")
    ones = np.eye(4)  # a and b are the projections already: W_q = W_k = identity
    want = R.additive_attention(
        a.numpy(), b.numpy(), v.numpy(), ones, ones, w.numpy(), mask.numpy(),
        is_causal="bottom_right",
    )  # fmt: skip
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-12)


def test_under_assume_finite_the_kernel_skips_the_nan_rule(monkeypatch):
    """``attnlab.assume_finite()``: the fused additive kernel's result is returned unchecked,
    the same bit for bit for finite inputs."""
    from attnlab.functional import nonfinite

    q, k, v, w_q, w_k, w, b = (t.float() for t in make((2,), 19, 23, 8, 6, 5, 16))
    want = AF.additive_attention(q, k, v, w_q, w_k, w, bias=b)

    def check(*args, **kwargs):
        raise AssertionError("the inputs were checked")

    monkeypatch.setattr(nonfinite, "all_finite", check)
    monkeypatch.setattr(nonfinite, "nonfinite_rows", check)
    with AF.assume_finite():
        assert AF.explain_additive(q, k, v, w_q, w_k, w, bias=b).path == "triton"
        got = AF.additive_attention(q, k, v, w_q, w_k, w, bias=b)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_nan_weight_makes_a_fully_masked_row_nan_as_the_chunked_path_does(kernel_calls):
    """A NaN in w reaches every score; where the mask forbids all of a row's keys the kernel
    wrote -inf over them and returned a dead row's 0 (the chunked path and the oracle: NaN)."""
    q, k, v, wq, wk, w, _ = (t.float() for t in make((1,), 3, 5, 4, 4, 2, 6))
    w[0] = float("nan")
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1] = False  # row 1 may attend nothing
    out = AF.additive_attention(q, k, v, wq, wk, w, mask)
    chunked, _ = AF.additive_attention(q, k, v, wq, wk, w, mask, return_weights=True)
    oracle = R.additive_attention(*(np64(t) for t in (q, k, v, wq, wk, w)), np64(mask))
    assert len(kernel_calls) == 1
    assert out.isnan().all() and chunked.isnan().all() and np.isnan(oracle).all()


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("which", [3, 4, 5, 6], ids=NAMES[3:])
@pytest.mark.parametrize(
    "L,S,alignment", [(40, 4, "bottom_right"), (70, 70, "top_left")], ids=["L>S", "L=S"]
)
def test_a_nonfinite_weight_under_causality_gives_the_chunked_paths_rows(
    L, S, alignment, which, value, kernel_calls
):
    """A NaN or inf in W_q, W_k, w or the bias reaches scores causality forbids: a NaN or +inf
    there makes the row NaN. The causal kernel skipped those tiles, so the rows of query blocks
    that see no key gave 0 (before: rows 0-31 of 40 with a NaN in w, L > S)."""
    leaves = [t.float() for t in make((1,), L, S, 3, 3, 2, 5, seed=3)]
    leaves[which][0] = value
    out = AF.additive_attention(*leaves[:6], bias=leaves[6], is_causal=alignment)
    chunked, _ = AF.additive_attention(
        *leaves[:6], bias=leaves[6], is_causal=alignment, return_weights=True
    )
    assert len(kernel_calls) == 1
    assert torch.equal(out.isnan(), chunked.isnan())
    torch.testing.assert_close(out.nan_to_num(7.0), chunked.nan_to_num(7.0))
    if value != value or which == 5:  # (a NaN anywhere, or an inf in w: every row)
        assert out.isnan().all()


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_under_autocast_the_kernel_takes_float32_projections(bias, kernel_calls):
    """Autocast's bf16 projections reached the kernel, documented to take float32: without a
    bias the forward refused them (tl.exp2 of bf16), with one the backward's db accumulator
    was bf16 (atomic_add refused it in the interpreter)."""
    from attnlab.nn import AdditiveAttention

    torch.manual_seed(0)
    layer = AdditiveAttention(16, 12, 8, bias=bias)
    check_under_cpu_autocast(layer, torch.randn(2, 5, 16), torch.randn(2, 20, 12))
    assert len(kernel_calls) == 2  # (the float32 call and the autocast one)


def test_bf16_gradients_stay_within_twice_the_naive_formulas_error():
    """The backward's row term D = rowsum(dO * O) came from the bf16-rounded output: a bias in
    every dS that the tanh chain sums over A (query gradients 3.5x the naive bf16 formula's
    error here). Controls: the naive formula in bf16, against float64."""
    torch.manual_seed(0)
    L, S, Dq, Dk, A, Dv = 15, 18, 1, 20, 33, 100
    base = [torch.randn(L, Dq), torch.randn(S, Dk), torch.randn(S, Dv), torch.randn(A, Dq),
            torch.randn(A, Dk) / Dk**0.5, torch.randn(A)]  # fmt: skip
    g = torch.randn(L, Dv, dtype=F64)

    def grads(fn, dtype):
        x = [t.bfloat16().to(dtype).requires_grad_() for t in base]
        return torch.autograd.grad(fn(*x), x, g.to(dtype))

    def textbook(q, k, v, wq, wk, w):
        return torch.softmax(torch.tanh((q @ wq.T)[:, None] + (k @ wk.T)[None]) @ w, -1) @ v

    assert AF.explain_additive(*(t.bfloat16() for t in base)).path == "triton"
    exact, control = grads(textbook, F64), grads(textbook, torch.bfloat16)
    got = grads(AF.additive_attention, torch.bfloat16)
    for name, e, c, a in zip(NAMES, exact, control, got, strict=False):
        err, bound = (a.double() - e).abs().max().item(), 2 * (c.double() - e).abs().max().item()
        assert err <= bound, (name, err, bound)


# forward and backward tiles of other shapes: the backward reads kept scores in tiles the causal
# forward never visited (filled with -inf) and tiles it wrote in parts
OTHER_TILES = [
    triton_additive.Tiling(triton_additive.Blocks(16, 16, 1), triton_additive.Blocks(32, 16, 1)),
    triton_additive.Tiling(triton_additive.Blocks(32, 16, 1), triton_additive.Blocks(16, 32, 1)),
]


@pytest.mark.parametrize("tiling", OTHER_TILES, ids=["fwd16x16-bwd32x16", "fwd32x16-bwd16x32"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-L{c[1]}-S{c[2]}-{c[7]}-{c[8]}")
def test_kept_scores_give_the_recomputing_backwards_gradients_bit_for_bit(case, tiling):
    """The interpreter runs each tile's arithmetic element by element in a fixed order, so the
    scores the forward keeps are the ones the backward would rebuild: any tile read wrongly
    (an unvisited causal tile, a partial edge, a mask applied twice) changes a gradient."""
    lead, L, S, Dq, Dk, Dv, A, kind, causal = case
    leaves = [t.float() for t in make(lead, L, S, Dq, Dk, Dv, A, seed=11)]
    query, key, value, w_query, w_key, w_score, bias = leaves
    N = int(np.prod(lead)) if lead else 1
    mask = mask_of(kind, lead, L, S)
    if mask is not None:
        mask = mask.float() if mask.dtype != torch.bool else mask
        mask = mask.expand(*lead, L, S).reshape(N, L, S)
    alignment = None if not causal else ("top_left" if causal is True else causal)
    a = (query @ w_query.T + bias).reshape(N, L, A)
    b = (key @ w_key.T).reshape(N, S, A)
    v = value.reshape(N, S, Dv)
    up = torch.randn(N, L, Dv, generator=torch.Generator().manual_seed(12))
    runs = []
    for keep in (True, False):
        ins = [t.clone().requires_grad_() for t in (a, b, w_score, v)]
        out = triton_additive.additive_attention(
            *ins, mask, alignment, tiling=tiling, keep_scores=keep
        )
        runs.append([out, *torch.autograd.grad(out, ins, up)])
    for name, kept, again in zip(("output", "a", "b", "w", "value"), *runs, strict=True):
        assert torch.isfinite(kept).all(), name
        assert torch.equal(kept, again), f"{name}: {(kept - again).abs().max().item():.3g}"


def test_scores_are_kept_in_training_within_the_budget_only(monkeypatch):
    leaves = [t.float() for t in make((2,), 9, 11, 3, 3, 2, 4, seed=6)]
    kept = []
    launch = triton_additive._AdditiveAttention.apply

    def spy(*args):
        kept.append(args[-2])  # (keep_scores, then finite)
        return launch(*args)

    monkeypatch.setattr(triton_additive._AdditiveAttention, "apply", spy)
    AF.additive_attention(*leaves[:6], bias=leaves[6])  # nothing requires grad
    with torch.no_grad():
        AF.additive_attention(*leaves[:6], bias=leaves[6].requires_grad_())
    AF.additive_attention(*leaves[:6], bias=leaves[6])  # training: 2 x 9 x 11 floats
    because = str(AF.explain_additive(*leaves[:6], bias=leaves[6]))
    assert "keeps the (..., L, S) float32 scores for the backward (0.000755 MiB" in because
    monkeypatch.setattr(triton_additive, "STORED_SCORES_BYTES", 4 * 2 * 9 * 11 - 1)
    AF.additive_attention(*leaves[:6], bias=leaves[6])
    assert kept == [False, False, True, False]
    because = str(AF.explain_additive(*leaves[:6], bias=leaves[6]))
    assert "the backward recomputes the scores (they would take" in because
    with torch.no_grad():
        because = str(AF.explain_additive(*leaves[:6], bias=leaves[6]))
    assert "nothing kept for a backward" in because


def test_settings_take_known_names_only_and_are_restored():
    before = (triton_additive.STORED_SCORES_BYTES, triton_additive.HARDWARE_TANH_ON)
    with triton_additive.settings(STORED_SCORES_BYTES=0, HARDWARE_TANH_ON=()):
        assert (triton_additive.STORED_SCORES_BYTES, triton_additive.HARDWARE_TANH_ON) == (0, ())
    assert (triton_additive.STORED_SCORES_BYTES, triton_additive.HARDWARE_TANH_ON) == before
    with pytest.raises(ValueError, match=r"unknown \['STORED_SCORES'\]; expected"):
        with triton_additive.settings(STORED_SCORES=0):
            pass


def test_explain_names_the_tanh_and_the_interpreter_emulates_the_hardware_one():
    """tanh.approx.f32 is PTX: the interpreter emulates that one instruction (from its own
    argument), so the path around it runs in these tests; explain_additive() says which."""
    leaves = [t.to(torch.bfloat16) for t in make((2,), 9, 11, 3, 3, 2, 4, seed=6)]
    because = str(AF.explain_additive(*leaves[:6], bias=leaves[6]))
    assert "(tanh.approx.f32, emulated by exp2 in the interpreter)" in because
    with triton_additive.settings(HARDWARE_TANH_ON=()):
        because = str(AF.explain_additive(*leaves[:6], bias=leaves[6]))
    assert "tanh per score (exp2 and a reciprocal)" in because
    because = str(AF.explain_additive(*(t.float() for t in leaves[:6]), bias=leaves[6].float()))
    assert "tanh per score (exp2 and a reciprocal)" in because


def test_the_hardware_tanh_path_is_taken_and_its_scale_is_checked(monkeypatch):
    """The hardware path's own arithmetic (x = x2 ln(2) / 2, slope 1 - t^2) differs from the
    exp2 form's in the last bits (seen in float32, which it serves here only for this test), and
    with its scale wrong the results are wrong."""
    leaves = [t.float().requires_grad_() for t in make((2,), 19, 23, 5, 6, 3, 7)]

    def run(on):
        with triton_additive.settings(HARDWARE_TANH_ON=on):
            out = AF.additive_attention(*leaves[:6], bias=leaves[6])
            return [out, *torch.autograd.grad(out.sum(), leaves)]

    hw, exact = run((torch.float32,)), run(())
    assert any(not torch.equal(a, b) for a, b in zip(hw, exact, strict=True))
    for a, b in zip(hw, exact, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    monkeypatch.setattr(triton_additive, "HALF_LN2", tl.constexpr(0.5))  # (ln 2 / 2 ~ 0.347)
    wrong = run((torch.float32,))
    assert (wrong[0] - exact[0]).abs().max() > 1e-2
