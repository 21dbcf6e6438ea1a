"""Running blocks of a kernel on Python threads, each with its own reusable scratch buffers.

Why not torch's own intra-op threads: each torch op is one OpenMP parallel region that waits for
its slowest thread. A blocked kernel issues ~20 ops per block; on a CPU shared with other
processes (2 vCPUs here) a stalled thread stalls every one of them -- measured: 2 OpenMP threads
2x to 5x slower than 1. Whole blocks per Python thread (torch ops release the GIL), each thread
running torch single-threaded, do not wait for each other between ops.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

PARALLEL = True  # False: one block at a time, torch's intra-op threads inside each op
# Fewer tasks than this per thread run one at a time with torch's intra-op threads: a few
# blocks do not balance over threads, and each Python thread waits for the GIL at every op
# (2 threads, fwd+bwd with and without dropout: at L = 48-128, 2 tasks, 1.2-1.6x the time of
# intra-op threads; at (4, 8, 256, 64), 4 tasks, 1.15-1.3x; from 8 tasks on, within noise).
TASKS_PER_THREAD = 3


def in_threads(tasks, work):
    """``work(task, scratch)`` for every task: the caller and torch.get_num_threads() - 1 pool
    threads each take the next task when done with one, run torch single-threaded and keep
    their own scratch.

    The pool threads live between calls (starting threads for every call cost more than the
    blocks of a short sequence: 2 threads were 2-18% slower at L = 64-512), and the caller works
    too instead of waiting.

    The caller's thread runs its blocks with CPU autocast off, as the pool threads run them
    (autocast is per thread): a kernel picks its own dtypes, and under fp16 autocast its
    float32 products, cast to fp16 on the caller's thread only, overflowed (inf outputs) and
    differed from run to run with the blocks each thread happened to take.
    """
    with torch.autocast("cpu", enabled=False):
        _run(tasks, work)


def _run(tasks, work):
    threads = min(torch.get_num_threads(), len(tasks))
    if threads <= 1 or not PARALLEL or len(tasks) < TASKS_PER_THREAD * threads:
        scratch = {}
        for task in tasks:
            work(task, scratch)
        return
    todo, lock = iter(tasks), threading.Lock()
    inference = torch.is_inference_mode_enabled()  # thread-local: the workers follow the caller

    def worker():
        torch.set_num_threads(1)
        scratch = {}
        with torch.inference_mode(inference), torch.no_grad():
            while True:
                with lock:
                    task = next(todo, None)
                if task is None:
                    return
                work(task, scratch)

    outer = torch.get_num_threads()
    try:
        helpers = [_pool(threads - 1).submit(worker) for _ in range(threads - 1)]
        worker()
        for f in helpers:
            f.result()
    finally:
        torch.set_num_threads(outer)  # MKL's thread count is global: give it back


_POOL: tuple[int, int, ThreadPoolExecutor] | None = None  # (process id, size, pool)
_POOL_LOCK = threading.Lock()


def _pool(size: int) -> ThreadPoolExecutor:
    """The process's pool of at least ``size`` threads; a new one after a fork (a forked child
    has none of its parent's threads: work queued to them would wait forever) or when more
    threads are asked for."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid() or _POOL[1] < size:
            if _POOL is not None and _POOL[0] == os.getpid():
                _POOL[2].shutdown(wait=False)  # (its threads end when idle)
            _POOL = (os.getpid(), size, ThreadPoolExecutor(size, "attnlab-kernel"))
        return _POOL[2]


def scratch_view(scratch, name, shape, dtype):
    """A contiguous (shape) view of the thread's reusable flat buffer ``name`` (grown on need)."""
    size = math.prod(shape)
    buf = scratch.get(name)
    if buf is None or buf.numel() < size or buf.dtype != dtype:
        buf = scratch[name] = torch.empty(size, dtype=dtype)
    return buf[:size].view(shape)
