"""attnlab's functional core: every attention mechanism as a torch function.

Layout ``(B, H, L, E)`` for queries, ``(B, Hkv, S, E)`` / ``(B, Hkv, S, Ev)`` for keys/values
(leading dims optional). Masks: bool True = may attend, or an additive float bias. Each function
has a float64 NumPy twin with the same name and signature in :mod:`attnlab.reference`, which is
its specification.
"""

from attnlab.functional.additive import additive_attention, additive_scores, explain_additive
from attnlab.functional.hard import hard_attention, hard_attention_weights
from attnlab.functional.nonfinite import assume_finite, is_finite_assumed
from attnlab.functional.rotary import (
    RotaryScaling,
    apply_rotary,
    rotary_angles,
    rotary_frequencies,
)
from attnlab.functional.scores import (
    concat_scores,
    dot_product_scores,
    general_scores,
    scaled_dot_product_scores,
)
from attnlab.functional.sdpa import Dispatch, explain, scaled_dot_product_attention
from attnlab.functional.softmax import attention, masked_softmax

__all__ = [
    "Dispatch",
    "RotaryScaling",
    "additive_attention",
    "additive_scores",
    "apply_rotary",
    "assume_finite",
    "attention",
    "concat_scores",
    "dot_product_scores",
    "explain",
    "explain_additive",
    "general_scores",
    "hard_attention",
    "hard_attention_weights",
    "is_finite_assumed",
    "masked_softmax",
    "rotary_angles",
    "rotary_frequencies",
    "scaled_dot_product_attention",
    "scaled_dot_product_scores",
]
