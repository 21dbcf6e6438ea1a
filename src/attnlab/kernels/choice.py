"""Which kernel trains attention faster on this CPU: torch's or attnlab's blocked one.

The dispatch chooses for 16-bit training (:func:`chooses`). float32 training stays on torch's
kernel unless ``ATTNLAB_CPU_TRAINING_KERNEL=attnlab`` asks for the blocked one where its float32
products go through oneDNN's brgemm (on a Xeon with AMX: 0.79-0.87x torch's float32
forward+backward time at (4, 8, 1024, 64); its at::bmm blocks, which serve float32 elsewhere,
take 1.1-1.2x). float32 is not measured: a choice made afresh in each process could make two
processes of one float32 training run (one resumed after a crash) differ in the last bits, and
resuming must repeat the uninterrupted run bit for bit (tests/test_faults.py).

The answer depends on the CPU and on the sequence length. The blocked kernel's forward+backward
time over torch's (``python -c`` over :func:`measure`, 1 thread), on an AMD Zen 4 (AVX512-BF16):

==========  ======  ======  ======  ======  ======
L = S        32      128     256     512     1024
==========  ======  ======  ======  ======  ======
bfloat16    x0.53   x0.48   x0.74   x0.91   x1.11
float16     x0.47   x0.29   x0.22   x0.19   x0.15
==========  ======  ======  ======  ======  ======

and on an AVX2 machine x0.22 in bfloat16 at L = 1024 (torch's bf16 backward there is 5x its
float32 one). On a Xeon with AMX (the kernel's C++ implementation; torch's bf16 kernel uses AMX
too), at the probe's shapes, 1 thread: bfloat16 x1.35 at L = 64, x0.87 at 256, x0.84-0.97 at
1,024; float16 x0.79, x0.69, x0.97 (at (4, 8, 1024, 64), bfloat16: x0.77-0.81).
A rule from CPU flags would be a guess, so the dispatch measures: once per process
for each (dtype, head sizes, length class, thread count), both kernels run forward+backward on a
probe of that length class (``max(L, S)`` rounded up to a power of two in 64..1024, about 2^23
scores but at most 64 heads: (1, min(64, 2^23 / n^2), n, E); with one head, at 2^20, a kernel
that spreads heads over threads looked slower than it is on real shapes), round-robin, and the
faster serves every later call of the class. The probe draws from its own generator (the global
RNG is left as it was) and takes ~0.2-1 s once.

``ATTNLAB_CPU_TRAINING_KERNEL`` decides instead of measuring: ``attnlab`` (the blocked kernel;
for float32 too, as above), ``torch`` (torch's fused kernel) or ``measure`` (the default). Both
kernels compute the same function; only the rounding of results differs between them. So where
the two are close (x0.9-1.1) two processes may choose differently: a 16-bit run that must repeat
bit for bit in another process sets the variable.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnlab.kernels import cpu_flash_native
from attnlab.kernels.cpu_flash import flash_attention

ENV = "ATTNLAB_CPU_TRAINING_KERNEL"
SETTINGS = ("measure", "attnlab", "torch")
LENGTHS = (64, 1024)  # the length classes: powers of two from the first to the last
SCORES = 2**23  # scores per probe call (heads x n x n) ...
HEADS = 64  # ... in at most this many heads
ROUNDS = 3  # timed rounds of each kernel after one warm-up round; the best of each is compared


@dataclass(frozen=True)
class Choice:
    """``blocked``: attnlab's kernel serves (else torch's); ``why``: one line for ``explain()``."""

    blocked: bool
    why: str


def length_class(L: int, S: int) -> int:
    """``max(L, S)`` rounded up to a power of two, clamped to ``LENGTHS``.

    (Comparisons only: under torch.compile with symbolic sizes they become guards on the class,
    so one graph serves every length of it.)"""
    n, c = max(L, S), LENGTHS[0]
    while c < LENGTHS[1] and n > c:
        c *= 2
    return c


def env_setting(name: str, settings: tuple[str, ...]) -> str:
    """The environment variable ``name``, one of ``settings`` (default the first, "measure")."""
    setting = os.environ.get(name, settings[0])
    if setting not in settings:
        raise ValueError(
            f"{name} must be one of {', '.join(settings)}; got {setting!r}. Unset it to let "
            "attnlab measure which is faster here."
        )
    return setting


def chooses(dtype: torch.dtype) -> bool:
    """Whether the dispatch chooses the kernel for CPU training in ``dtype`` (:func:`training`):
    float16 and bfloat16 always; float32 where ``ATTNLAB_CPU_TRAINING_KERNEL=attnlab`` and the
    blocked kernel's float32 products go through brgemm (this builds the C++ kernel if need
    be); else torch's kernel trains."""
    if dtype in (torch.float16, torch.bfloat16):
        return True
    return (
        dtype == torch.float32
        and env_setting(ENV, SETTINGS) == "attnlab"
        and cpu_flash_native.brgemm(torch.float32)
    )


