"""Scaled dot-product attention: one function, a fast path and a readable path.

``scaled_dot_product_attention`` picks a path for every call:

* **fused** -- torch's own ``F.scaled_dot_product_attention`` (on CPU its flash kernel), used
  whenever it gives the same result: no weights requested, and no dropout on CPU (torch's CPU
  kernel has no dropout and would silently fall back to its slow math path).
* **weights** -- the weights on demand: scores, weights and output computed together, one block
  of heads x query rows at a time, written in place into the returned weights, so the extra
  memory is one block (not the several (B, H, L, S) temporaries of the textbook formula). Used
  when weights are requested; with autograd (float32/float64) its backward reads the returned
  per-head weights, or recomputes averaged ones block by block from the row log-sum-exp
  (:mod:`attnlab.functional._weights`).
* **triton** -- attnlab's Triton kernels (:mod:`attnlab.functional._triton`), on CUDA (and on
  CPU under ``TRITON_INTERPRET=1``): weights on demand from the row log-sum-exp, and masks
  kept as structure (padding lengths, packed documents, sliding windows: key blocks outside
  them skipped, forward and backward).
* **cpu_flash** -- attnlab's blocked CPU kernel (:mod:`attnlab.kernels.cpu_flash`), where
  torch's CPU kernel falls short: dropout (torch's has none and falls back to its math path)
  and 16-bit training where the blocked kernel is faster on this CPU (measured once per
  process: :mod:`attnlab.kernels.choice`; float32 training when
  ``ATTNLAB_CPU_TRAINING_KERNEL=attnlab`` asks for it). Inside a ``torch.compile`` graph it
  serves too, as the operator ``attnlab::cpu_flash`` (the choice made when the graph is traced,
  from fixed sizes); a ``torch.export`` keeps torch's ops.
* **eager** -- the readable formula ``masked_softmax(Q K^T * scale) V``: weights with dropout,
  16-bit weights that need gradients, and what the blocked kernel does not take.

Both paths compute the same function: float64 results agree with the NumPy oracle
:func:`attnlab.reference.scaled_dot_product_attention` to rounding. Which path ran and why is
told by :func:`explain` (and logged at DEBUG level on the ``attnlab.dispatch`` logger)::

    >>> print(explain(q, k, v, return_weights=True))          # doctest: +SKIP
    weights: weights (per head) and output computed together in blocks of 2 head(s) x 1024 ...
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnlab import kernels
from attnlab._checks import (
    _any_autocast,
    autocast_inputs,
    causal_alignment,
    check_bias_range,
    check_dropout,
    check_mask,
    check_qkv,
    check_scale,
    qkv_fit_shapes,
)
from attnlab.functional import _transforms, _triton, nonfinite
from attnlab.functional._layout import (
    as_4d,
    grouped_scores,
    grouped_weighted_sum,
    with_causal,
)
from attnlab.functional._weights import WeightsAttention, block_shape, weights_in_blocks
from attnlab.functional._weights import path as weights_path
from attnlab.functional.nonfinite import (
    fill_rows,
    is_finite_assumed,
    propagate_nonfinite,
    rows_to_fill,
)
from attnlab.functional.softmax import LOW_PRECISION, masked_softmax
from attnlab.kernels import flex_padding
from attnlab.masks import unwrap

inf = float("inf")

logger = logging.getLogger("attnlab.dispatch")

# Weights that need gradients take the blocked weights path in these dtypes (its softmax
# backward runs in the inputs' dtype; 16-bit inputs keep the eager path's float32 softmax).
GRAD_WEIGHTS_DTYPES = (torch.float32, torch.float64)


@dataclass(frozen=True)
class Dispatch:
    """A call's path (``"fused"``, ``"triton"``, ``"flex"``, ``"cpu_flash"``, ``"weights"`` or
    ``"eager"``; ``"empty"`` for no heads) and why."""

    path: str
    reasons: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.path}: " + "; ".join(self.reasons)

    def noting_assumption(self) -> Dispatch:
        """This dispatch, with a last reason when :class:`~attnlab.functional.assume_finite`
        skips the NaN rule's checks."""
        if not is_finite_assumed():
            return self
        said = "inputs assumed finite (assume_finite): not checked for NaN/inf"
        return Dispatch(self.path, (*self.reasons, said))


_FUSED = Dispatch("fused", ("torch F.scaled_dot_product_attention",))
_WEIGHTS = Dispatch("weights", ("weights on demand, in blocks",))  # (the hot path's: no reasons)


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _exporting() -> bool:
    """Whether torch.export is tracing (torch >= 2.6 says so; before, never)."""
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    return bool(is_exporting and is_exporting())


