"""Drop-in use of attnlab's kernels inside other libraries' models.

* :mod:`attnlab.integrations.transformers` -- Hugging Face ``transformers`` models run on
  :func:`attnlab.functional.scaled_dot_product_attention` with
  ``attn_implementation="attnlab"``, and return attention weights on request.

Nothing is imported here: each integration imports its library only when it is used.
"""

from attnlab._lazy import lazy_exports

# attnlab.integrations.transformers after a plain `import attnlab` (imported on first use)
_EXPORTS = {name: f"attnlab.integrations.{name}" for name in ("transformers", "hf_examples")}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
