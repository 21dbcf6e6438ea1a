"""Mask builders in NumPy (True = may attend), the twins of :mod:`attnlab.masks`."""

from __future__ import annotations

import operator

import numpy as np


def _count(value, name):
    # (as the torch twin: bad input is refused) an integer >= 0, numpy's too
    try:
        count = operator.index(value)
    except TypeError:
        count = -1
    if count < 0:
        raise ValueError(f"{name} must be an int >= 0; got {value!r}")
    return count


def _positions(query_length, key_length, alignment):
    # Queries sit at positions offset..offset+L-1 on the keys' time axis.
    if key_length is None:
        key_length = query_length
    query_length = _count(query_length, "query_length")
    key_length = _count(key_length, "key_length")
    if alignment is None:
        if query_length != key_length:
            raise ValueError("alignment must be 'top_left' or 'bottom_right' when L != S")
        alignment = "top_left"
    if alignment not in ("top_left", "bottom_right"):
        raise ValueError(f"alignment must be 'top_left' or 'bottom_right'; got {alignment!r}")
    offset = key_length - query_length if alignment == "bottom_right" else 0
    q_pos = np.arange(query_length)[:, None] + offset  # [L, 1]
    k_pos = np.arange(key_length)[None, :]  # [1, S]
    return q_pos, k_pos


def causal_mask(query_length, key_length=None, *, alignment=None):
    # -> [L, S]: query i may see key j iff j <= i + offset
    q_pos, k_pos = _positions(query_length, key_length, alignment)
    return k_pos <= q_pos


def sliding_window_mask(query_length, key_length=None, *, window, alignment=None, causal=True):
    # -> [L, S]: query at position p sees keys p - window < j <= p (or |j - p| < window)
    if _count(window, "window") < 1:
        raise ValueError(f"window must be an int >= 1; got {window!r}")
    q_pos, k_pos = _positions(query_length, key_length, alignment)
    distance = q_pos - k_pos
    keep = np.abs(distance) < window
    return keep & (distance >= 0) if causal else keep


def _lengths(lengths):
    # (as the torch twin: bad input is refused) integers >= 0
    lengths = np.asarray(lengths)
    if not np.issubdtype(lengths.dtype, np.integer) or (lengths < 0).any():
        raise ValueError(f"lengths must be integers >= 0; got {lengths.tolist()}")
    return lengths


def padding_mask(lengths, max_length=None, *, side="right"):
    # [B] -> [B, 1, 1, S]: True marks a real token
    lengths = _lengths(lengths)
    if max_length is None:
        max_length = int(lengths.max()) if lengths.size else 0
    if (lengths > max_length).any():
        raise ValueError(f"lengths must be <= max_length={max_length}; got {lengths.tolist()}")
    pos = np.arange(max_length)[None, :]
    if side not in ("right", "left"):
        raise ValueError(f"side must be 'right' or 'left'; got {side!r}")
    if side == "right":
        keep = pos < lengths[:, None]
    else:
        keep = pos >= (max_length - lengths)[:, None]
    return keep[:, None, None, :]


def document_mask(lengths):
    # [documents] -> [T, T], T = sum(lengths): token i may attend token j iff same document
    doc = np.repeat(np.arange(len(lengths)), _lengths(lengths))
    return doc[:, None] == doc[None, :]
