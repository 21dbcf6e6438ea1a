"""attnlab's own thread pool (:mod:`attnlab.kernels._threads`) in a forked child.

Only the torch-ops blocks run on that pool; the C++ kernel runs on torch's OpenMP threads, whose
behaviour after a fork is torch's and its OpenMP runtime's (with GNU OpenMP, a child forked after
the parent ran a parallel region can hang in any parallel torch op, ``x.exp()`` included).
"""

from __future__ import annotations

import multiprocessing as mp

import torch

import attnlab.kernels.cpu_flash as cf
from attnlab.kernels import _threads, cpu_flash_native, flash_attention


def test_a_forked_child_runs_the_kernel_on_threads_of_its_own(monkeypatch):
    """A fork copies the pool object but none of its threads: the child must not queue its
    blocks to threads that do not exist (it would wait forever)."""
    monkeypatch.setattr(cpu_flash_native, "module", lambda: None)  # the torch-ops blocks
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 40, 8, generator=g) for h in (4, 2, 2))
    outer = torch.get_num_threads()
    try:
        want = _many_blocks(q, k, v)  # the parent's pool now exists
        assert _threads._POOL is not None and _threads._POOL[2]._threads
    finally:
        torch.set_num_threads(outer)
    with mp.get_context("fork").Pool(1) as pool:
        got = pool.apply_async(_many_blocks, (q, k, v)).get(timeout=120)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _many_blocks(q, k, v):
    """The torch-ops kernel on 2 threads with blocks of one kv head x 3 rows (many blocks)."""
    torch.set_num_threads(2)
    rows, size = cf.BLOCK_ROWS, cf.BLOCK_BYTES
    cf.BLOCK_ROWS, cf.BLOCK_BYTES = 3, 1
    try:
        return flash_attention(q, k, v, None, None, 0.3, 0.0)
    finally:
        cf.BLOCK_ROWS, cf.BLOCK_BYTES = rows, size
