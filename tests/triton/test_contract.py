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
