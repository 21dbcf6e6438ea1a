"""attnlab's functional core against its peers, in one run; prints times and ratios.

1. ``scaled_dot_product_attention`` (fused path) vs calling ``torch.nn.functional.
   scaled_dot_product_attention`` directly: forward and forward+backward, float32 and bfloat16.
   Target: within 1.05x. And the microseconds a call adds at tiny shapes (``--only
   overhead``; target <= 5 us over SDPA).
2. ``return_weights=True`` vs the naive materialising formula ``softmax(Q K^T / sqrt(E)) V``.
3. ``additive_attention`` vs the naive Bahdanau formula (seed 002's ``AdditiveAttention``):
   time and peak memory at B=8, L=S=1024, A=256. Target: >= 5x less peak memory, not slower.
4. ``attnlab.kernels.cpu_flash`` (the blocked CPU kernel: its C++ implementation where it
   builds, with a row for the torch-ops one) vs torch SDPA, forward+backward:
   bf16 (target: <= 0.5x torch's time; fp16 too, and which of the two the dispatch's one-off
   probe picks, :mod:`attnlab.kernels.choice`), fp32 (reported: the dispatch picks the faster), and
   dropout_p=0.1 (targets: <= 0.2x torch's time, <= 2x without dropout, <= 1/4 of torch's peak
   memory). Run it with ``--threads 1`` and ``--threads 2``.

Allocator: materialised weights are dominated by page faults on fresh memory; see
``common.py`` for ``THP_MEM_ALLOC_ENABLE=1`` and run the script a second time with it.

Usage: ``python benchmarks/bench_core.py [--quick] [--threads N] [--skip-naive-additive]
[--only fused|overhead|weights|additive|flash]``
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attnlab.functional as AF  # noqa: E402
from attnlab.kernels import choice, cpu_flash, cpu_flash_native, flash_attention  # noqa: E402
from common import header, peak_rss_mib_in_child, ratio_line, report_peak, round_robin  # noqa: E402

SDPA_SHAPES = [(8, 8, 256, 64), (4, 8, 1024, 64), (1, 8, 4096, 64)]
DROPOUT_SHAPE = (4, 8, 1024, 64)


def naive_weights(q, k, v):
    w = torch.softmax((q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1]), dim=-1)
    return w @ v, w


def naive_additive(q, k, v, w_q, w_k, w_s):
    """Seed 002's formula: broadcast (B, L, 1, A) + (B, 1, S, A), tanh, reduce with w."""
    energy = torch.tanh((q @ w_q.T).unsqueeze(2) + (k @ w_k.T).unsqueeze(1))  # (B, L, S, A)
    scores = energy @ w_s  # (B, L, S)
    return torch.softmax(scores, -1) @ v


def additive_inputs(B=8, L=1024, S=1024, A=256, D=256, grad=False):
    g = torch.Generator().manual_seed(0)
    t = [torch.randn(B, L, D, generator=g), torch.randn(B, S, D, generator=g)]
    t.append(torch.randn(B, S, D, generator=g))
    t += [torch.randn(A, D, generator=g) / D**0.5, torch.randn(A, D, generator=g) / D**0.5]
    t.append(torch.randn(A, generator=g) / A**0.5)
    return [x.requires_grad_(grad) for x in t]


def fwd_bwd(fn):
    def run(*args):
        out = fn(*args)
        out.backward(torch.ones_like(out))

    return run


def flash(q, k, v, dropout_p=0.0):
    return flash_attention(q, k, v, None, None, q.shape[-1] ** -0.5, dropout_p)


def flash_torch_ops(q, k, v, dropout_p=0.0):
    """The blocked kernel's torch-ops implementation (where the C++ one does not build)."""
    built = cpu_flash_native.module
    cpu_flash_native.module = lambda: None
    try:
        out = flash(q, k, v, dropout_p)
        out.backward(torch.ones_like(out))
    finally:
        cpu_flash_native.module = built


def torch_sdpa(q, k, v, dropout_p=0.0):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)


def sdpa_inputs(shape=DROPOUT_SHAPE, dtype=torch.float32, grad=True):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=g).to(dtype).requires_grad_(grad) for _ in range(3)]


