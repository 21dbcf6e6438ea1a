"""attnlab: attention mechanisms, exact against a NumPy oracle, fast, usable, visible.

* :mod:`attnlab.functional` -- every mechanism as a torch function (the fast paths).
* :mod:`attnlab.reference` -- the same functions in float64 NumPy (the specification).
* :mod:`attnlab.masks` -- mask builders; bool masks mean True = may attend.

Submodules are imported on first use, so ``import attnlab.reference`` needs NumPy only.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "functional": "attnlab.functional",
    "masks": "attnlab.masks",
    "reference": "attnlab.reference",
    "nn": "attnlab.nn",
    "cache": "attnlab.cache",
    "compat": "attnlab.compat",
    "MultiHeadAttention": "attnlab.nn",
    "AdditiveAttention": "attnlab.nn",
    "LuongAttention": "attnlab.nn",
    "DotProductAttention": "attnlab.nn",
    "SelfAttention": "attnlab.nn",
    "DynamicCache": "attnlab.cache",
    "StaticCache": "attnlab.cache",
    "SlidingWindowCache": "attnlab.cache",
    "additive_attention": "attnlab.functional",
    "explain": "attnlab.functional",
    "hard_attention": "attnlab.functional",
    "masked_softmax": "attnlab.functional",
    "scaled_dot_product_attention": "attnlab.functional",
    "causal_mask": "attnlab.masks",
    "padding_mask": "attnlab.masks",
    "sliding_window_mask": "attnlab.masks",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'attnlab' has no attribute {name!r}")
    module = importlib.import_module(_EXPORTS[name])
    value = module if module.__name__ == f"attnlab.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
