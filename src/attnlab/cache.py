"""Key/value caches for incremental decoding.

A decoder that generates one token at a time would recompute the keys and values of the whole
prefix at every step. A cache keeps them: each step projects only the new tokens and appends
their keys/values, and attention runs over everything cached::

    step t:   new query (B, H, 1, E)   --attends-->   cached keys (B, Hkv, P + 1, E)
              the new token sits at position P: bottom-right causal alignment

Every cache has the same interface (as Hugging Face's): ``update(key, value, layer_idx)``
stores the new keys/values of one layer and returns all of them. Three kinds:

* :class:`DynamicCache` grows as needed (amortised doubling, so appending is O(1) per token).
* :class:`StaticCache` preallocates ``max_length`` slots: fixed shapes, friendly to
  ``torch.compile`` and to memory planning; unfilled slots are masked.
* :class:`SlidingWindowCache` keeps only the last ``window`` tokens in a ring buffer, for
  layers with sliding-window attention (memory O(window) however long the text).

A cache also records where each slot sits in the sequence (:meth:`Cache.key_positions`) and
which cached keys are padding (:meth:`Cache.key_mask`), so the layer builds an exact mask
for any kind; and which slots hold a NaN or an infinity (:meth:`Cache.kv_finite`), checked once
when a token is written, so that attention's NaN policy (a non-finite key or value makes its
head's rows NaN) need not read the whole cache again at every step. Multi-query and
grouped-query layers cache only their Hkv heads: the memory saving of MQA/GQA is exactly here.

Compiled decoding. The fixed-shape caches (static, sliding) keep their storage at one address for
their whole life (``reorder`` copies in place when the batch size stays), and mark it with
``torch._dynamo.mark_static_address``: a compiled decode step can write into it in place and CUDA
graphs can replay over it. Such a step reaches the storage through :meth:`Cache.buffers`, finds
the next slot on the device from the positions tensor (the largest position + 1, so no Python
int that changes per step enters the graph), and then calls :meth:`Cache.advance` to count the
token (see :class:`attnlab.models.decode.DecodeStep`).

The cache stores tensors for inference; it is not meant to be backpropagated through.
"""

from __future__ import annotations

import weakref

import torch

from attnlab._checks import check_count
from attnlab.functional.nonfinite import max_abs

__all__ = ["Cache", "DynamicCache", "SlidingWindowCache", "StaticCache"]


