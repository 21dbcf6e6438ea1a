"""Turning what callers pass (tensors, arrays, token lists) into checked NumPy arrays."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np


def to_numpy(x: Any, name: str, dtype: Any = np.float64) -> np.ndarray:
    """A torch tensor or array-like as a NumPy array (detached, on the CPU)."""
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch here
        x = x.detach().float().cpu().numpy()
    try:
        arr = np.asarray(x, dtype=dtype)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"{name} must be an array or tensor of numbers; got {type(x).__name__}"
        ) from e
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise ValueError(f"{name} contains NaN or inf; check the masking of padded positions")
    return arr


def to_floats(x: Any, name: str) -> np.ndarray:
    """:func:`to_numpy` keeping float32 as float32 (a long text's weights are not copied to
    float64) and float64 as float64; anything else becomes float64."""
    arr = np.asarray(x) if not hasattr(x, "detach") else None
    dtype = arr.dtype if arr is not None and arr.dtype in (np.float32, np.float64) else np.float64
    return to_numpy(x, name, np.float32 if arr is None else dtype)


def squeeze_batch(arr: np.ndarray, name: str, ndim: int, legend: str) -> np.ndarray:
    """Drop leading batch dims of size 1 until ``arr`` has ``ndim`` dims."""
    while arr.ndim > ndim and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != ndim:
        raise ValueError(
            f"{name} must be {legend}; got shape {arr.shape}. Fix: index the extra leading "
            f"dims to the one you mean (a sentence of a batch, a layer, a head) first"
        )
    return arr


def layer_stack(attentions: Any, name: str = "attentions") -> np.ndarray:
    """Attention maps ``[layers, H, L, S]``: also from ``torch.stack(outputs.attentions)``,
    ``[layers, B=1, H, L, S]`` (float32 stays float32: a long text's maps are not copied)."""
    A = to_floats(attentions, name)
    if A.ndim == 5 and A.shape[1] == 1:  # [layers, B=1, H, L, S], as torch.stack(attentions)
        A = A[:, 0]
    return squeeze_batch(A, name, 4, "[layers, H, L, S] (or [layers, 1, H, L, S])")


def attention_map(weights: Any, name: str = "weights") -> np.ndarray:
    """One attention map ``[L, S]`` (leading dims of size 1 are dropped)."""
    return squeeze_batch(to_numpy(weights, name), name, 2, "one attention map [L, S]")


def check_tokens(tokens: Sequence[str] | None, n: int, name: str) -> list[str]:
    """``tokens`` as a list of ``n`` strings; ``None`` gives position numbers."""
    if tokens is None:
        return [str(i) for i in range(n)]
    if isinstance(tokens, str):
        raise TypeError(f"{name} must be a list of token strings, not one string; use text.split()")
    tokens = [str(t) for t in tokens]
    if len(tokens) != n:
        raise ValueError(f"{name} has {len(tokens)} tokens but the weights have {n} positions")
    return tokens


def label_step(n: int, length_pt: float, font_pt: float) -> int:
    """Show every ``step``-th of ``n`` labels along an axis ``length_pt`` points long, so that
    labels of size ``font_pt`` never overlap (1.25 line heights apart at least)."""
    if n <= 1:
        return 1
    return max(1, math.ceil(n * font_pt * 1.25 / max(length_pt, 1.0)))


def short(token: str, width: int = 14) -> str:
    """A token label cut to ``width`` characters (with an ellipsis); characters that print as
    nothing or as a box (controls, zero-width spaces) are written as escapes (``\\x0b``)."""
    if not token.isprintable():
        token = "".join(
            c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in token
        )
    return token if len(token) <= width else token[: width - 1] + "…"


def split_occurrence(word: str) -> tuple[str, int]:
    """A focus word and which of its uses is meant: ``"bank"`` -> ``("bank", 0)``, the first
    use; ``"bank#2"`` -> ``("bank", 1)``, the second (``#N`` counts from 1). ``"#2"`` or
    ``"C#"`` alone are words as written.

    Raises:
        ValueError: ``#0``: uses are counted from 1.
    """
    head, sep, tail = word.rpartition("#")
    if not sep or not head.strip() or not tail.isdigit():
        return word, 0
    if int(tail) < 1:
        raise ValueError(
            f"the focus {word!r} asks for use number {tail} of {head!r}; uses count from 1. "
            f"Fix: {head}#1 (or {head}) for the first"
        )
    return head, int(tail) - 1


def block_mean(W: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Shrink the last two dims of ``W`` to at most ``rows`` x ``cols`` by averaging blocks."""
    L, S = W.shape[-2:]
    if L > rows:
        edges = np.linspace(0, L, rows + 1).round().astype(int)
        W = np.add.reduceat(W, edges[:-1], axis=-2) / np.diff(edges)[:, None]
    if S > cols:
        edges = np.linspace(0, S, cols + 1).round().astype(int)
        W = np.add.reduceat(W, edges[:-1], axis=-1) / np.diff(edges)
    return W


def check_drawable(W: np.ndarray, name: str, vmax: float | None, kept_keys: int) -> None:
    """Refuse what a heatmap coloured from 0 up would draw wrong: no cells (or every key set
    aside), negative values (drawn as 0), a top of the scale that is not above 0."""
    if W.size == 0 or kept_keys == 0:
        raise ValueError(
            f"{name} has no cell to draw: shape {W.shape}"
            + (", and every key is set aside" if W.size and not kept_keys else "")
            + ". Fix: pass a map with at least one query and one key (set fewer keys aside)"
        )
    low = float(W.min())
    if low < 0:
        raise ValueError(
            f"{name} must be attention weights, >= 0 (colours run from 0 up); got a minimum of "
            f"{low:g}. Fix: plot softmax(scores), not the scores; a bias or a difference of "
            f"maps needs a diverging colour map of its own"
        )
    if vmax is not None and not float(vmax) > 0:
        raise ValueError(f"vmax (the top of the colour scale) must be > 0; got {vmax!r}")
