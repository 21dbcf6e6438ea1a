"""How the kernels are launched: on their tensors' CUDA device, in grids CUDA accepts, with the
product settings of the interpreter.

Triton launches on the *current* CUDA device: a model spread over two GPUs (Hugging Face's
``device_map="auto"``) calls attention on ``cuda:1`` while ``cuda:0`` is current, and a launch
there is refused ("cannot be accessed from Triton"). So every launcher enters
``_triton.on_device(tensor)``; here (no GPU) a recorder stands in for it and the test checks
that each kernel -- forward, weights, backward, decode, additive forward and backward -- was
launched inside it, for the tensor the call was given.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

import attnlab
import attnlab.functional as AF
from attnlab import masks, reference
from attnlab.kernels import _triton
from attnlab.kernels import triton_additive as tadd
from attnlab.kernels import triton_attention as ta
from attnlab.kernels import triton_backward as tb
from attnlab.kernels import triton_decode as td
from attnlab.kernels import triton_nonfinite as tn


def test_the_guard_selects_the_tensors_cuda_device():
    guard = _triton.on_device(SimpleNamespace(device=torch.device("cuda", 1)))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1  # not entered: no GPU here
    assert isinstance(_triton.on_device(torch.zeros(1)), contextlib.nullcontext)


def test_every_launch_happens_inside_the_device_guard(monkeypatch):
    import triton.runtime.interpreter as interpreter

    entered: list[torch.device] = []
    depth = [0]
    launched: list[tuple[str, int]] = []

    @contextlib.contextmanager
    def recorder(t):
        entered.append(t.device)
        depth[0] += 1
        try:
            yield
        finally:
            depth[0] -= 1

    run = interpreter.InterpretedFunction.run

    def watched(self, *args, **kwargs):
        launched.append((self.fn.__name__, depth[0]))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(_triton, "on_device", recorder)
    monkeypatch.setattr(interpreter.InterpretedFunction, "run", watched)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for n in (40, 40, 40))
    attnlab.scaled_dot_product_attention(q, k, v, return_weights=True)  # forward + weights
    attnlab.scaled_dot_product_attention(q, k, v, return_weights="average")
    attnlab.scaled_dot_product_attention(q[:, :, :1], k, v, return_weights=True)  # decode
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    pad = attnlab.masks.padding_mask([40])  # lengths: the Triton path trains too
    attnlab.scaled_dot_product_attention(*leaves, pad, is_causal=True).sum().backward()
    wq, wk, ws = torch.randn(8, 16), torch.randn(8, 16), torch.randn(8)
    x = [t.clone().requires_grad_() for t in (q, k)]
    AF.additive_attention(x[0], x[1], v, wq, wk, ws).sum().backward()

    names = {name for name, _ in launched}
    assert names == {"_forward_kernel", "_head_weights_kernel", "_weights_kernel",
                     "_decode_kernel", "_merge_kernel", "_dkdv_kernel", "_dq_kernel",
                     "_fwd_kernel", "_bwd_kernel"}, names  # fmt: skip
    assert all(depth >= 1 for _, depth in launched), launched
    assert set(entered) == {torch.device("cpu")}


def test_grids_stay_within_cudas_limits_for_70000_heads(monkeypatch):
    """CUDA refuses a grid whose y or z passes 65,535 blocks: B * H there would refuse 65,536
    heads (windows folded into the batch). Launches are recorded, not run."""
    import triton.runtime.interpreter as interpreter

    grids: dict[str, tuple] = {}

    def record(self, *args, grid, **kwargs):
        grids[self.fn.__name__] = tuple(grid)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", record)
    heads, E = 70_000, 16
    q = torch.zeros(1, heads, 1, E)
    kv = torch.zeros(1, heads, 2, E)
    out, lse = ta.attention_forward(q, kv, kv)
    ta.attention_weights(q, kv, lse)
    ta.attention_weights(q, kv, lse, average=True)
    tn.nonfinite_rows(q, kv, kv)
    tb.attention_backward(q, kv, kv, out, lse, out, None, None, 0.25, None, None)
    td.decode_attention(q, kv, kv)
    a, b = torch.zeros(heads, 1, 8), torch.zeros(heads, 2, 8)
    value = torch.zeros(heads, 2, E, requires_grad=True)
    tadd.additive_attention(a, b, torch.zeros(8), value).sum().backward()
    assert set(grids) == {"_forward_kernel", "_weights_kernel", "_head_weights_kernel",
                          "_dkdv_kernel", "_dq_kernel", "_decode_kernel", "_merge_kernel",
                          "_fwd_kernel", "_bwd_kernel", "_kv_kernel",
                          "_rows_kernel"}, grids  # fmt: skip
    for name, grid in grids.items():
        assert grid[0] <= 2**31 - 1 and all(g <= 65_535 for g in grid[1:]), (name, grid)
        if name != "_weights_kernel":  # (averaged weights: a program sums all heads)
            assert grid[0] >= heads, (name, grid)  # every head has its programs


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # (NaN on purpose)
def test_a_nan_or_inf_bias_makes_its_row_nan_not_dead():
    """The NaN rule: a row whose scores hold a NaN (or +inf) is NaN, in the output and the
    weights; only masks make a row dead (0). A NaN row's running sum is NaN, not > 0."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(3))
    bias = torch.zeros(1, 2, 40, 40)
    bias[0, 0, 1, 3] = float("nan")
    bias[0, 1, 4, 2] = float("inf")
    bias[0, 1, 6] = float("-inf")  # a dead row stays 0
    for alignment in (None, "top_left"):
        want_out, want_w = reference.scaled_dot_product_attention(
            *(t.double().numpy() for t in (q, k, v, bias)), is_causal=alignment or False,
            return_weights=True,
        )  # fmt: skip
        out, lse = ta.attention_forward(q, k, v, bias, alignment)
        w = ta.attention_weights(q, k, lse, bias, alignment)
        for got, want in ((out, want_out), (w, want_w)):
            got = got.double().numpy()
            assert (torch.isnan(torch.from_numpy(got)) == torch.isnan(torch.from_numpy(want))).all()
            finite = ~torch.isnan(torch.from_numpy(want)).numpy()
            assert abs(got[finite] - want[finite]).max() < 1e-5
        assert (out[0, 1, 6] == 0).all() and torch.isfinite(out[0, 0, 0]).all()
        if alignment is None:  # (causal: key 3 is hidden from row 1, and its NaN with it)
            assert torch.isnan(out[0, 0, 1]).all() and torch.isnan(out[0, 1, 4]).all()
    d = attnlab.explain(q, k, v, bias, return_weights=True)
    assert d.path == "triton", d
    o, w = attnlab.scaled_dot_product_attention(q, k, v, bias, return_weights=True)
    assert torch.isnan(o[0, 0, 1]).all() and torch.isnan(w[0, 0, 1]).all()


def test_a_second_derivative_through_the_kernels_raises():
    """The kernels' gradients carry no graph: differentiating them again must raise, not give a
    silent zero (a gradient penalty would be dropped)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, 16, generator=g, requires_grad=True) for _ in range(3))
    pad = masks.padding_mask([24])
    assert attnlab.explain(q, k, v, pad).path == "triton"
    out = attnlab.scaled_dot_product_attention(q, k, v, pad)
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="Triton attention kernel computes first"):
        dq.square().sum().backward()


def test_interpreted_products_are_ieee_with_bfloat16_widened_whatever_the_device():
    """The interpreter's tl.dot multiplies bfloat16's raw bits: widened, it is exact. The choice
    follows TRITON_INTERPRET (it also runs CUDA tensors), never the device."""
    assert tadd.products(torch.bfloat16) == {"PRECISION": "ieee", "WIDEN": True}
    assert tadd.products(torch.float32) == {"PRECISION": "ieee", "WIDEN": False}
    assert tadd.tiling_for(256) == tadd.TILINGS["interpreter"]
