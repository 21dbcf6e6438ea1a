"""Complete models built from attnlab layers, and their compiled decode step."""

from attnlab.models.decode import DecodeStep
from attnlab.models.llama import LlamaConfig, LlamaModel

__all__ = ["DecodeStep", "LlamaConfig", "LlamaModel"]
