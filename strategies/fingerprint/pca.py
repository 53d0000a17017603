"""The server's reduction of a family's fingerprints: PCA (scikit-learn), with the share of variance it keeps."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LOW_EXPLAINED_VARIANCE = 0.7  # seed 003 warns below this: the fingerprints then carry a weak signal


@dataclass
class Reduced:
    """Fingerprints after PCA: one row per client, and the share of variance the kept components explain."""

    points: np.ndarray
    explained_variance: float


def reduce_fingerprints(fingerprints: np.ndarray, dim: int, seed: int = 0) -> Reduced:
    """PCA of the clients' fingerprints (n x m) to at most ``dim`` components (and at most n - 1, the rank of n
    centred points). Explained variance is the kept components' share of the total (1.0 when nothing is cut)."""
    from sklearn.decomposition import PCA

    x = np.asarray(fingerprints, dtype=np.float64)
    n = x.shape[0]
    if x.ndim != 2 or n < 2:
        raise ValueError(f"need fingerprints of at least 2 clients as rows, got shape {x.shape}")
    components = max(1, min(dim, n - 1, x.shape[1]))
    if not np.any(x - x.mean(axis=0)):  # identical fingerprints: PCA is undefined, every client is the same point
        return Reduced(np.zeros((n, components)), 0.0)
    pca = PCA(n_components=components, random_state=seed)
    points = pca.fit_transform(x)
    return Reduced(points, float(np.sum(pca.explained_variance_ratio_)))
