"""The fused additive-attention kernel (attnlab.kernels.triton_additive) against the naive formula.

    python benchmarks/bench_gpu_additive.py           # on a CUDA machine (an H100 for the targets)
    python benchmarks/bench_gpu_additive.py --sweep   # also time other tiles (TILINGS)
    TRITON_INTERPRET=1 python benchmarks/bench_gpu_additive.py --smoke   # tiny, CPU interpreter:
                                                      # checks the script, times mean nothing

Also run by ``benchmarks/bench_gpu.py --only additive`` (its ``run(args)``). Without CUDA (and
without --smoke) it says so and exits 0.

At B=8, L=S=1024, D=256 (query, key and value width), A=256, float32 and bfloat16, it prints:

* forward and forward+backward time of ``attnlab.functional.additive_attention`` (the kernel:
  ``explain_additive`` is printed) and of the naive formula ``softmax(tanh(W_q q + b + W_k k) w)
  V`` with autograd (it stores the (B, L, S, A) tanh), and their ratio. Target: >= 5x faster.
* peak memory of forward+backward beyond the inputs. Target: <= 1 GiB.
* tanh evaluations per second (forward: B L S A; forward+backward: 2 B L S A with the scores
  kept for the backward, the default here, 3 B L S A with them recomputed, the kernel's counts)
  against the special-function units' limit, computed from the device's SM count and the
  assumptions printed with it; and forward+backward with the scores recomputed (as past
  ``STORED_SCORES_BYTES``) against kept, in the same run.
* the accuracy of the first batch row against a float64 evaluation, for the kernel and for the
  naive formula in the same dtype (GPU arithmetic, e.g. its approximate exp2, is not what the
  interpreter tests run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attnlab.functional as AF  # noqa: E402
from attnlab.functional.additive import explain_additive  # noqa: E402
from bench_gpu import peak_mib, pick_device, round_robin, row  # noqa: E402

SHAPE = {"B": 8, "L": 1024, "S": 1024, "D": 256, "A": 256}
SMOKE_SHAPE = {"B": 2, "L": 40, "S": 24, "D": 16, "A": 8}
DTYPES = (torch.float32, torch.bfloat16)

# The special-function units' limit (CUDA programming guide, arithmetic instruction throughput:
# exp2 and reciprocal at 16 results per clock per SM on compute capability 8.x and 9.0).
SFU_PER_CLOCK_PER_SM = 16
ASSUMED_CLOCK_HZ = 1.98e9  # H100 SXM boost clock; sustained clocks under load can be lower
# Tiles to sweep, rows x keys x warps, for the forward and for the backward apart (the backward
# reduces each tanh plane along both axes once per column of A; the forward never reduces).
# 2 warps only with 32 rows: compiled for sm_90, 2-warp tiles of 64+ rows spilled 20-135 KB
# per thread and took ~130 s of compilation between them, time a 10-minute GPU call lacks.
SWEEP = [(r, k, w) for r in (32, 64, 128) for k in (16, 32, 64) for w in (4, 8)] + [
    (32, 16, 2),
    (32, 32, 2),
]


def make_inputs(shape: dict, device: str, dtype: torch.dtype, seed: int = 0) -> list:
    """query (B, L, D), key and value (B, S, D), W_q, W_k (A, D), w (A,), bias (A,): leaves."""
    B, L, S, D, A = (shape[n] for n in "BLSDA")
    g = torch.Generator(device=device).manual_seed(seed)
    shapes = ((B, L, D), (B, S, D), (B, S, D), (A, D), (A, D), (A,), (A,))
    scales = (1.0, 1.0, 1.0, D**-0.5, D**-0.5, A**-0.5, 0.1)
    return [
        (torch.randn(s, device=device, generator=g) * c).to(dtype).requires_grad_()
        for s, c in zip(shapes, scales, strict=True)
    ]


def naive(query, key, value, w_query, w_key, w_score, bias):
    """The textbook formula: the (B, L, S, A) tanh, kept by autograd for the backward."""
    a = query @ w_query.T + bias  # (B, L, A)
    b = key @ w_key.T  # (B, S, A)
    scores = torch.tanh(a[:, :, None, :] + b[:, None, :, :]) @ w_score  # (B, L, S)
    return torch.softmax(scores, -1) @ value


def attnlab_additive(query, key, value, w_query, w_key, w_score, bias):
    return AF.additive_attention(query, key, value, w_query, w_key, w_score, bias=bias)


def attnlab_recomputed(query, key, value, w_query, w_key, w_score, bias):
    """The kernel with its backward rebuilding the scores, as past the kept scores' budget."""
    from attnlab.kernels import triton_additive as K

    with K.settings(STORED_SCORES_BYTES=0):
        return attnlab_additive(query, key, value, w_query, w_key, w_score, bias)


