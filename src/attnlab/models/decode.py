"""A compiled decode step: captured once, replayed for every new token (gpt-fast's recipe).

Generating a token runs the same small computation again and again: for a 135M-parameter model,
a few hundred small kernels per step. On a GPU their launch overhead, not the arithmetic or the
memory traffic, sets the speed; on a CPU, Python dispatch adds to the memory-bound matrix-vector
products. The recipe:

1. a fixed-shape cache (:class:`attnlab.cache.StaticCache`), so that every step sees the same
   shapes, at the same addresses;
2. nothing in the step that changes from token to token except tensors: the slot, the mask and
   (unless given) the rotary positions are computed on the device from the cache's positions
   tensor (no Python int, no host sync), so one graph serves every step;
3. ``torch.compile`` of that step, once (on CUDA with ``mode="reduce-overhead"``: the step is
   recorded as a CUDA graph and replayed as one launch);
4. the prompt's prefill separate and eager (its length varies from call to call)::

       prefill (eager, any P)          step (compiled once)          step (replayed) ...
       prompt -> slots 0..P-1          token -> slot P, logits       token -> slot P + 1

A :class:`DecodeStep` is bound to one cache geometry (batch size, slots, dtype, device, cache
kind): the first call compiles for it, and a cache of another geometry is refused with the fix
(shapes are part of the graph; build another ``DecodeStep`` for it), unless it was built with
``dynamic=True`` (or None): then sizes are symbolic and one graph serves every geometry (on CUDA
a CUDA graph is still recorded per geometry). The batch can be reordered
in place between steps (beam search: ``cache.reorder(index)`` with the same batch size).

Example:
    >>> from attnlab.models import LlamaConfig, LlamaModel
    >>> model = LlamaModel(LlamaConfig(vocab_size=100, d_model=32, num_layers=2, num_heads=4,
    ...                                num_kv_heads=2, d_ff=64)).eval()
    >>> prompt = torch.tensor([[1, 2, 3]])
    >>> cache = model.make_cache("static", max_length=16)
    >>> step = DecodeStep(model)                                      # doctest: +SKIP
    >>> with torch.no_grad():                                         # doctest: +SKIP
    ...     token = model(prompt, cache=cache)[:, -1:].argmax(-1)     # prefill, eager
    ...     for _ in range(4):
    ...         token = step(token, cache)[:, -1:].argmax(-1)         # compiled once, replayed

Any other model built from :class:`attnlab.nn.MultiHeadAttention` layers (each with its
``layer_idx``) and called as ``model(tokens, cache=cache)`` gets the same recipe from
``DecodeStep(model)``: around the compiled call the cache is ``stepping``, and each layer then
takes its new token's position from the cache's positions tensor (:meth:`Cache.next_position`)
and writes it at a slot found on the device (:meth:`Cache.write_step`) instead of reading and
counting a Python int; the step counts the token afterwards. So one graph serves every step
(a CUDA graph on CUDA), as for Llama's ``forward_step``.

References: PyTorch team, "Accelerating Generative AI with PyTorch II: GPT, Fast" (gpt-fast),
2023.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from attnlab.cache import Cache, SlidingWindowCache, StaticCache
from attnlab.kernels import few_rows
from attnlab.nn import MultiHeadAttention

__all__ = ["DecodeStep"]


class DecodeStep:
    """One decode step of ``model`` compiled for a fixed-shape cache: ``step(tokens, cache)``.

    Args:
        model: a model with ``forward_step(input_ids, buffers, position_ids)`` and ``cfg``
            (:class:`attnlab.models.LlamaModel`), or any module whose attention layers are
            :class:`attnlab.nn.MultiHeadAttention` with a ``layer_idx``, called as
            ``model(tokens, cache=cache)`` (and ``position_ids=`` when given).
        mode: ``torch.compile`` mode; default ``"reduce-overhead"`` (CUDA graphs) on CUDA and
            the default mode elsewhere (CUDA graphs do not exist on CPU).
        backend: ``torch.compile`` backend (``"inductor"``; tests pass a counting one).
        compile: False runs the same fast path eagerly (no compilation).
        dynamic: ``torch.compile``'s ``dynamic``: False (the default) specialises the graph to
            the cache's geometry; True compiles with symbolic sizes and None makes the sizes
            that change symbolic after the first change: either serves every geometry (the
            translator's beam search, whose batches differ in source length and cache size).

    Calling it with ``tokens`` (B, 1), a prefilled StaticCache (or SlidingWindowCache for a
    sliding-window model) and optional ``position_ids`` (B, 1) appends the tokens to the cache
    and returns (B, 1, vocab) logits, as ``model(tokens, cache=cache, position_ids=...)`` would.
    Other keyword arguments (tensors, or tuples of them: an encoder's memory) are passed on to
    a model of MultiHeadAttention layers as inputs of the graph; their shapes are part of the
    geometry.
    On CUDA graphs the logits are a copy (the graph's own output is overwritten by the next
    replay).

    Every DecodeStep compiles the same function, ``model.forward_step``: torch.compile keeps
    ``torch._dynamo.config.recompile_limit`` (8) variants of it per process (models x
    geometries) and runs further ones eagerly, with a warning.

    Raises:
        TypeError: a cache whose storage grows (DynamicCache).
        ValueError: a cache (or inputs) of another geometry than the first one it saw (another
            batch size or length; not with ``dynamic=True``), a batch that changed without
            ``cache.reorder``, a full static cache, an empty or partly filled cache, tokens not
            (B, 1).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        mode: str | None = None,
        backend: str | Callable = "inductor",
        compile: bool = True,
        dynamic: bool | None = False,
    ) -> None:
        # which cache layers the model writes: its config's, or its attention layers' indices
        self.own_step = hasattr(model, "forward_step")  # (else: model(tokens, cache=cache))
        if self.own_step:
            self.layers = list(range(model.cfg.num_layers))
        else:
            found = (m.layer_idx for m in model.modules() if isinstance(m, MultiHeadAttention))
            self.layers = sorted({i for i in found if i is not None})
            if not self.layers:
                raise TypeError(
                    f"{type(model).__name__} has no forward_step(input_ids, buffers, "
                    f"position_ids) and no attnlab.nn.MultiHeadAttention layer with a layer_idx, "
                    f"so a decode step cannot find its cache. Fix: build its attention from "
                    f"MultiHeadAttention(..., layer_idx=i), or compile it yourself."
                )
        self.model = model
        self.mode, self.backend, self.compile, self.dynamic = mode, backend, compile, dynamic
        self.geometry: tuple | None = None  # (kind, batch, slots, dtype, device), on first call
        self._fn: Callable | None = None
        self._cuda_graphs = False

    def check_cache_kind(self, cache: Cache) -> None:
        """Refuse, before any work, a cache this step cannot write (with the fix)."""
        if not isinstance(cache, StaticCache | SlidingWindowCache):
            raise TypeError(
                f"a compiled decode step needs a fixed-shape cache; got {type(cache).__name__}, "
                f"whose storage grows. Fix: cache='static' (StaticCache(max_length)), or "
                f"compile=False."
            )
        cfg = getattr(self.model, "cfg", None)  # (layers built from MultiHeadAttention check
        window = getattr(cfg, "sliding_window", None)  # their window themselves)
        if (
            cfg is not None
            and isinstance(cache, SlidingWindowCache)
            and (window is None or window > cache.window)
        ):
            raise ValueError(
                f"a SlidingWindowCache of window {cache.window} drops keys this model still "
                f"attends to (sliding_window={window}). Fix: a StaticCache, or a model with "
                f"sliding_window <= {cache.window}."
            )

    def __call__(
        self,
        tokens: torch.Tensor,
        cache: Cache,
        position_ids: torch.Tensor | None = None,
        **inputs,
    ) -> torch.Tensor:
        if inputs and self.own_step:
            raise TypeError(
                f"{type(self.model).__name__}.forward_step takes no other inputs; got "
                f"{sorted(inputs)}."
            )
        self._check(tokens, cache, position_ids, inputs)
        # A view such as tokens[:, -1:] has the strides of its base, which grow every step, and
        # the graph is specialised to strides: hand it (B, 1) tensors of strides (1, 1).
        tokens = _dense(tokens)
        if position_ids is None and self.own_step:
            counts = cache.token_counts(self.layers[0])
            if counts is not None:  # a padded prompt: each row counts its own real tokens
                position_ids = counts[:, None]
        if position_ids is not None:
            position_ids = _dense(position_ids)
        if self._fn is None:
            self._fn = self._build(tokens.device)
        # (a graph of fixed sizes: its few-row products may take the measured order)
        sizes = few_rows.fixed_sizes() if self.dynamic is False else contextlib.nullcontext()
        with torch.no_grad(), sizes:
            if self._cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are done
            if self.own_step:
                buffers = tuple(cache.buffers(i) for i in self.layers)
                logits = self._fn(tokens, buffers, position_ids)
            else:
                cache.stepping = True  # the layers write through cache.write_step
                try:
                    logits = self._fn(tokens, cache, position_ids, inputs)
                finally:
                    cache.stepping = False
        cache.advance(1)
        # A CUDA graph's outputs live in its memory pool and the next replay overwrites them.
        return logits.clone() if self._cuda_graphs else logits

    def _build(self, device: torch.device) -> Callable:
        fn = self.model.forward_step if self.own_step else self._call_model
        if not self.compile:
            return fn
        mode = self.mode
        if mode is None and device.type == "cuda" and self.backend == "inductor":
            mode = "reduce-overhead"
        self._cuda_graphs = mode == "reduce-overhead" and device.type == "cuda"
        # dynamic=False (the default): one graph specialised to this geometry (the CPU code is
        # faster with constant sizes; a CUDA graph is per geometry anyway); True: symbolic
        # sizes, one graph for all (the translator's batches); fullgraph: a break is a bug.
        return torch.compile(
            fn, mode=mode, backend=self.backend, fullgraph=True, dynamic=self.dynamic
        )

    def _call_model(self, tokens, cache, position_ids, inputs):
        if position_ids is not None:
            inputs = {**inputs, "position_ids": position_ids}
        return self.model(tokens, cache=cache, **inputs)

    def _check(self, tokens: torch.Tensor, cache: Cache, position_ids, inputs) -> None:
        self.check_cache_kind(cache)
        num_layers = len(self.layers)
        lengths = {cache.get_seq_length(i) for i in self.layers}
        if 0 in lengths or len(lengths) != 1:
            raise ValueError(
                f"the cache must hold the prompt in all {num_layers} layers before a decode "
                f"step; got lengths {sorted(lengths)}. Fix: prefill it with model(prompt, "
                f"cache=cache) first (the prefill is not part of the compiled step)."
            )
        if (
            not isinstance(tokens, torch.Tensor)
            or tokens.dim() < 2
            or (self.own_step and tokens.dim() != 2)  # (other models may take (B, 1, D))
            or tokens.shape[1] != 1
        ):
            got = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens)
            raise ValueError(
                f"a decode step takes one token per row, tokens (B, 1); got {got}. Fix: "
                f"tokens[:, None] for (B,) ids; several new tokens go through model(tokens, "
                f"cache=cache)."
            )
        if tokens.shape[0] != cache.batch_size:
            raise ValueError(
                f"batch size changed from {cache.batch_size} (the cache) to {tokens.shape[0]} "
                f"(the tokens) without reorder(). Fix: cache.reorder(index) to follow beams or "
                f"filter rows, or reset() the cache and prefill the new batch."
            )
        if position_ids is not None and position_ids.shape != tokens.shape[:2]:
            raise ValueError(
                f"position_ids must be (B, 1) = {tuple(tokens.shape[:2])} like the tokens; got "
                f"{tuple(position_ids.shape)}."
            )
        length = lengths.pop()
        if isinstance(cache, StaticCache) and length >= cache.max_length:
            raise ValueError(
                f"StaticCache of max_length={cache.max_length} is full ({length} tokens). Fix: "
                f"StaticCache(max_length >= {length + 1})."
            )
        keys = cache.buffers(self.layers[0])[0]
        geometry = (type(cache).__name__, cache.batch_size, cache.capacity, keys.dtype, keys.device)
        geometry += tuple(_shapes(inputs))
        if self.dynamic is not False:  # sizes may change: torch.compile recompiles once for them
            self.geometry = geometry
        elif self.geometry is None:
            self.geometry = geometry
        elif geometry[5:] != self.geometry[5:]:
            raise ValueError(
                f"this decode step was compiled for inputs of shapes {self.geometry[5:]}; got "
                f"{geometry[5:]}. Fix: a new DecodeStep(model) for inputs of other shapes."
            )
        elif geometry != self.geometry:
            kind, batch, slots, dtype, device = self.geometry[:5]
            raise ValueError(
                f"this decode step was compiled for a {kind} of batch {batch} x {slots} slots "
                f"({dtype}, {device}); got a {geometry[0]} of batch {geometry[1]} x "
                f"{geometry[2]} slots ({geometry[3]}, {geometry[4]}). Fix: a new "
                f"DecodeStep(model) for this cache, or a cache of the step's size "
                f"(StaticCache(max_length={slots}) for batch {batch})."
            )


def _shapes(inputs: dict):
    """(name, shape) of each tensor among the extra inputs, nested tuples opened (name.i.j)."""

    def walk(name, x):
        if isinstance(x, tuple | list):
            for i, item in enumerate(x):
                yield from walk(f"{name}.{i}", item)
        else:
            yield (name, tuple(x.shape) if isinstance(x, torch.Tensor) else x)

    for name, x in sorted(inputs.items()):
        yield from walk(name, x)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the contiguous strides of its shape (also for size-1 dims, which
    ``contiguous()`` leaves as they are), and not a view: torch.compile guards on a view's
    base too (its shape, and sizes that happen to be equal in it)."""
    dense, n = [], 1
    for size in reversed(t.shape):  # (B, 1) -> (1, 1); (B, 1, D) -> (D, D, 1)
        dense.insert(0, n)
        n *= max(size, 1)
    if t.stride() == tuple(dense) and t._base is None:
        return t
    return t.clone(memory_format=torch.contiguous_format)
