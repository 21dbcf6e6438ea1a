"""The NumPy oracle: every attnlab mechanism in float64, written to be read.

Each function has the same name and signature as its torch twin in :mod:`attnlab.functional`;
the tests hold the torch functions to these. This package imports NumPy only.
"""

from attnlab.reference.attention import (
    additive_attention,
    additive_scores,
    apply_rotary,
    attention,
    concat_scores,
    dot_product_scores,
    general_scores,
    hard_attention,
    hard_attention_weights,
    masked_softmax,
    rotary_angles,
    rotary_frequencies,
    scaled_dot_product_attention,
    scaled_dot_product_scores,
)
from attnlab.reference.masks import causal_mask, document_mask, padding_mask, sliding_window_mask

__all__ = [
    "additive_attention",
    "additive_scores",
    "apply_rotary",
    "attention",
    "causal_mask",
    "concat_scores",
    "dot_product_scores",
    "general_scores",
    "hard_attention",
    "hard_attention_weights",
    "masked_softmax",
    "padding_mask",
    "rotary_angles",
    "rotary_frequencies",
    "scaled_dot_product_attention",
    "scaled_dot_product_scores",
    "sliding_window_mask",
    "document_mask",
]
