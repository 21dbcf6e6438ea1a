"""Complete models built from attnlab layers."""

from attnlab.models.llama import LlamaConfig, LlamaModel

__all__ = ["LlamaConfig", "LlamaModel"]
