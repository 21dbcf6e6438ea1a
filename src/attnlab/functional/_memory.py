"""Fresh large result tensors on CPU, backed by huge pages where Linux allows it.

A fresh tensor of a few hundred MiB -- the (B, H, L, S) weights a caller asks for -- costs
little to allocate and a lot to touch the first time: the kernel maps and zeroes it one 4 KiB
page at a time. On this project's CPUs that first touch of 128 MiB takes ~90 ms on one thread,
as long as the attention that fills it. Advising the range for transparent huge pages
(``madvise(MADV_HUGEPAGE)``, 2 MiB pages) before the first touch makes it ~4x cheaper
(``benchmarks/bench_core.py --only weights``). torch does the same for every allocation when
``THP_MEM_ALLOC_ENABLE=1`` is set; here only the big results that attnlab writes ask for it.

The advice is a hint: where it cannot be given (not Linux, huge pages set to ``never``, no
libc through ctypes) the tensor is the same ``torch.empty`` tensor, only slower to fill.
"""

from __future__ import annotations

import ctypes
import sys

import torch

HUGE_PAGE = 2 * 2**20
MIN_BYTES = 8 * 2**20  # smaller tensors are reused by the allocator: nothing to gain
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


def _load_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _load_madvise()


def empty(*shape: int, like: torch.Tensor) -> torch.Tensor:
    """``like.new_empty(shape)``; on CPU, when at least ``MIN_BYTES``, its whole 2 MiB pages
    advised for huge pages before anything touches them."""
    t = like.new_empty(shape)
    if _madvise is None or torch.compiler.is_compiling():  # traced: no memory to advise
        return t
    nbytes = t.numel() * t.element_size()
    if t.device.type == "cpu" and nbytes >= MIN_BYTES:
        start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE  # the first 2 MiB boundary inside
        stop = (t.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
        if stop > start:
            _madvise(start, stop - start, _MADV_HUGEPAGE)  # a hint: a failure changes nothing
    return t