# name -> (run, inputs, tiny inputs: run once first, common.report_peak)
TINY_ADDITIVE = {"B": 1, "L": 8, "S": 8, "A": 8, "D": 8}
MEMORY_CASES = {
    "additive-attnlab-fwd": (
        lambda x: AF.additive_attention(*x),
        additive_inputs,
        lambda: additive_inputs(**TINY_ADDITIVE),
    ),
    "additive-naive-fwd": (
        lambda x: naive_additive(*x),
        additive_inputs,
        lambda: additive_inputs(**TINY_ADDITIVE),
    ),
    "additive-attnlab-fwdbwd": (
        lambda x: fwd_bwd(AF.additive_attention)(*x),
        lambda: additive_inputs(grad=True),
        lambda: additive_inputs(**TINY_ADDITIVE, grad=True),
    ),
    "additive-attnlab-fwdbwd-small": (
        lambda x: fwd_bwd(AF.additive_attention)(*x),
        lambda: additive_inputs(B=2, L=512, S=512, grad=True),
        lambda: additive_inputs(**TINY_ADDITIVE, grad=True),
    ),
    "additive-naive-fwdbwd-small": (
        lambda x: fwd_bwd(naive_additive)(*x),
        lambda: additive_inputs(B=2, L=512, S=512, grad=True),
        lambda: additive_inputs(**TINY_ADDITIVE, grad=True),
    ),
}
for _name, _dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
    for _who, _fn in (("flash", flash), ("torch", torch_sdpa)):
        MEMORY_CASES[f"{_who}-dropout-{_name}-fwdbwd"] = (
            lambda x, fn=_fn: fwd_bwd(fn)(*x, 0.1),
            lambda dtype=_dtype: sdpa_inputs(dtype=dtype),
            lambda dtype=_dtype: sdpa_inputs((1, 1, 8, 8), dtype=dtype),
        )
        MEMORY_CASES[f"{_who}-{_name}-fwdbwd"] = (
            lambda x, fn=_fn: fwd_bwd(fn)(*x),
            lambda dtype=_dtype: sdpa_inputs(dtype=dtype),
            lambda dtype=_dtype: sdpa_inputs((1, 1, 8, 8), dtype=dtype),
        )


def bench_fused(rounds: int) -> None:
    header("fused path vs torch F.scaled_dot_product_attention called directly (target <= 1.05)")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for dtype in (torch.float32, torch.bfloat16):
        for shape in SDPA_SHAPES:
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(*shape, generator=g).to(dtype) for _ in range(3))
            big = shape[2] >= 4096
            r = max(3, rounds // 3) if big else rounds
            with torch.inference_mode():
                stats = round_robin(
                    {
                        "attnlab": lambda: AF.scaled_dot_product_attention(q, k, v),
                        "torch": lambda: sdpa(q, k, v),
                    },
                    rounds=r,
                )
            print(ratio_line(f"fwd     {str(dtype)[6:]:>8} {shape}", stats, "attnlab", "torch"))
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            stats = round_robin(
                {
                    "attnlab": lambda: fwd_bwd(AF.scaled_dot_product_attention)(qg, kg, vg),
                    "torch": lambda: fwd_bwd(sdpa)(qg, kg, vg),
                },
                rounds=r,
            )
            print(ratio_line(f"fwd+bwd {str(dtype)[6:]:>8} {shape}", stats, "attnlab", "torch"))
        # causal and grouped-query: the cases where attnlab adds work before calling torch
        g = torch.Generator().manual_seed(1)
        q = torch.randn(4, 8, 1024, 64, generator=g).to(dtype)
        k, v = (torch.randn(4, 2, 1024, 64, generator=g).to(dtype) for _ in range(2))
        with torch.inference_mode():
            stats = round_robin(
                {
                    "attnlab": lambda: AF.scaled_dot_product_attention(q, k, v, is_causal=True),
                    "torch": lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True),
                },
                rounds=rounds,
            )
        print(ratio_line(f"fwd GQA 8/2 causal {str(dtype)[6:]}", stats, "attnlab", "torch"))


def _repeat(fn, q, k, v, kwargs, calls=2000) -> None:
    for _ in range(calls):
        fn(q, k, v, **kwargs)


def _assuming_finite(fn, q, k, v, kwargs, calls=2000) -> None:
    with AF.assume_finite():
        _repeat(fn, q, k, v, kwargs, calls)


