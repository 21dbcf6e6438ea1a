"""Input checks shared by the torch functions and layers.

Every check raises ``ValueError`` or ``TypeError`` with one message that names the argument,
what was expected, what was received, and how to fix it. The checks run before any work is
done, so bad input never produces a silent NaN or a half-finished result.

Shape legend (used throughout attnlab): ``B`` batch, ``H`` query heads, ``Hkv`` key/value heads,
``G = H // Hkv``, ``L`` query length, ``S`` key length, ``E`` query/key head dim, ``Ev`` value head
dim, ``D`` model dim, ``P`` cached length.
"""

from __future__ import annotations

import math
import numbers
import operator

import torch

CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")


def check_floating(name: str, tensor: torch.Tensor) -> None:
    """Raise TypeError unless ``tensor`` is a floating-point ``torch.Tensor``."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor; got {type(tensor).__name__}. "
            f"Fix: wrap it with torch.as_tensor(...)."
        )
    if not tensor.is_floating_point():
        raise TypeError(
            f"{name} must be a floating-point tensor; got dtype {tensor.dtype}. "
            f"Fix: convert it first, e.g. {name}.float() or {name}.to(torch.bfloat16)."
        )


# whether autocast is on for any device (torch >= 2.1; otherwise asked per device below)
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)


def autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors as torch's autocast gives them to its own attention: under an enabled
    ``torch.autocast`` for their device, float32 tensors are cast to the autocast dtype (so a
    bf16 projection meets a float32 RNN state as torch SDPA would take them); otherwise as is.
    """
    if _any_autocast is not None and not _any_autocast():
        return tensors  # (one C call, ~0.15 us: this runs at every attention call)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return tensors  # (the checks that follow name what is wrong)
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    low = torch.get_autocast_dtype(device)
    return tuple(t.to(low) if t.dtype == torch.float32 else t for t in tensors)


