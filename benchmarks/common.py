"""Timing and memory helpers shared by the benchmark scripts.

This machine's speed drifts in phases lasting seconds (up to 2.5x). So the cases compared are
timed round-robin -- one call of each case per round -- in one process, and the figures reported
are ratios of medians (and of bests) between cases of the same round.

Allocator: a tensor of fresh memory costs page faults on first touch (~3 GB/s here, PERF.md),
which dominates materialised weights (128 MiB at B=4, H=8, L=S=1024). PyTorch's own switch
``THP_MEM_ALLOC_ENABLE=1`` backs large CPU allocations with transparent huge pages (5x cheaper to
touch); it must be set before the process's first large allocation, so run the script a second
time with it to see both: ``THP_MEM_ALLOC_ENABLE=1 python benchmarks/...``. The first line of the
output says which allocator ran.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable


def round_robin(
    cases: dict[str, Callable[[], object]],
    rounds: int = 10,
    warmup: int = 2,
    sync: Callable[[], object] | None = None,
) -> dict[str, dict[str, float]]:
    """Time each case once per round, for ``rounds`` rounds; seconds: median, best.

    ``sync`` (:func:`device_sync`) runs before the first timed call and after each call, inside
    its timing: a GPU runs the work a call queued after the call returns, and without it that
    work would be timed in the next case's call.
    """
    sync = sync or (lambda: None)
    for _ in range(warmup):
        for fn in cases.values():
            fn()
    sync()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return {n: {"median": statistics.median(t), "best": min(t)} for n, t in times.items()}


def device_sync(device: str) -> Callable[[], object]:
    """What waits for the work queued on ``device`` (``round_robin``'s ``sync``): CUDA's
    synchronize (a CUDA call returns before its kernels have run); nothing elsewhere."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return functools.partial(torch.cuda.synchronize, device)
    return lambda: None


def ratio_line(label: str, stats: dict, case: str, baseline: str) -> str:
    a, b = stats[case], stats[baseline]
    return (
        f"{label:<44} {a['median'] * 1e3:9.2f} ms {b['median'] * 1e3:9.2f} ms   "
        f"x{a['median'] / b['median']:5.2f} (best x{a['best'] / b['best']:5.2f})"
    )


def peak_rss_mib_in_child(script: str, case: str, timeout: float = 900) -> float:
    """Run ``script --memory-case case`` in a fresh process; return its extra peak RSS in MiB.

    The child reports ``{"baseline": kib, "peak": kib}``: its peak resident set size after
    building the inputs and after running the case once. A fresh process per case keeps one
    case's freed memory from hiding another's peak.
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    out = subprocess.run(
        [sys.executable, script, "--memory-case", case],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    if out.returncode != 0:
        raise RuntimeError(f"memory case {case!r} failed:\n{out.stderr[-2000:]}")
    report = json.loads(out.stdout.strip().splitlines()[-1])
    return (report["peak"] - report["baseline"]) / 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def report_peak(
    run_case: Callable[[], object],
    setup: Callable[[], object],
    warm: Callable[[], object] | None = None,
) -> None:
    """In the child: build inputs, reset the peak RSS, run the case, print both as JSON (KiB).

    ``warm``: inputs of a tiny shape, run first, so that what a first call costs once (autograd's
    start, ~40 MiB; the C++ kernel's loading; the few-rows probe) counts on neither side: at
    fp32 (4, 8, 1024, 64) fwd+bwd it was half the blocked kernel's peak. Not the real shape:
    what glibc keeps after freeing it would hide the peak.

    ``ru_maxrss`` would not do: it survives ``exec`` and so starts at the parent's size. VmHWM
    belongs to this address space, and writing 5 to ``clear_refs`` resets it to the current RSS.
    """
    if warm is not None:
        run_case(warm())
    inputs = setup()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    baseline = _status_kib("VmRSS")
    run_case(inputs)
    print(json.dumps({"baseline": baseline, "peak": _status_kib("VmHWM")}))


def header(title: str) -> None:
    import torch

    thp = (
        "THP_MEM_ALLOC_ENABLE=1 (huge pages)"
        if os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"
        else "default glibc allocator"
    )
    print(f"\n== {title} ==")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {thp}")
    print(f"{'case':<44} {'attnlab':>12} {'peer':>12}   ratio (median; best)")
