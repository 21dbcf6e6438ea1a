"""Rotary position embedding (RoPE): positions enter attention as rotations of q and k.

Each pair of features (x_i, x_{i + E/2}) of a query or key at position m is rotated by the angle
m * theta_i, theta_i = base^(-2i / E). A rotation preserves lengths, and the dot product of a
query rotated by m with a key rotated by n depends on m - n only: attention sees relative
positions, and a constant shift of all positions (left padding) changes nothing.

Pairs are the two halves of the head dim ("rotate half", as Hugging Face Llama and GPT-NeoX);
the original RoFormer pairs adjacent features instead -- a fixed permutation of the same thing.

References: Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", 2021.
Oracle: :func:`attnlab.reference.apply_rotary`.
"""

from __future__ import annotations

import torch

from attnlab._checks import check_floating


def rotary_angles(
    positions: torch.Tensor,
    head_dim: int,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles: (..., L) positions -> (..., L, E) each.

    Computed in ``dtype``: float32 (float64 for float64 inputs), never in 16 bits, whose
    rounding of large angles m * theta would scramble distant positions.
    """
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embeddings; got {head_dim}.")
    exponent = torch.arange(0, head_dim, 2, device=positions.device, dtype=dtype) / head_dim
    inv_freq = base**-exponent  # (E/2,)
    angles = positions.to(dtype)[..., None] * inv_freq  # (..., L, E/2)
    angles = torch.cat([angles, angles], dim=-1)  # (..., L, E): the same angle for both halves
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate queries or keys by their positions.

    Math:
        .. math:: \\text{rope}(x)_m = x_m \\cos(m\\theta) + \\text{rotate\\_half}(x_m)
                  \\sin(m\\theta), \\quad \\text{rotate\\_half}([x_1, x_2]) = [-x_2, x_1]

    Args:
        x: (B, H, L, E) queries or keys (E even); (B, L, E) and (L, E) too.
        positions: (L,) or (B, L) integer positions ((B, L): x has that batch first).
        base: the frequency base (10000 in RoFormer; 1e5 or 5e5 in some models).

    Returns:
        The shape and dtype of ``x`` (angles are computed in float32).
    """
    return apply_rotary_qk(x, None, positions, base)[0]


def apply_rotary_qk(
    query: torch.Tensor, key: torch.Tensor | None, positions: torch.Tensor, base: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`apply_rotary` on queries (B, H, L, E) and keys (B, Hkv, L, E) at the same
    positions, computing the angles once (an attention layer's every step)."""
    check_floating("x", query)
    check_positions(positions, query.shape[-2])
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    return rotate_qk(query, key, *rotary_angles(positions, query.shape[-1], base, dtype))


def check_positions(positions: torch.Tensor, length: int) -> None:
    """Raise unless ``positions`` is (L,) or (B, L) with L = ``length``."""
    if positions.dim() not in (1, 2) or positions.shape[-1] != length:
        raise ValueError(
            f"positions must be (L,) or (B, L) with L = {length}; got {tuple(positions.shape)}."
        )


def rotate_qk(
    query: torch.Tensor, key: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate queries (B, H, L, E) and keys (B, Hkv, L, E) by angles already computed:
    ``cos, sin = rotary_angles(positions, E, base)``, (L, E) or (B, L, E).

    A model computes the angles once per forward and rotates every layer's queries and keys
    with them (as Hugging Face's ``position_embeddings``): the same numbers as
    :func:`apply_rotary_qk`, without recomputing ``cos`` and ``sin`` in every layer.
    """
    if cos.dim() == 3:  # positions per batch row: (B, L, E)
        if query.dim() not in (3, 4) or query.shape[0] != cos.shape[0]:
            raise ValueError(
                f"positions (B, L) = {tuple(cos.shape[:2])} need queries and keys with that "
                f"batch first, (B, H, L, E) or (B, L, E); got {tuple(query.shape)}. Fix: pass "
                f"(L,) positions to share them, or one row of positions per batch row."
            )
        if query.dim() == 4:  # (B, L, E) -> (B, 1, L, E): the same positions for every head
            cos, sin = cos[:, None], sin[:, None]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, cos.dtype))  # (16-bit inputs: float32)
        x1, x2 = xf.chunk(2, dim=-1)
        return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)

    return rotate(query), None if key is None else rotate(key)
