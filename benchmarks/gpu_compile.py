"""Compile every Triton kernel for an NVIDIA GPU without one: registers, spills, shared memory.

CI runs the kernels in Triton's interpreter, which checks their arithmetic but never compiles
them; compiled for a GPU they may fail to build, spill registers to local memory or ask for more
shared memory than the device has -- found otherwise only on a GPU. Triton compiles for a named
target with the ptxas its wheel carries, so this script calls attnlab's own launchers on small
CPU tensors with every ``kernel[grid](...)`` turned into "compile for the target" (nothing runs)
and reports what each compiled kernel uses::

    kernel           config                      tiles        regs  spilled  shared
    _forward_kernel  bfloat16 E=128 bool+range   128x32 w8 s3  ...

Each kernel is compiled as the launchers configure it on a GPU (their tiles, ``TILES`` in
:mod:`attnlab.kernels.triton_attention` and ``TILINGS`` in
:mod:`attnlab.kernels.triton_additive`, float32 products in TF32x3 for additive attention: the
launchers decide by ``TRITON_INTERPRET``, unset here), in
float32, bfloat16 and float16, for head dims 64, 128 and 256, with no mask, with the heaviest
mix (a bool mask, key ranges and a band) and with a float bias. Exits 1 when a kernel does not
compile, needs more shared memory than the target offers, or, on sm_90, spills registers (the
tiles were chosen for sm_90 not to, but for the few a GPU timed faster than every tile that does
not spill: ``SPILLS_TIMED`` in :mod:`attnlab.kernels._triton`; other targets get the
spills reported). Usage::

    python benchmarks/gpu_compile.py                 # sm_90 (H100), every case (~3 minutes)
    python benchmarks/gpu_compile.py --quick         # bfloat16 and float32, E = 128 (CI)
    python benchmarks/gpu_compile.py --arch 80       # sm_80 (A100): a few spill 12-72 B
    python benchmarks/gpu_compile.py --jobs 2        # 2 processes (default: the CPUs, <= 8)

Needs ``pip install triton`` and no GPU; must not run under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch

SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}  # per block, bytes
TUNED_FOR = 90  # the target the kernels' tiles were chosen for


@dataclass
class Compiled:
    kernel: str
    config: str
    tiles: str
    regs: int
    spilled: int  # bytes of spill stores per thread
    shared: int  # bytes of shared memory per block


def fake_cuda_driver(arch: int):
    """A Triton driver that targets ``sm_<arch>`` and owns no device: enough to compile."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class CompileOnly(DriverBase):
        def __init__(self):
            pass

        @classmethod
        def is_active(cls):
            return True

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):
            raise RuntimeError("nothing runs: kernels are compiled, not launched")

        def map_python_to_cpp_type(self, ty):
            return ty

    return CompileOnly()