def finite_slots(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, L, E), (B, Hkv, L, Ev) -> (B, Hkv, L) bool: True where the slot's key and value
    hold no NaN or inf (max |x| is non-finite exactly when x holds one; it cannot overflow).

    One reduction over the slot's key and value side by side (a cache checks every token it
    writes, in every layer: three small operations, not one per tensor).
    """
    both = torch.cat([key, value], dim=-1)  # (B, Hkv, L, E + Ev)
    if not both.shape[-1]:  # (E = Ev = 0 holds no NaN)
        return key.new_ones(key.shape[:-1], dtype=torch.bool)
    # NaN < inf and inf < inf are False. (Not torch.isfinite: inductor's CPU code for it
    # fails to compile when the result is written through a slice of a fresh tensor.)
    return max_abs(both, -1) < float("inf")


def write_token(keys, values, finite, slot, key, value) -> None:
    """Write one new token per row in place at ``slot`` (1,), a tensor (no Python int, for
    compiled steps): key (B, Hkv, 1, E) into keys (B, Hkv, C, E), value likewise, and its
    :func:`finite_slots` verdict into finite (B, Hkv, C)."""
    keys.index_copy_(2, slot, key)
    values.index_copy_(2, slot, value)
    finite.index_copy_(2, slot, finite_slots(key, value))


class _Layer:
    """One layer's storage: keys (B, Hkv, C, E), values (B, Hkv, C, Ev), padding (B, C), and
    finite (B, Hkv, C): whether each slot's key and value are free of NaN and inf."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor, capacity: int) -> None:
        B, Hkv, _, E = key.shape
        self.keys = key.new_zeros(B, Hkv, capacity, E)
        self.values = value.new_zeros(B, Hkv, capacity, value.shape[-1])
        self.real = torch.ones(B, capacity, dtype=torch.bool, device=key.device)
        self.positions = torch.full((capacity,), -1, dtype=torch.long, device=key.device)
        self.finite = torch.ones(B, Hkv, capacity, dtype=torch.bool, device=key.device)
        self.length = 0  # tokens seen so far (for a ring buffer, more than it holds)
        self.padded = False  # has any padding been stored?
        self.pads = torch.zeros(B, dtype=torch.long, device=key.device)  # padding seen per row
        self.view = None  # (keys, values, positions, padding, finite) of the last update

    def grow(self, capacity: int) -> None:
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], capacity, old.shape[3])
            new[:, :, : old.shape[2]] = old
            setattr(self, name, new)
        real = torch.ones(self.real.shape[0], capacity, dtype=torch.bool, device=self.real.device)
        real[:, : self.real.shape[1]] = self.real
        self.real = real
        finite = self.finite.new_ones(*self.finite.shape[:2], capacity)
        finite[:, :, : self.finite.shape[2]] = self.finite
        self.finite = finite
        positions = torch.full((capacity,), -1, dtype=torch.long, device=self.positions.device)
        positions[: self.positions.shape[0]] = self.positions
        self.positions = positions

    def write(self, slots, key, value, padding, start: int) -> None:
        self.keys[:, :, slots] = key
        self.values[:, :, slots] = value
        self.finite[:, :, slots] = finite_slots(key, value)
        self.positions[slots] = torch.arange(start, start + key.shape[2], device=key.device)
        if padding is not None:
            self.real[:, slots] = padding
            self.pads += (~padding).sum(1)
            self.padded = True
        else:
            self.real[:, slots] = True

    def storage(self) -> tuple[torch.Tensor, ...]:
        """(keys, values, positions, real, finite): all of it, as a fixed-shape cache returns."""
        return self.keys, self.values, self.positions, self.real, self.finite

    def fits(self, key: torch.Tensor, value: torch.Tensor, capacity: int) -> bool:
        """Whether this storage can hold a new sequence of these keys/values."""
        B, Hkv, _, E = key.shape
        return (
            self.keys.shape == (B, Hkv, capacity, E)
            and self.values.shape[3] == value.shape[3]
            and self.keys.dtype == key.dtype
            and self.values.dtype == value.dtype
            and self.keys.device == key.device
        )

    def clear(self) -> None:
        """Empty, in place: zeros (a stale NaN would reach the NaN screen), no positions."""
        self.keys.zero_()
        self.values.zero_()
        self.real.fill_(True)
        self.finite.fill_(True)
        self.positions.fill_(-1)
        self.pads.zero_()
        self.length, self.padded, self.view = 0, False, None

    def reorder(self, index: torch.Tensor, in_place: bool) -> None:
        for name in ("keys", "values", "real", "finite", "pads"):
            old = getattr(self, name)
            new = old.index_select(0, index)
            if in_place and new.shape == old.shape:
                old.copy_(new)  # same address: compiled steps and CUDA graphs stay valid
            else:
                setattr(self, name, new)
        if in_place:
            self.mark_static()

    def mark_static(self) -> None:
        """Tell torch.compile the storage keeps its address (no copy into CUDA graph inputs)."""
        if torch.compiler.is_compiling():  # (allocated inside a traced call: nothing to mark)
            return
        for t in (self.keys, self.values, self.real, self.positions, self.finite, self.pads):
            torch._dynamo.mark_static_address(t)