def check_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Check the (B, H, L, E) / (B, Hkv, S, E) / (B, Hkv, S, Ev) contract of attention inputs.

    Leading dims are optional: 2-D ``(L, E)``, 3-D ``(B, L, E)`` and 4-D ``(B, H, L, E)`` are
    accepted, but query, key and value must all have the same number of dims.
    """
    if qkv_fit_shapes(query, key, value) is not None:
        return  # (the common case in ~1 us; the checks below say what is wrong otherwise)
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_floating(name, t)
    if query.dim() < 2:
        raise ValueError(
            f"query must have at least 2 dims: (L, E), (B, L, E), (B, H, L, E) or (..., B, H, L, "
            f"E); got shape {tuple(query.shape)}. Fix: reshape it to (B, H, L, E)."
        )
    for name, t in (("key", key), ("value", value)):
        if t.dim() != query.dim():
            raise ValueError(
                f"{name} must have as many dims as query ({query.dim()}); got shape "
                f"{tuple(t.shape)} for query {tuple(query.shape)}. "
                f"Fix: give all three the layout (B, H, L, E) / (B, Hkv, S, E)."
            )
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(
            f"query, key and value must share one dtype; got {query.dtype}, {key.dtype}, "
            f"{value.dtype}. Fix: cast them to the same dtype, e.g. key.to(query.dtype)."
        )
    if key.device != query.device or value.device != query.device:
        raise ValueError(
            f"query, key and value must be on one device; got {query.device}, {key.device}, "
            f"{value.device}. Fix: move them with .to(query.device)."
        )
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(
            f"key head dim E must equal query's: expected {query.shape[-1]}, got "
            f"{key.shape[-1]} (query {tuple(query.shape)}, key {tuple(key.shape)}). "
            f"Fix: project both to the same width, or use additive attention, whose query and "
            f"key widths may differ."
        )
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(
            f"key and value must have the same length S; got key {tuple(key.shape)} and value "
            f"{tuple(value.shape)}. Fix: every key needs exactly one value."
        )
    if key.shape[:-2] != value.shape[:-2]:
        raise ValueError(
            f"key and value must have the same leading dims; got key {tuple(key.shape)} and "
            f"value {tuple(value.shape)}."
        )
    batch = query.shape[:-3] if query.dim() >= 4 else query.shape[:-2]
    if key.shape[: len(batch)] != batch:
        got_q, got_k = (
            (batch[0], key.shape[0])
            if len(batch) == 1
            else (tuple(batch), tuple(key.shape[: len(batch)]))
        )
        raise ValueError(
            f"batch size B must match: query has {got_q}, key/value have {got_k} (query "
            f"{tuple(query.shape)}, key {tuple(key.shape)}). Fix: pass one key/value sequence "
            f"per query sequence."
        )
    if query.dim() >= 4:
        h, hkv = query.shape[-3], key.shape[-3]
        if (hkv == 0 and h != 0) or (hkv != 0 and h % hkv != 0):
            raise ValueError(
                f"key/value heads Hkv must divide query heads H (grouped-query attention: "
                f"query head h reads kv head h // (H // Hkv)); got H={h}, Hkv={hkv}. "
                f"Fix: use Hkv in {divisors(h)}."
            )


def qkv_fit_shapes(query, key, value) -> tuple[torch.Size, torch.Size] | None:
    """``(query.shape, key.shape)`` when :func:`check_qkv` has nothing to say about 4-D inputs
    on the CPU or on one CUDA device (its hot case, in ~0.9 us), else None: "run the checks",
    not "wrong". The fused hot path reads the sizes from them rather than asking again."""
    T = torch.Tensor
    if not (isinstance(query, T) and isinstance(key, T) and isinstance(value, T)):
        return None
    dtype = query.dtype  # (dtypes are singletons: `is` compares them)
    if not (dtype.is_floating_point and key.dtype is dtype and value.dtype is dtype):
        return None
    if not (query.is_cpu and key.is_cpu and value.is_cpu) and not (
        query.is_cuda
        and key.is_cuda
        and value.is_cuda
        and query.get_device() == key.get_device() == value.get_device()
    ):
        return None
    qs, ks, vs = query.shape, key.shape, value.shape
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        return None
    B, H, _, E = qs
    Bk, Hkv, S, Ek = ks
    if Ek == E and vs[0] == Bk == B and vs[1] == Hkv and vs[2] == S and Hkv > 0 and H % Hkv == 0:
        return qs, ks
    return None


def broadcast_shapes(*shapes) -> tuple[int, ...]:
    """``torch.broadcast_shapes`` for the few short shapes of a call, as a tuple; raises
    RuntimeError where torch's does. (torch's costs ~40 us a call and ~0.6 s the first time,
    more than a decode step's attention.)"""
    out: list[int] = []
    for shape in shapes:
        shape = tuple(shape)
        if len(shape) > len(out):
            out = [1] * (len(shape) - len(out)) + out
        for i, n in enumerate(shape, start=len(out) - len(shape)):
            if n != out[i] and n != 1:
                if out[i] != 1:
                    raise RuntimeError(f"shapes {[tuple(s) for s in shapes]} do not broadcast")
                out[i] = n
    return tuple(out)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_mask(
    attn_mask: torch.Tensor,
    target: tuple[int, ...],
    name: str = "attn_mask",
    device: torch.device | None = None,
) -> None:
    """Check that ``attn_mask`` is bool (True = may attend) or float (additive), broadcasts to
    ``target`` and lies on ``device`` (the scores'), when given."""
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor (bool: True = may attend, or float: additive bias); "
            f"got {type(attn_mask).__name__}."
        )
    if device is not None and attn_mask.device != device:
        raise ValueError(
            f"{name} must be on the device of the scores it masks, {device}; got {name} on "
            f"{attn_mask.device}. Fix: build it there or move it with .to({str(device)!r})."
        )
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(
            f"{name} must be bool (True = may attend) or floating (an additive bias); got dtype "
            f"{attn_mask.dtype}. Fix: {name}.bool() if 1 means 'may attend' "
            f"(or {name} == 0 if 1 means 'masked', as in nn.MultiheadAttention's key_padding_mask)."
        )
    if attn_mask.dim() > len(target):
        raise ValueError(
            f"{name} has more dims than the scores it masks: got shape {tuple(attn_mask.shape)}, "
            f"scores have shape {target}. Fix: give it at most {len(target)} dims."
        )
    # broadcasts without enlarging: each of its dims (from the right) is 1 or the target's.
    # (Written out: torch.broadcast_shapes costs ~40 us a call, and ~0.6 s the first time.)
    tail = target[len(target) - attn_mask.dim() :]  # (dims already checked: <= len(target))
    for m, t in zip(attn_mask.shape, tail, strict=True):  # (a loop: ~0.4 us less than all(...))
        if m == 1 or m == t:
            continue
        raise ValueError(
            f"{name} of shape {tuple(attn_mask.shape)} does not broadcast to the scores' shape "
            f"{target} (..., L, S). Fix: give it shape (L, S), (B, 1, L, S), (B, 1, 1, S) or any "
            f"shape that broadcasts to it without enlarging it; a key padding mask of shape "
            f"(B, S) needs [:, None, None, :]."
        )


def real_number(value):
    """``value`` itself if a Python int or float; a Python float for any other real scalar that
    torch takes where a float is expected (a numpy scalar, a 0-d int or float tensor); ``None``
    for everything else (bools included)."""
    if value.__class__ is float or value.__class__ is int:
        return value
    if isinstance(value, bool) or isinstance(value, torch.Tensor) and value.dtype == torch.bool:
        return None
    if isinstance(value, numbers.Real):  # (float and int subclasses, numpy's scalars)
        return float(value)
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex():
        return float(value)
    return None


