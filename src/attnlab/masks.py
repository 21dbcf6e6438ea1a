"""Attention masks: one polarity everywhere.

* A **bool** mask means **True = may attend**. Position ``[..., i, j]`` says whether query ``i``
  may look at key ``j``.
* A **float** mask is an **additive bias** added to the scores before the softmax (``-inf``
  forbids a position; ``0`` leaves it alone).

Masks broadcast against the scores of shape ``(B, H, L, S)``: ``(L, S)`` for a pattern shared by
the whole batch, ``(B, 1, 1, S)`` for key padding, ``(B, 1, L, S)`` for both.

Causal alignment when ``L != S`` must be chosen explicitly::

    top_left (L=3, S=5)          bottom_right (L=3, S=5)
    query i sees keys j <= i     query i sees keys j <= i + (S - L)
      ■ · · · ·                    ■ ■ ■ · ·
      ■ ■ · · ·                    ■ ■ ■ ■ ·
      ■ ■ ■ · ·                    ■ ■ ■ ■ ■

``top_left`` is torch SDPA's ``is_causal``; ``bottom_right`` is FlashAttention's and is what
incremental decoding needs: the L new queries are the *last* L positions of the S keys (the
P = S - L cached ones come first). When L == S both are the usual lower triangle.

Every builder returns a :class:`Mask`, a plain bool ``torch.Tensor`` that prints as a picture.
It can be passed anywhere a bool tensor is accepted (attnlab, ``torch`` SDPA, NumPy via
``.numpy()``); operations on it return ordinary tensors.

Example:
    >>> from attnlab import masks
    >>> print(masks.causal_mask(3, 5, alignment="bottom_right"))
    Mask (3, 5), True = may attend (■), False = masked (·)
      ■ ■ ■ · ·
      ■ ■ ■ ■ ·
      ■ ■ ■ ■ ■
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils._pytree import tree_map

from attnlab._checks import CAUSAL_ALIGNMENTS, check_count

__all__ = [
    "Mask",
    "and_masks",
    "causal_mask",
    "document_mask",
    "expand_key_padding",
    "from_torch_mask",
    "or_masks",
    "padding_mask",
    "plain",
    "restrict",
    "show",
    "sliding_window_mask",
    "to_additive",
    "to_bool",
]

ATTEND, MASKED = "■", "·"

# In-place ops that change a tensor's shape or strides: a wrapper's are fixed when it is made.
_RESHAPING = frozenset(
    {"t_", "transpose_", "swapdims_", "swapaxes_", "unsqueeze_", "squeeze_", "as_strided_",
     "resize_", "resize_as_", "set_"}
)  # fmt: skip


class Mask(torch.Tensor):
    """A bool tensor (True = may attend) whose ``repr`` is an ASCII picture.

    Any torch operation on a ``Mask`` returns a plain ``torch.Tensor`` (an in-place one, the
    mask itself; a conversion that changes nothing, ``.cpu()`` or ``.bool()`` of a CPU mask,
    returns it too, as torch returns ``self``), so the subclass never leaks into computations.
    It wraps the plain tensor (``_data``) as torch's traceable subclasses do
    (``__tensor_flatten__``), so a ``Mask`` may be an input of a ``torch.compile``-d function
    or an exported program: compiled graphs see the plain tensor. (A subclass that shares its
    tensor's storage, as this one was, fails in AOTAutograd as an input; inside a traced
    function a ``Mask`` is never made at all.)
    """

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> Mask:
        if data.dtype != torch.bool:
            raise TypeError(f"Mask holds a bool tensor; got dtype {data.dtype}.")
        if type(data) is not torch.Tensor or torch.compiler.is_compiling():
            # Traced (torch.compile, torch.export, AOTAutograd: fake or functional tensors):
            # the picture is for people, so the plain tensor goes on through the graph.
            return data
        return cls._wrap(data)

    @classmethod
    def _wrap(cls, data: torch.Tensor) -> Mask:
        mask = torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            device=data.device,
            requires_grad=False,
        )
        mask._data = data
        return mask

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Mask._wrap(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda x: x._data if isinstance(x, Mask) else x  # noqa: E731
        first = func._schema.arguments[:1]
        in_place = bool(first and first[0].alias_info is not None and first[0].alias_info.is_write)
        if in_place and func.overloadpacket.__name__ in _RESHAPING and isinstance(args[0], Mask):
            name = func.overloadpacket.__name__
            raise TypeError(
                f"{name} (an in-place reshape) cannot change a Mask's shape {tuple(args[0].shape)}."
                f" Fix: the out-of-place form, mask.{name.rstrip('_')}(...), which returns a "
                f"plain bool tensor."
            )
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if in_place and isinstance(args[0], Mask):  # (m &= keep, m[...] = False)
            return args[0]  # the mask itself
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    # What reads the storage directly, which a wrapper has not: its tensor's.
    def numpy(self, *args, **kwargs):
        """Its values as a read-only NumPy array: a write through NumPy would bypass torch's
        version counters, and the structure would be trusted although the values changed
        (``mask.numpy().copy()`` to edit, or change the mask itself: ``mask[i, j] = False``)."""
        array = self._data.numpy(*args, **kwargs)
        array.flags.writeable = False
        return array

    def __dlpack__(self, *args, **kwargs):
        """Its tensor, shared (zero-copy, as DLPack means), so the mask forgets its structure:
        writes through the other library bypass torch's version counters, and from now on
        its values alone tell what it masks."""
        self._built_version = None
        return self._data.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._data.__dlpack_device__()

    def tolist(self):
        return self._data.tolist()

    def __copy__(self):  # (its own tensor and version counters: a copy keeps no structure)
        return Mask._wrap(self._data.clone())

    def __deepcopy__(self, memo):
        return self.__copy__()

    @property
    def data(self) -> torch.Tensor:
        """Its plain tensor, detached, sharing its memory; the mask forgets its structure, as
        :func:`plain` says why."""
        self._built_version = None
        return self._data.detach()

    def _stable_hash_for_caching(self) -> str:  # (AOTAutograd's cache of compiled graphs)
        return "attnlab.masks.Mask"

    def __repr__(self, *, tensor_contents=None) -> str:  # noqa: ARG002 (torch's signature)
        return show(self)

    __str__ = __repr__


def _remember(mask: torch.Tensor, **structure) -> None:
    """Attach to a :class:`Mask` the structure it was built from (``key_range``, ``band``), so
    kernels that take it skip key blocks outside it instead of reading the mask. It holds
    while the mask is unchanged: torch's version counters, which every in-place change of the
    mask, of a view of it or of its plain tensor bumps, are recorded with it
    (:func:`structure`)."""
    if isinstance(mask, Mask):
        for name, value in structure.items():
            setattr(mask, name, value)
        mask._built_version = _versions(mask)


def _versions(mask: Mask) -> tuple[int, int] | None:
    """The mask's version counter (bumped by its own in-place ops) and its tensor's (by writes
    through its views); None for an inference tensor (made under ``torch.inference_mode()``),
    which has none: its structure cannot be trusted to hold, so only its values count."""
    if mask._data.is_inference():
        return None
    return mask._version, mask._data._version


def structure(mask) -> tuple:
    """``(key_range, band)`` remembered by a mask of this module (None for what it has not), or
    ``(None, None)`` when it was changed in place since it was built: then only its values
    tell what it masks."""
    if torch.compiler.is_compiling():  # (traced: torch's ops run, and a version is no guard)
        return None, None
    version = getattr(mask, "_built_version", None)
    if version is None or _versions(mask) != version:  # (an inference tensor's: None)
        return None, None
    return getattr(mask, "key_range", None), getattr(mask, "band", None)


def plain(mask: torch.Tensor | None) -> torch.Tensor | None:
    """``mask`` as a plain ``torch.Tensor`` (a :class:`Mask` unwrapped; anything else as is).

    The tensor shares the mask's memory, so a :class:`Mask` forgets the structure it was built
    from (as after ``__dlpack__``): a write through the tensor's NumPy array would bypass
    torch's version counters, and kernels would skip key blocks by a structure the values no
    longer have. From now on its values alone tell what it masks (``explain()`` names the
    dense path). To keep the structure: read ``mask.numpy()`` (read-only), or take
    ``plain(mask.clone())``, a copy.
    """
    if isinstance(mask, Mask):
        mask._built_version = None
        return mask._data
    return mask


def unwrap(mask: torch.Tensor | None) -> torch.Tensor | None:
    """``mask``'s tensor (a :class:`Mask` unwrapped; anything else as is), structure kept: for
    attnlab's own reading, which never writes through it nor hands it out (else :func:`plain`).
    """
    return mask._data if isinstance(mask, Mask) else mask


def show(mask: torch.Tensor, max_rows: int = 24, max_cols: int = 48) -> str:
    """Draw a bool mask (or an additive bias: -inf or finfo.min = masked, :func:`to_bool`) as
    text, one picture per (L, S) slice.

    Args:
        mask: bool tensor of shape (..., L, S), True = may attend; or a float additive bias.
        max_rows, max_cols: larger masks are cut, with "…" marking the cut.
    """
    m = to_bool(mask) if mask.is_floating_point() else mask
    m = unwrap(m).detach().cpu()
    if m.dim() < 2:
        m = m.reshape(1, -1)
    head = (
        f"Mask {tuple(m.shape)}, True = may attend ({ATTEND}), False = masked ({MASKED})"
        if mask.dtype == torch.bool
        else f"Additive bias {tuple(m.shape)}: may attend ({ATTEND}), -inf or finfo.min ({MASKED})"
    )
    lines = [head]
    slices = m.reshape(-1, m.shape[-2], m.shape[-1])
    lead = m.shape[:-2]
    shown = min(len(slices), 4)
    for n in range(shown):
        if lead:
            idx = torch.unravel_index(torch.tensor(n), lead)
            lines.append("  [" + ", ".join(str(int(i)) for i in idx) + ", :, :]")
        for row in slices[n][:max_rows]:
            cells = " ".join(ATTEND if x else MASKED for x in row[:max_cols].tolist())
            lines.append("  " + cells + (" …" if m.shape[-1] > max_cols else ""))
        if m.shape[-2] > max_rows:
            lines.append("  …")
    if len(slices) > shown:
        lines.append(f"  … ({len(slices) - shown} more slices)")
    return "\n".join(lines)


def _positions(query_length: int, key_length: int | None, alignment: str | None, device):
    """Absolute positions of the queries and keys on one time axis, per the causal alignment."""
    query_length = check_count(query_length, "query_length", 0, "L, the queries")
    if key_length is None:
        key_length = query_length
    key_length = check_count(key_length, "key_length", 0, "S, the keys")
    if alignment is None:
        if query_length != key_length:
            raise ValueError(
                f"alignment must be given when the query length L={query_length} differs from "
                f"the key length S={key_length}. Fix: alignment='bottom_right' (queries are the "
                f"last L positions, as in KV-cache decoding) or 'top_left' (the first L, as "
                f"torch SDPA's is_causal)."
            )
        alignment = "top_left"
    if alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"alignment must be 'top_left' or 'bottom_right'; got {alignment!r}.")
    offset = key_length - query_length if alignment == "bottom_right" else 0
    q_pos = torch.arange(query_length, device=device) + offset  # (L,)
    k_pos = torch.arange(key_length, device=device)  # (S,)
    return q_pos[:, None], k_pos[None, :]


def causal_mask(
    query_length: int,
    key_length: int | None = None,
    *,
    alignment: str | None = None,
    device: torch.device | str | None = None,
) -> Mask:
    """Causal mask of shape (L, S): query ``i`` may attend key ``j`` iff ``j <= i + offset``.

    ``offset`` is 0 for ``alignment="top_left"`` and ``S - L`` for ``"bottom_right"`` (see the
    module docstring for the picture). ``alignment`` is required when L != S. With
    ``bottom_right`` and L > S the first ``L - S`` queries see no key at all: attnlab gives such
    fully masked rows weight 0 and output 0.
    """
    return Mask(causal_keep(query_length, key_length, alignment, device))


def causal_keep(query_length: int, key_length: int | None, alignment: str | None, device):
    """:func:`causal_mask` as a plain bool tensor (L, S), for attnlab's own computations."""
    q_pos, k_pos = _positions(query_length, key_length, alignment, device)
    return k_pos <= q_pos