def resources(ptx: str, name: str, arch: int) -> tuple[int, int]:
    """(registers, spill-store bytes) of a kernel, from the target's ptxas in verbose mode."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        run = subprocess.run(
            [get_ptxas(arch).path, "-v", "--gpu-name", gpu, f.name, "-o", os.devnull],
            capture_output=True,
            text=True,
            check=True,
        )
    finally:
        os.unlink(f.name)
    text = run.stdout + run.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    if regs is None or spills is None:
        raise RuntimeError(f"ptxas -v said nothing of {name}'s resources:\n{text}")
    return int(regs.group(1)), int(spills.group(1))


class CompileEveryLaunch:
    """Within the block, ``kernel[grid](...)`` compiles for the target and records the result."""

    def __init__(self, arch: int):
        self.arch = arch
        self.records: list[tuple[str, object, dict]] = []

    def __enter__(self):
        import triton.runtime.jit as jit
        from triton.runtime.driver import driver

        self._jit = jit
        self._getitem = jit.JITFunction.__getitem__
        driver.set_active(fake_cuda_driver(self.arch))  # this process has no other
        outer = self

        def compile_only(fn, grid):
            def launch(*args, **kwargs):
                kernel = fn.run(*args, grid=grid, warmup=True, **kwargs)
                outer.records.append((fn.fn.__name__, kernel, kwargs))
                return kernel

            return launch

        jit.JITFunction.__getitem__ = compile_only
        return self

    def __exit__(self, *exc):
        self._jit.JITFunction.__getitem__ = self._getitem


def attention_cases(dtypes, dims):
    """(config, call) pairs: attnlab's attention launchers as the dispatch calls them."""
    from attnlab.kernels import triton_attention as ta
    from attnlab.kernels import triton_backward as tb
    from attnlab.kernels import triton_decode as td
    from attnlab.kernels import triton_nonfinite as tn

    B, H, Hkv, L, S = 2, 8, 2, 256, 256
    for dtype in dtypes:
        for E in dims:
            q = torch.zeros(B, H, L, E, dtype=dtype)
            k = torch.zeros(B, Hkv, S, E, dtype=dtype)
            starts, ends = torch.zeros(B, dtype=torch.long), torch.tensor([S, S // 2])
            bool_mask = torch.ones(B, 1, L, S, dtype=torch.bool)
            bias = torch.zeros(1, H, L, S, dtype=dtype)
            heavy = dict(mask=bool_mask, alignment="bottom_right", key_range=(starts, ends))
            heavy["band"] = (0, -63, 0)
            variants = {
                "plain": dict(),
                "bool+range+band": heavy,
                "bias, causal": dict(mask=bias, alignment="top_left"),
            }
            name = f"{str(dtype).removeprefix('torch.')} E={E}"
            for label, kw in variants.items():
                args = (kw.get("mask"), kw.get("alignment"), None, kw.get("key_range"))
                band = kw.get("band")

                def launch_all(q=q, k=k, E=E, args=args, band=band):
                    mask, alignment, _, key_range = args
                    out, lse = ta.attention_forward(q, k, k, *args, band=band)
                    ta.attention_forward(q, k, k, *args, band=band, out_dtype=torch.float32)
                    ta.attention_weights(q, k, lse, *args, band=band)
                    ta.attention_weights(q, k, lse, *args, average=True, band=band)
                    tb.attention_backward(q, k, k, out, lse, out, mask, alignment, E**-0.5,
                                          key_range, band)  # fmt: skip
                    rows = None if mask is None else mask[:, :, :3]  # 3 new query rows
                    td.decode_attention(q[:, :, :3], k, k, rows, "bottom_right", None, key_range,
                                        return_weights=True, band=band)  # fmt: skip
                    td.decode_attention(q[:, :, :1], k, k, None, "bottom_right")
                    tn.nonfinite_rows(q, k, k)  # (the NaN rule's row check)

                yield f"{name} {label}", launch_all


def additive_cases(dtypes):
    from attnlab.kernels import triton_additive as tadd

    N, L, S, A = 2, 128, 128, 64
    for dtype in dtypes:
        for DV in (64, 256):
            a = torch.zeros(N, L, A, requires_grad=True)
            b = torch.zeros(N, S, A, requires_grad=True)
            w = torch.zeros(A, requires_grad=True)
            value = torch.zeros(N, S, DV, dtype=dtype, requires_grad=True)
            tiling = tadd.tiling_for(DV)
            for label, mask in (("plain", None), ("bool", torch.ones(N, L, S, dtype=torch.bool))):

                def run(mask=mask, a=a, b=b, w=w, value=value, tiling=tiling):
                    out = tadd.additive_attention(a, b, w, value, mask, "top_left", tiling)
                    out.float().sum().backward()

                yield f"{str(dtype).removeprefix('torch.')} Dv={DV} {label}", run


def compile_cases(cases, arch: int) -> tuple[list[Compiled], list[str]]:
    """Compiles each (config, call) pair's kernels for ``sm_<arch>``: what they use, and the
    configurations that did not compile."""
    results: list[Compiled] = []
    failures: list[str] = []
    for config, run in cases:
        with CompileEveryLaunch(arch) as launches:
            try:
                run()
            except Exception as e:  # a kernel that does not compile for the target
                failures.append(f"{config}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
                print(f"FAIL {config}: {failures[-1]}", flush=True)
                continue
        for name, kernel, kw in launches.records:
            regs, spilled = resources(kernel.asm["ptx"], name, arch)
            tiles = "x".join(str(kw[k]) for k in ("BLOCK_M", "BLOCK_R", "BLOCK_L", "BLOCK_N",
                                                  "BLOCK_S") if k in kw)  # fmt: skip
            tiles += f" w{kernel.metadata.num_warps} s{kernel.metadata.num_stages}"
            results.append(Compiled(name, config, tiles, regs, spilled, kernel.metadata.shared))
    return results, failures


def every_case(quick: bool) -> list:
    """Every kernel's (config, call) pairs: float32, bfloat16 and float16 at head dims 64, 128
    and 256, or (``quick``) bfloat16 and float32 at 128."""
    from attnlab.kernels import triton_decode as td

    td._splits = lambda B, Hkv, S, block_n, device: min(3, -(-S // block_n))  # no device to ask
    dtypes = (torch.bfloat16, torch.float32) if quick else (torch.bfloat16, torch.float16,
                                                            torch.float32)  # fmt: skip
    dims = (128,) if quick else (64, 128, 256)
    return [*attention_cases(dtypes, dims), *additive_cases(dtypes)]


def compile_share(quick: bool, arch: int, share: int, shares: int):
    """In a worker process: every ``shares``-th of :func:`every_case` from ``share``."""
    return compile_cases(every_case(quick)[share::shares], arch)


def main(argv=None, cases=None) -> int:
    """``cases``: (config, call) pairs instead of every kernel's (for tests)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, choices=sorted(SHARED_LIMIT))
    p.add_argument("--quick", action="store_true", help="bfloat16 and float32 at E = 128")
    p.add_argument("--jobs", type=int, default=min(8, len(os.sched_getaffinity(0))),
                   help="processes compiling at once (default: the CPUs, at most 8)")  # fmt: skip
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the kernels must be compiled, not interpreted")
    if args.jobs < 1:
        p.error(f"--jobs: expected at least 1, got {args.jobs}")
    limit = SHARED_LIMIT[args.arch]
    if cases is not None:
        print(f"sm_{args.arch}: compiling {len(cases)} configurations (shared memory: {limit:,} B)")
        results, failures = compile_cases(cases, args.arch)
    else:
        count, jobs = len(every_case(args.quick)), args.jobs
        print(f"sm_{args.arch}: compiling {count} configurations in {jobs} processes "
              f"(shared memory: {limit:,} B)", flush=True)  # fmt: skip
        spawn = multiprocessing.get_context("spawn")  # (no fork of a process that ran torch)
        with ProcessPoolExecutor(jobs, mp_context=spawn) as pool:
            futures = [pool.submit(compile_share, args.quick, args.arch, i, jobs)
                       for i in range(jobs)]  # fmt: skip
            shares = [future.result() for future in futures]
        results = [r for share_results, _ in shares for r in share_results]
        failures = [f for _, share_failures in shares for f in share_failures]
    from attnlab.kernels._triton import SPILLS_TIMED

    timed = {name: f"{rows}x{keys} w{warps} " for name, (rows, keys, warps) in SPILLS_TIMED.items()}
    seen = set()
    print(f"{'kernel':<22}{'config':<34}{'tiles':<16}{'regs':>5}{'spilled':>9}{'shared':>9}")
    for r in results:
        key = (r.kernel, r.config, r.tiles)
        if key in seen:
            continue
        seen.add(key)
        flag = ""
        if r.shared > limit:
            flag = "  <- more shared memory than the target has"
            failures.append(f"{r.kernel} {r.config}: {r.shared:,} B of shared memory > {limit:,}")
        elif r.spilled and args.arch == TUNED_FOR and r.tiles.startswith(timed.get(r.kernel, "-")):
            flag = "  (spills; timed faster than the tiles that do not: SPILLS_TIMED)"
        elif r.spilled and args.arch == TUNED_FOR:
            flag = "  <- spills registers to local memory"
            failures.append(f"{r.kernel} {r.config} ({r.tiles}): spills {r.spilled} B")
        elif r.spilled:
            flag = f"  (spills: tiles chosen for sm_{TUNED_FOR})"
        print(
            f"{r.kernel:<22}{r.config:<34}{r.tiles:<16}{r.regs:>5}{r.spilled:>9}{r.shared:>9}{flag}"
        )
    print(f"{len(seen)} kernels compiled for sm_{args.arch}; {len(failures)} failures")
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
