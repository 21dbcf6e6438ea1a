"""Which kernel trains 16-bit attention faster on this CPU: torch's or attnlab's blocked one.

The answer depends on the CPU. ``benchmarks/bench_core.py --only flash --threads 1``, bf16
forward+backward at (4, 8, 1024, 64), the blocked kernel's time over torch's: x0.22 on an AVX2
machine (torch's bf16 backward there is 5x its float32 one), x1.17 on an AVX512-BF16 one (AMD
Zen 4, where torch's bf16 is faster than its float32). A rule from CPU flags would be a guess, so
the dispatch measures: once per process for each (dtype, head sizes, thread count), both kernels
run forward+backward on a small probe, (1, 4, 512, E) queries and keys, round-robin, and the
faster serves every later call. The probe draws from its own generator (the global RNG is left as
it was) and takes ~0.1-1 s once.

``ATTNLAB_CPU_TRAINING_KERNEL`` decides instead of measuring: ``attnlab`` (the blocked kernel),
``torch`` (torch's fused kernel) or ``measure`` (the default). Both kernels compute the same
function; only the rounding of 16-bit results differs between them.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnlab.kernels.cpu_flash import flash_attention

ENV = "ATTNLAB_CPU_TRAINING_KERNEL"
SETTINGS = ("measure", "attnlab", "torch")
PROBE = (1, 4, 512)  # (B, H, L = S) of the probe; E and Ev are the call's
ROUNDS = 3  # timed rounds of each kernel after one warm-up round; the best of each is compared


@dataclass(frozen=True)
class Choice:
    """``blocked``: attnlab's kernel serves (else torch's); ``why``: one line for ``explain()``."""

    blocked: bool
    why: str


def training_16bit(dtype: torch.dtype, E: int, Ev: int) -> Choice:
    """The kernel for 16-bit attention with autograd on CPU (no dropout): set, or measured once."""
    setting = os.environ.get(ENV, "measure")
    if setting not in SETTINGS:
        raise ValueError(
            f"{ENV} must be one of {', '.join(SETTINGS)}; got {setting!r}. Unset it to let "
            "attnlab measure which kernel is faster here."
        )
    if setting != "measure":
        return Choice(setting == "attnlab", f"{ENV}={setting}")
    return _measured(dtype, E, Ev, torch.get_num_threads())


@functools.cache
def _measured(dtype: torch.dtype, E: int, Ev: int, threads: int) -> Choice:
    ratio = measure(dtype, E, Ev)
    B, H, L = PROBE
    said = (
        f"measured once in this process: attnlab's blocked kernel takes x{ratio:.2f} torch's "
        f"forward+backward time at ({B}, {H}, {L}, {E}) {str(dtype).removeprefix('torch.')}, "
        f"{threads} thread(s)"
    )
    return Choice(ratio < 1.0, said)


def measure(dtype: torch.dtype, E: int, Ev: int, rounds: int = ROUNDS) -> float:
    """attnlab's blocked kernel's forward+backward time over torch's, best of ``rounds`` each."""
    B, H, L = PROBE
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
