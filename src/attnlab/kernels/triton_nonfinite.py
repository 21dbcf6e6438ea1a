"""The NaN rule's row check in two Triton kernels: one read of Q, K and V, no host sync.

Which output rows a NaN or an infinity reaches (:func:`attnlab.functional.nonfinite.
nonfinite_rows`, the readable torch reference this must equal; docs/conventions.md)::

    bad[b, h, i] = (q[b, h, i, :] holds a NaN or an inf)
                   or (k[b, h // G] or v[b, h // G] holds one anywhere)

In torch ops that is a few small kernels (a norm per input, two maxima, a finiteness test): on
a GPU each is a launch, and the norms of 16-bit inputs ran well under the memory's bandwidth.
Here:

1. ``_kv_kernel``: one program per (BLOCK_S keys, b, kv head) reads its keys and values and
   writes one flag (1 when any element is NaN or inf) to its own slot of a
   (B * Hkv, blocks) buffer: every slot is written, so the buffer needs no zeroing and no
   atomics;
2. ``_rows_kernel``: one program per (BLOCK_L query rows, b, h) reads its rows and its kv
   head's flags and writes ``bad`` (B, H, L).

A value is non-finite iff ``x - x`` is not 0 (NaN for NaN and +-inf, 0 otherwise): one
subtraction, no overflow, and NaN never compares equal. With ``kv_finite`` (a KV cache's
verdict per kv head) step 1 is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnlab.kernels import _triton
from attnlab.kernels._triton import offsets_unfit
from attnlab.kernels.triton_attention import MAX_HEAD_DIM, _program, _tile

BLOCK_S = 64  # keys per program in _kv_kernel
BLOCK_L = 64  # query rows per program in _rows_kernel


@triton.jit
def _any_nonfinite(x):
    """1 when the tile holds a NaN or an inf, else 0 (int32 scalar)."""
    return tl.max(tl.max(((x - x) != 0).to(tl.int32), 1), 0)


@triton.jit
def _kv_kernel(
    K, V, FLAGS, skb, skh, sks, ske, svb, svh, svs, sve, Hkv, S, E, EV,
    BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
):  # fmt: skip
    pid_s, bh = _program(tl.cdiv(S, BLOCK_S))  # bh = b * Hkv + kv head, int64
    b = bh // Hkv
    h = bh % Hkv
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)
    k = _tile(K, b * skb + h * skh, offs_s, offs_e, sks, ske, S, E)
    v = _tile(V, b * svb + h * svh, offs_s, offs_ev, svs, sve, S, EV)
    bad = tl.maximum(_any_nonfinite(k.to(tl.float32)), _any_nonfinite(v.to(tl.float32)))
    tl.store(FLAGS + bh * tl.cdiv(S, BLOCK_S) + pid_s, bad.to(tl.int8))


@triton.jit
def _rows_kernel(
    Q, FLAGS, BAD, sqb, sqh, sql, sqe, H, G, L, E, NFLAGS,
    BLOCK_L: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    pid_l, bh = _program(tl.cdiv(L, BLOCK_L))  # bh = b * H + h, int64
    b = bh // H
    h = bh % H
    offs_l = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_e = tl.arange(0, BLOCK_E)
    q = _tile(Q, b * sqb + h * sqh, offs_l, offs_e, sql, sqe, L, E).to(tl.float32)
    rows = tl.max(((q - q) != 0).to(tl.int32), 1)  # (BLOCK_L,)
    kv = tl.zeros([BLOCK_F], tl.int32)
    flags = FLAGS + (b * (H // G) + h // G) * NFLAGS  # this kv head's flags
    for start in range(0, NFLAGS, BLOCK_F):
        offs_f = start + tl.arange(0, BLOCK_F)
        kv = tl.maximum(kv, tl.load(flags + offs_f, mask=offs_f < NFLAGS, other=0).to(tl.int32))
    kv = tl.max(kv, 0)
    tl.store(BAD + bh * L + offs_l, (rows > 0) | (kv > 0), mask=offs_l < L)


def unfit(query, key, value, kv_finite=None) -> str | None:
    """None when the kernels take these inputs: (B, H, L, E), (B, Hkv, S, E), (B, Hkv, S, Ev)
    with Hkv dividing H, on a device Triton serves (:func:`attnlab.kernels._triton.unfit`)."""
    why = _triton.unfit(query, key, value)
    if why is not None:
        return why
    if not query.is_floating_point() or query.dtype == torch.float64:
        return f"{query.dtype} (the row check kernels take float16, bfloat16 and float32)"
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "inputs other than (B, H, L, E)"
    B, H = query.shape[:2]
    if key.shape[0] != B or value.shape[:3] != key.shape[:3]:
        return "a batch or key/value shapes that broadcast"
    if key.shape[1] == 0 or H % key.shape[1] or not query.numel():
        return "kv heads that do not divide the query heads, or an empty input"
    if max(query.shape[-1], key.shape[-1], value.shape[-1]) > MAX_HEAD_DIM:
        return f"a head dim over {MAX_HEAD_DIM}"
    return offsets_unfit(query=query, key=key, value=value)


def nonfinite_rows(query, key, value, kv_finite=None) -> torch.Tensor:
    """(B, H, L, 1) bool: the rows a NaN or an inf reaches (see the module docstring).

    ``kv_finite`` (B, Hkv) bool: each kv head's keys and values already known finite or not.
    Call only after :func:`unfit` returned None."""
    B, H, L, E = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    Ev = value.shape[-1]
    bad = torch.empty(B, H, L, dtype=torch.bool, device=query.device)
    with _triton.on_device(query):
        if kv_finite is not None:
            flags, nflags = (~kv_finite).to(torch.int8).reshape(B * Hkv, 1), 1
        elif S == 0:
            flags, nflags = torch.zeros(B * Hkv, 1, dtype=torch.int8, device=query.device), 1
        else:
            nflags = triton.cdiv(S, BLOCK_S)
            flags = torch.empty(B * Hkv, nflags, dtype=torch.int8, device=query.device)
            _kv_kernel[(nflags * B * Hkv,)](
                key, value, flags, *key.stride(), *value.stride(), Hkv, S, E, Ev,
                BLOCK_S=BLOCK_S, BLOCK_E=_width(E), BLOCK_EV=_width(Ev),
            )  # fmt: skip
        _rows_kernel[(triton.cdiv(L, BLOCK_L) * B * H,)](
            query, flags, bad, *query.stride(), H, H // Hkv, L, E, nflags,
            BLOCK_L=BLOCK_L, BLOCK_E=_width(E), BLOCK_F=min(1024, triton.next_power_of_2(nflags)),
        )  # fmt: skip
    return bad[..., None]


def _width(n: int) -> int:
    return max(16, triton.next_power_of_2(n))
