"""torch.func transforms through attnlab: vmap, grad, vmap(grad) (per-sample gradients), jvp.

Before, every call under ``vmap`` raised (the NaN rule's screen read values on the host), the
weights path raised under ``grad``, and forward-mode AD raised on torch's fused CPU kernel and
on the additive path. Each case here is compared with the same call made without the transform
(a loop over the batch, autograd, or central differences in float64).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.func import functional_call, grad, jvp, stack_module_state, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnlab.functional as AF
from attnlab import masks
from attnlab.nn import MultiHeadAttention
from conftest import check_under_cpu_autocast

N = 3  # the vmapped dim
F64 = torch.float64


@pytest.fixture(autouse=True)
def _no_per_sample_loops():
    # torch warns (once a process) when vmap loops over an op without a batching rule, as its
    # fused CPU kernel: attnlab takes the readable formula under vmap, which never should
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="There is a performance drop")
        yield


def batch(seed=0, dtype=torch.float32):
    """(N, B, H, L, E) queries, (N, B, Hkv, S, E) keys and (N, B, Hkv, S, Ev) values."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(N, 2, 4, 5, 8, generator=g, dtype=dtype),
        torch.randn(N, 2, 2, 7, 8, generator=g, dtype=dtype),
        torch.randn(N, 2, 2, 7, 6, generator=g, dtype=dtype),
    )


def looped(f, *args):
    """f over the leading dim of every argument, stacked (what vmap must equal)."""
    outs = [f(*(a[i] for a in args)) for i in range(N)]
    if isinstance(outs[0], tuple):
        return tuple(torch.stack(parts) for parts in zip(*outs, strict=True))
    return torch.stack(outs)


def assert_same(got, want):
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


MASKS = {
    "none": None,
    "bool": torch.rand(N, 2, 1, 5, 7, generator=torch.Generator().manual_seed(1)) > 0.3,
    "float": torch.randn(N, 2, 1, 5, 7, generator=torch.Generator().manual_seed(2)),
}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"is_causal": "bottom_right"},
        {"return_weights": True},
        {"return_weights": "average"},
        {"scale": 0.3},
    ],
    ids=["plain", "causal", "weights", "averaged", "scale"],
)
def test_vmap_equals_a_loop(kw, mask):
    q, k, v = batch()
    m = MASKS[mask]
    if m is None:

        def f(a, b, c):
            return AF.scaled_dot_product_attention(a, b, c, **kw)

        assert_same(vmap(f)(q, k, v), looped(f, q, k, v))
    else:

        def f(a, b, c, d):
            return AF.scaled_dot_product_attention(a, b, c, d, **kw)

        assert_same(vmap(f)(q, k, v, m), looped(f, q, k, v, m))


def test_vmap_keeps_the_nan_rule_per_sample():
    q, k, v = batch()
    q[1, 0, 1, 2, 0] = float("nan")
    out = vmap(AF.scaled_dot_product_attention)(q, k, v)
    assert out[1, 0, 1, 2].isnan().all()
    assert int(out.isnan().any(-1).sum()) == 1  # that row of that sample only


def test_explain_under_vmap_names_the_path_and_why():
    q, k, v = batch()
    seen = []

    def f(a, b, c):
        seen.append(AF.explain(a, b, c, return_weights=True))
        seen.append(AF.explain(a, b, c))
        return AF.scaled_dot_product_attention(a, b, c, return_weights=True)

    vmap(f)(q, k, v)
    assert seen[0].path == "eager" and "torch.func (vmap)" in seen[0].reasons[0]
    # plain calls too: torch's fused CPU kernel has no batching rule (vmap would loop over it)
    assert seen[1].path == "eager"