# torch.compiler.assume_constant_result(chooses), without importing torch._dynamo: run when a
# graph is traced (it may build the C++ kernel), its answer a constant of the graph
chooses._dynamo_marked_constant = True


def training(dtype: torch.dtype, E: int, Ev: int, L: int, S: int) -> Choice:
    """The kernel for attention with autograd on CPU (no dropout) in a dtype the dispatch
    :func:`chooses` for: set, or measured once per length class."""
    setting = env_setting(ENV, SETTINGS)
    if setting != "measure":
        return Choice(setting == "attnlab", f"{ENV}={setting}")
    return _measured(dtype, E, Ev, length_class(L, S), torch.get_num_threads())


@functools.cache
def _measured(dtype: torch.dtype, E: int, Ev: int, n: int, threads: int) -> Choice:
    ratio = _on_own_thread(measure, dtype, E, Ev, n)
    said = (
        f"measured once in this process: attnlab's blocked kernel takes x{ratio:.2f} torch's "
        f"forward+backward time at {probe_shape(n, E)} {str(dtype).removeprefix('torch.')}, "
        f"{threads} thread(s)"
    )
    return Choice(ratio < 1.0, said)


def _on_own_thread(fn, *args):
    """``fn(*args)`` on a fresh thread, returned (or raised) here.

    The probe trains a graph of its own while the caller may be recording one: autograd's
    state is per thread (grad mode, autocast, and the saved-tensor hooks of activation
    checkpointing, which would otherwise capture the probe's tensors and find a different
    count when the checkpoint recomputes), so a thread of its own leaves the caller's alone.
    """
    done: dict = {}

    def run():
        try:
            done["value"] = fn(*args)
        except BaseException as error:  # (raised again in the caller's thread)
            done["error"] = error

    thread = threading.Thread(target=run, name="attnlab-kernel-probe")
    thread.start()
    thread.join()
    if "error" in done:
        raise done["error"]
    return done["value"]


def probe_shape(n: int, E: int) -> tuple[int, int, int, int]:
    """(B, H, L = S, E) of the probe of length class ``n``."""
    return (1, min(HEADS, max(1, SCORES // (n * n))), n, E)


def measure(dtype: torch.dtype, E: int, Ev: int, n: int = 512, rounds: int = ROUNDS) -> float:
    """attnlab's blocked kernel's forward+backward time over torch's at length ``n``, best of
    ``rounds`` each."""
    B, H, L, _ = probe_shape(n, E)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, d, generator=g).to(dtype) for d in (E, E, Ev))
    dout = torch.randn(B, H, L, Ev, generator=g).to(dtype)
    scale = E**-0.5

    def blocked(q, k, v):
        return flash_attention(q, k, v, None, None, scale, 0.0)

    def fused(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, scale=scale)

    best = {blocked: float("inf"), fused: float("inf")}
    with torch.enable_grad(), torch.autocast("cpu", enabled=False):
        for r in range(rounds + 1):  # round 0 warms both up and is not counted
            for kernel in best:
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                start = time.perf_counter()
                torch.autograd.backward(kernel(*leaves), dout)
                if r:
                    best[kernel] = min(best[kernel], time.perf_counter() - start)
    return best[blocked] / best[fused]
