"""attnlab's Triton kernels against their peers on a GPU, one run, ratios (issue targets).

    python benchmarks/bench_gpu.py                 # on a CUDA machine (an H100 for the targets)
    python benchmarks/bench_gpu.py --only weights  # weights|padding|structure|overhead|decode|
                                                   # additive
    python benchmarks/bench_gpu.py --only weights --sweep   # also other weights-kernel tiles
    python benchmarks/bench_gpu.py --only padding --sweep   # also other forward/backward tiles
    TRITON_INTERPRET=1 python benchmarks/bench_gpu.py --smoke   # tiny shapes, CPU interpreter:
                                                   # checks the script, times mean nothing

Run ``benchmarks/gpu_check.py`` first on a new machine: it checks every kernel's results on
the GPU against float64 (CI runs them only through the interpreter). Without CUDA (and without
--smoke) this script says so and exits 0. Each table times its cases
round-robin (one call of each per round) with CUDA events, medians over rounds, and prints
ratios against the peer measured in the same rounds:

* weights  -- ``return_weights`` per head and averaged vs the fused call without weights
  (torch SDPA), and the per-head target's bound: fused time + the time to write the weights
  tensor at this device's measured copy bandwidth. Targets: averaged <= 2x fused, per head
  <= 1.3x that bound. bf16, (4, 32, 4096, 128) causal and (8, 16, 1024, 64).
* padding  -- lengths uniform in [L/2, L]: attnlab with ``masks.padding_mask(lengths)`` (as
  dispatched: FlexAttention in 16 bits on CUDA) and its Triton kernels vs FlexAttention with
  a block mask built from the lengths, and vs SDPA with the dense mask; forward and
  forward+backward, causal and not. Target: no slower than FlexAttention.
* structure -- sliding windows and packed documents: attnlab as dispatched vs FlexAttention
  with the same rule's block mask and SDPA with the dense mask (no target: the measure that
  decides whether they go to FlexAttention too).
* overhead -- attnlab's fused path vs calling SDPA directly at tiny shapes: microseconds added
  per call, with the NaN rule's row check (the default) and under ``attnlab.assume_finite()``
  (target <= 5 us).
* decode   -- one new query row per sequence against a KV cache (issue 11): attnlab without
  weights, with weights per head and averaged, and SDPA with ``enable_gqa``, under
  ``attnlab.assume_finite()``. Target: weights <= 1.2x the call without. GQA shapes of
  SmolLM2-135M (a 256- and a 2,176-token cache) and Llama-3-8B (4k; one sequence at 32k).
* additive -- the fused additive-attention kernel (benchmarks/bench_gpu_additive.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import attnlab
from attnlab import masks
from attnlab.functional import _triton as _dispatch
from attnlab.kernels import flex_padding


def timer(device: str) -> Callable[[Callable[[], object]], float]:
    """Seconds one call takes: CUDA events on a GPU, wall clock elsewhere."""
    if device == "cuda":

        def cuda_time(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        return cuda_time
    return lambda fn: (lambda t0: (fn(), time.perf_counter() - t0)[1])(time.perf_counter())


def round_robin(cases: dict, device: str, rounds: int, warmup: int = 3) -> dict[str, float]:
    """Median seconds per case, timed one call of each case per round."""
    clock = timer(device)
    for _ in range(warmup):
        for fn in cases.values():
            fn()
    times = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            times[name].append(clock(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def peak_mib(fn, device: str) -> float:
    if device != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def row(label: str, seconds: float, ref: float | None = None, extra: str = "") -> None:
    ratio = f"x{seconds / ref:6.2f}" if ref else "       "
    print(f"  {label:<44} {seconds * 1e3:10.3f} ms  {ratio}  {extra}")


def qkv(B, H, L, E, device, dtype, grad=False, Hkv=None):
    g = torch.Generator(device=device).manual_seed(0)
    make = lambda h: torch.randn(B, h, L, E, device=device, dtype=dtype, generator=g)  # noqa: E731
    q, k, v = make(H), make(Hkv or H), make(Hkv or H)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def copy_bandwidth(nbytes: int, device: str, rounds: int) -> float:
    """Bytes per second of a device-to-device copy of ``nbytes``, counting the bytes read and
    the bytes written (2 ``nbytes``), as a device's copy bandwidth is stated: writing the
    weights (``nbytes``) takes ``nbytes`` over it, half a copy's time. (Counted once, as
    before 2026-11-29, the bound credited a whole copy, read and write, to writing the weights:
    2x too generous, the per-head figures of earlier logs x1.5-1.9 too low.)"""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    t = round_robin({"copy": lambda: dst.copy_(src)}, device, rounds)["copy"]
    return 2 * nbytes / t


def bench_weights(args) -> None:
    print("== weights on demand: attnlab (Triton: forward + lse, then exp(s - lse)) vs fused ==")
    shapes = [(1, 2, 80, 16, True), (1, 2, 64, 16, False)] if args.smoke else [
        (4, 32, 4096, 128, True), (8, 16, 1024, 64, False)
    ]  # fmt: skip
    for B, H, L, E, causal in shapes:
        q, k, v = qkv(B, H, L, E, args.device, args.dtype)
        is_causal = "bottom_right" if causal else False
        print(f"({B},{H},{L},{E}) {args.dtype} causal={causal}:", attnlab.explain(
            q, k, v, is_causal=is_causal, return_weights=True).path)  # fmt: skip
        buf = torch.empty(B, H, L, L, device=args.device, dtype=args.dtype)
        with torch.no_grad():
            cases = {
                "fused (SDPA, no weights)": lambda: F.scaled_dot_product_attention(
                    q, k, v, is_causal=causal
                ),
                "attnlab weights averaged": lambda: attnlab.scaled_dot_product_attention(
                    q, k, v, is_causal=is_causal, return_weights="average"
                ),
                "attnlab weights per head": lambda: attnlab.scaled_dot_product_attention(
                    q, k, v, is_causal=is_causal, return_weights=True
                ),
                "attnlab weights per head, weights_out": lambda: (
                    attnlab.scaled_dot_product_attention(
                        q, k, v, is_causal=is_causal, return_weights=True, weights_out=buf
                    )
                ),
                # the first pass by torch's flash kernel (TORCH_PASS1_ON, off until timed)
                "  same, first pass torch's flash": torch_pass1(lambda: (
                    attnlab.scaled_dot_product_attention(
                        q, k, v, is_causal=is_causal, return_weights=True, weights_out=buf
                    )
                )),
                "  averaged, first pass torch's flash": torch_pass1(lambda: (
                    attnlab.scaled_dot_product_attention(
                        q, k, v, is_causal=is_causal, return_weights="average"
                    )
                )),
            }  # fmt: skip
            t = round_robin(cases, args.device, args.rounds)
        fused = t["fused (SDPA, no weights)"]
        nbytes = buf.numel() * buf.element_size()
        write = nbytes / copy_bandwidth(nbytes, args.device, args.rounds)
        bound = fused + write
        for name, s in t.items():
            row(name, s, fused)
        row("bound: fused + writing the weights", bound, fused, f"({nbytes / 2**30:.2f} GiB)")
        print(
            f"  targets: averaged x{t['attnlab weights averaged'] / fused:.2f} of fused (<= 2);"
            f" per head x{t['attnlab weights per head, weights_out'] / bound:.2f} of the bound"
            f" (<= 1.3; fresh tensor x{t['attnlab weights per head'] / bound:.2f})"
        )
        pass1 = t["  same, first pass torch's flash"], t["  averaged, first pass torch's flash"]
        print(
            f"  with torch's flash as the first pass (TORCH_PASS1_ON): per head x"
            f"{pass1[0] / bound:.2f} of the bound, averaged x{pass1[1] / fused:.2f} of fused"
        )
        if args.sweep:
            with torch.no_grad():
                sweep_tiles(args, "average", q, {
                    "averaged": lambda: attnlab.scaled_dot_product_attention(
                        q, k, v, is_causal=is_causal, return_weights="average"
                    ),
                }, fused, "fused")  # fmt: skip
                sweep_tiles(args, "weights", q, {
                    "per head": lambda: attnlab.scaled_dot_product_attention(
                        q, k, v, is_causal=is_causal, return_weights=True, weights_out=buf
                    ),
                }, fused, "fused")  # fmt: skip


def torch_pass1(run):
    """``run`` with torch's flash kernel as the weights' first pass on this device (where it
    serves: no mask, causal with L = S)."""
    from attnlab.kernels import triton_attention as ta

    def switched():
        kept = ta.TORCH_PASS1_ON
        ta.TORCH_PASS1_ON = ("cuda", "cpu")
        try:
            return run()
        finally:
            ta.TORCH_PASS1_ON = kept

    return switched


# Tiles to time per kernel (rows x keys x warps x stages), TILES in
# attnlab.kernels.triton_attention. The weights: each program recomputes one tile of scores
# per head, reading a (rows, E) query block for every key block, so wider key blocks read Q
# fewer times; compiled for sm_90 the 128 x 32 tiles use ~60-80 registers of 255. The forward
# and the backward: 128 x 64 x 8 x 3 compiles for sm_90 without spills (Triton 3.6 and 3.9,
# 200-255 registers at E = 128), the tutorial's Hopper tile; the others are smaller.
SWEPT_TILES = {
    "weights": [(128, 32, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
                (64, 128, 4, 3), (64, 128, 8, 3), (128, 64, 4, 3), (256, 64, 8, 2)],
    "average": [(128, 32, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
                (64, 128, 4, 3), (128, 64, 4, 3), (64, 64, 4, 4), (128, 32, 4, 4)],
    "forward": [(128, 32, 8, 3), (128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3),
                (64, 32, 4, 3)],
    "backward": [(64, 32, 4, 2), (64, 16, 4, 2), (32, 32, 4, 2), (64, 64, 4, 2),
                 (64, 64, 8, 2), (128, 32, 8, 2)],
}  # fmt: skip


def sweep_tiles(args, kernel: str, q, cases: dict, ref: float, ref_name: str) -> None:
    """``cases`` timed again with each tile of :data:`SWEPT_TILES` for one kernel (the others
    kept), as ratios to ``ref`` measured above."""
    from attnlab.kernels import triton_attention as ta

    key = (q.dtype != torch.float32, 64 if q.shape[-1] <= 64 else q.shape[-1])
    kept = ta.TILES[kernel].get(key)
    print(f"  -- {kernel}-kernel tiles (rows x keys x warps x stages); now {kept}")
    try:
        for tile in SWEPT_TILES[kernel]:
            ta.TILES[kernel][key] = tile
            try:
                t = round_robin(cases, args.device, args.rounds)
            except Exception as e:  # a tile that does not compile or fit: say so, go on
                print(f"  {tile}: failed ({type(e).__name__}: {e})"[:160])
                continue
            mark = "  <- TILES now" if tile == kept else ""
            times = "  ".join(
                f"{name} {s * 1e3:8.3f} ms (x{s / ref:5.2f} of {ref_name})" for name, s in t.items()
            )
            print(f"  {str(tile):<18} {times}{mark}")
    finally:
        ta.TILES[kernel][key] = kept


_FLEX = {}  # one compiled flex_attention for every shape (static shapes, no automatic dynamic)


def flex_case(q, k, v, lengths, causal):
    """FlexAttention with a block mask built from the lengths (the peer), or why not."""

    def mask_mod(b, h, q_idx, kv_idx):
        keep = kv_idx < lengths[b]
        return keep & (kv_idx <= q_idx) if causal else keep

    return flex_peer(q, k, v, mask_mod, per_batch=True)


def flex_peer(q, k, v, mask_mod, per_batch):
    """FlexAttention with the block mask of ``mask_mod`` (``per_batch``: it reads b), or why
    not.

    Compiled once with static shapes: each configuration is its own graph, and dynamo's
    recompile limit is raised for them (at the default 8, the later shapes fell back to
    flex's unfused eager path, a peer measured under other conditions). The probe runs the
    backward too when the inputs take gradients, so that a failure there is reported here
    instead of ending the benchmark.
    """
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:
        return None, f"FlexAttention unavailable ({e})"
    B, H, L, _ = q.shape
    if "fn" not in _FLEX:
        import torch._dynamo as dynamo  # (a bare `import torch._dynamo` makes `torch` local)

        for limit in ("recompile_limit", "cache_size_limit"):  # (the name changed in torch 2.6)
            if hasattr(dynamo.config, limit):
                setattr(dynamo.config, limit, max(64, getattr(dynamo.config, limit)))
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    flex = _FLEX["fn"]
    gqa = k.shape[1] != H
    try:
        S = k.shape[2]
        block = create_block_mask(mask_mod, B if per_batch else None, None, L, S, device=q.device)
        out = flex(q, k, v, block_mask=block, enable_gqa=gqa)
        if q.requires_grad:
            out.backward(torch.randn_like(out))
            q.grad = k.grad = v.grad = None
    except Exception as e:  # noqa: BLE001 (a peer that cannot run here is reported, not fatal)
        return None, f"FlexAttention failed here: {type(e).__name__}: {str(e)[:120]}"
    return (lambda: flex(q, k, v, block_mask=block, enable_gqa=gqa)), None


def bench_padding(args) -> None:
    print("== padding as lengths in [L/2, L]: attnlab vs FlexAttention block mask vs dense ==")
    shapes = [(2, 2, 80, 16)] if args.smoke else [(8, 16, 1024, 64), (4, 32, 4096, 128), (
        32, 16, 128, 64)]  # fmt: skip
    for B, H, L, E in shapes:
        g = torch.Generator().manual_seed(1)
        lengths = torch.randint(L // 2, L + 1, (B,), generator=g).to(args.device)
        pad = masks.padding_mask(lengths, L)
        dense = masks.plain(pad)
        for causal in (False, True):
            for train in (False, True):
                q, k, v = qkv(B, H, L, E, args.device, args.dtype, grad=train)
                is_causal = "top_left" if causal else False
                grad = torch.randn_like(q)
                path = attnlab.explain(q, k, v, pad, is_causal=is_causal).path
                # built once, not timed; (B, 1, 1, S) as labelled unless causal (& a
                # (L, L) triangle: (B, 1, L, S)); before, & ones(L, L) made it (B, 1, L, S)
                dense_mask = dense & _tril(L, q.device) if causal else dense

                step = _stepper(train, grad)
                cases = {
                    f"attnlab ({path})": lambda: step(
                        lambda: attnlab.scaled_dot_product_attention(
                            q, k, v, pad, is_causal=is_causal
                        )
                    ),
                    "attnlab's Triton kernels": lambda: step(
                        lambda: _on_kernels(q, k, v, pad, is_causal)
                    ),
                    "  the same, assume_finite": lambda: step(  # (the NaN rule's share)
                        lambda: _assuming_finite(lambda: _on_kernels(q, k, v, pad, is_causal))
                    ),
                    "SDPA, dense (B,1,1,S) mask": lambda: step(
                        lambda: F.scaled_dot_product_attention(q, k, v, dense_mask)
                    ),
                }
                what = "fwd+bwd" if train else "fwd"
                title = f"({B},{H},{L},{E}) {args.dtype} causal={causal} {what}:"
                flex = flex_case(q, k, v, lengths, causal)
                peer = _against_flex(args, title, cases, flex, step, "SDPA, dense (B,1,1,S) mask")
                if args.sweep:
                    kernels = {"attnlab's Triton kernels": cases["attnlab's Triton kernels"]}
                    sweep_tiles(args, "forward", q, kernels, peer, "the peer")
                    if train:
                        sweep_tiles(args, "backward", q, kernels, peer, "the peer")


def bench_structure(args) -> None:
    """Sliding windows and packed documents: attnlab as dispatched (its Triton kernels, which
    skip the key blocks outside the band or the document) vs FlexAttention with the block mask
    of the same rule and SDPA with the dense (L, S) mask. Measured before deciding whether
    these too go to FlexAttention, as key padding does (attnlab.kernels.flex_padding)."""
    print("== windows and packed documents: attnlab vs FlexAttention block mask vs dense ==")
    shapes = [(2, 2, 80, 16)] if args.smoke else [(8, 16, 1024, 64), (4, 32, 4096, 128)]
    for B, H, L, E in shapes:
        g = torch.Generator().manual_seed(2)
        w = 17 if args.smoke else 256
        cuts = torch.sort(torch.randperm(L - 1, generator=g)[:5] + 1).values.tolist()
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, L], strict=True)]
        doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        doc = doc.to(args.device)

        def in_window(b, h, q_idx, kv_idx, w=w):
            return (q_idx - kv_idx >= 0) & (q_idx - kv_idx < w)

        def same_document(b, h, q_idx, kv_idx, doc=doc):
            return doc[q_idx] == doc[kv_idx]

        kinds = {
            f"window {w}, causal": (
                masks.sliding_window_mask(L, L, window=w, device=args.device),
                in_window,
            ),
            f"{len(lengths)} documents": (
                masks.document_mask(lengths, device=args.device),
                same_document,
            ),
        }
        for label, (m, mask_mod) in kinds.items():
            dense = masks.plain(m)
            for train in (False, True):
                q, k, v = qkv(B, H, L, E, args.device, args.dtype, grad=train)
                grad = torch.randn_like(q)
                path = attnlab.explain(q, k, v, m).path

                step = _stepper(train, grad)
                cases = {
                    f"attnlab ({path})": lambda: step(
                        lambda: attnlab.scaled_dot_product_attention(q, k, v, m)
                    ),
                    "SDPA, dense (L,S) mask": lambda: step(
                        lambda: F.scaled_dot_product_attention(q, k, v, dense)
                    ),
                }
                what = "fwd+bwd" if train else "fwd"
                title = f"({B},{H},{L},{E}) {args.dtype} {label} {what}:"
                flex = flex_peer(q, k, v, mask_mod, per_batch=False)
                _against_flex(args, title, cases, flex, step, "SDPA, dense (L,S) mask")


def _stepper(train: bool, grad):
    """A timed call: ``fn()`` without gradients, or ``fn()`` and its backward with ``grad``."""

    def step(fn):
        if not train:
            with torch.no_grad():
                return fn()
        out = fn()
        out.backward(grad)
        return out

    return step


def _against_flex(args, title, cases, flex, step, fallback) -> float:
    """Time ``cases`` and FlexAttention (``flex``: its call and why not) round-robin, print the
    table against it (or ``fallback`` where it cannot run) and return the peer's time."""
    run, why = flex
    if run is not None:
        cases["FlexAttention, block mask"] = lambda: step(run)
    t = round_robin(cases, args.device, args.rounds)
    peer = t.get("FlexAttention, block mask", t[fallback])
    print(title)
    for name, sec in t.items():
        row(name, sec, peer)
    if why:
        print("  " + why)
    return peer


def _on_kernels(q, k, v, pad, is_causal):
    """attnlab's call with the Triton kernels serving padding (the dispatch gives padding
    alone to FlexAttention or SDPA on CUDA, where they were measured faster: this keeps the
    kernels measured)."""
    kept = _dispatch.SDPA_SERVES_PADDING_ON, flex_padding.SERVES_ON
    _dispatch.SDPA_SERVES_PADDING_ON = flex_padding.SERVES_ON = ()
    try:
        return attnlab.scaled_dot_product_attention(q, k, v, pad, is_causal=is_causal)
    finally:
        _dispatch.SDPA_SERVES_PADDING_ON, flex_padding.SERVES_ON = kept


def _tril(L, device):
    return torch.ones(L, L, dtype=torch.bool, device=device).tril()


def bench_overhead(args) -> None:
    print("== call overhead: attnlab's fused path vs SDPA called directly ==")
    # the large shape shows the NaN policy's row check (one more read of Q, K, V per call)
    big = [(16, 16, 512, 64), (4, 32, 4096, 128)]
    for B, H, L, E in [(1, 8, 64, 64)] + ([] if args.smoke else big):
        q, k, v = qkv(B, H, L, E, args.device, args.dtype)
        with torch.no_grad():
            cases = {
                "SDPA": lambda: F.scaled_dot_product_attention(q, k, v),
                "attnlab": lambda: attnlab.scaled_dot_product_attention(q, k, v),
            }
            # wall clock of many back-to-back calls: the host cost is what differs
            n = 20 if args.smoke or L >= 4096 else 200
            loops = {name: (lambda fn=fn: [fn() for _ in range(n)]) for name, fn in cases.items()}
            loops["assumed"] = lambda: _assuming_finite(loops["attnlab"])  # no NaN row check
            t = round_robin(loops, args.device, args.rounds)
        sdpa, ours, assumed = t["SDPA"] / n, t["attnlab"] / n, t["assumed"] / n
        print(
            f"  ({B},{H},{L},{E}) {args.dtype}: SDPA {sdpa * 1e6:.1f} us, attnlab "
            f"{ours * 1e6:.1f} us: +{(ours - sdpa) * 1e6:.1f} us per call; under assume_finite "
            f"+{(assumed - sdpa) * 1e6:.1f} us (target <= 5)"
        )


def bench_decode(args) -> None:
    """One new query row per sequence against a KV cache (issue 11): weights on request."""
    print(
        "== decode: one query row vs the cache; weights on request vs without (target <= 1.2x) =="
    )
    shapes = [(1, 2, 1, 40, 16)] if args.smoke else [
        (4, 9, 3, 256, 64),  # SmolLM2-135M's heads, a 128-token prompt + 128 new tokens
        (4, 9, 3, 2176, 64),  # ... after a 2,048-token prompt
        (8, 32, 8, 4096, 128),  # Llama-3-8B's heads, a 4k cache
        (1, 32, 8, 32768, 128),  # one sequence, a 32k cache (the decode kernel splits it)
    ]  # fmt: skip
    for B, H, Hkv, S, E in shapes:
        g = torch.Generator(device=args.device).manual_seed(0)
        q = torch.randn(B, H, 1, E, device=args.device, dtype=args.dtype, generator=g)
        k, v = (torch.randn(B, Hkv, S, E, device=args.device, dtype=args.dtype, generator=g)
                for _ in range(2))  # fmt: skip
        call = attnlab.scaled_dot_product_attention
        kw = dict(is_causal="bottom_right")
        paths = {rw: attnlab.explain(q, k, v, return_weights=rw, **kw).path
                 for rw in (False, True, "average")}  # fmt: skip
        n = 5 if args.smoke else 50  # calls per timing: a decode call is a few microseconds
        with torch.no_grad(), attnlab.assume_finite():  # the kernels' cost, not the NaN check
            cases = {
                "SDPA (enable_gqa), no weights": lambda: F.scaled_dot_product_attention(
                    q, k, v, enable_gqa=Hkv != H
                ),
                f"attnlab, no weights ({paths[False]})": lambda: call(q, k, v, **kw),
                f"attnlab, weights per head ({paths[True]})": lambda: call(
                    q, k, v, return_weights=True, **kw
                ),
                f"attnlab, weights averaged ({paths['average']})": lambda: call(
                    q, k, v, return_weights="average", **kw
                ),
            }
            loops = {name: (lambda fn=fn: [fn() for _ in range(n)]) for name, fn in cases.items()}
            t = {name: s / n for name, s in round_robin(loops, args.device, args.rounds).items()}
        base = t[f"attnlab, no weights ({paths[False]})"]
        print(f"(B={B}, H={H}, Hkv={Hkv}, S={S}, E={E}) {args.dtype}, under assume_finite:")
        for name, s in t.items():
            row(name, s, base)
        each, avg = (t[f"attnlab, weights per head ({paths[True]})"],
                     t[f"attnlab, weights averaged ({paths['average']})"])  # fmt: skip
        print(f"  targets: weights per head x{each / base:.2f}, averaged x{avg / base:.2f} of the"
              " call without (<= 1.2)")  # fmt: skip


def _assuming_finite(fn):
    with attnlab.assume_finite():
        return fn()


def pick_device(args, script: str) -> bool:
    """Set ``args.device`` (CUDA, or CPU for ``--smoke``); False, said, when there is none."""
    if torch.cuda.is_available() and not args.smoke:
        args.device = "cuda"
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    elif args.smoke:
        args.device, args.rounds = "cpu", min(args.rounds, 2)
        print("smoke run on CPU: checks the script only; the times mean nothing")
    else:
        print(f"{script}: no CUDA device here; nothing to measure (--smoke checks the script)")
        return False
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--only",
        choices=["weights", "padding", "structure", "overhead", "decode", "additive"],
    )
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1)")
    p.add_argument("--sweep", action="store_true", help="also time other kernel tiles")
    args = p.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    if not pick_device(args, "bench_gpu"):
        return 0
    chosen = [args.only] if args.only else [
        "weights", "padding", "structure", "overhead", "decode", "additive"
    ]  # fmt: skip
    for name in chosen:
        if name == "additive":
            try:
                import bench_gpu_additive
            except ImportError:
                print("== additive: benchmarks/bench_gpu_additive.py not found ==")
                continue
            bench_gpu_additive.run(args)
        else:
            globals()[f"bench_{name}"](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