def test_per_sample_gradients_equal_a_loop():
    q, k, v = batch(dtype=F64)
    pad = masks.padding_mask([3, 7], 7)

    def loss(a, b, c):
        out, w = AF.scaled_dot_product_attention(a, b, c, pad, return_weights=True)
        return out.square().sum() + w.square().sum()

    got = vmap(grad(loss, argnums=(0, 1, 2)))(q, k, v)
    want = looped(grad(loss, argnums=(0, 1, 2)), q, k, v)
    assert_same(got, want)
    plain = vmap(grad(lambda a, b, c: AF.scaled_dot_product_attention(a, b, c).sum()))(q, k, v)
    assert_same(
        plain, looped(grad(lambda a, b, c: AF.scaled_dot_product_attention(a, b, c).sum()), q, k, v)
    )


@pytest.mark.parametrize("return_weights", [True, "average"])
def test_func_grad_of_weights_equals_autograd(return_weights):
    q, k, v = (t[0] for t in batch(dtype=F64))

    def loss(a, b, c):
        out, w = AF.scaled_dot_product_attention(a, b, c, return_weights=return_weights)
        return out.sum() + w.square().sum()

    got = grad(loss, argnums=(0, 1, 2))(q, k, v)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    loss(*leaves).backward()
    assert_same(tuple(got), tuple(t.grad for t in leaves))


@pytest.mark.parametrize(
    "kw",
    [{}, {"is_causal": "bottom_right"}, {"attn_mask": "bool"}, {"return_weights": True}],
    ids=["plain", "causal", "mask", "weights"],
)
def test_jvp_equals_central_differences(kw):
    q, k, v = (t[0] for t in batch(dtype=F64))
    if kw.get("attn_mask") == "bool":
        kw = {"attn_mask": MASKS["bool"][0]}

    def f(a):
        out = AF.scaled_dot_product_attention(a, k, v, **kw)
        return out[0] if isinstance(out, tuple) else out

    t = torch.randn(q.shape, dtype=F64, generator=torch.Generator().manual_seed(5))
    _, got = jvp(f, (q,), (t,))
    eps = 1e-6
    torch.testing.assert_close(
        got, (f(q + eps * t) - f(q - eps * t)) / (2 * eps), rtol=1e-6, atol=1e-7
    )
    with torch.autograd.forward_ad.dual_level():  # forward AD without torch.func, the same
        dual = torch.autograd.forward_ad.make_dual(q, t)
        tangent = torch.autograd.forward_ad.unpack_dual(f(dual)).tangent
    torch.testing.assert_close(tangent, got)


def test_additive_attention_under_vmap_grad_and_jvp():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(N, 2, n, d, generator=g, dtype=F64) for n, d in ((5, 8), (7, 6), (7, 4)))
    w_q, w_k, w = (torch.randn(*s, generator=g, dtype=F64) for s in ((16, 8), (16, 6), (16,)))

    def f(a, b, c):
        return AF.additive_attention(a, b, c, w_q, w_k, w, return_weights=True)

    assert_same(vmap(f)(q, k, v), looped(f, q, k, v))

    def loss(a, b, c):
        return AF.additive_attention(a, b, c, w_q, w_k, w).square().sum()

    got = grad(loss, argnums=(0, 1, 2))(q[0], k[0], v[0])
    leaves = [t[0].clone().requires_grad_() for t in (q, k, v)]
    loss(*leaves).backward()
    assert_same(tuple(got), tuple(t.grad for t in leaves))
    assert_same(
        vmap(grad(loss, argnums=(0, 1)))(q, k, v), looped(grad(loss, argnums=(0, 1)), q, k, v)
    )
    t = torch.randn(q[0].shape, generator=g, dtype=F64)
    _, tangent = jvp(lambda a: f(a, k[0], v[0])[0], (q[0],), (t,))
    eps = 1e-6
    fd = (f(q[0] + eps * t, k[0], v[0])[0] - f(q[0] - eps * t, k[0], v[0])[0]) / (2 * eps)
    torch.testing.assert_close(tangent, fd, rtol=1e-6, atol=1e-7)


