"""attnlab's Triton kernels on a real GPU against float64: run this first on a GPU machine.

The kernels are tested in CI through Triton's interpreter (``tests/triton/``, CPU tensors);
compiled for a GPU they take other tile sizes and other code generation. Before timing them
(``bench_gpu.py``), this script runs every kernel through the public API on the device and
compares it with float64 on the CPU:

* weights on demand (per head and averaged): float32 / bfloat16 / float16, GQA, both causal
  alignments, bool masks with dead rows, float biases, head dims 32-256;
* masks kept as structure (padding lengths, packed documents, sliding windows), forward and
  forward+backward;
* training without weights (the dK/dV and dQ kernels), GQA, causal, padding;
* the split-key decode kernel (1 and 3 query rows against a long cache) with weights;
* additive attention, forward and backward;
* the NaN rule's row check (exactly the torch-ops verdict);
* with two GPUs, kernels on ``cuda:1`` while ``cuda:0`` is current.

Each result must be within twice the error of a control, the naive formula in the same dtype
on the same device (plus a rounding floor), and each call must run on the Triton kernels
(``explain()``). Exits 1 when any case fails. Usage::

    python benchmarks/gpu_check.py                    # on a CUDA machine
    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --smoke   # tiny shapes, CPU interpreter
"""

from __future__ import annotations

import argparse
import itertools
import platform
import sys
import traceback

import torch

import attnlab
import attnlab.functional as AF
from attnlab import masks
from attnlab.functional import _triton as dispatch
from attnlab.kernels import flex_padding

F64 = torch.float64
FLOOR = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
failures: list[str] = []


def inputs(B, H, Hkv, L, S, E, Ev, device, dtype, seed=0, grad=False):
    """float64 CPU originals and their ``dtype`` copies on the device."""
    g = torch.Generator().manual_seed(seed)
    ref = [
        torch.randn(B, H, L, E, generator=g, dtype=F64),
        torch.randn(B, Hkv, S, E, generator=g, dtype=F64),
        torch.randn(B, Hkv, S, Ev, generator=g, dtype=F64),
    ]
    dev = [t.to(device, dtype).requires_grad_(grad) for t in ref]
    return [t.requires_grad_(grad) for t in ref], dev


def naive(q, k, v, mask=None, scale=None):
    """The control: the textbook formula in the inputs' dtype (GQA by repeating heads)."""
    if k.shape[1] != q.shape[1]:
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (q @ k.transpose(-2, -1)) * (scale or q.shape[-1] ** -0.5)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    w = torch.softmax(s, -1).nan_to_num(0.0)
    return w @ v, w


def err(a, b) -> float:
    return (a.detach().to("cpu", F64) - b.detach()).abs().max().item() if a.numel() else 0.0


def judge(name, got, ref, ctrl, dtype) -> None:
    """got and ctrl: device tensors; ref: float64 CPU. Records a failure when out of bounds."""
    e, c = err(got, ref), err(ctrl, ref)
    bound = 2 * c + FLOOR[dtype]
    ok = e <= bound
    print(f"  {'ok  ' if ok else 'FAIL'} {name:<58} err {e:9.3g}  control {c:9.3g}")
    if not ok:
        failures.append(f"{name}: err {e:.3g} > {bound:.3g}")


def on_triton(name, *args, **kwargs) -> bool:
    return on_path(name, "triton", *args, **kwargs)


def on_path(name, path, *args, **kwargs) -> bool:
    """Whether the call takes ``path`` (``explain()``); a failure recorded when it does not."""
    d = attnlab.explain(*args, **kwargs)
    if d.path != path:
        print(f"  FAIL {name}: not on {path} ({d})")
        failures.append(f"{name}: path {d.path}")
        return False
    return True