def bench_overhead(rounds: int) -> None:
    """Microseconds attnlab adds per call at tiny shapes (issue: <= 5 us over SDPA): with the
    NaN rule (the default) and under ``assume_finite`` (its checks skipped)."""
    header("call overhead: attnlab vs torch SDPA at tiny shapes, no grad (us per call)")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = 2000  # back to back per timing (_repeat): what differs is the host's cost per call
    for shape in [(1, 2, 4, 8), (1, 8, 64, 64)]:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(*shape, generator=g) for _ in range(3))
        keep = torch.ones(shape[2], shape[2], dtype=torch.bool).tril()
        kinds = {
            "plain": ({}, {}),
            "causal": ({"is_causal": True}, {"is_causal": True}),
            "bool mask": ({"attn_mask": keep}, {"attn_mask": keep}),
        }
        for kind, (ours, theirs) in kinds.items():
            ours_fn = AF.scaled_dot_product_attention
            cases = {
                "attnlab": lambda o=ours: _repeat(ours_fn, q, k, v, o),
                "assumed": lambda o=ours: _assuming_finite(ours_fn, q, k, v, o),
                "torch": lambda t=theirs: _repeat(sdpa, q, k, v, t),
            }
            with torch.no_grad():
                stats = round_robin(cases, rounds=rounds)
            us = {n: {s: stats[n][s] / calls * 1e6 for s in ("best", "median")} for n in stats}
            torch_us = us["torch"]["best"]
            line = f"{kind:<10} {shape!s:<16} torch {torch_us:7.1f} us"
            for name, said in (("attnlab", "attnlab"), ("assumed", "assume_finite")):
                best = us[name]["best"] - torch_us
                median = us[name]["median"] - us["torch"]["median"]
                line += f" | {said} +{best:5.1f} us (best), +{median:5.1f} (median)"
            print(line)


def bench_weights(rounds: int) -> None:
    header("return_weights=True vs the naive materialising formula (forward, float32)")
    for shape in SDPA_SHAPES[:2]:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(*shape, generator=g) for _ in range(3))
        with torch.inference_mode():
            stats = round_robin(
                {
                    "weights": lambda: AF.scaled_dot_product_attention(
                        q, k, v, return_weights=True
                    ),
                    "naive": lambda: naive_weights(q, k, v),
                    "no-weights": lambda: AF.scaled_dot_product_attention(q, k, v),
                },
                rounds=rounds,
            )
        print(ratio_line(f"return_weights vs naive {shape}", stats, "weights", "naive"))
        print(ratio_line(f"return_weights vs without {shape}", stats, "weights", "no-weights"))
    header(
        "weights on demand vs the same call without weights: per head into a fresh tensor, into "
        "a reused weights_out (target <= 1.5x at (4, 8, 1024, 64), float32, 1 thread), averaged; "
        "and with autograd, forward+backward (target <= 1.5x at L = 1024); the dispatch's blocks "
        "(the C++ kernel's where its products go through brgemm), and the torch-ops blocks "
        "(their readable twin) in the same run"
    )
    from attnlab.functional import _weights

    q = torch.randn(SDPA_SHAPES[1])
    print(f"the dispatch, float32: {_weights.path(q, q, q, None)}")
    cases = [(torch.float32, shape) for shape in SDPA_SHAPES[:2]]
    if cpu_flash.native_bf16():  # (elsewhere bfloat16 products are float32: torch-ops blocks)
        cases.append((torch.bfloat16, SDPA_SHAPES[1]))
    for dtype, shape in cases:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(*shape, generator=g).to(dtype) for _ in range(3))
        buffer = torch.empty(*shape[:3], shape[2], dtype=dtype)
        call = AF.scaled_dot_product_attention
        name = f"{str(dtype)[6:]} {shape}"
        with torch.inference_mode():
            stats = round_robin(
                {
                    "no-weights": lambda: call(q, k, v),
                    "per-head": lambda: call(q, k, v, return_weights=True),
                    "weights_out": lambda: call(q, k, v, return_weights=True, weights_out=buffer),
                    "average": lambda: call(q, k, v, return_weights="average"),
                    "weights_out, torch ops": torch_ops_blocks(
                        lambda: call(q, k, v, return_weights=True, weights_out=buffer)
                    ),
                    "average, torch ops": torch_ops_blocks(
                        lambda: call(q, k, v, return_weights="average")
                    ),
                },
                rounds=rounds,
            )
        for case in ("per-head", "weights_out", "average", "weights_out, torch ops"):
            print(ratio_line(f"{case} vs without {name}", stats, case, "no-weights"))
        print(ratio_line(f"average, torch ops vs without {name}", stats, "average, torch ops",
                         "no-weights"))  # fmt: skip
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        # dense gradients, as a real loss hands in (a sum's are broadcast ones, never read as
        # a (B, H, L, S) tensor: 5% in attnlab's favour, measured)
        d_out = torch.randn(shape, generator=g).to(dtype)
        d_weights = {True: torch.randn(*shape[:3], shape[2], generator=g).to(dtype)}
        d_weights["average"] = d_weights[True][:, 0].clone()

        def train(rw):
            out = call(qg, kg, vg, return_weights=rw)
            if rw:
                torch.autograd.backward(out, (d_out, d_weights[rw]))
            else:
                out.backward(d_out)
            qg.grad = kg.grad = vg.grad = None

        trains = {
            "no-weights": lambda: train(False),
            "per-head": lambda: train(True),
            "average": lambda: train("average"),
        }
        # (without the C++ kernel, float32 takes the torch-ops blocks, 16 bits the readable
        # formula: the path each took before the kernel served it)
        trains["per-head, no C++"] = torch_ops_blocks(lambda: train(True))
        stats = round_robin(trains, rounds=rounds)
        for case in list(trains)[1:]:
            print(ratio_line(f"fwd+bwd {case} vs without {name}", stats, case, "no-weights"))