def sliding_window_mask(
    query_length: int,
    key_length: int | None = None,
    *,
    window: int,
    alignment: str | None = None,
    causal: bool = True,
    device: torch.device | str | None = None,
) -> Mask:
    """Local attention: each query sees only keys within ``window`` positions, shape (L, S).

    With ``causal=True`` query ``i`` (at position ``p``) sees keys ``p - window < j <= p``: itself
    and the ``window - 1`` before it (Mistral/Gemma-style sliding window). With ``causal=False``
    it sees ``|j - p| < window``. Positions follow ``alignment`` as in :func:`causal_mask`.

    window=3, causal, L = S = 5::

        ■ · · · ·
        ■ ■ · · ·
        ■ ■ ■ · ·
        · ■ ■ ■ ·
        · · ■ ■ ■
    """
    window = check_count(window, "window", 1, "keys seen per query")
    q_pos, k_pos = _positions(query_length, key_length, alignment, device)
    distance = q_pos - k_pos  # (L, S): how far key j lies behind query i
    keep = (distance < window) & (distance > -window)
    if causal:
        keep &= distance >= 0
    mask = Mask(keep)
    # the structure, for kernels that skip blocks outside the band: key j may be attended by
    # query i iff lo <= j - (i + offset) <= hi
    # (query 0's position, from the sizes -- Python ints, whatever integer type the lengths
    # came as (a numpy or 0-d tensor one crashed the Triton kernels) -- not from q_pos's
    # values: reading them would stop torch.export)
    L, S = keep.shape
    offset = S - L if alignment == "bottom_right" and S else 0
    _remember(mask, band=(offset, -(window - 1), 0 if causal else window - 1))
    return mask