class Cache:
    """The interface shared by every cache kind.

    Subclasses decide where new tokens are stored (:meth:`_store`) and what is returned.
    """

    #: True when cached keys sit in slots 0..S-1 in order, so that the new queries are the last
    #: L positions: bottom-right causal alignment then needs no explicit mask.
    in_order = True
    #: True when the storage never changes shape or address (a compiled step may write it).
    fixed_shape = False
    #: True while a compiled decode step runs (:class:`attnlab.models.decode.DecodeStep`):
    #: layers then write their one new token through :meth:`write_step`, at a slot found on
    #: the device, and the step counts it afterwards (:meth:`advance`).
    stepping = False

    def __init__(self, num_layers: int | None = None) -> None:
        if num_layers is not None:
            num_layers = check_count(num_layers, "num_layers", 1, "or None for any number")
        self.num_layers = num_layers
        self._layers: dict[int, _Layer] = {}
        self._spare: dict[int, _Layer] = {}  # storage kept by reset() for the next sequence

    # -- the interface --------------------------------------------------------------------------

    def update(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_idx: int,
        *,
        key_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys/values of layer ``layer_idx``; return everything attention needs.

        Args:
            key: (B, Hkv, L, E) keys of the L new tokens.
            value: (B, Hkv, L, Ev) their values.
            layer_idx: which layer these belong to (each layer has its own storage).
            key_mask: optional (B, L) bool, True = real token, False = padding (left-
                padded prompts of different lengths). Remembered for later steps.

        Returns:
            (keys, values): (B, Hkv, S, E) and (B, Hkv, S, Ev). :meth:`key_positions` and
            :meth:`key_mask` describe their S slots.
        """
        self._check(key, value, layer_idx, key_mask)
        layer = self._layers.get(layer_idx)
        if layer is None:
            layer = self._spare.pop(layer_idx, None)  # a fixed-shape cache's storage, reset
            capacity = self._initial_capacity(key)
            if layer is not None and layer.fits(key, value, capacity):
                layer.clear()
            else:
                layer = _Layer(key, value, capacity)
                if self.fixed_shape:
                    layer.mark_static()
            self._layers[layer_idx] = layer
        start = layer.length
        layer.view = self._store(layer, key, value, key_mask, start)
        layer.length += key.shape[2]
        return layer.view[0], layer.view[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Number of tokens seen by layer ``layer_idx`` (the position of the next token)."""
        layer = self._layers.get(layer_idx)
        return 0 if layer is None else layer.length

    def token_counts(self, layer_idx: int = 0) -> torch.Tensor | None:
        """(B,) real tokens (not padding) each row has seen at layer ``layer_idx``: the position
        of its next token when positions count from each row's first real token, as for a
        left-padded prompt. None while no padding was stored (every row has seen
        :meth:`get_seq_length` tokens)."""
        layer = self._layers.get(layer_idx)
        if layer is None or not layer.padded:
            return None
        return layer.length - layer.pads

    def key_positions(self, layer_idx: int) -> torch.Tensor:
        """(S,) position in the sequence of each slot returned by the last update; -1 = empty."""
        return self._layer(layer_idx).view[2]

    def key_mask(self, layer_idx: int) -> torch.Tensor | None:
        """(B, S) bool, True = real token, for the last update's slots; None if no padding."""
        layer = self._layer(layer_idx)
        return layer.view[3] if layer.padded else None

    def filled_prefix(self, layer_idx: int) -> int | None:
        """n where the last update's slots 0..n-1 hold positions 0..n-1, in order, and every
        later slot is empty, so attention may read those n slots alone (bottom-right aligned,
        no mask for the empty ones); None where that does not hold. In-order caches return
        exactly those slots: n is all of them."""
        return self._layer(layer_idx).view[0].shape[2] if self.in_order else None

    def kv_finite(self, layer_idx: int) -> torch.Tensor:
        """(B, Hkv) bool: True where none of the last update's slots (masked or empty ones
        included) holds a NaN or inf in its key or value. Each slot is checked once, when
        written; attention takes this instead of reading the cache again
        (``scaled_dot_product_attention``'s NaN policy)."""
        return self._layer(layer_idx).view[4].all(-1)

    def reorder(self, index: torch.Tensor) -> None:
        """Re-index the batch: beam search reorders rows; a smaller index filters the batch.

        Args:
            index: (B',) long tensor; row i of the new batch is row ``index[i]`` of the old one.
        """
        index = torch.as_tensor(index)
        if index.dim() != 1 or index.dtype not in (torch.int32, torch.int64):
            raise TypeError(
                f"index must be a 1-D integer tensor of batch rows; got {tuple(index.shape)} "
                f"{index.dtype}."
            )
        if not self._layers:
            return
        B = next(iter(self._layers.values())).keys.shape[0]  # every layer holds the same batch
        if len(index) and (int(index.min()) < 0 or int(index.max()) >= B):  # checked once
            raise ValueError(f"index must lie in [0, {B}); got {index.tolist()}.")
        for layer in self._layers.values():
            layer.reorder(index.to(layer.keys.device), in_place=self.fixed_shape)
            layer.view = None  # stale until the next update

    def reset(self) -> None:
        """Forget everything (start a new sequence).

        A fixed-shape cache keeps its storage, zeroed, for a next sequence of the same batch
        size, heads, dtype and device: the same addresses, so a compiled step and its CUDA graph
        serve it without being recorded again.
        """
        if self.fixed_shape:
            self._spare.update(self._layers)
        self._layers.clear()

    @property
    def batch_size(self) -> int | None:
        layer = next(iter(self._layers.values()), None)
        return None if layer is None else layer.keys.shape[0]

    @property
    def capacity(self) -> int | None:
        """Slots per layer (C): ``max_length`` or ``window``; None before the first update."""
        layer = next(iter(self._layers.values()), None)
        return None if layer is None else layer.keys.shape[2]

    # -- for compiled decode steps --------------------------------------------------------------

    def buffers(
        self, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The storage of layer ``layer_idx`` itself, for a compiled step that writes it in place.

        Returns:
            ``(keys (B, Hkv, C, E), values (B, Hkv, C, Ev), positions (C,), real (B, C),
            finite (B, Hkv, C))``: ``positions`` holds each slot's position in the sequence
            (-1 = empty), ``real`` is True for real tokens (False = padding), ``finite`` is
            True where the slot's key and value hold no NaN or inf (:func:`finite_slots`). A
            step that writes one token stores it at slot ``(positions.max() + 1) % C`` in all
            five, then calls :meth:`advance`.

        Raises:
            TypeError: a cache whose storage grows (DynamicCache): its shape and address change.
            ValueError: nothing cached yet for the layer (prefill it first).
        """
        return self._fixed_layer(layer_idx).storage()

    def next_position(self, layer_idx: int) -> torch.Tensor:
        """(1,) long, on the cache's device: the position of layer ``layer_idx``'s next token
        (the largest stored position + 1), computed without reading a Python count, so that a
        compiled step's graph does not change from token to token."""
        return self._fixed_layer(layer_idx).positions.max().add(1).view(1)

    def write_step(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, position: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one new token per row at ``position`` ((1,), from :meth:`next_position`), in
        place, at slot ``position % C``; return the whole storage (keys, values) as
        :meth:`update` does. The token is counted by :meth:`advance`, after the step.

        key (B, Hkv, 1, E), value (B, Hkv, 1, Ev). A full StaticCache is refused when run
        eagerly; a compiled step cannot look (no host sync), so its caller checks for room
        first (:class:`attnlab.models.decode.DecodeStep` does).
        """
        layer = self._fixed_layer(layer_idx)
        C = layer.positions.shape[0]
        if (
            isinstance(self, StaticCache)
            and not torch.compiler.is_compiling()
            and layer.length >= C
        ):
            raise ValueError(
                f"StaticCache of max_length={C} is full ({layer.length} tokens): the next token "
                f"would overwrite the first. Fix: StaticCache(max_length >= {layer.length + 1})."
            )
        if (
            key.dim() != 4
            or key.shape != (*layer.keys.shape[:2], 1, layer.keys.shape[3])
            or value.shape != (*layer.values.shape[:2], 1, layer.values.shape[3])
        ):
            raise ValueError(
                f"write_step takes one token per row, key (B, Hkv, 1, E) = "
                f"{(*layer.keys.shape[:2], 1, layer.keys.shape[3])} and value (B, Hkv, 1, Ev) "
                f"= {(*layer.values.shape[:2], 1, layer.values.shape[3])}; got "
                f"{tuple(key.shape)} and {tuple(value.shape)}."
            )
        slot = position % C  # (a ring: SlidingWindowCache; a StaticCache never wraps)
        write_token(layer.keys, layer.values, layer.finite, slot, key, value)
        layer.positions.index_copy_(0, slot, position)
        layer.real.index_fill_(1, slot, True)
        layer.view = layer.storage()
        return layer.keys, layer.values

    def _fixed_layer(self, layer_idx: int) -> _Layer:
        if not self.fixed_shape:
            raise TypeError(
                f"{type(self).__name__} grows its storage, so a compiled step cannot write into "
                f"it. Fix: decode with a StaticCache(max_length) (or a SlidingWindowCache for "
                f"sliding-window models)."
            )
        layer = self._layers.get(layer_idx)
        if layer is None:
            raise ValueError(
                f"layer_idx {layer_idx} has nothing cached yet: prefill the cache (an update of "
                f"every layer) before a decode step writes into it."
            )
        return layer

    def advance(self, num_tokens: int = 1) -> None:
        """Count ``num_tokens`` tokens that a compiled step wrote through :meth:`buffers`."""
        for layer in self._layers.values():
            layer.length += num_tokens
            layer.view = layer.storage()

    # -- for subclasses -------------------------------------------------------------------------

    def _initial_capacity(self, key: torch.Tensor) -> int:
        raise NotImplementedError

    def _store(self, layer: _Layer, key, value, padding, start: int):
        """Store the new tokens; return (keys, values, positions, padding, finite) for
        attention."""
        raise NotImplementedError

    def _layer(self, layer_idx: int) -> _Layer:
        if layer_idx not in self._layers or self._layers[layer_idx].view is None:
            raise ValueError(
                f"layer_idx {layer_idx} has nothing cached yet; call update(key, value, "
                f"{layer_idx}) first."
            )
        return self._layers[layer_idx]

    def _check(self, key, value, layer_idx, padding) -> None:
        if not isinstance(layer_idx, int) or isinstance(layer_idx, bool) or layer_idx < 0:
            raise ValueError(f"layer_idx must be an int >= 0; got {layer_idx!r}.")
        if self.num_layers is not None and layer_idx >= self.num_layers:
            raise ValueError(
                f"layer_idx {layer_idx} is out of range for a cache of num_layers="
                f"{self.num_layers}. Fix: give each layer its index 0..{self.num_layers - 1}."
            )
        if key.dim() != 4 or value.dim() != 4 or key.shape[:3] != value.shape[:3]:
            raise ValueError(
                f"key and value must be (B, Hkv, L, E) and (B, Hkv, L, Ev); got "
                f"{tuple(key.shape)} and {tuple(value.shape)}."
            )
        if padding is not None and (
            padding.dtype != torch.bool or padding.shape != (key.shape[0], key.shape[2])
        ):
            raise ValueError(
                f"key_mask must be a (B, L) = {(key.shape[0], key.shape[2])} bool tensor "
                f"(True = real token) for the new tokens; got {tuple(padding.shape)} "
                f"{padding.dtype}."
            )
        layer = self._layers.get(layer_idx)
        if layer is None:
            return
        if key.dtype != layer.keys.dtype or value.dtype != layer.values.dtype:
            raise TypeError(
                f"layer {layer_idx} caches {layer.keys.dtype}; got key {key.dtype}. Fix: keep "
                f"one dtype per cache, or call reset() to start over."
            )
        if key.device != layer.keys.device:
            raise ValueError(
                f"layer {layer_idx} caches on {layer.keys.device}; got key on {key.device}. "
                f"Fix: move the model and cache together."
            )
        if key.shape[0] != layer.keys.shape[0]:
            raise ValueError(
                f"batch size changed from {layer.keys.shape[0]} to {key.shape[0]} without "
                f"reorder(). Fix: call cache.reorder(index) to reorder or filter the batch "
                f"(beam search), or reset() for a new batch."
            )
        if key.shape[1] != layer.keys.shape[1] or key.shape[3] != layer.keys.shape[3]:
            raise ValueError(
                f"layer {layer_idx} caches (Hkv, E) = {(layer.keys.shape[1], layer.keys.shape[3])}"
                f"; got {(key.shape[1], key.shape[3])}: is layer_idx wrong? Each layer needs its "
                f"own index."
            )
        if value.shape != (*key.shape[:3], layer.values.shape[3]):  # (a width 1 broadcast)
            raise ValueError(
                f"layer {layer_idx} caches values (B, Hkv, ·, Ev) with Ev = "
                f"{layer.values.shape[3]}; got value {tuple(value.shape)} for key "
                f"{tuple(key.shape)}. Fix: the value of the same tokens, its own width."
            )


class DynamicCache(Cache):
    """A cache that grows with the sequence (doubling its storage when full).

    Example:
        >>> cache = DynamicCache()
        >>> k, v = cache.update(torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8), layer_idx=0)
        >>> k, v = cache.update(torch.randn(2, 4, 1, 8), torch.randn(2, 4, 1, 8), layer_idx=0)
        >>> k.shape, cache.get_seq_length(0)
        (torch.Size([2, 4, 6, 8]), 6)
    """

    def _initial_capacity(self, key):
        return max(16, key.shape[2])

    def _store(self, layer, key, value, padding, start):
        end = start + key.shape[2]
        if end > layer.keys.shape[2]:
            layer.grow(max(end, 2 * layer.keys.shape[2]))
        layer.write(slice(start, end), key, value, padding, start)
        return (
            layer.keys[:, :, :end],
            layer.values[:, :, :end],
            layer.positions[:end],
            layer.real[:, :end],
            layer.finite[:, :, :end],
        )


class StaticCache(Cache):
    """A preallocated cache of ``max_length`` slots per layer: shapes never change.

    ``update`` returns all ``max_length`` slots; the unfilled ones have position -1 and are
    masked by the layer (or, eagerly, left out: slots fill in order from 0, so the layer reads
    the first :meth:`filled_prefix` alone). Storage is allocated at the first update of each
    layer, from the key's batch size, heads, width, dtype and device.

    Raises on update past ``max_length`` (with the fix: a larger cache).
    """

    in_order = False  # S = max_length, not P + L: alignment needs the explicit mask
    fixed_shape = True

    def __init__(self, max_length: int, num_layers: int | None = None) -> None:
        super().__init__(num_layers)
        self.max_length = check_count(max_length, "max_length", 1, "slots per row")

    def _initial_capacity(self, key):
        return self.max_length

    def _store(self, layer, key, value, padding, start):
        end = start + key.shape[2]
        if end > self.max_length:
            raise ValueError(
                f"StaticCache of max_length={self.max_length} cannot take {key.shape[2]} more "
                f"token(s) after {start}. Fix: StaticCache(max_length >= {end}), or a "
                f"DynamicCache."
            )
        layer.write(slice(start, end), key, value, padding, start)
        return layer.storage()

    def advance(self, num_tokens: int = 1) -> None:
        """Count ``num_tokens`` tokens that a step wrote through :meth:`buffers`; refuses to
        count past ``max_length``: such a step wrapped to slot 0 and overwrote the sequence's
        first token (:class:`attnlab.models.DecodeStep` checks before the step)."""
        length = max((layer.length for layer in self._layers.values()), default=0)
        if length + num_tokens > self.max_length:
            raise ValueError(
                f"StaticCache of max_length={self.max_length} holds {length} token(s) and cannot "
                f"count {num_tokens} more: a step written past its last slot wraps to slot 0 "
                f"and overwrites the first token, so the cache no longer holds the sequence. "
                f"Fix: StaticCache(max_length >= {length + num_tokens}), and check "
                f"get_seq_length() < max_length before a step (DecodeStep does)."
            )
        super().advance(num_tokens)

    def filled_prefix(self, layer_idx: int) -> int | None:
        """Slots are written in order from 0 (slot = position): the first ``length`` are filled.
        None while traced: a compiled graph keeps the fixed shape that is this cache's point."""
        if torch.compiler.is_compiling():
            return None
        return self._layer(layer_idx).length


# owner (a model) -> the StaticCache it decoded with last (kept_static_cache). Weak: the cache
# goes with its model, and is never pickled with it.
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def kept_static_cache(owner, max_length: int, num_layers: int | None = None) -> StaticCache:
    """The StaticCache of ``max_length`` slots that ``owner`` (a model) decoded with last,
    reset; a new one, kept in its place, for another length.

    A compiled decode step's CUDA graph replays over its cache's addresses: a new cache for
    every call would have the graph recorded again each time. A reset cache keeps its storage
    (zeroed) when the batch size, dtype and device stay. One decoding at a time per owner: two
    at once need a cache each.
    """
    cache = _KEPT.get(owner)
    if cache is None or cache.max_length != max_length or cache.num_layers != num_layers:
        cache = _KEPT[owner] = StaticCache(max_length, num_layers)
    cache.reset()
    return cache


class SlidingWindowCache(Cache):
    """Keeps the last ``window`` tokens per layer in a ring buffer.

    For layers whose attention is limited to a sliding window of ``window`` keys (the query
    itself and the ``window - 1`` before it): older keys can never be attended again, so they
    are overwritten. A decode step returns the ``window`` ring slots (fixed shape); a prefill
    of several tokens returns the ring plus the new tokens, so every new query still sees its
    own window.
    """

    in_order = False  # ring order: positions are tracked per slot
    fixed_shape = True

    def __init__(self, window: int, num_layers: int | None = None) -> None:
        super().__init__(num_layers)
        self.window = check_count(window, "window", 1, "tokens kept per row")

    def _initial_capacity(self, key):
        return self.window

    def _store(self, layer, key, value, padding, start):
        L, W = key.shape[2], self.window
        if L == 1:  # decode: overwrite the slot of the token that just left the window
            layer.write(slice(start % W, start % W + 1), key, value, padding, start)
            return layer.storage()
        # prefill: attention needs the old window and every new token; the ring keeps the last W
        real = padding if padding is not None else torch.ones_like(layer.real[:, :1]).expand(-1, L)
        finite = finite_slots(key, value)  # (B, Hkv, L)
        view = (
            torch.cat([layer.keys, key], dim=2),
            torch.cat([layer.values, value], dim=2),
            torch.cat([layer.positions, torch.arange(start, start + L, device=key.device)]),
            torch.cat([layer.real, real], dim=1),
            torch.cat([layer.finite, finite], dim=2),
        )
        keep = torch.arange(max(0, L - W), L, device=key.device)  # the last W new tokens
        slots = (start + keep) % W
        layer.keys[:, :, slots] = key[:, :, keep]
        layer.values[:, :, slots] = value[:, :, keep]
        layer.positions[slots] = start + keep
        layer.real[:, slots] = real[:, keep]
        layer.finite[:, :, slots] = finite[:, :, keep]
        if padding is not None:
            layer.pads += (~padding).sum(1)
            layer.padded = True
        return view