def attnlab_other_tanh(query, key, value, w_query, w_key, w_score, bias):
    """The kernel with the other tanh of the two (:func:`other_tanh`)."""
    from attnlab.kernels import triton_additive as K

    on = () if value.dtype in K.HARDWARE_TANH_ON else (value.dtype,)
    with K.settings(HARDWARE_TANH_ON=on):
        return attnlab_additive(query, key, value, w_query, w_key, w_score, bias)


def other_tanh(dtype: torch.dtype) -> str:
    """The tanh the dispatch does not use for ``dtype``: the SFU's tanh.approx.f32 or exp2 and
    a reciprocal (``triton_additive.HARDWARE_TANH_ON``)."""
    from attnlab.kernels import triton_additive as K

    return "exp2 + reciprocal" if dtype in K.HARDWARE_TANH_ON else "tanh.approx.f32"


def forward(fn, leaves):
    def step():
        with torch.no_grad():
            fn(*leaves)

    return step


def forward_backward(fn, leaves, grad):
    def step():
        torch.autograd.grad(fn(*leaves), leaves, grad)

    return step


def sfu_limit(device: str) -> tuple[float, str]:
    """SFU operations per second, and the line that states the assumptions."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 132
    ops = sms * SFU_PER_CLOCK_PER_SM * ASSUMED_CLOCK_HZ
    return ops, (
        f"SFU limit assumed: {sms} SMs x {SFU_PER_CLOCK_PER_SM} results/clock x "
        f"{ASSUMED_CLOCK_HZ / 1e9:.2f} GHz = {ops:.3g} ops/s"
    )


def tanh_limit(ops: float, dtype: torch.dtype) -> tuple[float, str]:
    """tanh per second at the SFU limit for the kernel's tanh in ``dtype``: one operation
    (tanh.approx.f32) or two (exp2 and a reciprocal)."""
    from attnlab.kernels import triton_additive as K

    per = 1 if K.hardware_tanh(dtype) else 2
    return ops / per, f"{per} SFU op(s) per tanh -> {ops / per:.3g} tanh/s"


def first_row_errors(leaves, chunk: int = 128, fn=attnlab_additive) -> tuple[float, float]:
    """max|error| of the kernel (``fn``) and of the naive formula on batch row 0, against
    float64."""
    one = [t[:1].detach() if t.dim() == 3 else t.detach() for t in leaves]
    L = one[0].shape[1]
    with torch.no_grad():
        ours = fn(*one).double()
        ctl = torch.cat([naive(one[0][:, i : i + chunk], *one[1:]) for i in range(0, L, chunk)], 1)
        ref = torch.cat(
            [
                naive(one[0][:, i : i + chunk].double(), *(t.double() for t in one[1:]))
                for i in range(0, L, chunk)
            ],
            1,
        )  # float64 in row chunks: (1, chunk, S, A) at a time
    return (ours - ref).abs().max().item(), (ctl.double() - ref).abs().max().item()


def bench_dtype(args, shape: dict, dtype: torch.dtype, ops: float) -> None:
    B, L, S, A = (shape[n] for n in "BLSA")
    leaves = make_inputs(shape, args.device, dtype)
    grad = torch.randn(B, L, shape["D"], device=args.device, dtype=dtype)
    limit, per = tanh_limit(ops, dtype)
    print(
        f"\n-- {str(dtype).removeprefix('torch.')}: B={B} L={L} S={S} D={shape['D']} A={A}; {per}"
    )
    print("  path: " + str(explain_additive(*leaves[:6], bias=leaves[6])))
    hw = {"hw": attnlab_other_tanh} if args.device == "cuda" else {}  # (compiled only)
    fwd = {"naive": naive, "attnlab": attnlab_additive, **hw}
    fwd = round_robin({k: forward(f, leaves) for k, f in fwd.items()}, args.device, args.rounds)
    both = {"naive": naive, "attnlab": attnlab_additive, "recomputed": attnlab_recomputed, **hw}
    both = round_robin(
        {k: forward_backward(f, leaves, grad) for k, f in both.items()}, args.device, args.rounds
    )
    tanh = B * L * S * A
    row("naive formula, forward", fwd["naive"])
    row(
        "attnlab kernel, forward",
        fwd["attnlab"],
        fwd["naive"],
        f"{tanh / fwd['attnlab']:.3g} tanh/s = {tanh / fwd['attnlab'] / limit:.0%} of the limit",
    )
    row("naive formula, forward+backward", both["naive"])
    speedup = both["naive"] / both["attnlab"]
    row(
        "attnlab kernel, forward+backward",
        both["attnlab"],
        both["naive"],
        f"{speedup:.1f}x faster (target >= 5x: {'met' if speedup >= 5 else 'NOT met'}); "
        f"{2 * tanh / both['attnlab']:.3g} tanh/s = {2 * tanh / both['attnlab'] / limit:.0%}",
    )
    row(
        "  the same, scores recomputed",
        both["recomputed"],
        both["attnlab"],
        f"(vs kept); {both['naive'] / both['recomputed']:.1f}x faster than naive; "
        f"{3 * tanh / both['recomputed']:.3g} tanh/s = {3 * tanh / both['recomputed'] / limit:.0%}",
    )
    if hw:
        other = other_tanh(dtype)
        row(f"  forward, {other}", fwd["hw"], fwd["attnlab"], "(vs the default tanh)")
        row(
            f"  forward+backward, {other}",
            both["hw"],
            both["attnlab"],
            f"(vs the default); {both['naive'] / both['hw']:.1f}x faster than naive",
        )
    mem = {
        name: peak_mib(forward_backward(fn, leaves, grad), args.device)
        for name, fn in (("naive", naive), ("attnlab", attnlab_additive))
    }
    if args.device == "cuda":
        verdict = "met" if mem["attnlab"] <= 1024 else "NOT met"
        print(
            f"  peak memory, forward+backward: attnlab {mem['attnlab']:.1f} MiB (target <= 1 GiB: "
            f"{verdict}), naive {mem['naive'] / 1024:.2f} GiB"
        )
    err, ctl = first_row_errors(leaves)
    print(
        f"  accuracy, batch row 0, max|error| vs float64: kernel {err:.3g}, naive formula in "
        f"the same dtype {ctl:.3g} (x{err / ctl if ctl else float('nan'):.2f})"
    )
    if hw:
        err = first_row_errors(leaves, fn=attnlab_other_tanh)[0]
        print(f"  the same with {other}: kernel {err:.3g} (x{err / ctl:.2f} the naive's)")


def sweep(args, shape: dict, dtype: torch.dtype, ops: float) -> None:
    """Forward time per forward tile, then forward+backward time per backward tile (the
    forward's kept at its default), of the kernel alone."""
    from attnlab.kernels import triton_additive as K

    B, L, S, D, A = (shape[n] for n in "BLSDA")
    g = torch.Generator(device=args.device).manual_seed(1)
    a, b = (torch.randn(B, n, A, device=args.device, generator=g) for n in (L, S))
    w = torch.randn(A, device=args.device, generator=g) * A**-0.5
    v = torch.randn(B, S, D, device=args.device, generator=g).to(dtype)
    leaves = [t.requires_grad_() for t in (a, b, w, v)]
    grad = torch.randn(B, L, D, device=args.device, dtype=dtype)
    default = K.tiling_for(D)
    tanh = B * L * S * A
    limit = tanh_limit(ops, dtype)[0]
    for direction in ("forward", "backward"):
        print(
            f"\n-- sweep ({str(dtype).removeprefix('torch.')}), {direction} tiles, rows x keys x "
            "warps"
        )
        for rows, keys, warps in SWEEP:
            blocks = K.Blocks(rows, keys, warps)
            if direction == "forward":
                tiling = K.Tiling(blocks, default.backward)

                def step(tiling=tiling):
                    with torch.no_grad():
                        K.additive_attention(*leaves, tiling=tiling)

            else:
                tiling = K.Tiling(default.forward, blocks)

                def step(tiling=tiling):
                    out = K.additive_attention(*leaves, tiling=tiling)
                    torch.autograd.grad(out, leaves, grad)

            label = f"  {rows:>3} x {keys:>3} x {warps}"
            try:
                t = round_robin({"k": step}, args.device, args.rounds)["k"]
            except Exception as e:  # a tile that does not compile or fit: say so, go on
                print(f"{label}: failed ({type(e).__name__}: {e})"[:160])
                continue
            count = tanh if direction == "forward" else 2 * tanh  # (the scores kept)
            mark = "  <- TILINGS now" if blocks == getattr(default, direction) else ""
            what = "forward" if direction == "forward" else "forward+backward"
            print(
                f"{label}: {what} {t * 1e3:8.3f} ms ({count / t / limit:4.0%} of the limit){mark}"
            )


def run(args) -> None:
    """The additive section of bench_gpu.py (``args``: device, rounds, smoke[, sweep]).

    Both float32 and bfloat16 run whatever ``args.dtype`` says: the targets name both.
    """
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    ops, assumption = sfu_limit(args.device)
    print("\n== additive: fused Triton kernel vs the naive formula ==")
    print(assumption)
    for dtype in DTYPES:  # both benchmarks first: a call cut short loses only sweep rows
        bench_dtype(args, shape, dtype, ops)
    if getattr(args, "sweep", False):
        for dtype in DTYPES:
            sweep(args, shape, dtype, ops)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--sweep", action="store_true", help="also time other tile sizes")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1)")
    args = p.parse_args(argv)
    if not pick_device(args, "bench_gpu_additive"):
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
