"""A deterministic 2-D PCA for pictures of embedding vectors. NumPy only.

To compare positions *before* and *after* attention, both sets of vectors must be drawn in one
coordinate system: fit one projection on the stacked vectors, then project each set with it.
Fitting separately would give two unrelated planes and meaningless arrows.

Math:
    With the rows of :math:`X \\in \\mathbb{R}^{N \\times D}` centred by their mean
    :math:`\\mu`, the thin SVD :math:`X - \\mu = U \\Sigma V^T` gives the principal directions as
    the rows of :math:`V^T`; a vector :math:`x` is drawn at :math:`(x - \\mu) V_{:, :k}`.

    The SVD is computed through the smaller Gram matrix, which has the same singular vectors:
    :math:`(X-\\mu)^T(X-\\mu) = V \\Sigma^2 V^T` (``D x D``) when :math:`N \\ge D`, else
    :math:`(X-\\mu)(X-\\mu)^T = U \\Sigma^2 U^T` (``N x N``) and :math:`V^T = \\Sigma^{-1} U^T
    (X - \\mu)`. ``numpy.linalg.eigh`` of a 576 x 576 matrix is several times faster than the
    SVD of the 1024 x 576 data (512 tokens before and after attention in SmolLM2), and squaring
    the singular values costs nothing that a picture of the top 2 directions can show
    (``tests/test_viz.py`` checks it against ``numpy.linalg.svd``).

Sign convention: an SVD direction and its negative are equally valid, and which one LAPACK
returns can change with the input's size or the library build. Each direction is flipped so that
its largest-magnitude coordinate (the first, on ties) is positive; the same vectors then always
give the same picture.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ._arrays import to_numpy

__all__ = ["PCA", "fit_pca"]


@dataclass(frozen=True)
class PCA:
    """A fitted projection to ``k`` dimensions.

    Attributes:
        mean: ``[D]`` the mean of the fitted vectors.
        components: ``[k, D]`` orthonormal principal directions, sign-fixed.
        explained: ``[k]`` the fraction of the total variance along each direction.
    """

    mean: np.ndarray
    components: np.ndarray
    explained: np.ndarray

    def __call__(self, x: Any) -> np.ndarray:
        """Project ``[..., D]`` vectors to ``[..., k]``."""
        arr = to_numpy(x, "x")
        if arr.shape[-1] != self.mean.shape[0]:
            raise ValueError(
                f"x has width {arr.shape[-1]} but the projection was fitted on width "
                f"{self.mean.shape[0]}; project vectors of the same model and layer"
            )
        return (arr - self.mean) @ self.components.T

    def axis_label(self, i: int) -> str:
        """``"PC1 (42% of variance)"``, for plot axes."""
        return f"PC{i + 1} ({100 * self.explained[i]:.0f}% of variance)"


def fit_pca(*vectors: Any, k: int = 2) -> PCA:
    """Fit one ``k``-dimensional PCA on all the given sets of vectors together.

    Args:
        *vectors: one or more arrays ``[..., D]`` (e.g. ``before`` and ``after``, each
            ``[L, D]``); all rows of all of them are stacked.
        k: number of directions.

    Returns:
        A :class:`PCA`; call it on any ``[..., D]`` array.

    Raises:
        ValueError: no vectors, widths differ, or NaN/inf.

    Example:
        >>> rng = np.random.default_rng(0)
        >>> before = rng.normal(size=(5, 8)); after = before + 0.1
        >>> pca = fit_pca(before, after)
        >>> pca(before).shape, pca(after).shape
        ((5, 2), (5, 2))
    """
    if not vectors:
        raise ValueError("fit_pca needs at least one array of vectors")
    arrays = [to_numpy(v, f"vectors[{i}]") for i, v in enumerate(vectors)]
    widths = {a.shape[-1] if a.ndim else None for a in arrays}
    if len(widths) != 1 or None in widths:
        raise ValueError(
            "all vector sets must have the same last dim (D); got shapes "
            f"{[a.shape for a in arrays]}"
        )
    X = np.concatenate([a.reshape(-1, a.shape[-1]) for a in arrays])  # [N, D]
    mean = X.mean(axis=0)
    centred = X - mean
    Vt, sigma = _top_directions(centred, k)  # [m, D], [m]: largest first
    components = np.zeros((k, X.shape[1]))
    m = Vt.shape[0]
    components[:m] = Vt
    for row in components:
        pivot = int(np.argmax(np.abs(row)))  # first index on ties
        if row[pivot] < 0:
            row *= -1.0
    total = float((centred**2).sum())
    explained = np.zeros(k)
    if total > 0:
        explained[:m] = sigma**2 / total
    return PCA(mean=mean, components=components, explained=explained)


def _top_directions(centred: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` top right singular vectors ``[m, D]`` and singular values ``[m]`` of
    ``centred`` ``[N, D]``, largest first (``m <= k``: zero-variance directions are dropped)."""
    N, D = centred.shape
    small_side = centred.T if N >= D else centred  # the Gram matrix is small_side @ small_side.T
    evals, evecs = np.linalg.eigh(small_side @ small_side.T)  # ascending eigenvalues
    order = np.argsort(-evals, kind="stable")[:k]
    sigma = np.sqrt(np.clip(evals[order], 0.0, None))
    live = sigma > sigma.max(initial=0.0) * 1e-9
    order, sigma = order[live], sigma[live]
    if N >= D:
        Vt = evecs[:, order].T  # [m, D]
    else:
        Vt = (evecs[:, order].T @ centred) / sigma[:, None]  # V^T = Sigma^-1 U^T X
        Vt /= np.linalg.norm(Vt, axis=1, keepdims=True)  # unit length up to rounding; exactly
    return Vt, sigma
