"""Key padding through torch's FlexAttention, with a block mask built from the key ranges.

A padding mask from :func:`attnlab.masks.padding_mask` remembers each batch row's key range
``[start_b, end_b)``. FlexAttention (``torch.nn.attention.flex_attention``, compiled) takes a
*block mask*: for each tile of ``BLOCK`` query rows and ``BLOCK`` keys, whether it is empty
(skipped), full (no mask read) or partial (the element rule ``mask_mod`` applied). Here it is
built on the device from the ranges, with no (L, S) tensor and no host sync::

    keys [k0, k1) of batch row b, query rows [q0, q1), causal offset c (kv <= q + c):
    full    = start_b <= k0  and  k1 <= end_b  and  (k1 - 1) - q0 <= c
    f, l    = max(k0, start_b), min(k1, end_b) - 1          (the tile's keys in range)
    empty   = f > l  or  f - (q1 - 1) > c
    partial = neither;   mask_mod(b, h, q, kv) = start_b <= kv < end_b  and  kv - q <= c

Both tests are exact: a full tile allows every pair, an empty one none, a partial one some.

with ``c = 0`` top-left causal, ``S - L`` bottom-right, ``S`` (always true) without causality:
one ``mask_mod`` whose ranges and offset are tensors, and the scale a tensor too (a
``score_mod``), so new lengths (a new batch) and new scales reuse the compiled kernels (dynamo
lifts captured tensors as inputs; a test counts the graphs). The block mask is cached per
key-range tensor (a padding mask is built once and read by every layer) and holds copies of
the ranges, so that it goes with the mask.

Why: measured with ``benchmarks/bench_gpu.py --only padding`` (bf16, lengths in [L/2, L],
(8,16,1024,64), (4,32,4096,128), (32,16,128,64), causal and not; results in
``benchmarks/results/``), FlexAttention with a block mask took 0.52-0.72x the time of attnlab's
Triton kernels forward and 0.60-0.69x forward and backward on an H100 and an H200, and
0.37-0.83x that of attnlab's call through SDPA with the dense mask it builds per call. So on
CUDA it serves key padding alone (no window, no documents, no weights, no dropout), 16-bit,
head dims 16-128, GPUs from sm_80. Rows with no key give 0 (FlexAttention's rule too); the
caller applies the NaN rule.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.weak import WeakIdKeyDictionary

SERVES_ON = ("cuda",)  # devices the dispatch routes padding to FlexAttention on
COMPILED_ON = ("cuda",)  # elsewhere (tests on CPU) FlexAttention's eager form runs
DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = (16, 32, 64, 128)
BLOCK = 128  # FlexAttention's default tile, rows and keys

# key-range start tensor -> {(L, S, offset kind, device): BlockMask}; entries go with the mask
_cache = WeakIdKeyDictionary()


@functools.cache
def available() -> bool:
    """Whether this torch's FlexAttention takes what the route passes: ``enable_gqa`` and a
    block mask from ``BlockMask.from_kv_blocks(..., seq_lengths=...)`` (later than 2.5's)."""
    import inspect

    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
    except ImportError:
        return False
    takes = inspect.signature(flex_attention).parameters
    blocks = inspect.signature(BlockMask.from_kv_blocks).parameters
    return "enable_gqa" in takes and "seq_lengths" in blocks


def unfit(q, k, v, key_range, band, dropout_p, return_weights) -> str | None:
    """None when FlexAttention serves this call, else why not (for ``explain()``)."""
    if q.device.type not in SERVES_ON:
        return f"{q.device.type} tensors (FlexAttention serves padding on {', '.join(SERVES_ON)})"
    if key_range is None or key_range[0].dim() != 1 or band is not None:
        return "not key padding alone (windows and packed documents keep attnlab's kernels)"
    if key_range[0].device != q.device:
        return f"key ranges on {key_range[0].device}, queries on {q.device}"
    if return_weights or dropout_p > 0:
        return "weights or dropout (FlexAttention returns neither)"
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"{q.dtype} (FlexAttention is measured and served in bfloat16 and float16)"
    if q.dim() != 4 or q.shape[-1] != v.shape[-1] or q.shape[-1] not in HEAD_DIMS:
        return f"head dims E={q.shape[-1]}, Ev={v.shape[-1]} (served: E = Ev in {HEAD_DIMS})"
    if not available():
        return "this torch has no FlexAttention that takes enable_gqa and seq_lengths"
    if q.is_cuda and torch.cuda.get_device_capability(q.device) < (8, 0):
        return "a GPU before sm_80 (FlexAttention's 16-bit kernels need Ampere or later)"
    return None


def describe(q, k, alignment) -> str:
    """One line for ``explain()``."""
    how = "compiled" if q.device.type in COMPILED_ON else "eager (its unfused form: tests)"
    causal = "" if alignment is None else f", {alignment} causal in the block mask"
    gqa = (
        f", grouped-query heads H={q.shape[1]}, Hkv={k.shape[1]}"
        if k.shape[1] != q.shape[1]
        else ""
    )
    return (
        f"key padding by torch's FlexAttention ({how}) with a block mask from each batch row's "
        f"key range, cached with the mask: empty key tiles skipped, full ones read no mask"
        f"{causal}{gqa}; measured faster than attnlab's Triton kernels and its SDPA call, "
        "forward and backward (H100, H200: attnlab.kernels.flex_padding)"
    )


def attention(q, k, v, key_range, alignment, scale):
    """(B, H, L, E), (B, Hkv, S, E), (B, Hkv, S, E) -> (B, H, L, E): attention over each batch
    row's key range (``key_range`` (start, end), (B,) int), causal by ``alignment`` (None,
    ``"top_left"``, ``"bottom_right"``); ``scale`` None is 1/sqrt(E)."""
    L, S = q.shape[-2], k.shape[-2]
    block = block_mask(key_range, alignment, L, S)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # the scale as a tensor that score_mod reads, FlexAttention's own scale 1: a float argument
    # is a guard, so that each new scale would compile a new graph (and past dynamo's limit of
    # 8, calls would run FlexAttention's unfused eager form)
    run = _compiled() if q.device.type in COMPILED_ON else _eager
    return run(q, k, v, block, _factor(scale, q.device))


@functools.lru_cache(maxsize=64)
def _factor(scale: float, device: torch.device) -> torch.Tensor:
    """The scale as a 0-d float32 tensor on the device, made once per (scale, device): not a
    host-to-device copy at every call."""
    return torch.tensor(scale, dtype=torch.float32, device=device)


def block_mask(key_range, alignment, L: int, S: int):
    """The FlexAttention block mask of these key ranges and causality (module docstring),
    cached per key-range tensor."""
    start, end = key_range
    kind = "none" if alignment is None else alignment
    key = (L, S, kind, BLOCK, start.device)
    entries = _cache.setdefault(start, {})
    seen = (start._version, id(end), end._version)  # (end lives as long as start: one mask's)
    if key not in entries or entries[key][0] != seen:
        entries[key] = (seen, _build(start, end, kind, L, S))
    return entries[key][1]


def _build(start, end, kind: str, L: int, S: int):
    from torch.nn.attention.flex_attention import BlockMask

    offset = {"none": S, "top_left": 0, "bottom_right": S - L}[kind]
    device = start.device
    rows, keys = -(-L // BLOCK), -(-S // BLOCK)
    q0 = torch.arange(rows, device=device)[:, None] * BLOCK  # (rows, 1): a tile's first row
    q1 = torch.clamp(q0 + BLOCK, max=L)
    k0 = torch.arange(keys, device=device)[None, :] * BLOCK  # (1, keys)
    k1 = torch.clamp(k0 + BLOCK, max=S)
    s, e = start.long()[:, None, None], end.long()[:, None, None]  # (B, 1, 1)
    full = (s <= k0) & (k1 <= e) & ((k1 - 1) - q0 <= offset)  # (B, rows, keys)
    first, last = torch.maximum(k0, s), torch.minimum(k1, e) - 1  # the tile's keys in range
    empty = (first > last) | (first - (q1 - 1) > offset)  # none, or past every row's reach
    partial = ~full & ~empty
    c = torch.tensor(offset, device=device)
    # copies: the block mask (the cache's value) must not hold the cache's key, ``start``
    lo, hi = start.clone(), end.clone()

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx >= lo[b]) & (kv_idx < hi[b]) & (kv_idx - q_idx <= c)

    return BlockMask.from_kv_blocks(
        *_listed(partial), *_listed(full), BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(L, S)
    )


def _listed(chosen: torch.Tensor):
    """(B, rows, keys) bool -> the counts (B, 1, rows) and the key tiles listed first
    (B, 1, rows, keys), as ``BlockMask.from_kv_blocks`` reads them."""
    count = chosen.sum(-1, dtype=torch.int32)
    order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count[:, None], order[:, None]


def _call(q, k, v, block, factor):
    """FlexAttention with the scores times ``factor`` (a 0-d tensor) and grouped-query heads
    always allowed (G = 1 is a group too): no Python value that varies between calls."""
    from torch.nn.attention.flex_attention import flex_attention

    def scaled(score, b, h, q_idx, kv_idx):
        return score * factor

    return flex_attention(q, k, v, scaled, block_mask=block, scale=1.0, enable_gqa=True)


@functools.cache
def _compiled():
    """``_call`` compiled, its own code object: dynamo's recompile limit is per code object,
    so attnlab's shapes do not use up the user's own compiled FlexAttention's. Dynamic shapes
    after the first change of size (dynamo's default), so varying lengths compile once more."""
    return torch.compile(_call)


def _eager(*args):
    """``_call`` as it is (FlexAttention's unfused form: the tests' CPU route)."""
    import warnings

    with warnings.catch_warnings():  # ("called without torch.compile": meant, off CUDA)
        warnings.simplefilter("ignore", UserWarning)
        return _call(*args)