def _int_lengths(lengths, device, what: str) -> torch.Tensor:
    """``lengths`` as a 1-D integer tensor, or a ValueError saying what was given instead."""
    given, lengths = lengths, torch.as_tensor(lengths, device=device)
    if lengths.dim() != 1 or lengths.is_floating_point() or lengths.dtype == torch.bool:
        got = (
            "an empty sequence"
            if lengths.numel() == 0 and not torch.is_tensor(given)
            else f"{tuple(lengths.shape)} {lengths.dtype}"
        )
        raise ValueError(f"lengths must be a 1-D sequence of ints {what}, at least one; got {got}.")
    return lengths.long()  # (uint8/int8 lengths: S - length would wrap or overflow)


def padding_mask(
    lengths: torch.Tensor | Sequence[int],
    max_length: int | None = None,
    *,
    side: str = "right",
    device: torch.device | str | None = None,
) -> Mask:
    """Key padding mask from sequence lengths, shape (B, 1, 1, S): True marks a real token.

    Args:
        lengths: (B,) number of real tokens per sequence.
        max_length: S; defaults to ``max(lengths)``.
        side: ``"right"`` when padding follows the tokens (encoders, training batches),
            ``"left"`` when it precedes them (batched generation prompts).

    It broadcasts against scores (B, H, L, S); combine it with a causal mask by
    :func:`and_masks`. The result remembers the lengths (``mask.key_range``: the (B,) start
    and end of each row's real keys), so attention kernels that take a range can skip the
    padding's key blocks instead of reading the mask; any operation on it gives a plain
    tensor without them.
    """
    lengths = _int_lengths(lengths, device, "(B,), one per batch row")
    if side not in ("right", "left"):
        raise ValueError(f"side must be 'right' or 'left'; got {side!r}.")
    if max_length is not None:
        max_length = check_count(max_length, "max_length", 0, "S, the keys")
    longest = int(lengths.max()) if len(lengths) else 0
    if max_length is None:
        max_length = longest
    if (lengths < 0).any():
        raise ValueError(f"lengths must be >= 0 (real tokens per row); got {lengths.tolist()}.")
    if longest > max_length:
        raise ValueError(
            f"lengths must be <= max_length={max_length}; got {lengths.tolist()}. Fix: "
            f"max_length >= {longest} (or leave it out for max(lengths))."
        )
    pos = torch.arange(max_length, device=lengths.device)  # (S,)
    if side == "right":
        start, end = torch.zeros_like(lengths), lengths.clone()  # (not the caller's tensor)
    else:
        start, end = max_length - lengths, torch.full_like(lengths, max_length)
    keep = (pos[None, :] >= start[:, None]) & (pos[None, :] < end[:, None])  # (B, S)
    mask = Mask(keep[:, None, None, :])
    # The structure, kept: kernels that take it skip the key blocks outside [start, end)
    # instead of reading the mask (attnlab.explain says when). int32, as the kernels read it:
    # no conversion per call.
    _remember(mask, key_range=(start.to(torch.int32), end.to(torch.int32)))
    return mask