def test_vmap_dropout_draws_per_sample_masks_when_asked():
    q = torch.randn(2, 4, 64, 8).expand(N, -1, -1, -1, -1)

    def f(a):
        return AF.scaled_dot_product_attention(a, a, a, dropout_p=0.5, return_weights=True)

    _, w = vmap(f, randomness="different")(q)
    dropped = w == 0
    assert abs(dropped.double().mean() - 0.5) < 0.02  # 98,304 draws: std 0.0016
    assert not torch.equal(dropped[0], dropped[1])
    _, w = vmap(f, randomness="same")(q)
    assert torch.equal(w[0], w[1])


def test_an_ensemble_of_layers_under_vmap_equals_each_layer():
    torch.manual_seed(0)
    layers = [MultiHeadAttention(16, 4, num_kv_heads=2) for _ in range(N)]
    params, buffers = stack_module_state(layers)
    base = copy.deepcopy(layers[0]).to("meta")
    x = torch.randn(2, 5, 16)
    key_mask = torch.tensor([[True] * 5, [True, True, True, False, False]])

    def f(p, b):
        return functional_call(base, (p, b), (x,), {"key_mask": key_mask, "return_weights": True})

    got = vmap(f)(params, buffers)
    want = [layer(x, key_mask=key_mask, return_weights=True) for layer in layers]
    assert_same(got, tuple(torch.stack(parts) for parts in zip(*want, strict=True)))


def test_compiled_and_exported_graphs_stay_whole():
    # the transforms question must not break a graph; additive attention's tanh choice (a
    # measurement) was a graph break under fullgraph=True, and an exported module holding
    # AdditiveAttention raised ("functions with out=... arguments don't support automatic
    # differentiation")
    from attnlab.nn import AdditiveAttention

    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 4)
    x, key_mask = torch.randn(2, 5, 16), torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    f = torch.compile(lambda x, m: layer(x, key_mask=m, return_weights=True), fullgraph=True)
    assert_same(f(x, key_mask), layer(x, key_mask=key_mask, return_weights=True))

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = AdditiveAttention(8, 6, 5)

        def forward(self, q, k, m):
            return self.attention(q, k, key_mask=m)

    model = Wrapped()
    q, k, m = torch.randn(2, 3, 8), torch.randn(2, 4, 6), key_mask[:, :4]
    compiled = torch.compile(model, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, m), model(q, k, m))
    exported = torch.export.export(model, (q, k, m))
    torch.testing.assert_close(exported.module()(q, k, m), model(q, k, m))


def test_second_derivatives_are_not_silently_zero():
    # a kernel's once-differentiable backward under a nested torch.func.grad gave 0 (not an
    # error): nested grads take the readable formula
    g = torch.Generator().manual_seed(4)
    q, k = (
        torch.randn(2, 3, 4, generator=g, dtype=F64),
        torch.randn(2, 5, 4, generator=g, dtype=F64),
    )
    w_q, w_k, w = (torch.randn(*s, generator=g, dtype=F64) for s in ((6, 4), (6, 4), (6,)))

    def loss(a):
        return AF.additive_attention(a, k, k, w_q, w_k, w).square().sum()

    got = grad(lambda a: grad(loss)(a).square().sum())(q)
    leaf = q.clone().requires_grad_()
    naive = torch.tanh((leaf @ w_q.T)[:, :, None] + (k @ w_k.T)[:, None]) @ w
    first = torch.autograd.grad(
        (torch.softmax(naive, -1) @ k).square().sum(), leaf, create_graph=True
    )
    (want,) = torch.autograd.grad(first[0].square().sum(), leaf)
    assert want.abs().max() > 1e-3
    torch.testing.assert_close(got, want)

    seen = []

    def sdpa_loss(a):
        seen.append(AF.explain(a, a, a, dropout_p=0.1).path)
        return AF.scaled_dot_product_attention(a, a, a).square().sum()

    x = torch.randn(1, 2, 4, 8, generator=g)
    grad(lambda a: grad(sdpa_loss)(a).sum())(x)
    assert seen == ["eager"]  # (under one grad the blocked CPU kernel serves dropout)
    seen.clear()
    grad(sdpa_loss)(x)
    assert seen == ["cpu_flash"]