def _blocked_in_graph(dtype: torch.dtype, E: int, Ev: int, n: int) -> bool:
    """:func:`attnlab.kernels.training`'s verdict for length class ``n``, computed when
    torch.compile traces the call (the probe runs then, outside the graph) and kept in the graph
    as a constant."""
    return kernels.training(dtype, E, Ev, n, n).blocked


# torch.compiler.assume_constant_result(_blocked_in_graph), without importing torch._dynamo
# (1.2 s) with attnlab: this is all it does (tests/test_dispatch_cpu_flash.py checks that).
_blocked_in_graph._dynamo_marked_constant = True


def _trains_16bit(query, key, value) -> bool:
    return query.dtype in LOW_PRECISION and _needs_grad(query, key, value)


def _trains_chosen(query, key, value) -> bool:
    """Training whose CPU kernel the dispatch chooses (:func:`attnlab.kernels.choice.chooses`)."""
    return _needs_grad(query, key, value) and kernels.choice.chooses(query.dtype)


def _choose(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: torch.Tensor | None,
    alignment: str | None,
    dropout_p: float,
    return_weights: bool | str,
    value: torch.Tensor | None = None,
    structure=(None, None),
    *,
    why: bool = True,
    triton: bool = True,
    scale: float | None = None,
) -> Dispatch:
    """The path of a call; ``why=False`` skips writing the fused path's reasons (hot path)."""
    if not query.numel() or not key.numel():  # (an empty B, H, L or E empties the query)
        return Dispatch(
            "eager",
            (
                f"an empty dimension (query {tuple(query.shape)}, key "
                f"{tuple(key.shape)}): nothing to fuse",
            ),
        )
    if return_weights and dropout_p > 0:
        return Dispatch(
            "eager", ("return_weights with dropout -- the weights must be the dropped ones",)
        )
    if _transforms.math_backend_only():
        return Dispatch(
            "eager",
            (
                "torch's sdpa_kernel allows its math backend only: the readable formula (torch "
                "ops, differentiable twice), not attnlab's kernels or torch's fused ones",
            ),
        )
    transforms = _transforms.active()  # torch.func's: attnlab's own kernels stand aside
    kernel = dropout_p > 0 or query.is_cpu and _trains_chosen(query, key, value)  # (cpu_flash)
    if _transforms.readable_only(transforms) or (
        transforms
        and (return_weights or kernel and transforms != {"grad"})  # (cpu_flash takes one grad)
    ):
        return Dispatch(
            "eager",
            (
                f"under torch.func ({', '.join(sorted(transforms))}): the readable formula, "
                "which every transform takes (attnlab's kernels fill fresh tensors in place)",
            ),  # fmt: skip
        )
    grad = return_weights and _needs_grad(query, key, value, attn_mask)
    if grad and _exporting():  # (export runs its no_grad forward as the graph: no gradients)
        return Dispatch(
            "eager",
            (
                "return_weights with autograd under torch.export: the readable formula, whose "
                "gradients an exported program keeps",
            ),  # fmt: skip
        )
    native = None  # why the C++ kernel's blocks do not train 16-bit weights here, if they do not
    if grad and query.dtype not in GRAD_WEIGHTS_DTYPES:
        native = _native_weights_grad(query, key, value, attn_mask)
    if grad and (native is not None or _needs_grad(attn_mask)):
        return Dispatch(
            "eager",
            (
                f"return_weights with autograd for {query.dtype}"
                + (" and a mask that takes gradients" if _needs_grad(attn_mask) else "")
                + " -- the blocked weights backward takes float32/float64 (16 bits: the C++ "
                f"kernel's blocks, {native or 'where they serve'}) and a constant mask",
            ),
        )
    # traced (torch.compile, torch.export): torch's ops, which the graph can hold
    if (
        triton
        and (return_weights or structure != (None, None))
        and not torch.compiler.is_compiling()
        and not transforms
    ):
        flex = None  # why FlexAttention does not serve key padding here
        if structure[0] is not None and not return_weights:
            flex = flex_padding.unfit(query, key, value, *structure, dropout_p, return_weights)
            if flex is None:  # (its line written only when asked: the hot path skips it)
                said = (flex_padding.describe(query, key, alignment),) if why else ()
                return Dispatch("flex", said)
        training = _needs_grad(query, key, value, attn_mask)
        unfit = _triton.sdpa_serves(
            query, structure, return_weights, training, alignment
        ) or _triton.unfit(query, key, value, attn_mask, dropout_p, training, return_weights)
        if unfit is None:
            said = _triton.describe(
                query, key, return_weights, *structure, training, value, attn_mask, alignment
            )
            return Dispatch(
                "triton", (said, *(() if flex is None else (f"not FlexAttention: {flex}",)))
            )
        if why:  # say why attnlab's own kernels do not serve this call
            chosen = _choose(
                query,
                key,
                attn_mask,
                alignment,
                dropout_p,
                return_weights,
                value,
                triton=False,
                scale=scale,
            )
            return Dispatch(chosen.path, (*chosen.reasons, f"not the Triton kernels: {unfit}"))
    if return_weights and not why:
        return _WEIGHTS
    if return_weights:
        H, Hkv = query.shape[1], key.shape[1]
        batches, heads, rows = block_shape(
            H, query.shape[2], key.shape[2], query.element_size(), G=H // Hkv if Hkv else 1,
            B=query.shape[0],
        )  # fmt: skip
        what = "averaged over heads" if return_weights == "average" else "per head"
        backward = ""
        if grad and return_weights == "average":
            backward = (
                "; with autograd: saves Q, K, V and each row's max and log-sum, the backward "
                "recomputes each block's weights"
            )
        elif grad:
            backward = "; with autograd: the backward reads the returned weights, block by block"

        value = key if value is None else value
        kind, why_not = weights_path(query, key, value, attn_mask)
        if kind == "native":
            if grad:
                backward = (
                    "; with autograd: the backward by the same kernel's at::bmm blocks, the "
                    "weights' gradient added to dO V^T"
                )
            said = (
                f"weights ({what}) and output computed together by the "
                f"{kernels.describe(query, key, value, alignment, weights=return_weights)}"
                f"{backward}"
            )
        elif kind == "one block":
            group = f", each kv group's {H // Hkv} query heads as rows of its kv head"
            said = (
                f"weights ({what}) and output computed together in one block (the whole "
                f"(B, H, L, S) scores{group if Hkv != H else ''}), written in place{backward}"
            )
        else:
            said = (
                f"weights ({what}) and output computed together in blocks of {heads} head(s) "
                f"x {rows} query rows in torch ops (not the C++ blocked kernel: "
                f"{why_not}), written in place: "
                f"extra memory one block, not (B, H, L, S){backward}"
            )
        return Dispatch("weights", (said,))
    measured = None  # why torch's kernel trains this call, when measured faster
    if query.is_cpu and (dropout_p > 0 or _trains_chosen(query, key, value)):
        # Measured in benchmarks/bench_core.py (--only flash), on an AMX Xeon: the blocked
        # kernel (C++) runs dropout at 0.16-0.22x torch's time in float32 (0.07-0.10x in
        # bfloat16) and 1/6 its memory. Which trains 16-bit attention faster depends on the
        # CPU: measured once per process (attnlab.kernels.choice). float32 training keeps
        # torch's kernel unless ATTNLAB_CPU_TRAINING_KERNEL=attnlab (a choice measured per
        # process would let a resumed float32 run differ in the last bits). A compiled
        # graph holds the kernel as an operator (attnlab::cpu_flash); the choice is made when
        # the graph is traced (from fixed sizes). An exported program keeps torch's ops (it
        # must load without attnlab).
        unfit = kernels.supports(query, key, value, attn_mask, dropout_p)
        if _exporting():
            unfit = "under torch.export (an exported program keeps torch's ops)"
        if dropout_p > 0:
            said = (
                "dropout_p > 0 on CPU: torch's fused CPU kernel has no dropout (its math path "
                "is slower and holds (B, H, L, S))"
            )
            if unfit is None:  # (its tiling described only when asked: the hot path and a
                # traced graph do not build it, which reads the CPU's flags for bf16 products)
                tiling = (kernels.describe(query, key, value, alignment),) if why else ()
                return Dispatch("cpu_flash", (said, *tiling))
            return Dispatch("eager", (said, f"attnlab's blocked kernel does not serve: {unfit}"))
        Ev = query.shape[-1] if value is None else value.shape[-1]
        sizes = (query.shape[-1], Ev, query.shape[-2], key.shape[-2])  # E, Ev, L, S
        if unfit is None and torch.compiler.is_compiling():
            E, Ev, L, S = sizes  # (symbolic ones: head sizes specialised, lengths by class)
            n = kernels.choice.length_class(L, S)
            # (operator.index, not int(): dynamo makes a symbolic size a number with it)
            if _blocked_in_graph(query.dtype, operator.index(E), operator.index(Ev), n):
                return Dispatch("cpu_flash", ("training, chosen when traced",))
        elif unfit is None:
            choice = kernels.training(query.dtype, *sizes)
            said = f"{query.dtype} with autograd on CPU: the faster kernel here ({choice.why})"
            if choice.blocked:
                tiling = (kernels.describe(query, key, value, alignment),) if why else ()
                return Dispatch("cpu_flash", (said, *tiling))
            measured = said
    if not why:
        return _FUSED
    reasons = ["torch F.scaled_dot_product_attention"]
    if measured:
        reasons.append(measured)
    if _bias_wider(query, attn_mask):
        eps = torch.finfo(query.dtype).eps
        reasons.append(
            f"a {attn_mask.dtype} mask with {query.dtype} inputs: computed in float32 (the "
            f"bias rounded to {query.dtype} would move by up to |bias| * {eps / 2:g})"
        )
    H, Hkv = query.shape[1], key.shape[1]
    if Hkv != H and query.is_cpu and _trains_16bit(query, key, value):
        reasons.append(
            f"grouped-query heads H={H}, Hkv={Hkv}: kv heads repeated (torch's CPU backward with "
            "enable_gqa sums a group's dK, dV in 16 bits)"
        )
    elif Hkv != H and _fold_applies(query, key, attn_mask, alignment, scale, dropout_p):
        reasons.append(
            f"grouped-query heads H={H}, Hkv={Hkv}, one query row: each group's {H // Hkv} "
            "heads as rows of its kv head (one read of each kv head)"
        )
    elif Hkv != H:
        reasons.append(f"grouped-query heads H={H}, Hkv={Hkv} (enable_gqa)")
    L, S = query.shape[-2], key.shape[-2]
    if alignment is not None and attn_mask is None and scale is not None and scale <= 0:
        reasons.append(
            f"{alignment} causal passed as a bool mask (torch's is_causal gives NaN for a "
            f"scale <= 0, here {scale:g})"
        )
    elif alignment is not None and L == S and attn_mask is None:
        reasons.append("is_causal (L == S: top-left and bottom-right coincide)")
    elif alignment == "top_left" and attn_mask is None:
        reasons.append("is_causal (top-left)")
    elif alignment == "bottom_right" and L == 1:
        reasons.append("bottom-right causal with one query sees every key: no mask needed")
    elif alignment is not None:
        reasons.append(f"{alignment} causal with L={L}, S={S} passed as a bool mask")
    if attn_mask is not None and not query.is_cpu:
        reasons.append("fully masked rows zeroed after the kernel")
    return Dispatch("fused", tuple(reasons))


