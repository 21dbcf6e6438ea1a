"""Setting tokens aside: each row of weights renormalised without some keys.

BERT puts much of every row on ``[CLS]`` and ``[SEP]`` (MiniLM: 0.3 to 0.9 of each row), and a
decoder on its first token (an "attention sink", Xiao et al. 2023). Such attention is often a
no-op: the head parks its weight there when nothing else fits (Clark et al. 2019), and it hides
how the rest of the row is shared. Setting those keys aside shows the rest.

Math:
    With ``A`` the set-aside keys, row ``i`` of the shown map is

    .. math:: \\tilde w_{ij} = \\frac{w_{ij}}{\\sum_{k \\notin A} w_{ik}}
              \\quad (j \\notin A), \\qquad \\tilde w_{ij} = 0 \\quad (j \\in A)

    so every row that gives the other keys any weight sums to 1 again. A row that gives them
    nothing (a decoder's first query sees only itself) has nothing left to share: it is all 0,
    as a fully masked row is everywhere in attnlab, never uniform.

The pictures of :mod:`attnlab.viz` drop the set-aside *columns* (keys) and keep every row: a
``[CLS]`` query still shows how it spreads its attention over the other tokens. The explorer
page keeps its layout and shows the set-aside columns as 0. When the map is a mean of heads, the
mean is taken first and then renormalised (as the explorer does).

Legend: ``L`` queries, ``S`` keys.

References:
    Clark et al., "What Does BERT Look At?" (2019); Xiao et al., "Efficient Streaming Language
    Models with Attention Sinks" (2023).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._arrays import short

__all__ = ["ASIDE_CHOICES", "aside_flags", "aside_note", "set_aside"]

ASIDE_CHOICES = ("special", "first")
"""What can be set aside: the tokens the tokenizer added (``[CLS]``, ``[SEP]``, ``<s>``), or the
first token (a decoder's attention sink, special or not)."""


def set_aside(weights: Any, aside: Sequence[bool] | np.ndarray) -> np.ndarray:
    """Zero the set-aside keys and renormalise each row over the others.

    Args:
        weights: ``[..., L, S]`` attention weights, rows summing to 1 (or 0).
        aside: ``S`` flags, True for a key to set aside.

    Returns:
        ``[..., L, S]`` float32: set-aside columns 0; other rows divided by what they give the
        remaining keys; rows that give them nothing are all 0.

    Raises:
        ValueError: ``aside`` does not have one flag per key.

    Example:
        >>> set_aside(np.array([[0.5, 0.25, 0.25]]), [True, False, False]).tolist()
        [[0.0, 0.5, 0.5]]
    """
    W = np.asarray(weights, dtype=np.float32)
    flags = np.asarray(aside, dtype=bool)
    if flags.shape != W.shape[-1:]:
        raise ValueError(
            f"aside must be one flag per key: {W.shape[-1]} flags; got shape {flags.shape}. "
            "Fix: pass aside_flags(trace, 'special')"
        )
    kept = np.where(flags, np.float32(0), W)  # [..., L, S]
    total = kept.sum(axis=-1, keepdims=True)  # [..., L, 1]
    safe = np.where(total > 0, total, np.float32(1))
    return np.where(total > 0, kept / safe, np.float32(0)).astype(np.float32, copy=False)


def aside_flags(trace: Any, what: str | None) -> np.ndarray | None:
    """The ``S`` key flags of ``what`` (one of :data:`ASIDE_CHOICES`) in a self-attention trace.

    Returns:
        ``None`` for ``what=None`` (nothing set aside), else the flags.

    Raises:
        ValueError: an unknown ``what``, a cross-attention trace, or ``"special"`` when the
            tokenizer added no special token to this text (the fix is ``"first"``).
    """
    if what is None:
        return None
    if what not in ASIDE_CHOICES:
        raise ValueError(
            f"set aside must be one of {', '.join(ASIDE_CHOICES)}; got {what!r}. Fix: "
            "'special' for [CLS]/[SEP]/<s>, 'first' for the first token"
        )
    if getattr(trace, "kind", "self") != "self":
        raise ValueError(
            "setting tokens aside needs self-attention; a translator's cross-attention has no "
            "special tokens to set aside. Fix: leave out --set-aside"
        )
    n = len(trace.keys)
    if what == "first":
        flags = np.zeros(n, bool)
        flags[0] = True
        return flags
    flags = np.asarray(trace.special, bool)
    if not flags.any():
        raise ValueError(
            f"--set-aside special: the tokenizer of {trace.model} added no special token to this "
            "text; fix: --set-aside first sets the first token (a decoder's sink) aside"
        )
    return flags


def aside_note(tokens: Sequence[str], aside: Sequence[bool] | np.ndarray | None) -> str:
    """The phrase pictures put in their titles: ``"“[CLS]”, “[SEP]” set aside, rows
    renormalised"`` (empty when nothing is set aside)."""
    if aside is None:
        return ""
    flagged = [t for t, a in zip(tokens, aside, strict=True) if a]
    names = list(dict.fromkeys(f"“{short(t, 12)}”" for t in flagged))
    shown = ", ".join(names[:4]) + (f" (+{len(names) - 4})" if len(names) > 4 else "")
    return f"{shown} set aside, rows renormalised"
