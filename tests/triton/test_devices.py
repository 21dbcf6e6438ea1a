"""Every kernel launch runs on its tensors' CUDA device.

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

import torch

import attnlab
import attnlab.functional as AF
from attnlab.kernels import _triton


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
    attnlab.scaled_dot_product_attention(q[:, :, :1], k, v, return_weights=True)  # decode
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    pad = attnlab.masks.padding_mask([40])  # lengths: the Triton path trains too
    attnlab.scaled_dot_product_attention(*leaves, pad, is_causal=True).sum().backward()
    wq, wk, ws = torch.randn(8, 16), torch.randn(8, 16), torch.randn(8)
    x = [t.clone().requires_grad_() for t in (q, k)]
    AF.additive_attention(x[0], x[1], v, wq, wk, ws).sum().backward()

    names = {name for name, _ in launched}
    assert names == {"_forward_kernel", "_weights_kernel", "_decode_kernel", "_dkdv_kernel",
                     "_dq_kernel", "_fwd_kernel", "_bwd_kernel"}, names  # fmt: skip
    assert all(depth >= 1 for _, depth in launched), launched
    assert set(entered) == {torch.device("cpu")}
