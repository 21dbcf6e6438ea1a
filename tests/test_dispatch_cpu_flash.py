"""The dispatch sends dropout and 16-bit training on CPU to attnlab's blocked kernel (issue 10)."""

from __future__ import annotations

import pytest
import torch

import attnlab.functional as AF
from attnlab.functional import sdpa


def qkv(dtype=torch.float32, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 33, 16, generator=g).to(dtype)
    k = torch.randn(2, 2, 40, 16, generator=g).to(dtype)
    v = torch.randn(2, 2, 40, 8, generator=g).to(dtype)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def test_dropout_on_cpu_takes_the_blocked_kernel_and_says_why():
    q, k, v = qkv()
    d = AF.explain(q, k, v, dropout_p=0.1)
    assert d.path == "cpu_flash" and "no dropout" in str(d) and "blocked CPU kernel" in str(d)
    q, k, v = qkv(torch.float64)  # float64 stays on the exact eager path, and says why
    d = AF.explain(q, k, v, dropout_p=0.1)
    assert d.path == "eager" and "does not serve: torch.float64" in str(d)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_training_takes_the_kernel_inference_keeps_torchs(dtype):
    q, k, v = qkv(dtype, grad=True)
    assert AF.explain(q, k, v, is_causal="bottom_right").path == "cpu_flash"
    with torch.no_grad():
        assert AF.explain(q, k, v).path == "fused"
    assert AF.explain(*qkv(torch.float32, grad=True)).path == "fused"  # torch is faster there


@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_the_dispatched_kernel_equals_the_eager_formula_with_gradients(causal):
    q, k, v = qkv(torch.bfloat16, grad=True)
    mask = torch.rand(2, 1, 33, 40, generator=torch.Generator().manual_seed(1)) > 0.2
    out = AF.scaled_dot_product_attention(q, k, v, mask, is_causal=causal)
    out.float().square().sum().backward()
    got = (out.detach().float(), *(t.grad.float() for t in (q, k, v)))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = sdpa._eager(q64, k64, v64, mask, causal or None, 16**-0.5, 0.0)[0]
    ref.square().sum().backward()
    want = (ref.detach(), q64.grad, k64.grad, v64.grad)
    for a, b in zip(got, want, strict=True):  # bf16 rounding of inputs and output
        torch.testing.assert_close(a, b.float(), rtol=0.05, atol=0.05)


def test_dropout_through_the_dispatch_is_reproducible_and_unbiased():
    q, k, v = qkv()
    torch.manual_seed(3)
    a = AF.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(3)
    b = AF.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(a, AF.scaled_dot_product_attention(q, k, v, dropout_p=0.3))
    torch.manual_seed(4)  # the mean's bound below is loose, but seeded: CI cannot flake
    mean = torch.stack(
        [AF.scaled_dot_product_attention(q, k, v, dropout_p=0.3) for _ in range(200)]
    ).mean(0)
    want = AF.scaled_dot_product_attention(q, k, v)
    assert (mean - want).abs().mean() < 0.05 * want.abs().mean()


def test_compiled_calls_keep_torchs_ops():
    q, k, v = qkv(torch.bfloat16, grad=True)
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v: AF.scaled_dot_product_attention(q, k, v), fullgraph=True)
    out = fn(q, k, v)
    torch.testing.assert_close(out, AF.scaled_dot_product_attention(q, k, v), rtol=0.02, atol=0.02)
