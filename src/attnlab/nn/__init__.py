"""attnlab layers: thin ``torch.nn`` modules around :mod:`attnlab.functional`.

Layers take batch-first ``(B, L, D)`` inputs; masks mean True = may attend; key padding masks
are (B, S) with True = real token.
"""

from attnlab.nn.classic import AdditiveAttention, DotProductAttention, LuongAttention, SelfAttention
from attnlab.nn.multihead import MultiHeadAttention

__all__ = [
    "AdditiveAttention",
    "DotProductAttention",
    "LuongAttention",
    "MultiHeadAttention",
    "SelfAttention",
]
