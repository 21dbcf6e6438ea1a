"""Rotary position embedding (RoPE): positions enter attention as rotations of q and k.

Each pair of features (x_i, x_{i + E/2}) of a query or key at position m is rotated by the angle
m * theta_i, theta_i = base^(-2i / E). A rotation preserves lengths, and the dot product of a
query rotated by m with a key rotated by n depends on m - n only: attention sees relative
positions, and a constant shift of all positions (left padding) changes nothing.

Pairs are the two halves of the head dim ("rotate half", as Hugging Face Llama and GPT-NeoX);
the original RoFormer pairs adjacent features instead -- a fixed permutation of the same thing.

Models trained on a short context and extended to a longer one stretch the slow frequencies
(:class:`RotaryScaling`): "linear" divides every theta_i by a factor (position interpolation),
"llama3" divides only the slow ones and blends the middle band (Llama 3.1 and later).

References: Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", 2021;
Chen et al., "Extending Context Window of Large Language Models via Positional Interpolation",
2023; Meta, "The Llama 3 Herd of Models", 2024 (its rope scaling).
Oracle: :func:`attnlab.reference.apply_rotary`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnlab._checks import check_floating

SCALING_KINDS = ("linear", "llama3")


@dataclass(frozen=True)
class RotaryScaling:
    """How the rotary frequencies theta_i = base^(-2i/E) are stretched for a longer context.

    Math (wavelength lambda_i = 2 pi / theta_i, c = ``original_context``):

    * ``"linear"``: theta_i / factor for every i (the positions divided by ``factor``);
    * ``"llama3"``: theta_i where lambda_i < c / high_freq_factor (fast: kept), theta_i / factor
      where lambda_i > c / low_freq_factor (slow: stretched), and in between
      ((1 - s) / factor + s) theta_i with s = (c / lambda_i - low_freq_factor) /
      (high_freq_factor - low_freq_factor), which meets both ends continuously.

    Args:
        kind: ``"linear"`` or ``"llama3"``.
        factor: the stretch, > 0 (8 in Llama 3.1, 32 in Llama 3.2).
        low_freq_factor, high_freq_factor: ``"llama3"`` only: the band's ends, 0 < low < high
            (1 and 4 in Llama 3.1).
        original_context: ``"llama3"`` only: the context length the model was trained on
            (8192 in Llama 3.1).

    Raises:
        ValueError: an unknown kind, or a factor or band that is not a positive finite number
            (low < high).

    Example:
        >>> llama31 = RotaryScaling("llama3", 8.0, 1.0, 4.0, 8192)
        >>> plain = rotary_frequencies(128, 500000.0, None, torch.float64)
        >>> theta = rotary_frequencies(128, 500000.0, llama31, torch.float64)
        >>> float(theta[0] / plain[0]), float(theta[-1] / plain[-1])  # fastest kept, slowest / 8
        (1.0, 0.125)
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in SCALING_KINDS:
            raise ValueError(
                f"RotaryScaling(kind): expected one of {SCALING_KINDS}; got {self.kind!r}. "
                f"Fix: 'linear' for position interpolation, 'llama3' for Llama 3.1's scaling."
            )
        fields = ("factor", "low_freq_factor", "high_freq_factor", "original_context")
        for name in fields:
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (math.isfinite(value) and value > 0)
            ):
                raise ValueError(
                    f"RotaryScaling({name}): expected a positive finite number; got {value!r}."
                )
        if self.low_freq_factor >= self.high_freq_factor:
            raise ValueError(
                f"RotaryScaling: low_freq_factor ({self.low_freq_factor}) must be below "
                f"high_freq_factor ({self.high_freq_factor}); Llama 3.1 uses 1 and 4."
            )

    @classmethod
    def from_hf(cls, params: dict | None, context: int | None = None) -> RotaryScaling | None:
        """From a Hugging Face config's ``rope_parameters`` (or older ``rope_scaling``) dict:
        None for plain rotary frequencies (``rope_type`` "default" or no dict). ``context``: the
        config's ``max_position_embeddings``, which Hugging Face takes for a "llama3" dict
        without ``original_max_position_embeddings``. (``attention_factor`` is ignored, as
        Hugging Face ignores it for these kinds.)

        Raises:
            ValueError: what :func:`unsupported_hf` names (its weights would load and give other
                logits), or a "linear" or "llama3" dict that lacks a value it needs.
        """
        params = params or {}
        why = unsupported_hf(params)
        if why is not None:
            raise ValueError(f"RotaryScaling.from_hf: this rope dict sets {why}.")
        kind = params.get("rope_type", params.get("type", "default"))
        if kind == "default":
            return None
        need = ["factor"]
        if kind == "llama3":
            params = {"original_max_position_embeddings": context, **params}
            need += ["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
        missing = [name for name in need if params.get(name) is None]
        if missing:
            raise ValueError(
                f"RotaryScaling.from_hf: rope_type {kind!r} needs {missing}; this dict has "
                f"{sorted(params)}. Fix: set them as the model's config.json does."
            )
        return cls(kind, *(params[name] for name in need))


def unsupported_hf(params: dict | None) -> str | None:
    """What of a Hugging Face rope dict :class:`RotaryScaling` does not compute, said as
    ``"rope_type='yarn' (takes ...)"``; None when it computes it as Hugging Face does."""
    params = params or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", *SCALING_KINDS):
        return f"rope_type={kind!r} (takes 'default', 'linear' or 'llama3')"
    partial = params.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        return f"partial_rotary_factor={partial!r} (takes 1.0: every feature rotated)"
    return None


def rotary_frequencies(
    head_dim: int,
    base: float = 10000.0,
    scaling: RotaryScaling | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """theta_i = base^(-2i/E), i < E/2, stretched by ``scaling`` (:class:`RotaryScaling`): (E/2,).

    Computed in float64 and rounded once to ``dtype``."""
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embeddings; got {head_dim}.")
    # (MPS has no float64: its frequencies are computed on the CPU; elsewhere on the device,
    # so that a CUDA graph of a decode step holds no host work)
    on = "cpu" if torch.device(device or "cpu").type == "mps" else device
    exponent = torch.arange(0, head_dim, 2, device=on, dtype=torch.float64) / head_dim
    theta = base**-exponent  # (E/2,)
    if scaling is not None:
        if scaling.kind == "linear":
            theta = theta / scaling.factor
        else:  # llama3: s = 0 where slow (stretched), 1 where fast (kept), a blend between
            c, low, high = (
                scaling.original_context,
                scaling.low_freq_factor,
                scaling.high_freq_factor,
            )
            wavelength = 2 * math.pi / theta
            s = ((c / wavelength - low) / (high - low)).clamp(0.0, 1.0)
            theta = theta * ((1 - s) / scaling.factor + s)
    return theta.to(device=device, dtype=dtype)


def rotary_angles(
    positions: torch.Tensor,
    head_dim: int,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
    scaling: RotaryScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles: (..., L) positions -> (..., L, E) each.

    Computed in ``dtype``: float32 (float64 for float64 inputs), never in 16 bits, whose
    rounding of large angles m * theta would scramble distant positions. ``scaling``: the
    frequencies' stretch (:class:`RotaryScaling`; None for plain RoPE).
    """
    theta = rotary_frequencies(head_dim, base, scaling, dtype, positions.device)  # (E/2,)
    angles = positions.to(dtype)[..., None] * theta  # (..., L, E/2)
    angles = torch.cat([angles, angles], dim=-1)  # (..., L, E): the same angle for both halves
    return angles.cos(), angles.sin()


def apply_rotary(
    x: torch.Tensor,
    positions: torch.Tensor,
    base: float = 10000.0,
    scaling: RotaryScaling | None = None,
) -> torch.Tensor:
    """Rotate queries or keys by their positions.

    Math:
        .. math:: \\text{rope}(x)_m = x_m \\cos(m\\theta) + \\text{rotate\\_half}(x_m)
                  \\sin(m\\theta), \\quad \\text{rotate\\_half}([x_1, x_2]) = [-x_2, x_1]

    Args:
        x: (B, H, L, E) queries or keys (E even); (B, L, E) and (L, E) too.
        positions: (L,) or (B, L) integer positions ((B, L): x has that batch first; (1, L),
            Hugging Face's default ``position_ids``, is shared by every row as (L,)).
        base: the frequency base (10000 in RoFormer; 1e5 or 5e5 in some models).
        scaling: the frequencies' stretch for a longer context (:class:`RotaryScaling`), or
            None.

    Returns:
        The shape and dtype of ``x`` (angles are computed in float32).
    """
    return apply_rotary_qk(x, None, positions, base, scaling)[0]


def apply_rotary_qk(
    query: torch.Tensor,
    key: torch.Tensor | None,
    positions: torch.Tensor,
    base: float = 10000.0,
    scaling: RotaryScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`apply_rotary` on queries (B, H, L, E) and keys (B, Hkv, L, E) at the same
    positions, computing the angles once (an attention layer's every step)."""
    check_floating("x", query)
    check_positions(positions, query.shape[-2])
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    return rotate_qk(query, key, *rotary_angles(positions, query.shape[-1], base, dtype, scaling))


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
    ``cos, sin = rotary_angles(positions, E, base, scaling=scaling)``, (L, E) or (B, L, E).

    A model computes the angles once per forward and rotates every layer's queries and keys
    with them (as Hugging Face's ``position_embeddings``): the same numbers as
    :func:`apply_rotary_qk`, without recomputing ``cos`` and ``sin`` in every layer.
    """
    if cos.dim() == 3:  # positions per batch row: (B, L, E), or (1, L, E) shared
        if query.dim() not in (3, 4) or cos.shape[0] not in (1, query.shape[0]):
            raise ValueError(
                f"positions (B, L) = {tuple(cos.shape[:2])} need queries and keys with that "
                f"batch first (or B = 1, shared), (B, H, L, E) or (B, L, E); got "
                f"{tuple(query.shape)}. Fix: pass (L,) or (1, L) positions to share them, or one "
                f"row of positions per batch row."
            )
        if query.dim() == 4:  # (B, L, E) -> (B, 1, L, E): the same positions for every head
            cos, sin = cos[:, None], sin[:, None]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, cos.dtype))  # (16-bit inputs: float32)
        x1, x2 = xf.chunk(2, dim=-1)
        return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)

    return rotate(query), None if key is None else rotate(key)
