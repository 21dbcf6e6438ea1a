"""When :func:`scaled_dot_product_attention` runs attnlab's Triton kernels, and how.

The Triton path serves what torch's fused kernels do not (on CUDA; and on CPU tensors under
``TRITON_INTERPRET=1``, where the same kernel code runs in Triton's interpreter, so the tests
exercise it):

* **weights on demand** -- the forward kernel returns each row's log-sum-exp with the output,
  then a second kernel writes ``exp(s - lse)`` tile by tile, per head or averaged over heads
  (:mod:`attnlab.kernels.triton_attention`); a few query rows against a long cache take the
  split-key decode kernel, which returns the weights in the same pass
  (:mod:`attnlab.kernels.triton_decode`);
* **padding kept as lengths** -- a mask from :func:`attnlab.masks.padding_mask` carries each
  row's key range; the kernel skips the padding's key blocks instead of reading a mask.

Weights with autograd, dropout, float64, a head dim over 256 or a mask that takes gradients
keep the existing paths; ``explain()`` says why.
"""

from __future__ import annotations

import torch

from attnlab.kernels import _triton


def key_range_of(mask, query: torch.Tensor, key: torch.Tensor):
    """The (start, end) key range a padding mask carries, when it applies to these 4-D inputs."""
    key_range = getattr(mask, "key_range", None)
    if key_range is None or query.dim() != 4:
        return None
    B, S = query.shape[0], key.shape[-2]
    if tuple(mask.shape) != (B, 1, 1, S) or key_range[0].shape != (B,):
        return None
    return key_range


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
    from attnlab.kernels import triton_attention

    return triton_attention.supports(q, k, v, mask)


def describe(q, k, return_weights, key_range, grad=False) -> str:
    """One line for ``explain()``: which Triton kernel(s) run."""
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
        parts.append(
            f"forward with row log-sum-exp, then weights ({what}) = exp(s - lse) tile by tile"
        )
    else:
        parts.append(
            "forward (flash tiling, online softmax)"
            + ("; backward by the dK/dV and dQ kernels, from the row log-sum-exp" if grad else "")
        )
    if key_range is not None:
        parts.append("padding as per-row key ranges: key blocks outside them skipped, no mask read")
    return "; ".join(parts)


def _decode_fits(q, k) -> bool:
    from attnlab.kernels import triton_decode

    return triton_decode.supports(q, k, None, None) is None and q.shape[2] < k.shape[2]


def run(q, k, v, mask, alignment, scale, return_weights, key_range, buffer=None):
    """out (B, H, L, Ev) and weights (B, H or 1, L, S) or None, by the Triton kernels."""
    from attnlab.kernels import triton_attention, triton_decode

    if key_range is not None:
        mask = None  # the range says everything the padding mask said
    if not return_weights and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        from attnlab.kernels.triton_backward import TritonAttention

        return TritonAttention.apply(q, k, v, mask, alignment, scale, key_range), None
    if return_weights and _decode_fits(q, k):
        out, weights = triton_decode.decode_attention(
            q, k, v, mask, alignment, scale, key_range, return_weights
        )
        if buffer is not None:
            weights = buffer.copy_(weights)
        return out, weights
    out, lse = triton_attention.attention_forward(q, k, v, mask, alignment, scale, key_range)
    if not return_weights:
        return out, None
    weights = triton_attention.attention_weights(
        q, k, lse, mask, alignment, scale, key_range, return_weights == "average", buffer
    )
    return out, weights
