"""When attnlab's Triton kernels run, in one place.

A Triton kernel serves a tensor when Triton is installed and either

* the tensor is on a CUDA device (the compiled kernel), or
* ``TRITON_INTERPRET=1`` was set before attnlab was imported and the tensor is on the CPU: Triton's
  interpreter then runs the *same* kernel code with NumPy. That is how CI (no GPU) tests every
  kernel, and how a reader can step through one. It is slow: never a production path.

Without Triton everything runs on the existing paths. The kernel modules (``triton_*.py``) import
Triton at their top; import them only after :func:`unfit` returned None.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import torch

# Read once, when attnlab is imported: Triton decides at decoration time (``@triton.jit``)
# whether a kernel is compiled or interpreted, so a later change would not take effect.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Tiles allowed to spill registers because a GPU timed them faster than every tile that does
# not (benchmarks/gpu_compile.py fails on any other spill): kernel name -> (rows, keys, warps).
# The additive backward in float32 (~850 B, 1.5-2.5x faster than the tiles that spill nothing,
# H200); the 16-bit dK/dV kernel at 64 x 64 (16-352 B with Triton 3.9; fwd+bwd with padding at
# (4, 32, 4096, 128) 12.0 vs 19.6 ms at its spill-free 32 x 32, causal 9.1 vs 12.8; at
# (8, 16, 1024, 64) 1.43 vs 1.69 and 1.60 vs 1.78 ms; H100, Triton 3.6).
SPILLS_TIMED = {"_bwd_kernel": (128, 32, 4), "_dkdv_kernel": (64, 64, 4)}


@functools.cache
def installed() -> bool:
    """Whether the ``triton`` package can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def unfit(*tensors: torch.Tensor | None) -> str | None:
    """None when a Triton kernel can run on these tensors, else why not (for ``explain()``)."""
    if not installed():
        return "Triton is not installed (pip install triton)"
    present = [t.device for t in tensors if t is not None]
    if len(set(present)) > 1:  # (the checks raise before this, for the public calls)
        return f"tensors on several devices ({', '.join(map(str, present))})"
    devices = {d.type for d in present}
    if devices == {"cuda"}:
        return None
    if devices == {"cpu"} and INTERPRET:
        return None
    if devices == {"cpu"}:
        return "CPU tensors (Triton kernels run on CUDA, or on CPU under TRITON_INTERPRET=1)"
    return f"tensors on {sorted(devices)}"


def on_device(t: torch.Tensor):
    """The context to launch a kernel on ``t``'s device in.

    Triton launches on the *current* CUDA device, not on the tensors': a tensor on ``cuda:1``
    while ``cuda:0`` is current (a model spread over two GPUs) would be refused ("cannot be
    accessed from Triton") or read from the wrong device. Every launcher enters this first.
    """
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def where() -> str:
    """How a kernel runs: ``"Triton interpreter"`` or ``"Triton (CUDA)"``."""
    return "Triton interpreter (TRITON_INTERPRET=1)" if INTERPRET else "Triton (CUDA)"


INT32_MAX = 2**31 - 1


def offsets_unfit(**tensors: torch.Tensor | None) -> str | None:
    """None when each tensor's offsets within one (rows, columns) slice fit in int32, else why not.

    The kernels take each program's base offset (``b * stride_b + h * stride_h``) in int64 and
    the offsets within a tile's slice in int32, which keeps their registers free; a tensor whose
    last two dims span 2**31 elements or more (one head of a 50,000 x 50,000 mask) would wrap
    there, so it keeps the existing paths. Nearly always answered from the storage's size alone.
    """
    for name, t in tensors.items():
        if t is None or t.untyped_storage().nbytes() <= INT32_MAX * t.element_size():
            continue
        dims = zip(t.shape[-2:], t.stride()[-2:], strict=True)
        span = sum((n - 1) * abs(s) for n, s in dims if n)
        if span > INT32_MAX:
            return (
                f"{name}: offsets within one head reach {span:,} elements, past the kernels' "
                "32-bit tile offsets (2**31 - 1)"
            )
    return None
