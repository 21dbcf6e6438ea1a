"""Drop-in use of attnlab's kernels inside other libraries' models.

* :mod:`attnlab.integrations.transformers` -- Hugging Face ``transformers`` models run on
  :func:`attnlab.functional.scaled_dot_product_attention` with
  ``attn_implementation="attnlab"``, and return attention weights on request.

Nothing is imported here: each integration imports its library only when it is used.
"""

import importlib

_SUBMODULES = ("transformers", "hf_examples")


def __getattr__(name: str):
    # attnlab.integrations.transformers after a plain `import attnlab` (imported on first use)
    if name not in _SUBMODULES:
        raise AttributeError(f"module 'attnlab.integrations' has no attribute {name!r}")
    return importlib.import_module(f"attnlab.integrations.{name}")