def document_mask(
    lengths: torch.Tensor | Sequence[int], *, device: torch.device | str | None = None
) -> Mask:
    """Packed sequences: several documents back to back in one row of T = sum(lengths) tokens,
    each token attending only tokens of its own document. Shape (T, T), block diagonal.

    lengths=[2, 3]::

        ■ ■ · · ·
        ■ ■ · · ·
        · · ■ ■ ■
        · · ■ ■ ■
        · · ■ ■ ■

    Combine with ``is_causal=True`` for causal packed training (FlashAttention's varlen with
    cumulative lengths ``cu_seqlens = [0, *cumsum(lengths)]``). The result remembers each
    query's key range (``mask.key_range``: (1, T) start and end), so kernels that take ranges
    skip the other documents' key blocks instead of reading the mask.
    """
    lengths = _int_lengths(lengths, device, "(documents,)")
    if (lengths < 0).any():
        raise ValueError(f"lengths must be >= 0; got {lengths.tolist()}.")
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
    ends = lengths.cumsum(0)  # (documents,)
    start, end = (ends - lengths)[doc], ends[doc]  # (T,) each token's document span
    pos = torch.arange(len(doc), device=lengths.device)
    keep = (pos[None, :] >= start[:, None]) & (pos[None, :] < end[:, None])  # (T, T)
    mask = Mask(keep)
    ranges = (start[None, :].to(torch.int32), end[None, :].to(torch.int32))  # as kernels read
    _remember(mask, key_range=ranges)  # (1, T): a range per query row
    return mask


