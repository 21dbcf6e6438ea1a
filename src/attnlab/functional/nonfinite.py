"""The NaN rule: a NaN or an infinity in the inputs is never turned into a number.

Every attention path (fused, weights, Triton, blocked CPU, eager, additive, hard) follows one
rule (docs/conventions.md), here in one place:

* output row ``i`` (and its weights row) is NaN when query row ``i`` holds a NaN or an inf;
* every output row of a head is NaN when any key or value of the kv head it reads does --
  masked or not, as in torch's own kernels: a mask does not clean a NaN.

What it costs. Eagerly on CPU, one sum per input screens first (:func:`all_finite`): only a
non-finite input pays for the row-by-row check (:func:`nonfinite_rows`). That screen is ~6 us
of a call at tiny shapes (three sums and three host reads; torch's SDPA itself takes ~5 us
there) and one read of each input. On a GPU and inside compiled graphs, where a data-dependent
branch would stall the device, the row check always runs, with no host synchronisation: one
more read of the three inputs, in a few small torch kernels inside a graph, in two Triton
kernels eagerly on a GPU (:mod:`attnlab.kernels.triton_nonfinite`). Measured on an H200 in
torch ops (benchmarks/results/h200-2026-11-26, bf16, per call): ~175 us of host time at
(1, 8, 64, 64), ~105 us at (16, 16, 512, 64), ~0.5 ms (a quarter of the attention) at
(4, 32, 4096, 128); the Triton kernels' figures are still to be taken.

Who knows the inputs are finite (a model that checks its activations, a serving loop fed by a
checked embedding) can say so with :class:`assume_finite`: the screen and the row check are
skipped, and each call costs what its kernel costs. Non-finite inputs then give whatever the
kernel gives, which may be numbers (a NaN key under a mask, an inf key that scores ``-inf``).
This is scikit-learn's ``assume_finite`` and SciPy's ``check_finite=False``: a promise made by
the caller, off by default.
"""

from __future__ import annotations

import math

import torch

from attnlab.functional import _transforms

inf = float("inf")

_assumed = False  # process-wide, as torch.backends' flags (a compiled graph guards on it)


class assume_finite:
    """Promise that attention inputs hold no NaN and no inf, so attnlab does not check them.

    Like ``torch.set_grad_enabled``: calling it sets the mode for the process; used in a
    ``with`` statement it sets the mode for the block and restores the previous one after::

        with attnlab.functional.assume_finite():   # these calls skip the NaN screen
            out = model(tokens)
        attnlab.functional.assume_finite(True)     # from now on, in this process
        attnlab.functional.assume_finite(False)    # back to the NaN rule (the default)

    What is skipped: the NaN rule's screen of query, key and value (on CPU, ~6 us a call at
    tiny shapes, see :mod:`attnlab.functional.nonfinite`) and, on a GPU and in compiled graphs,
    its row check (a read of each input in a few kernels). Everything else is unchanged:
    masks, dead rows (weights 0, output 0), the argument checks. A KV cache still records
    which slots it was given NaN or inf in (:meth:`attnlab.cache.Cache.kv_finite`), so a later
    call without the promise still makes their heads NaN.

    If the promise is broken, a non-finite input gives whatever the kernel gives: NaN rows
    where the NaN reaches the arithmetic, but numbers where a mask or a ``-inf`` score keeps it
    out (a NaN key in a masked position, an inf key that scores ``-inf`` for some rows).
    :func:`is_finite_assumed` says which mode is on; :func:`attnlab.functional.explain` says it
    too. The mode is process-wide (all threads), as torch.backends' flags; a compiled graph is
    traced for the mode it was first called in and recompiled when the mode changes, while an
    exported program (``torch.export``, which keeps no guards) keeps the mode it was exported
    in.

    Args:
        mode: True (the default) to skip the checks, False to apply the NaN rule.

    Raises:
        TypeError: ``mode`` is not a bool.

    Example:
        >>> q = k = v = torch.randn(1, 2, 4, 8)
        >>> with assume_finite():
        ...     out = attnlab.functional.scaled_dot_product_attention(q, k, v)
        >>> is_finite_assumed()
        False
    """

    def __init__(self, mode: bool = True) -> None:
        global _assumed
        if not isinstance(mode, bool):
            raise TypeError(
                f"assume_finite(mode): mode must be True (skip the NaN screen) or False (apply "
                f"the NaN rule); got {mode!r}. Fix: pass a bool."
            )
        self.previous = _assumed
        _assumed = mode

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        global _assumed
        _assumed = self.previous