def torch_ops_blocks(run):
    """``run`` with the weights path's torch-ops blocks serving (the C++ kernel's switched off
    for the call)."""

    def switched():
        said = cpu_flash.weights_unfit
        cpu_flash.weights_unfit = lambda *args: "switched off by the benchmark"
        try:
            return run()
        finally:
            cpu_flash.weights_unfit = said

    return switched


def bench_additive(rounds: int, skip_naive: bool) -> None:
    header("additive_attention vs the naive Bahdanau formula, B=8, L=S=1024, A=256, D=256")
    here = str(Path(__file__).resolve())
    x = additive_inputs()
    cases = {"attnlab": lambda: AF.additive_attention(*x)}
    if not skip_naive:
        cases["naive"] = lambda: naive_additive(*x)
    with torch.inference_mode():
        stats = round_robin(cases, rounds=max(2, rounds // 4), warmup=1)
    if skip_naive:
        print(f"attnlab forward {stats['attnlab']['median']:.2f} s (naive skipped)")
    else:
        print(ratio_line("forward time", stats, "attnlab", "naive"))
    ours = peak_rss_mib_in_child(here, "additive-attnlab-fwd")
    line = f"forward peak memory: attnlab {ours:8.0f} MiB"
    if not skip_naive:
        naive = peak_rss_mib_in_child(here, "additive-naive-fwd")
        line += f"   naive {naive:8.0f} MiB   naive/attnlab x{naive / max(ours, 1):.1f}"
    print(line)
    xg = additive_inputs(grad=True)
    stats = round_robin(
        {"attnlab": lambda: fwd_bwd(AF.additive_attention)(*xg)}, rounds=2, warmup=1
    )
    ours = peak_rss_mib_in_child(here, "additive-attnlab-fwdbwd")
    print(
        f"forward+backward: attnlab {stats['attnlab']['median']:.2f} s, peak {ours:.0f} MiB; "
        f"naive needs > 24 GiB (the (B, L, S, A) tanh twice, 8 GiB each, kept for backward)"
    )
    xs = additive_inputs(B=2, L=512, S=512, grad=True)
    stats = round_robin(
        {
            "attnlab": lambda: fwd_bwd(AF.additive_attention)(*xs),
            "naive": lambda: fwd_bwd(naive_additive)(*xs),
        },
        rounds=max(3, rounds // 2),
    )
    print(ratio_line("fwd+bwd time at B=2, L=S=512", stats, "attnlab", "naive"))
    ours = peak_rss_mib_in_child(here, "additive-attnlab-fwdbwd-small")
    naive = peak_rss_mib_in_child(here, "additive-naive-fwdbwd-small")
    print(
        f"fwd+bwd peak at B=2, L=S=512: attnlab {ours:.0f} MiB, naive {naive:.0f} MiB, "
        f"x{naive / max(ours, 1):.1f}"
    )


def bench_flash(rounds: int, quick: bool) -> None:
    header("attnlab.kernels.cpu_flash vs torch SDPA, forward+backward (bf16 target <= 0.5)")
    shapes = SDPA_SHAPES[1:2] if quick else SDPA_SHAPES
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for shape in shapes:
            if choice.chooses(dtype):  # what the dispatch picks for training, and why
                E, L = shape[3], shape[2]
                pick = choice.training(dtype, E, E, L, L)
                print(f"dispatch for {dtype} training at L={L}: "
                      f"{'cpu_flash' if pick.blocked else 'torch'} ({pick.why})")  # fmt: skip
            q, k, v = sdpa_inputs(shape, dtype)
            big = shape[2] >= 4096
            stats = round_robin(
                {
                    "flash": lambda: fwd_bwd(flash)(q, k, v),
                    "torch": lambda: fwd_bwd(torch_sdpa)(q, k, v),
                },
                rounds=max(2, rounds // 3) if big else rounds,
                warmup=1,
            )
            print(ratio_line(f"fwd+bwd {str(dtype)[6:]:>8} {shape}", stats, "flash", "torch"))

    header(f"dropout_p=0.1, forward+backward at {DROPOUT_SHAPE} (targets <= 0.2 and <= 2)")
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = sdpa_inputs(DROPOUT_SHAPE, dtype)
        name = str(dtype)[6:]
        stats = round_robin(
            {
                "flash": lambda: fwd_bwd(flash)(q, k, v, 0.1),
                "torch": lambda: fwd_bwd(torch_sdpa)(q, k, v, 0.1),
                "flash-no-dropout": lambda: fwd_bwd(flash)(q, k, v),
                "attnlab-no-dropout": lambda: fwd_bwd(AF.scaled_dot_product_attention)(q, k, v),
                "torch-ops": lambda: flash_torch_ops(q, k, v, 0.1),
            },
            rounds=max(2, rounds // 2),
            warmup=1,
        )
        print(ratio_line(f"dropout {name}: flash vs torch", stats, "flash", "torch"))
        print(ratio_line(f"dropout {name}: vs flash without", stats, "flash", "flash-no-dropout"))
        print(
            ratio_line(f"dropout {name}: vs attnlab without", stats, "flash", "attnlab-no-dropout")
        )
        if cpu_flash_native.module() is not None:  # the C++ kernel vs the same blocks in torch ops
            print(ratio_line(f"dropout {name}: C++ vs torch ops", stats, "flash", "torch-ops"))
        else:
            print(f"(the C++ kernel does not serve here: {cpu_flash_native.unavailable()})")

    # inside torch.compile graphs: attnlab's dispatch puts the kernel in as an operator; torch's
    # compiled dropout is its math path, fused by inductor
    q, k, v = sdpa_inputs(DROPOUT_SHAPE, torch.float32)
    ours = torch.compile(lambda q, k, v: AF.scaled_dot_product_attention(q, k, v, dropout_p=0.1))
    theirs = torch.compile(lambda q, k, v: torch_sdpa(q, k, v, 0.1))
    stats = round_robin(
        {"attnlab": lambda: fwd_bwd(ours)(q, k, v), "torch": lambda: fwd_bwd(theirs)(q, k, v)},
        rounds=max(2, rounds // 2),
        warmup=2,  # (compiles)
    )
    print(ratio_line("dropout float32 under torch.compile", stats, "attnlab", "torch"))

    here = str(Path(__file__).resolve())
    for name in ("fp32", "bf16"):
        peaks = {
            case: peak_rss_mib_in_child(here, case)
            for case in (
                f"flash-dropout-{name}-fwdbwd",
                f"torch-dropout-{name}-fwdbwd",
                f"flash-{name}-fwdbwd",
                f"torch-{name}-fwdbwd",
            )
        }
        ours, theirs = peaks[f"flash-dropout-{name}-fwdbwd"], peaks[f"torch-dropout-{name}-fwdbwd"]
        plain_ours, plain_theirs = peaks[f"flash-{name}-fwdbwd"], peaks[f"torch-{name}-fwdbwd"]
        print(
            f"peak fwd+bwd {name} {DROPOUT_SHAPE} (child, default threads): dropout flash "
            f"{ours:.0f} MiB, torch {theirs:.0f} MiB (x{theirs / max(ours, 1):.1f}); "
            f"no dropout flash {plain_ours:.0f} MiB, torch {plain_theirs:.0f} MiB"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer rounds")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument(
        "--skip-naive-additive",
        action="store_true",
        help="skip the naive additive forward (needs ~16 GiB)",
    )
    p.add_argument(
        "--only", choices=["fused", "overhead", "weights", "additive", "flash"], default=None
    )
    p.add_argument("--memory-case", choices=sorted(MEMORY_CASES), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_case:
        run, setup, warm = MEMORY_CASES[args.memory_case]
        with torch.inference_mode(not args.memory_case.endswith(("fwdbwd", "fwdbwd-small"))):
            report_peak(run, setup, warm)
        return
    rounds = 4 if args.quick else 10
    if args.only in (None, "fused"):
        bench_fused(rounds)
    if args.only in (None, "overhead"):
        bench_overhead(rounds)
    if args.only in (None, "weights"):
        bench_weights(rounds)
    if args.only in (None, "additive"):
        bench_additive(rounds, args.skip_naive_additive)
    if args.only in (None, "flash"):
        bench_flash(rounds, args.quick)


if __name__ == "__main__":
    main()
