"""attnlab: attention mechanisms, exact against a NumPy oracle, fast, usable, visible.

* :mod:`attnlab.functional` -- every mechanism as a torch function (the fast paths).
* :mod:`attnlab.reference` -- the same functions in float64 NumPy (the specification).
* :mod:`attnlab.masks` -- mask builders; bool masks mean True = may attend.
"""

from attnlab import functional, masks, reference
from attnlab.functional import (
    additive_attention,
    explain,
    hard_attention,
    masked_softmax,
    scaled_dot_product_attention,
)
from attnlab.masks import (
    causal_mask,
    padding_mask,
    sliding_window_mask,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "additive_attention",
    "causal_mask",
    "explain",
    "functional",
    "hard_attention",
    "masked_softmax",
    "masks",
    "padding_mask",
    "reference",
    "scaled_dot_product_attention",
    "sliding_window_mask",
]