def full_mask(kind, B, H, L, S, device, seed=1):
    """A bool (B, 1, L, S) mask with a dead row, or a float (1, H, L, S) bias with -inf."""
    g = torch.Generator().manual_seed(seed)
    if kind == "bool":
        m = torch.rand(B, 1, L, S, generator=g) > 0.3
        m[0, 0, L // 2] = False
        return m.to(device)
    bias = torch.randn(1, H, L, S, generator=g, dtype=F64)
    return bias.masked_fill(torch.rand(1, H, L, S, generator=g) > 0.7, float("-inf")).to(device)


def check_weights(device, shapes, dtypes) -> None:
    print("== weights on demand (forward with lse, then exp(s - lse) per tile) ==")
    for dtype in dtypes:
        for shape, alignment, kind in shapes:
            B, H, Hkv, L, S, E, Ev = shape
            (q0, k0, v0), (q, k, v) = inputs(*shape, device, dtype)
            m = None if kind is None else full_mask(kind, B, H, L, S, device)
            m = m.to(dtype) if m is not None and m.is_floating_point() else m
            name = f"{str(dtype)[6:]} {shape} {alignment} {kind}"
            kw = {"is_causal": alignment or False}
            if not on_triton(name, q, k, v, m, return_weights=True, **kw):
                continue
            with torch.no_grad():
                out, w = attnlab.scaled_dot_product_attention(q, k, v, m, return_weights=True, **kw)
                _, avg = AF.scaled_dot_product_attention(q, k, v, m, return_weights="average", **kw)
            m0 = None if m is None else m.cpu().to(F64) if m.is_floating_point() else m.cpu()
            ref_out, ref_w = attnlab.scaled_dot_product_attention(
                q0, k0, v0, m0, return_weights=True, **kw
            )
            mc = masks.restrict(m, _causal(alignment, L, S, device)) if alignment else m
            c_out, c_w = naive(q, k, v, mc)
            judge(f"{name} out", out, ref_out, c_out, dtype)
            judge(f"{name} weights", w, ref_w, c_w, dtype)
            judge(f"{name} averaged", avg, ref_w.mean(1), c_w.mean(1), dtype)


def check_torch_pass1(device, n, dtypes) -> None:
    """The weights with torch's flash kernel as their first pass (TORCH_PASS1_ON, off until
    timed): it must serve these calls, and its log-sum-exp give the oracle's weights."""
    print("== weights from torch's flash kernel's log-sum-exp (TORCH_PASS1_ON) ==")
    from attnlab.kernels import triton_attention as ta

    kept = ta.TORCH_PASS1_ON
    ta.TORCH_PASS1_ON = (torch.device(device).type,)
    try:
        for dtype in dtypes:
            if device != "cpu" and dtype == torch.float32:
                continue  # (torch's CUDA flash kernel takes 16 bits)
            for shape, alignment in (
                ((2, 8, 8, n + 33, n, 64, 64), None),
                ((1, 4, 4, n + 43, n + 43, 128, 128), "top_left"),
            ):
                B, H, Hkv, L, S, E, Ev = shape
                (q0, k0, v0), (q, k, v) = inputs(*shape, device, dtype)
                name = f"{str(dtype)[6:]} {shape} {alignment} torch pass 1"
                kw = {"is_causal": alignment or False}
                said = str(attnlab.explain(q, k, v, return_weights=True, **kw))
                if "torch's flash kernel with row log-sum-exp" not in said:
                    print(f"  FAIL {name}: not served ({said})")
                    failures.append(f"{name}: not served")
                    continue
                with torch.no_grad():
                    out, w = attnlab.scaled_dot_product_attention(
                        q, k, v, return_weights=True, **kw
                    )
                    _, avg = AF.scaled_dot_product_attention(
                        q, k, v, return_weights="average", **kw
                    )
                ref_out, ref_w = attnlab.scaled_dot_product_attention(
                    q0, k0, v0, return_weights=True, **kw
                )
                mc = _causal(alignment, L, S, device) if alignment else None
                c_out, c_w = naive(q, k, v, mc)
                judge(f"{name} out", out, ref_out, c_out, dtype)
                judge(f"{name} weights", w, ref_w, c_w, dtype)
                judge(f"{name} averaged", avg, ref_w.mean(1), c_w.mean(1), dtype)
    finally:
        ta.TORCH_PASS1_ON = kept


def _causal(alignment, L, S, device):
    return masks.causal_keep(L, S, alignment, device)


def check_structure(device, n, dtypes) -> None:
    print("== masks as structure: padding lengths, packed documents, sliding windows ==")
    B, H, Hkv, E = 3, 4, 2, 64
    for dtype in dtypes:
        cases = {
            "padding": (n, 2 * n, masks.padding_mask([2 * n, n + 7, 0], device=device)),
            "documents": (n, n, masks.document_mask([7, 0, n // 2, n - 7 - n // 2], device=device)),
            "window": (n, 2 * n, masks.sliding_window_mask(
                n, 2 * n, window=33, alignment="bottom_right", causal=False, device=device)),
        }  # fmt: skip
        for label, (L, S, m) in cases.items():
            plain = m.as_subclass(torch.Tensor)
            for causal in (False, "bottom_right" if L != S else True):
                keep = plain
                if causal:
                    keep = masks.restrict(plain, _causal(
                        "top_left" if causal is True else causal, L, S, device))  # fmt: skip
                for train in (False, True):
                    name = f"{str(dtype)[6:]} {label} causal={causal} "
                    name += "fwd+bwd" if train else "fwd"
                    shape = (B, H, Hkv, L, S, E, E)
                    (q0, k0, v0), (q, k, v) = inputs(*shape, device, dtype, grad=train)
                    if on_triton(name, q, k, v, m, is_causal=causal):
                        _judge_masked(name, (q, k, v), (q0, k0, v0), m, plain, keep, causal, dtype)


def check_flex(device, n, dtypes) -> None:
    """Key padding as the dispatch routes it on CUDA: torch's FlexAttention with attnlab's
    block mask (attnlab.kernels.flex_padding), forward and backward, against float64."""
    print("== key padding through FlexAttention with attnlab's block mask ==")
    B, H, Hkv, E = 3, 4, 2, 64
    for dtype in [d for d in dtypes if d in flex_padding.DTYPES]:
        cases = ((n, 2 * n + 5, False, "right"), (n + 9, n + 9, True, "right"),
                 (n, 2 * n, "bottom_right", "left"))  # fmt: skip
        for L, S, causal, side in cases:
            # a full row, a cut one, a dead one
            pad = masks.padding_mask([S, n + 7, 0], S, side=side, device=device)
            plain = pad.as_subclass(torch.Tensor)
            keep = plain
            if causal:
                align = "top_left" if causal is True else causal
                keep = masks.restrict(plain, _causal(align, L, S, device))
            for train in (False, True):
                name = f"{str(dtype)[6:]} flex padding ({L}, {S}) causal={causal} "
                name += "fwd+bwd" if train else "fwd"
                (q0, k0, v0), (q, k, v) = inputs(B, H, Hkv, L, S, E, E, device, dtype, grad=train)
                if on_path(name, "flex", q, k, v, pad, is_causal=causal):
                    _judge_masked(name, (q, k, v), (q0, k0, v0), pad, plain, keep, causal, dtype)


def _judge_masked(name, dev, ref_in, mask, plain, keep, causal, dtype) -> None:
    """attnlab's call with ``mask`` on the device against float64 with its plain tensor, and
    the naive formula with ``keep`` (the mask and causality) as the control; gradients when
    the inputs take them."""
    out = attnlab.scaled_dot_product_attention(*dev, mask, is_causal=causal)
    ref = attnlab.scaled_dot_product_attention(*ref_in, plain.cpu(), is_causal=causal)
    ctrl = naive(*dev, keep)[0]
    judge(f"{name} out", out, ref, ctrl, dtype)
    if dev[0].requires_grad:
        _judge_grads(name, dev, ref_in, out, ref, ctrl, dtype)


def _judge_grads(name, dev, ref_in, out, ref, ctrl, dtype, labels="qkv") -> None:
    """The gradients of ``out`` (device), ``ref`` (float64) and ``ctrl`` for one random dout."""
    g = torch.Generator().manual_seed(5)
    dout = torch.randn(ref.shape, generator=g, dtype=F64)
    grads = torch.autograd.grad(out, dev, dout.to(out.device, out.dtype), retain_graph=True)
    ref_g = torch.autograd.grad(ref, ref_in, dout)
    ctrl_g = torch.autograd.grad(ctrl, dev, dout.to(out.device, out.dtype))
    for label, a, b, c in zip(labels, grads, ref_g, ctrl_g, strict=True):
        judge(f"{name} d{label}", a, b, c, dtype)


def check_training(device, shapes, dtypes) -> None:
    print("== training without weights: forward, then the dK/dV and dQ kernels ==")
    for dtype in dtypes:
        for shape, alignment in shapes:
            (q0, k0, v0), (q, k, v) = inputs(*shape, device, dtype, grad=True)
            name = f"{str(dtype)[6:]} {shape} {alignment}"
            kw = {"is_causal": alignment or False}
            # (a call without a mask keeps torch's fused kernel; lengths that keep every key
            # route it to attnlab's)
            pad = masks.padding_mask([shape[4]] * shape[0], device=device)
            if not on_triton(name, q, k, v, pad, **kw):
                continue
            out = attnlab.scaled_dot_product_attention(q, k, v, pad, **kw)
            ref = attnlab.scaled_dot_product_attention(q0, k0, v0, **kw)
            L, S = shape[3], shape[4]
            ctrl = naive(q, k, v, _causal(alignment, L, S, device) if alignment else None)[0]
            judge(f"{name} out", out, ref, ctrl, dtype)
            _judge_grads(name, (q, k, v), (q0, k0, v0), out, ref, ctrl, dtype)


def check_decode(device, S, dtypes) -> None:
    print("== split-key decode kernel, weights in the same pass ==")
    for dtype in dtypes:
        for L in (1, 3):
            shape = (4, 9, 3, L, S, 64, 64)
            (q0, k0, v0), (q, k, v) = inputs(*shape, device, dtype)
            name = f"{str(dtype)[6:]} {shape} bottom_right"
            kw = {"is_causal": "bottom_right", "return_weights": True}
            if not on_triton(name, q, k, v, **kw):
                continue
            with torch.no_grad():
                out, w = attnlab.scaled_dot_product_attention(q, k, v, **kw)
            ref_out, ref_w = attnlab.scaled_dot_product_attention(q0, k0, v0, **kw)
            c_out, c_w = naive(q, k, v, _causal("bottom_right", L, S, device))
            judge(f"{name} out", out, ref_out, c_out, dtype)
            judge(f"{name} weights", w, ref_w, c_w, dtype)


def check_additive(device, n, dtypes) -> None:
    from attnlab.kernels import triton_additive  # (imports Triton)

    print("== additive attention: fused forward and backward ==")
    B, D, A = 2, 64, 48
    for dtype in dtypes:
        g = torch.Generator().manual_seed(0)
        ref_in = [torch.randn(B, n, D, generator=g, dtype=F64) for _ in range(3)]
        ref_in += [torch.randn(A, D, generator=g, dtype=F64) / D**0.5 for _ in range(2)]
        ref_in += [torch.randn(A, generator=g, dtype=F64) / A**0.5]
        ref_in = [t.requires_grad_() for t in ref_in]
        dev = [t.detach().to(device, dtype).requires_grad_() for t in ref_in]
        # the defaults, the backward rebuilding the scores (as past STORED_SCORES_BYTES), and
        # for 16 bits the other tanh (the SFU's tanh.approx.f32 or exp2 and a reciprocal)
        variants = {"": {}, " scores recomputed": {"STORED_SCORES_BYTES": 0}}
        if dtype != torch.float32:
            hw = dtype in triton_additive.HARDWARE_TANH_ON
            variants[" exp2 tanh" if hw else " tanh.approx.f32"] = {
                "HARDWARE_TANH_ON": () if hw else (dtype,)
            }
        for causal, (label, settings) in itertools.product((False, True), variants.items()):
            name = f"{str(dtype)[6:]} additive B={B} L=S={n} causal={causal}{label}"
            d = AF.explain_additive(*dev, is_causal=causal)
            if d.path != "triton":
                print(f"  FAIL {name}: not on the Triton kernel ({d})")
                failures.append(f"{name}: path {d.path}")
                continue
            with triton_additive.settings(**settings):  # (the backward keeps the forward's)
                out = AF.additive_attention(*dev, is_causal=causal)
            ref = AF.additive_attention(*ref_in, is_causal=causal)
            ctrl = _naive_additive(*dev, causal)
            judge(f"{name} out", out, ref, ctrl, dtype)
            _judge_grads(
                name, dev, ref_in, out, ref, ctrl, dtype, ("q", "k", "v", "W_q", "W_k", "w")
            )


def _naive_additive(q, k, v, w_q, w_k, w, causal):
    s = torch.tanh((q @ w_q.T).unsqueeze(2) + (k @ w_k.T).unsqueeze(1)) @ w  # (B, L, S)
    if causal:
        s = s.masked_fill(~_causal("top_left", q.shape[1], k.shape[1], q.device), float("-inf"))
    return torch.softmax(s, -1) @ v


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def check_nonfinite(device, n, dtypes) -> None:
    """The NaN rule's row check in Triton against its torch-ops reference: exact, bool."""
    print("== the NaN rule's row check (Triton) vs torch ops ==")
    from attnlab.functional import nonfinite
    from attnlab.kernels import triton_nonfinite as tn

    for dtype in dtypes:
        for B, H, Hkv, L, S, E, Ev in [(2, 8, 2, n, 3 * n, 64, 64), (3, 4, 4, 1, 8 * n, 128, 64)]:
            g = torch.Generator().manual_seed(L + S)
            q, k, v = (torch.randn(B, h, m, e, generator=g).to(device, dtype)
                       for h, m, e in ((H, L, E), (Hkv, S, E), (Hkv, S, Ev)))  # fmt: skip
            q[0, 1, L // 2, 3], k[1, 0, S - 1, E - 1] = float("nan"), float("inf")
            v[0, Hkv - 1, 0, 0] = float("-inf")
            name = f"{str(dtype)[6:]} {(B, H, Hkv, L, S, E, Ev)} row check"
            got, ref = tn.nonfinite_rows(q, k, v), nonfinite.rows_in_torch_ops(q, k, v)
            ok = torch.equal(got, ref) and bool(got.any()) and not bool(got.all())
            print(f"  {'ok  ' if ok else 'FAIL'} {name}")
            if not ok:
                failures.append(f"{name}: differs from torch ops")


def section(check, *args) -> None:
    """Run one ``check_*``; an exception there (a kernel that does not compile on this GPU, out
    of memory) is a failure with its traceback, and the later sections still run."""
    try:
        check(*args)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        failures.append(f"{check.__name__} raised {type(e).__name__}: {str(e)[:300]}")
        print(f"  FAIL {failures[-1]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1)")
    args = p.parse_args(argv)
    # The dispatch gives key padding alone to torch's FlexAttention on CUDA (16-bit) or to its
    # SDPA (measured faster there); the kernel sections check attnlab's kernels, so they take
    # padding too, and check_flex checks the FlexAttention route.
    dispatch.SDPA_SERVES_PADDING_ON = ()
    versions = f"torch {torch.__version__}, triton {_version('triton')}"
    print(f"{versions}, python {platform.python_version()}")
    if args.smoke:  # (the interpreter runs a tile at a time: small and float32 only)
        device, n, dtypes = "cpu", 24, [torch.float32]
    elif torch.cuda.is_available():
        device, n, dtypes = "cuda", 300, [torch.float32, torch.bfloat16, torch.float16]
        print(f"device: {torch.cuda.get_device_name()}")
    else:
        print("gpu_check: no CUDA device here (--smoke checks the script under the interpreter)")
        return 0
    wide = 128 if n > 100 else 32  # (the interpreter is slow at wide heads)
    widest = 256 if n > 100 else 48
    weights = [  # ((B, H, Hkv, L, S, E, Ev), causal alignment, mask kind)
        ((2, 8, 2, n, n + 33, 64, 64), None, None),
        ((1, 4, 4, n + 43, n + 43, wide, wide), "top_left", None),
        ((1, 2, 1, n // 2, n, widest, widest), "bottom_right", "bool"),
        ((2, 6, 3, n // 3, n + 100, 64, 32), "bottom_right", "bool"),
        ((2, 4, 2, n // 2, n, 32, 64), None, "float"),
    ]  # fmt: skip
    section(check_weights, device, weights, dtypes)
    section(check_torch_pass1, device, n, dtypes)
    if device == "cuda":
        section(check_flex, device, n, dtypes)
    flex_padding.SERVES_ON = ()
    section(check_structure, device, n, dtypes)
    training = [((2, 8, 2, n, n, 64, 64), "top_left"), ((2, 4, 1, n // 2, n + 50, 64, 64), None)]
    section(check_training, device, training, dtypes)
    section(check_decode, device, 8 * n, dtypes)
    section(check_additive, device, n, dtypes[:2])
    section(check_nonfinite, device, n, dtypes)
    if device == "cuda" and torch.cuda.device_count() > 1:  # Triton launches on the current one
        print("== on cuda:1 while cuda:0 is current (a model spread over GPUs) ==")
        section(check_weights, "cuda:1", weights[:1], dtypes[1:2])
        section(check_training, "cuda:1", training[:1], dtypes[1:2])
    elif device == "cuda":
        print("(one GPU: the case of tensors on a second GPU is not run)")
    print(f"\n{len(failures)} failure(s)" + "".join(f"\n  {f}" for f in failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
