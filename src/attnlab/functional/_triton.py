"""When :func:`scaled_dot_product_attention` runs attnlab's Triton kernels, and how.

The Triton path serves what torch's fused kernels do not (on CUDA; and on CPU tensors under
``TRITON_INTERPRET=1``, where the same kernel code runs in Triton's interpreter, so the tests
exercise it):

* **weights on demand** -- the forward kernel returns each row's log-sum-exp with the output,
  then a second kernel writes ``exp(s - lse)`` tile by tile, per head or averaged over heads
  (:mod:`attnlab.kernels.triton_attention`); a few query rows against a long cache take the
  split-key decode kernel, which returns the weights in the same pass
  (:mod:`attnlab.kernels.triton_decode`);
* **masks kept as structure** -- a mask from :func:`attnlab.masks.padding_mask` carries each
  batch row's key range, :func:`~attnlab.masks.document_mask` (packed sequences) each query
  row's, :func:`~attnlab.masks.sliding_window_mask` its band: the kernels skip the key blocks
  outside them instead of reading an (L, S) mask, forward and backward.

Weights with autograd, dropout, float64, a head dim over 256 or a mask that takes gradients
keep the existing paths; ``explain()`` says why.
"""

from __future__ import annotations

import torch

from attnlab import masks
from attnlab.kernels import _triton


def structure_of(mask, query: torch.Tensor, key: torch.Tensor):
    """(key_range, band) that a mask from :mod:`attnlab.masks` carries, when it applies to
    these inputs as built (a padding mask (B, 1, 1, S), a document mask or a sliding window
    (L, S)); (None, None) otherwise, and the mask is read as it is."""
    if mask is None:
        return None, None
    key_range, band = masks.structure(mask)  # (None, None) once the mask was changed in place
    if (key_range is None and band is None) or query.dim() != 4:
        return None, None
    B, L, S = query.shape[0], query.shape[-2], key.shape[-2]
    shape = tuple(mask.shape)
    if key_range is not None and key_range[0].dim() == 1:  # padding: one range per batch row
        return (
            (key_range, None) if shape == (B, 1, 1, S) and len(key_range[0]) == B else (None,) * 2
        )
    if shape[-2:] != (L, S) or any(n != 1 for n in shape[:-2]):
        return None, None
    if key_range is not None and tuple(key_range[0].shape) != (1, L):
        return None, None
    return key_range, band


# Devices on which torch's SDPA, given the dense (B, 1, 1, S) mask, serves key padding alone
# (no window, no documents, no weights) in training, rather than the Triton kernels. Measured
# as attnlab's fused call (which builds the mask it hands SDPA, and combines it with causality)
# against the kernels, bf16, lengths uniform in [L/2, L], at (8,16,1024,64), (4,32,4096,128)
# and (32,16,128,64), causal and not, on an H100 (benchmarks/results/h100-2026-11-28) and an
# H200 twice (h200-2026-11-26b, h200-2026-11-28):
# - forward+backward: the fused call took 0.62-1.01x the kernels' time, except causal at
#   (4,32,4096,128): 1.09-1.59x;
# - forward alone (no gradient): the fused call took 1.01-1.96x the kernels' time, every case.
# So the kernels serve padding without gradients, and causal padding from that length.
# (In 16 bits FlexAttention comes first, measured faster than both: kernels.flex_padding.)
# Windows and packed documents, which skip most blocks, always keep the kernels. (Not the
# interpreter's CPU tensors: the tests exercise the kernels there.)
SDPA_SERVES_PADDING_ON = ("cuda",)
KERNELS_TRAIN_CAUSAL_PADDING_FROM = 4096  # query rows


def sdpa_serves(q, structure, return_weights, training, alignment) -> str | None:
    """Why torch's SDPA with the materialised mask serves a structured mask here, or None."""
    key_range, band = structure
    if (
        return_weights
        or not training
        or band is not None
        or key_range is None
        or key_range[0].dim() != 1  # (packed documents: a range per query row)
        or q.device.type not in SDPA_SERVES_PADDING_ON
        or (alignment is not None and q.shape[-2] >= KERNELS_TRAIN_CAUSAL_PADDING_FROM)
    ):
        return None
    return (
        "key padding alone, in training: attnlab's fused call (torch's SDPA with the (B, 1, 1, "
        "S) mask) took 0.62-1.01x the time of attnlab's kernels forward and backward on an "
        f"H100 and an H200, causal below {KERNELS_TRAIN_CAUSAL_PADDING_FROM} query rows "
        "(benchmarks/results/)"
    )