def explain(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    is_causal: bool | str = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool | str = False,
) -> Dispatch:
    """Which path :func:`scaled_dot_product_attention` takes for these inputs, and why (its
    checks, and its casts under ``torch.autocast``, included: bad inputs raise as the call)."""
    _, q, k, v, mask, _, alignment, structure, scale, dropout_p = _prepared(
        query, key, value, attn_mask, is_causal, scale, dropout_p, return_weights
    )
    if q.shape[1] == 0:
        return Dispatch(
            "empty", ("H = 0 heads: the empty output (and weights) are made directly",)
        ).noting_assumption()
    return _choose(
        q, k, mask, alignment, dropout_p, return_weights, v, structure, scale=scale
    ).noting_assumption()


def _prepared(query, key, value, attn_mask, is_causal, scale, dropout_p, return_weights):
    """What :func:`attention_with` and :func:`explain` both do before choosing a path: the
    inputs checked and cast (autocast) -> ``(query, q, k, v, mask, restore, alignment,
    structure, scale, dropout_p)``, q, k, v and mask as (B, H, L, E)-layout views, ``restore``
    giving an output the user's layout back, scale and dropout_p as Python numbers. (A plain
    tuple: this runs at every call.)"""
    query, key, value = autocast_inputs(query, key, value)
    check_qkv(query, key, value)
    dropout_p = check_dropout(dropout_p)
    scale = check_scale(scale)
    if return_weights not in (False, True, "average"):
        raise ValueError(
            f"return_weights must be False, True (per head) or 'average' (mean over heads); "
            f"got {return_weights!r}."
        )
    L, S = query.shape[-2], key.shape[-2]
    alignment = causal_alignment(is_causal, L, S)
    if attn_mask is not None:
        scores_shape = (*query.shape[:-2], L, S)
        check_mask(attn_mask, scores_shape, device=query.device)
        check_bias_range(attn_mask, query.dtype)
    structure = _triton.structure_of(attn_mask, query, key)  # padding as lengths, windows
    if attn_mask is not None:
        attn_mask = unwrap(attn_mask)  # a masks.Mask is a bool tensor that prints as a picture
    q, k, v, mask, restore = as_4d(query, key, value, attn_mask)
    return query, q, k, v, mask, restore, alignment, structure, scale, dropout_p


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    is_causal: bool | str = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool | str = False,
    weights_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention with grouped-query heads, masks, dropout and weights.

    Math:
        .. math:: \\text{Attention}(Q, K, V) = \\text{softmax}\\Big(\\frac{Q K^\\top}{\\sqrt{E}}
                  + M\\Big) V

        with ``M`` 0 where attending is allowed and ``-inf`` where it is not. Query rows that
        may attend no key at all get weights 0 and output 0.

    Grouped-query attention: key/value may have Hkv heads for H query heads (Hkv divides H);
    query head ``h`` reads key/value head ``h // (H // Hkv)``. Hkv == 1 is multi-query
    attention. See :mod:`attnlab.functional._layout` for the picture.

    Args:
        query: (B, H, L, E); (B, L, E) and (L, E) are accepted too.
        key: (B, Hkv, S, E), with as many dims as ``query``.
        value: (B, Hkv, S, Ev).
        attn_mask: bool (True = may attend) or float (additive bias), broadcastable to
            (B, H, L, S). May be combined with ``is_causal``.
        is_causal: False; True (requires L == S); ``"top_left"`` or ``"bottom_right"`` to say
            how queries align with keys when L != S (see :mod:`attnlab.masks`).
        scale: multiplier of the scores; ``1/sqrt(E)`` by default. ``scale=1.0`` gives plain
            dot-product attention.
        dropout_p: probability of zeroing an attention weight (survivors are scaled by
            1 / (1 - p); on attnlab's CPU kernel by 1 / rho, rho the exact keep rate of its
            draws, 1 - p rounded to 2^-16). Applied whenever > 0: pass 0 at evaluation time.
            Reproducible under ``torch.manual_seed`` for one path; the paths draw different
            masks (torch's kernel, attnlab's C++ kernel, its torch-ops twin under
            ``torch.func``), so the same seed through another path drops other weights.
        return_weights: also return the attention weights: ``True`` per head (B, H, L, S),
            ``"average"`` averaged over the heads (B, L, S). With dropout they are the dropped
            weights that produced the output. Under ``torch.no_grad()`` the output and the
            weights are computed together in blocks, at bounded extra memory (see
            :func:`explain`).
        weights_out: a contiguous tensor of the returned weights' shape and the inputs' dtype
            and device, into which the weights are written (and which is returned): reuse one
            across calls to spare the page faults of a fresh (B, H, L, S) result. Inference
            only (under ``torch.no_grad()``, no dropout).

    Returns:
        The (B, H, L, Ev) output, or ``(output, weights)`` if ``return_weights``.

    Raises:
        TypeError: non-floating inputs, mixed dtypes, an integer mask.
        ValueError: mismatched batch/head/length/width dims, Hkv not dividing H, a mask that
            does not broadcast, dropout_p outside [0, 1), is_causal=True with L != S.

    References:
        Vaswani et al., "Attention Is All You Need", 2017; Ainslie et al., "GQA", 2023.
        Oracle: :func:`attnlab.reference.scaled_dot_product_attention`.

    Example:
        >>> q = torch.randn(2, 8, 5, 16)                 # B=2, H=8, L=5, E=16
        >>> k, v = torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 32)   # Hkv=2, S=7, Ev=32
        >>> out, w = scaled_dot_product_attention(q, k, v, is_causal="bottom_right",
        ...                                       return_weights=True)
        >>> out.shape, w.shape
        (torch.Size([2, 8, 5, 32]), torch.Size([2, 8, 5, 7]))
    """
    if (
        attn_mask is None
        and return_weights is False
        and weights_out is None
        and (dropout_p.__class__ is float or dropout_p.__class__ is int)
        and dropout_p == 0
    ):
        out = _plain_fused(query, key, value, is_causal, scale)
        if out is not None:
            return out
    return attention_with(
        query,
        key,
        value,
        attn_mask,
        is_causal=is_causal,
        scale=scale,
        dropout_p=dropout_p,
        return_weights=return_weights,
        weights_out=weights_out,
    )


def _plain_fused(query, key, value, is_causal, scale) -> torch.Tensor | None:
    """The output of the commonest calls (no mask, dropout or weights), or None for any other.

    The hot path: these calls take the fused path, decided here in a few tests instead of the
    general route's (:func:`_prepared`, :func:`_choose`, :func:`_fused`: ~2-3 us a call at tiny
    shapes, measured with ``benchmarks/bench_core.py --only overhead``). Served: 4-D inputs that
    :func:`check_qkv` accepts, on the CPU or one CUDA device, none empty; ``is_causal`` False,
    or True with L == S; ``scale`` None or a positive float; outside ``torch.autocast``, traced
    graphs, ``torch.func`` transforms and DEBUG logging of ``attnlab.dispatch``; not training
    on the CPU whose kernel is chosen by measurement (:func:`_trains_chosen`). Any other call
    returns None and takes the general route, whose checks raise and whose dispatch logs, with
    the same result: the same torch call and the same NaN rule
    (tests/test_dropout_and_dispatch.py compares the two)."""
    if _any_autocast is None or _any_autocast() or torch.compiler.is_compiling():
        return None
    if _transforms.active():  # (torch.func: see _choose)
        return None
    shapes = qkv_fit_shapes(query, key, value)
    if shapes is None:
        return None
    (B, H, L, E), (_, Hkv, S, _) = shapes
    if not (B and H and L and E and S):  # (empty: the eager path, or no heads)
        return None
    if is_causal is True:
        if L != S:  # (refused by causal_alignment)
            return None
    elif is_causal is not False:  # (alignments, and what causal_alignment refuses)
        return None
    if scale is not None and not (scale.__class__ is float and 0.0 < scale < inf):
        return None  # (a scale <= 0 makes causal a mask; check_scale refuses the rest)
    if query.is_cpu and _trains_chosen(query, key, value):
        return None
    if logger.isEnabledFor(logging.DEBUG):
        return None
    out = _fused(query, key, value, None, "top_left" if is_causal else None, scale, 0.0)
    if nonfinite._assumed:  # (propagate_nonfinite's own test, without the call)
        return out
    return propagate_nonfinite(query, key, value, out)[0]


def _native_weights_grad(query, key, value, mask) -> str | None:
    """None when the C++ kernel's blocks take weights with autograd in this (16-bit) dtype,
    else why not: the torch-ops weights blocks train float32/float64 only."""
    kind, why = weights_path(query, key, key if value is None else value, mask)
    if kind == "one block":
        return "not here: the scores fit one block, which the torch-ops blocks take"
    return None if kind == "native" else f"not here: {why}"


def attention_with(
    query,
    key,
    value,
    attn_mask=None,
    *,
    is_causal=False,
    scale=None,
    dropout_p=0.0,
    return_weights=False,
    weights_out=None,
    kv_finite: torch.Tensor | None = None,
):
    """:func:`scaled_dot_product_attention`, plus what a caller knows of its inputs:
    ``kv_finite`` (B, Hkv) bool, whether each head's keys and values are free of NaN and inf
    (a KV cache's :meth:`~attnlab.cache.Cache.kv_finite`), so that the NaN policy screens only
    the query instead of reading the whole cache again at every decode step."""
    query, q, k, v, mask, restore, alignment, structure, scale, dropout_p = _prepared(
        query, key, value, attn_mask, is_causal, scale, dropout_p, return_weights
    )
    if kv_finite is not None and (
        key.dim() != 4 or kv_finite.shape != k.shape[:2] or kv_finite.dtype != torch.bool
    ):
        raise ValueError(
            f"kv_finite must be (B, Hkv) = {tuple(k.shape[:2])} bool for 4-D key/value; got "
            f"{tuple(kv_finite.shape)} {kv_finite.dtype} for key {tuple(key.shape)}. Fix: "
            f"kv_finite.bool(), or a cache's kv_finite()."
        )
    buffer = None  # the caller's weights_out, as a (B, H or 1, L, S) view
    if weights_out is not None:
        buffer = _check_weights_out(weights_out, query, q, k, v, return_weights, dropout_p)
    if q.shape[1] == 0:  # H = 0 (and Hkv = 0): no heads, nothing to compute
        out = q.new_zeros(*q.shape[:-1], v.shape[-1])
        heads = 1 if return_weights == "average" else 0
        weights = q.new_zeros(q.shape[0], heads, q.shape[-2], k.shape[-2])
        return _finish(out, weights, return_weights, restore, query.dim())

    log = not torch.compiler.is_compiling() and logger.isEnabledFor(logging.DEBUG)
    decision = _choose(
        q, k, mask, alignment, dropout_p, return_weights, v, structure, why=log, scale=scale
    )
    if log:
        logger.debug("scaled_dot_product_attention %s", decision)  # (dynamo cannot trace logging)

    if scale is None and decision.path != "fused":  # (fused: torch's default, 1/sqrt(E) too)
        scale = 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0  # E = 0: every score is 0
    weights, screened = None, False
    # torch's 16-bit products on the CPU (oneDNN) with an odd inner dimension carry one row's
    # NaN or inf into the next row (torch.bmm itself, on an AMX Xeon): where they serve a call
    # that takes no gradient, the rule's rows are found first and the rest computed from finite
    # inputs (what a row the rule leaves alone reads is finite)
    first = (
        decision.path in ("weights", "eager")
        and q.is_cpu
        and q.dtype in (torch.bfloat16, torch.float16)
        and not _needs_grad(q, k, v)
    )
    bad = rows_to_fill(q, k, v, kv_finite) if first else None
    if bad is not None:
        q, k, v = (t.nan_to_num(0.0, 0.0, 0.0) for t in (q, k, v))
    if decision.path == "fused":
        out = _fused(q, k, v, mask, alignment, scale, dropout_p)
    elif decision.path == "triton":
        out, weights, screened = _triton.run(
            q, k, v, mask, alignment, scale, return_weights, structure, buffer, kv_finite
        )
    elif decision.path == "flex":
        out = flex_padding.attention(q, k, v, structure[0], alignment, scale)
    elif decision.path == "cpu_flash":
        out = kernels.flash_attention(q, k, v, mask, alignment, scale, dropout_p)
    elif decision.path == "weights" and _needs_grad(q, k, v):
        out, weights = WeightsAttention.apply(
            q, k, v, mask, alignment, scale, return_weights == "average"
        )
    elif decision.path == "weights":
        out, weights = weights_in_blocks(
            q, k, v, mask, alignment, scale, return_weights == "average", buffer
        )
    else:
        out, weights = _eager(q, k, v, mask, alignment, scale, dropout_p)
        if return_weights == "average":
            weights = weights.mean(1, keepdim=True)
    # NaN/inf in the inputs propagate (no path may turn them into numbers): see nonfinite_rows
    if first and bad is not None:
        out, weights = fill_rows(out, weights if return_weights else None, bad)
    elif not screened and not first:
        weights = weights if return_weights else None
        out, weights = propagate_nonfinite(q, k, v, out, weights, kv_finite)
    if buffer is not None:
        if weights is not buffer:  # (an empty dimension took the eager path)
            buffer.copy_(weights)
        return _finish(out, None, False, restore, query.dim()), weights_out
    return _finish(out, weights, return_weights, restore, query.dim())


def _finish(out, weights, return_weights, restore, ndim):
    """(B, H, L, Ev) output and (B, H or 1, L, S) weights -> the user's layout and return."""
    if not return_weights:
        return out if ndim == 4 else restore(out)
    if return_weights == "average":  # (B, 1, L, S) -> (B, L, S), in the user's layout
        return restore(out), restore(weights).squeeze(-3) if ndim >= 4 else restore(weights)
    return restore(out), restore(weights)


def _eager(q, k, v, mask, alignment, scale, dropout_p):
    """The readable path: (B, H, L, E), (B, Hkv, S, E), (B, Hkv, S, Ev) -> out, weights."""
    L, S = q.shape[-2], k.shape[-2]
    mask = with_causal(mask, alignment, L, S, q.device)
    scores = grouped_scores(q * scale, k)  # (B, H, L, S)
    weights = masked_softmax(scores, mask)  # float32 accumulation for 16-bit inputs
    if dropout_p > 0:
        weights = F.dropout(weights, dropout_p)
    return grouped_weighted_sum(weights, v), weights  # (B, H, L, Ev), (B, H, L, S)


def _check_weights_out(buffer, query, q, k, v, return_weights, dropout_p) -> torch.Tensor:
    """Validate a caller's weights buffer; return it as a (B, H or 1, L, S) view."""
    B, H, L, _ = q.shape
    S = k.shape[-2]
    heads = 1 if return_weights == "average" else H
    average = return_weights == "average" and query.dim() >= 4  # (B, L, S): no heads dim
    shape = (*query.shape[:-3], L, S) if average else (*query.shape[:-1], S)
    if not return_weights:
        raise ValueError("weights_out is only used with return_weights=True or 'average'.")
    if dropout_p > 0 or _needs_grad(query, k, v):
        raise ValueError(
            "weights_out is for inference: with dropout or autograd the weights are a new "
            "tensor of the graph. Fix: call under torch.no_grad() with dropout_p=0, or drop "
            "weights_out."
        )
    if (
        not isinstance(buffer, torch.Tensor)
        or buffer.shape != shape
        or (
            buffer.dtype != query.dtype
            or buffer.device != query.device
            or not buffer.is_contiguous()
        )
    ):
        got = (
            (tuple(buffer.shape), buffer.dtype, str(buffer.device))
            if isinstance(buffer, torch.Tensor)
            else type(buffer).__name__
        )
        raise ValueError(
            f"weights_out must be a contiguous {query.dtype} tensor of shape {shape} on "
            f"{query.device}; got {got}. Fix: allocate it once with "
            f"torch.empty({shape}, dtype={query.dtype}) and pass it at every call."
        )
    return buffer.view(B, heads, L, S)


def _torch_is_causal(alignment, L: int, S: int, mask, scale) -> bool:
    """Whether the fused call hands causality to torch's ``is_causal`` (top-left, no mask, a
    positive scale) rather than a bool mask or nothing."""
    if alignment == "bottom_right" and L == S:
        alignment = "top_left"  # the same triangle
    return alignment == "top_left" and mask is None and not (scale is not None and scale <= 0)


def _fold_applies(q, k, mask, alignment, scale, dropout_p) -> bool:
    """Whether the fused call attends the G query heads of a kv group as G rows of one head
    (grouped-query heads assumed): on the CPU, one query row (L = 1), a mask the same for every
    head and row (sizes 1 there), no dropout (its draws are per head), and no top-left triangle
    handed to torch (it would apply to the folded rows)."""
    if not q.is_cpu or q.dim() != 4 or q.shape[-2] != 1 or dropout_p:
        return False
    if _torch_is_causal(alignment, 1, k.shape[-2], mask, scale):
        return False
    return mask is None or all(mask.shape[d] == 1 for d in (-2, -3) if mask.dim() >= -d)


def _bias_wider(q, mask) -> bool:
    """Whether ``mask`` is a float32/float64 bias for 16-bit inputs (the fused call computes in
    float32 then: see :func:`_fused`)."""
    dtype = getattr(mask, "dtype", None)  # (a structured mask is bool)
    return dtype in (torch.float32, torch.float64) and q.dtype in (torch.bfloat16, torch.float16)


def _fused(q, k, v, mask, alignment, scale, dropout_p):
    """torch's fused kernel, with attnlab's mask and causal semantics. ``scale`` None is
    torch's default, ``1 / sqrt(E)`` computed in double as attnlab's other paths do (passing
    the number instead costs torch ~0.5 us more a call at tiny shapes, measured)."""
    if _bias_wider(q, mask):
        # a float32 bias with 16-bit inputs: rounded to their dtype it would move by up to
        # |bias| 2^-8 (bfloat16: 1 at an ALiBi bias of 255: output errors 100x the other paths',
        # which add it in float32); torch's kernel takes a mask of the inputs' dtype only
        out = _fused(q.float(), k.float(), v.float(), mask.float(), alignment, scale, dropout_p)
        return out.to(q.dtype)
    torch_causal = False
    if alignment is not None:
        L, S = q.shape[-2], k.shape[-2]
        # (torch's is_causal gives NaN for a scale <= 0: -inf, then scaled)
        torch_causal = _torch_is_causal(alignment, L, S, mask, scale)
        if alignment == "bottom_right" and L == S:
            alignment = "top_left"  # the same triangle: let torch use its is_causal fast path
        if alignment == "bottom_right" and L == 1:
            alignment = None  # the last position sees every key
        if not torch_causal:
            mask = with_causal(mask, alignment, L, S, q.device)
    if mask is not None and mask.is_floating_point() and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)
    gqa = False  # a Python bool also under symbolic shapes (the branch is a guard)
    unfold = None  # (the output's shape, when the group's rows were folded into one head)
    if k.shape[1] != q.shape[1] and q.is_cpu and _trains_16bit(q, k, v):
        # torch's CPU backward with enable_gqa sums a group's dK, dV in 16 bits: 1.5-2x the
        # naive formula's error (median, bf16, G = 4). Repeated kv heads (a copy of K and V,
        # G times) let autograd sum the group once.
        G = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    elif k.shape[1] != q.shape[1]:
        gqa = True
    if gqa and _fold_applies(q, k, mask, alignment, scale, dropout_p):
        # one query row per head (decode): a group's G rows read their kv head once, as G rows
        # of one head -- (B, H, 1, E) -> (B, Hkv, G, E). torch's CPU kernel with enable_gqa
        # took 1.3-3x longer (measured: (4, 9, 3, 256, 64) to (1, 32, 8, 4096, 128), 1 and 2
        # threads)
        B, H, _, E = q.shape
        q, gqa, unfold = q.reshape(B, k.shape[1], H // k.shape[1], E), False, (B, H, 1, -1)
    # only the keywords that differ from torch's defaults: each one torch parses costs ~0.1 us
    # a call (measured at tiny shapes)
    kw = {}
    if mask is not None:
        kw["attn_mask"] = mask
    if dropout_p:
        kw["dropout_p"] = dropout_p
    if torch_causal:
        kw["is_causal"] = True
    if scale is not None:
        kw["scale"] = scale
    if gqa:
        kw["enable_gqa"] = True
    out = F.scaled_dot_product_attention(q, k, v, **kw)
    if unfold is not None:
        return out.reshape(unfold)  # (B, Hkv, G, Ev) -> (B, H, 1, Ev); (CPU: dead rows are 0)
    if mask is not None and not q.is_cpu:
        # CPU's kernel returns 0 for rows with no attendable key; others may return NaN.
        alive = (mask if mask.dtype == torch.bool else mask > float("-inf")).any(-1, keepdim=True)
        out = out.masked_fill(~alive, 0.0)
    return out