def expand_key_padding(key_padding_mask: torch.Tensor) -> Mask:
    """(B, S) bool key padding mask (True = real token) -> (B, 1, 1, S) attention mask.

    Note: ``torch.nn.MultiheadAttention``'s ``key_padding_mask`` uses the opposite meaning
    (True = ignore); convert it with ``~key_padding_mask`` first.
    """
    if key_padding_mask.dtype != torch.bool or key_padding_mask.dim() != 2:
        raise TypeError(
            f"key_padding_mask must be a (B, S) bool tensor with True = real token; got "
            f"{tuple(key_padding_mask.shape)} {key_padding_mask.dtype}. Fix: lengths can be "
            f"turned into one with attnlab.masks.padding_mask(lengths)."
        )
    return Mask(unwrap(key_padding_mask)[:, None, None, :])


def from_torch_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A mask written for ``torch.nn.MultiheadAttention`` -> attnlab's convention.

    torch's module reads a bool ``attn_mask`` or ``key_padding_mask`` as True = *not* allowed;
    attnlab reads True = may attend, so bool masks are inverted. Float masks are additive in
    both and pass unchanged. (torch's ``F.scaled_dot_product_attention`` already uses
    True = may attend: do not convert masks meant for it.)
    """
    if mask is None or mask.is_floating_point():
        return mask
    if mask.dtype != torch.bool:
        raise TypeError(f"from_torch_mask expects a bool or float mask; got {mask.dtype}.")
    return Mask(~unwrap(mask))


def _combine(op, masks: tuple[torch.Tensor, ...], name: str) -> Mask:
    if not masks:
        raise ValueError(f"{name} needs at least one mask.")
    for i, m in enumerate(masks):
        if not isinstance(m, torch.Tensor) or m.dtype != torch.bool:
            raise TypeError(
                f"{name}: mask {i} must be a bool tensor (True = may attend); got "
                f"{getattr(m, 'dtype', type(m).__name__)}. Fix: convert an additive bias with "
                f"attnlab.masks.to_bool."
            )
    out = unwrap(masks[0])
    for m in masks[1:]:
        out = op(out, unwrap(m))
    return Mask(out)


def and_masks(*masks: torch.Tensor) -> Mask:
    """A position may be attended iff every mask allows it (broadcasting shapes)."""
    return _combine(torch.logical_and, masks, "and_masks")


def or_masks(*masks: torch.Tensor) -> Mask:
    """A position may be attended iff at least one mask allows it (broadcasting shapes)."""
    return _combine(torch.logical_or, masks, "or_masks")


def restrict(attn_mask: torch.Tensor | None, allowed: torch.Tensor | None):
    """``attn_mask`` (bool, or an additive bias) further limited to where ``allowed`` is True.

    ``None`` means no limit. Two bool masks give their AND (a bool mask); a bias gets ``-inf``
    where ``allowed`` is False and keeps its values elsewhere. Shapes broadcast.
    """
    if allowed is None:
        return attn_mask
    if attn_mask is None:
        return allowed
    if attn_mask.dtype == torch.bool:
        return attn_mask & allowed
    return attn_mask.masked_fill(~allowed, float("-inf"))


def to_additive(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Bool mask (True = may attend) -> additive bias: 0 where allowed, ``-inf`` where not.

    attnlab uses ``-inf`` rather than a large negative constant such as ``-1e9``: masked weights
    come out exactly 0, and fully masked rows are detected and given weight 0.
    """
    if mask.dtype != torch.bool:
        raise TypeError(f"to_additive expects a bool mask; got {mask.dtype}.")
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return bias.masked_fill_(~unwrap(mask), float("-inf"))


def to_bool(bias: torch.Tensor) -> Mask:
    """Additive bias -> bool mask: True wherever the bias is above ``finfo(dtype).min / 2``.

    ``-inf`` is masked, and so is the dtype's most negative range: Hugging Face and torch mark
    masked keys with ``torch.finfo(dtype).min``, finite, which no attention weight survives
    once a row has any other key (read as "may attend", such a mask let every query attend
    the padding). A row that bias covers entirely differs: the bias gives it uniform weights,
    the bool mask a dead row (0). Smaller biases (``-1e9``, ``-1e4``) stay "may attend".
    """
    if not bias.is_floating_point():
        raise TypeError(f"to_bool expects a floating additive bias; got {bias.dtype}.")
    return Mask(unwrap(bias) > torch.finfo(bias.dtype).min / 2)