def unfit(q, k, v, mask, dropout_p, grad, return_weights=False) -> str | None:
    """None when a Triton kernel may run this call, else why not."""
    why = _triton.unfit(q, k, v, mask)
    if why is not None:
        return why
    if grad and return_weights:
        return "weights with autograd (the blocked weights path has their backward)"
    if grad and mask is not None and mask.requires_grad:
        return "a mask that takes gradients"
    if dropout_p > 0:
        return "dropout (not in the Triton kernels)"
    L, S = q.shape[-2], k.shape[-2]
    if return_weights and L * S > _triton.INT32_MAX + 1:  # (the weights are contiguous)
        return f"weights of L x S = {L} x {S} per head: past the kernels' 32-bit offsets (2**31)"
    from attnlab.kernels import triton_attention

    return triton_attention.supports(q, k, v, mask)


def describe(
    q, k, return_weights, key_range, band=None, grad=False, v=None, mask=None, alignment=None
) -> str:
    """One line for ``explain()``: which Triton kernel(s) run (``v``, ``mask`` and
    ``alignment``: whether torch's flash kernel gives the weights' first pass)."""
    G, L = q.shape[1] // k.shape[1], q.shape[2]
    decode = _decode_fits(q, k)
    parts = [f"attnlab Triton kernels ({_triton.where()})"]
    if return_weights and decode:
        parts.append(
            f"split-key decode kernel (G*L = {G * L} rows per kv head) writing the scores, "
            "weights = exp(s - lse) after the merge"
        )
    elif return_weights:
        what = "averaged over heads in the kernel" if return_weights == "average" else "per head"
        from attnlab.kernels import triton_attention

        first = "forward"
        v = k if v is None else v
        if triton_attention.torch_pass1_unfit(q, k, v, mask, alignment, key_range, band) is None:
            first = "torch's flash kernel"
        parts.append(
            f"{first} with row log-sum-exp, then weights ({what}) = exp(s - lse) tile by tile"
        )
    else:
        parts.append(
            "forward (flash tiling, online softmax)"
            + ("; backward by the dK/dV and dQ kernels, from the row log-sum-exp" if grad else "")
        )
    if key_range is not None and key_range[0].dim() == 1:
        parts.append("padding as key ranges per batch row: key blocks outside them skipped")
    elif key_range is not None:
        parts.append("packed documents as key ranges per query row: other documents skipped")
    if band is not None:
        parts.append(f"sliding window as a band {band[1]}..{band[2]}: key blocks outside skipped")
    if key_range is not None or band is not None:
        parts.append("no mask read")
    return "; ".join(parts)


def _decode_fits(q, k) -> bool:
    from attnlab.kernels import triton_decode

    return triton_decode.supports(q, k, None, None) is None and q.shape[2] < k.shape[2]


def run(
    q, k, v, mask, alignment, scale, return_weights, structure=(None, None), buffer=None,
    kv_finite=None,
):  # fmt: skip
    """out (B, H, L, Ev), weights (B, H or 1, L, S) or None, and whether the NaN rule was
    applied already (else the caller applies it), by the Triton kernels.

    Weights by the second kernel: rows that a NaN or an inf reaches (the NaN rule,
    :func:`attnlab.functional.nonfinite.nonfinite_rows`) get a NaN log-sum-exp first, so that
    the kernel writes them NaN itself: no second pass over the (B, H, L, S) weights.
    """
    from attnlab.functional.nonfinite import fill_nan, rows_to_fill
    from attnlab.kernels import triton_attention, triton_decode

    key_range, band = structure
    if key_range is not None or band is not None:
        mask = None  # the ranges and the band say everything the mask said
    if not return_weights and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        from attnlab.kernels.triton_backward import TritonAttention

        return TritonAttention.apply(q, k, v, mask, alignment, scale, key_range, band), None, False
    if return_weights and _decode_fits(q, k):
        out, weights = triton_decode.decode_attention(
            q, k, v, mask, alignment, scale, key_range, return_weights, band
        )
        if buffer is not None:
            weights = buffer.copy_(weights)
        return out, weights, False
    if (
        return_weights
        and triton_attention.torch_pass1_unfit(q, k, v, mask, alignment, key_range, band) is None
    ):  # (torch's flash kernel: the output and the row log-sum-exp)
        out, stats = triton_attention.torch_forward(q, k, v, alignment, scale)
    else:
        out, stats = triton_attention.attention_forward(
            q, k, v, mask, alignment, scale, key_range, band
        )
    if not return_weights:
        return out, None, False
    bad = rows_to_fill(q, k, v, kv_finite)  # (B, H, L, 1) or None
    if bad is not None:
        out, stats = fill_nan(out, bad), stats.masked_fill(bad, float("nan"))  # (B, H, L, 2)
    average = return_weights == "average"
    weights = triton_attention.attention_weights(
        q, k, stats, mask, alignment, scale, key_range, average, buffer, band
    )
    return out, weights, True