@pytest.mark.parametrize("weights", [True, "average"])
def test_second_derivatives_under_torchs_math_backend(weights):
    """torch's sdpa_kernel(SDPBackend.MATH) asks for the readable formula: attnlab's kernels
    (whose backwards are first-derivative only) stand aside, and gradgradcheck passes."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, n, 4, generator=g, dtype=F64, requires_grad=True)
               for n in (3, 5, 5))  # fmt: skip
    w_q, w_k, w = (torch.randn(*s, generator=g, dtype=F64) for s in ((6, 4), (6, 4), (6,)))
    mask = torch.tensor([True, True, False, True, True])

    def sdpa(*t):
        out, p = AF.scaled_dot_product_attention(*t, mask, return_weights=weights)
        return out.square().sum() + p.square().sum()

    def additive(*t):
        return AF.additive_attention(*t, w_q, w_k, w, attn_mask=mask).square().sum()

    assert AF.explain(q, k, v, mask, return_weights=weights).path == "weights"
    assert "chunked" in str(AF.explain_additive(q, k, v, w_q, w_k, w, attn_mask=mask))
    with pytest.raises(RuntimeError, match="computes first derivatives only"):
        (d,) = torch.autograd.grad(sdpa(q, k, v), q, create_graph=True)
        d.sum().backward()
    with sdpa_kernel(SDPBackend.MATH):
        for kw in ({"return_weights": weights}, {"dropout_p": 0.1}):
            explained = AF.explain(q, k, v, mask, **kw)
            assert explained.path == "eager" and "math backend only" in str(explained)
        assert "SDPBackend.MATH" in str(AF.explain_additive(q, k, v, w_q, w_k, w))
        assert torch.autograd.gradgradcheck(sdpa, (q, k, v))
        assert torch.autograd.gradgradcheck(additive, (q, k, v))
        assert AF.explain(q.float(), k.float(), v.float(), dropout_p=0.1).path == "eager"
    assert AF.explain(q.float(), k.float(), v.float(), dropout_p=0.1).path == "cpu_flash"


def test_a_second_derivative_through_a_kernel_names_it_and_the_way_out():
    # torch's once_differentiable said "trying to differentiate twice" and, where the incoming
    # gradient needed none (a plain sum), returned gradients with no graph: "does not require
    # grad" at the second backward
    q = torch.randn(1, 2, 6, 8, requires_grad=True)
    assert AF.explain(q, q, q, dropout_p=0.1).path == "cpu_flash"
    for loss in (lambda o: o.square().sum(), lambda o: o.sum()):
        out = AF.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
        (d,) = torch.autograd.grad(loss(out), q, create_graph=True)
        with pytest.raises(RuntimeError) as err:
            d.square().sum().backward()
        message = str(err.value)
        assert "attnlab's blocked CPU kernel computes first derivatives only" in message
        assert "sdpa_kernel(SDPBackend.MATH)" in message and "torch.func.grad" in message
    out = AF.scaled_dot_product_attention(q, q, q, dropout_p=0.1)  # first derivatives: as ever
    (d,) = torch.autograd.grad(out.sum(), q)
    assert not d.requires_grad and d.abs().sum() > 0


def test_compiled_causal_and_window_calls_do_not_recompile_per_length():
    # the size checks of the mask builders once specialised a dynamic graph to each length
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()

    def f(q, k, v):
        return AF.scaled_dot_product_attention(q, k, v, is_causal="bottom_right")

    compiled = torch.compile(f, backend=counter, dynamic=True)
    layer = MultiHeadAttention(16, 2, sliding_window=3, is_causal=True).eval()
    layer_counter = CompileCounter()
    compiled_layer = torch.compile(layer, backend=layer_counter, dynamic=True)
    for n in (3, 4, 5, 6):
        q, k = torch.randn(1, 2, n, 8), torch.randn(1, 2, n + 2, 8)
        torch.testing.assert_close(compiled(q, k, k), f(q, k, k))
        x = torch.randn(1, n, 16)
        torch.testing.assert_close(compiled_layer(x), layer(x))
    assert counter.frame_count == 1 and layer_counter.frame_count == 1


def test_additive_attention_under_cpu_autocast_takes_a_bf16_projection():
    # the dtype check refused the bf16 keys that a projection gives under autocast beside the
    # float32 encoder states (attnlab train --precision bf16 with Bahdanau attention)
    from attnlab.nn import AdditiveAttention

    torch.manual_seed(0)
    layer = AdditiveAttention(8, 6, 5)
    q, enc = torch.randn(2, 3, 8), torch.randn(2, 4, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        keys = layer.project_keys(enc)
        out = layer(q, enc, keys_proj=keys)
    assert keys.dtype == torch.bfloat16
    want = layer(q, enc)  # float32 throughout; autocast rounds the projections to bf16
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=0)


@pytest.mark.parametrize("kind", ["additive, no bias", "luong concat"])
def test_additive_layers_without_a_bias_run_under_cpu_autocast(kind):
    """Without a bias to promote it, the query side stayed bf16 under autocast and met the
    float32 score vector in a matmul with out= (a crash; the translator's --precision bf16
    with Luong concat)."""
    from attnlab.nn import AdditiveAttention, LuongAttention

    torch.manual_seed(0)
    if kind == "luong concat":
        layer = LuongAttention(16, 12, "concat", attn_dim=8)
    else:
        layer = AdditiveAttention(16, 12, 8, bias=False)
    check_under_cpu_autocast(layer, torch.randn(2, 5, 16), torch.randn(2, 20, 12))


def test_additive_key_gradients_under_autocast_do_not_round_at_every_row_block(monkeypatch):
    """Under autocast the key projection b = W_k k came out bf16, and the backward summed db
    over row blocks in bf16: with 512 one-row blocks, dk's error was 13x the naive formula's
    under the same autocast. Now within 2x, as with one block."""
    from attnlab.functional import additive

    g = torch.Generator().manual_seed(0)
    L, S, D, A, Dv = 512, 16, 16, 16, 8
    shapes = ((1, L, D), (1, S, D), (1, S, Dv), (A, D), (A, D), (A,), (A,))
    scales = (1, 1, 1, 0.25, 0.25, 1, 0.25)
    leaves = [torch.randn(s, generator=g) * c for s, c in zip(shapes, scales, strict=True)]
    grad = torch.randn(1, 1, Dv, generator=g).expand(1, L, Dv)  # one sign per column: no cancelling

    def naive(q, k, v, wq, wk, w, b):
        scores = torch.tanh((q @ wq.T + b)[..., :, None, :] + (k @ wk.T)[..., None, :, :]) @ w
        return torch.softmax(scores, -1) @ v

    def key_grads(fn, dtype=None):
        xs = [t.to(dtype or t.dtype).requires_grad_() for t in leaves]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is None):
            out = fn(*xs)
        return torch.autograd.grad(out, [xs[1], xs[4]], grad.to(out.dtype))

    ref = key_grads(naive, torch.float64)
    control = key_grads(naive)
    monkeypatch.setattr(additive, "CHUNK_BYTES", 4 * S * A)  # one query row per block
    got = key_grads(lambda q, k, v, wq, wk, w, b: AF.additive_attention(q, k, v, wq, wk, w, bias=b))
    for name, x, c, r in zip(("key", "w_key"), got, control, ref, strict=True):
        err, ctl = (x.double() - r).norm() / r.norm(), (c.double() - r).norm() / r.norm()
        assert err <= 2 * ctl, f"{name}: relative error {err:.2e} > 2 x {ctl:.2e}"