def check_count(value, name: str, minimum: int = 1, what: str = ""):
    """``value`` as an int (a Python, numpy or 0-d torch integer; not a bool or a float) of at
    least ``minimum``, or a ValueError naming ``name`` and ``what`` it counts. Traced
    (torch.compile, torch.export) it passes as it is: there a size may be symbolic, and
    ``operator.index`` would specialise the graph to it (a recompilation per length)."""
    if isinstance(value, torch.SymInt) or torch.compiler.is_compiling():
        return value
    try:
        ok = not isinstance(value, bool) and operator.index(value) >= minimum
    except TypeError:
        ok = False
    if not ok:
        counts = f" ({what})" if what else ""
        raise ValueError(f"{name} must be an int >= {minimum}{counts}; got {value!r}.")
    return operator.index(value)


def check_scale(scale: float | None) -> float | None:
    """``scale`` as a Python float (or None), or raise unless it is a finite real number (NaN
    would silently become 0s). Numpy scalars and 0-d tensors are taken, as torch takes them."""
    if scale is None:
        return None
    value = real_number(scale)
    # (abs(value) < inf, not math.isfinite: a scale that torch.compile makes symbolic is
    # compared, where math.isfinite would break the graph; NaN compares False too)
    if value is None or not abs(value) < math.inf:
        raise ValueError(
            f"scale must be a finite number (the multiplier of the scores) or None for "
            f"1/sqrt(E); got {scale!r}. Fix: pass e.g. scale=1.0, or leave it out."
        )
    return value


def check_bias_range(
    attn_mask: torch.Tensor,
    dtype: torch.dtype,
    name: str = "attn_mask",
    bool_mask: str = "True = may attend",
) -> None:
    """Refuse a float mask whose finite values overflow to +-inf in the inputs' ``dtype``.

    A float32 mask filled with ``torch.finfo(torch.float32).min`` gives uniform weights to a
    row it covers entirely; cast to float16 those values become ``-inf`` and the row would be
    dead instead (and a large positive bias would become ``+inf``, and its row NaN). Rather
    than answer differently per dtype, such a mask is refused (eagerly; a traced call cannot
    look at values and casts as torch does). ``bool_mask`` is what a bool mask means where
    ``name`` is read (the fix the message offers).
    """
    if attn_mask.dtype == torch.bool or torch.finfo(attn_mask.dtype).max <= torch.finfo(dtype).max:
        return
    if torch.compiler.is_compiling():
        return
    overflows = attn_mask.to(dtype).isinf() & attn_mask.isfinite()  # (exactly what the cast does)
    if bool(overflows.any()):
        top = torch.finfo(dtype).max
        raise ValueError(
            f"{name} ({attn_mask.dtype}) holds finite values outside {dtype}'s range (|x| > "
            f"{top:g}, e.g. torch.finfo({attn_mask.dtype}).min); in {dtype} they would become "
            f"-inf or +inf and change which rows attend at all, or make them NaN. Fix: mark "
            f"masked positions with -inf (or use a bool mask, {bool_mask}), keep biases within "
            f"+-{top:g}, or build the bias in {dtype}."
        )


def check_dropout(dropout_p: float, name: str = "dropout_p") -> float:
    """``dropout_p`` as a Python number, or raise (naming it ``name``) unless it is a
    probability in [0, 1) (numpy scalars and 0-d tensors are taken, as torch takes them)."""
    value = real_number(dropout_p)
    if value is None or not 0.0 <= value < 1.0:
        raise ValueError(
            f"{name} must be a probability in [0, 1); got {dropout_p!r}. "
            f"Fix: pass e.g. 0.1, or 0.0 to disable dropout."
        )
    return value


def causal_alignment(is_causal: bool | str, query_len: int, key_len: int) -> str | None:
    """Turn ``is_causal`` into an explicit alignment, or None when not causal.

    ``True`` is accepted only when L == S, where both alignments coincide; when L != S the user
    must say which one is meant.
    """
    if is_causal is False or is_causal is None:
        return None
    if is_causal is True:
        if query_len != key_len:
            raise ValueError(
                f"is_causal=True is ambiguous when the query length L={query_len} differs from "
                f"the key length S={key_len}. Fix: pass is_causal='bottom_right' (queries are "
                f"the last L positions, as in KV-cache decoding and FlashAttention) or "
                f"is_causal='top_left' (queries are the first L positions, as torch SDPA)."
            )
        return "top_left"
    if is_causal in CAUSAL_ALIGNMENTS:
        return is_causal
    raise ValueError(
        f"is_causal must be False, True, 'top_left' or 'bottom_right'; got {is_causal!r}."
    )