def is_finite_assumed() -> bool:
    """Whether :class:`assume_finite` is on: attention inputs are not checked for NaN/inf."""
    return _assumed


def nonfinite_rows(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_finite: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which output rows a NaN or an infinity reaches: (..., L, E), (..., S, *) -> (..., L, 1).

    Output row ``i`` is NaN when query row ``i`` holds a NaN or an inf, or when any key or
    value that its head reads does -- masked or not. 4-D grouped-query inputs: head ``h`` reads
    kv head ``h // G``; other leading dims broadcast.

    ``kv_finite`` (B, Hkv) bool, when given, is that verdict for key and value already (a KV
    cache checks each slot once, when it is written): K and V are then not read here.

    How: ``max |x|`` per query row and per kv head (one read of each input, no copy), their
    maximum per row (NaN and inf propagate through both, which cannot overflow), then one
    finiteness test: this runs at every traced or GPU call, so it is a few small kernels.
    Eagerly on a GPU (and under Triton's interpreter), 4-D inputs take two Triton kernels
    instead, the same verdict in one read of each input
    (:mod:`attnlab.kernels.triton_nonfinite`).
    """
    if not torch.compiler.is_compiling() and _kernels_serve(query, key, value):
        from attnlab.kernels import triton_nonfinite

        return triton_nonfinite.nonfinite_rows(query, key, value, kv_finite)
    return rows_in_torch_ops(query, key, value, kv_finite)


def rows_in_torch_ops(query, key, value, kv_finite=None) -> torch.Tensor:
    """:func:`nonfinite_rows` in torch ops: what compiled graphs, the CPU and inputs the
    kernels do not take run, and the readable reference the Triton kernels must equal."""
    rows = _max_abs(query, 1)  # (..., L, 1)
    if kv_finite is None:
        heads = torch.maximum(_max_abs(key, 2), _max_abs(value, 2))  # (..., 1, 1)
    else:
        heads = torch.where(kv_finite, 0.0, inf)[..., None, None]  # (B, Hkv, 1, 1)
    if query.dim() == 4 and key.dim() == 4 and 0 < key.shape[1] != query.shape[1]:
        B, H, L, _ = query.shape
        Hkv = key.shape[1]  # (B, H, L, 1) -> (B, Hkv, G, L, 1): a view
        reach = torch.maximum(rows.view(B, Hkv, H // Hkv, L, 1), heads[:, :, None])
        return ~torch.isfinite(reach.view(B, H, L, 1))
    return ~torch.isfinite(torch.maximum(rows, heads))


def _kernels_serve(query, key, value) -> bool:
    """Whether :mod:`attnlab.kernels.triton_nonfinite` takes these inputs (imported only then)."""
    from attnlab.kernels import _triton

    if query.dim() != 4 or _triton.unfit(query, key, value) is not None:
        return False
    from attnlab.kernels import triton_nonfinite

    return triton_nonfinite.unfit(query, key, value) is None


def propagate_nonfinite(query, key, value, out, weights=None, kv_finite=None):
    """``out`` (..., L, Ev) and ``weights`` (..., H or 1, L, S) with :func:`nonfinite_rows` NaN.

    Results that need no gradient are filled in place. ``kv_finite``: see
    :func:`nonfinite_rows` (with it, only the query is screened: a decode step against a cache
    reads the cache once, for attention itself).
    """
    if _assumed:  # (rows_to_fill says so too; this spares a call on the hot path)
        return out, weights
    bad = rows_to_fill(query, key, value, kv_finite)
    if bad is None:
        return out, weights
    return fill_rows(out, weights, bad)


def fill_rows(out, weights, bad):
    """``out`` (..., L, Ev) and ``weights`` (..., H or 1, L, S) or None with the rows ``bad``
    (:func:`rows_to_fill`) NaN."""
    out = fill_nan(out, bad)
    if weights is not None:
        if weights.dim() >= 3 and bad.dim() >= 3 and weights.shape[-3] == 1 < bad.shape[-3]:
            bad = bad.any(-3, keepdim=True)  # weights averaged over heads: any head's row
        weights = fill_nan(weights, bad)
    return out, weights


def rows_to_fill(query, key, value, kv_finite=None) -> torch.Tensor | None:
    """The rows a path must make NaN (:func:`nonfinite_rows`), or None where there are none to
    look for: under :class:`assume_finite`, or where an eager CPU screen finds every input
    finite. Traced (``torch.compile``, ``torch.export``), batched by ``torch.func.vmap`` or on
    other devices the row check always runs (no data-dependent branch, no host sync)."""
    if _assumed:
        return None
    if _screens_eagerly(query):
        if kv_finite is not None:  # the caller vouched for K and V: screen the query only
            clean = all_finite(query) and bool(kv_finite.all())
        else:
            clean = all_finite(query, key, value)
        if clean:
            return None
    return nonfinite_rows(query, key, value, kv_finite)


def value_heads_to_fill(value: torch.Tensor, H: int) -> torch.Tensor | None:
    """The value side of the rule for attention over given scores: (B, Hkv, S, Ev) -> (B, H, 1,
    1) bool, the heads that read a NaN or an inf among their values (masked or not), or None
    where there is nothing to fill (as :func:`rows_to_fill`: under :class:`assume_finite`, or
    where an eager CPU screen finds ``value`` finite)."""
    if _assumed:
        return None
    if _screens_eagerly(value) and all_finite(value):
        return None
    heads = ~torch.isfinite(_max_abs(value, 2))  # (B, Hkv, 1, 1)
    return heads if value.shape[1] == H else heads.repeat_interleave(H // value.shape[1], 1)


def _screens_eagerly(t: torch.Tensor) -> bool:
    """Whether a call on ``t`` may screen its inputs with a host read first (:func:`all_finite`):
    eagerly on the CPU, outside traced graphs and ``vmap`` (whose values cannot be read)."""
    return t.is_cpu and not torch.compiler.is_compiling() and "vmap" not in _transforms.active()


def all_finite(*tensors: torch.Tensor) -> bool:
    """Whether no tensor holds a NaN or an inf (eager; reads each once, syncs with the host).

    A sum is non-finite when its tensor holds a NaN or an inf, or when finite values overflow
    (float16 from 65,504; float32 and bfloat16 from 3.4e38): only then does a min and max,
    which cannot overflow, decide. Each tensor is summed in its own dtype (torch accumulates
    16-bit sums in float32 and rounds once): ``sum(dtype=float32)`` first makes a float32 copy,
    5-27x slower from a million elements.
    """
    if math.isfinite(sum([t.sum().item() for t in tensors])):
        return True
    return all(math.isfinite(m.item()) for t in tensors if t.numel() for m in torch.aminmax(t))


def fill_nan(t: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """``t`` with NaN where ``bad`` (broadcast) is True; in place unless ``t`` needs gradients."""
    return (
        t.masked_fill(bad, float("nan")) if t.requires_grad else t.masked_fill_(bad, float("nan"))
    )


def _max_abs(x: torch.Tensor, dims: int) -> torch.Tensor:
    """max |x| over the last ``dims`` dims, kept as size-1 dims (0 where they are empty)."""
    reduced = tuple(range(-dims, 0))
    if any(x.shape[d] == 0 for d in reduced):
        return x.new_zeros(*x.shape[:-dims], *(1,) * dims)
    return max_abs(x, reduced, keepdim=True)


def max_abs(x: torch.Tensor, dim, keepdim: bool = False) -> torch.Tensor:
    """max |x| over ``dim`` (non-empty): NaN or inf exactly where x holds one there (the max
    propagates NaN; |x| cannot overflow).

    On the CPU ``abs()`` then ``amax()``: its inf-norm reduction is 1.5-10x slower there, though
    one pass (float32, 1 thread: 330 us against 35 at (4, 2, 128, 32) over the last dim; 11 ms
    against 2 at (1, 8, 2048, 128)). Elsewhere, and compiled, the inf-norm's single pass
    (``abs().amax()`` writes a copy first, one more kernel on a GPU).
    """
    if x.is_cpu and not torch.compiler.is_compiling():
        return x.abs().amax(dim, keepdim=keepdim)
    return torch.linalg.vector_norm(x, inf, dim=dim, keepdim=keepdim)
