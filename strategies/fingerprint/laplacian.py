"""The graph over task fingerprints, as pure functions: the RBF adjacency and the graph-Laplacian step.

MIRA's math (its whole server step), and ATLAS's in-cluster step (``atlas.laplacian-eta``): both strategies reach
it here, in the package they share, not in each other.

W_k <- W_k - eta * sum_l a_kl (W_k - W_l), with a_kl = exp(-alpha ||f_k - f_l||^2), a_kk = 0, rows summing to 1.
Because the rows sum to 1 the step is a mix: W_k <- (1 - eta) W_k + eta * sum_l a_kl W_l. In plaintext the server
sees every W_l and the neighbour term is exact; in secure mode it sees only group means, and the neighbour term
is client k's adjacency summed per group times the group means (``strategies.aggregation.mix_group_means``).
NumPy in, NumPy out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

Arrays = dict[str, np.ndarray]


def squared_distances(fingerprints: np.ndarray) -> np.ndarray:
    """||f_k - f_l||^2 for every pair of rows (n x n, exact zeros on the diagonal)."""
    x = np.asarray(fingerprints, dtype=np.float64)
    diff = x[:, None, :] - x[None, :, :]
    return np.einsum("ijk,ijk->ij", diff, diff)


def median_alpha(fingerprints: np.ndarray) -> float:
    """``mira.alpha = "median"``: 1 / the median squared distance between distinct clients (the usual RBF
    bandwidth heuristic: a typical pair gets a_kl = exp(-1)); 1.0 if every pair coincides."""
    d = squared_distances(fingerprints)
    off = d[~np.eye(d.shape[0], dtype=bool)]
    med = float(np.median(off)) if off.size else 0.0
    return 1.0 / med if med > 0 else 1.0


def rbf_adjacency(fingerprints: np.ndarray, alpha: float) -> np.ndarray:
    """a_kl = exp(-alpha ||f_k - f_l||^2) for k != l, a_kk = 0 (the raw, symmetric adjacency)."""
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    a = np.exp(-alpha * squared_distances(fingerprints))
    np.fill_diagonal(a, 0.0)
    return a


def normalised_adjacency(fingerprints: np.ndarray, alpha: float, clusters: Sequence[int] | None = None) -> np.ndarray:
    """``rbf_adjacency`` with rows scaled to sum to 1, computed as a softmax of -alpha ||f_k - f_l||^2 over l != k
    (the same numbers, without exp underflowing to an all-zero row when alpha * distance is large). A client with
    no neighbours has a zero row, and the Laplacian step leaves it as it is.

    ``clusters`` (a label per client): neighbours only inside a client's own cluster (ATLAS's
    ``atlas.laplacian-eta``), every other a_kl = 0 before the rows are normalised.
    """
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    logits = -alpha * squared_distances(fingerprints)
    n = logits.shape[0]
    allowed = ~np.eye(n, dtype=bool)
    if clusters is not None:
        labels = np.asarray(clusters)
        if labels.shape != (n,):
            raise ValueError(f"{labels.shape[0]} cluster labels for {n} clients")
        allowed &= labels[:, None] == labels[None, :]
    logits = np.where(allowed, logits, -np.inf)
    peak = logits.max(axis=1, keepdims=True) if n else logits
    has = np.isfinite(peak)
    a = np.exp(logits - np.where(has, peak, 0.0))
    totals = a.sum(axis=1, keepdims=True)
    return np.divide(a, totals, out=np.zeros_like(a), where=totals > 0)


def laplacian_step(adapters: Sequence[Arrays], adjacency: np.ndarray, eta: float) -> list[Arrays]:
    """W_k - eta * sum_l a_kl (W_k - W_l) for every client k and array name (float64 math, float32 out).

    ``adjacency`` is the row-normalised one; eta = 0 returns every adapter unchanged.
    """
    a = np.asarray(adjacency, dtype=np.float64)
    n = len(adapters)
    if a.shape != (n, n):
        raise ValueError(f"adjacency {a.shape} for {n} adapters")
    out: list[Arrays] = []
    for k in range(n):
        mixed = {}
        for name, value in adapters[k].items():
            own = np.asarray(value, dtype=np.float64)
            pull = sum(a[k, j] * (own - np.asarray(adapters[j][name], dtype=np.float64)) for j in range(n))
            mixed[name] = (own - eta * pull).astype(np.float32)
        out.append(mixed)
    return out


def apply_step(own: Arrays, neighbours: Arrays, eta: float) -> Arrays:
    """(1 - eta) W_k + eta N_k: the Laplacian step on the client, from its own adapter and the neighbour term
    N_k = sum_l a_kl W_l the server sent (no neighbours: unchanged). Equals ``laplacian_step`` when N_k is exact."""
    if not neighbours:
        return {k: np.asarray(v, dtype=np.float32) for k, v in own.items()}
    return {
        k: ((1 - eta) * np.asarray(v, dtype=np.float64) + eta * np.asarray(neighbours[k], dtype=np.float64)).astype(
            np.float32
        )
        for k, v in own.items()
    }


def laplacian_start(own: Arrays | None, received: Arrays | None, first: Arrays, eta: float, neighbours: bool) -> Arrays:
    """Where a client that keeps its own adapter starts: before it has trained (``own`` None: round 1, or a fresh
    node state after a restart), from what was sent or else ``first``; later, its own adapter stepped toward the
    neighbour term received, (1 - eta) W_k + eta N_k, or left as it is when what arrived is not a neighbour term
    (``neighbours`` False: the server has none for it yet)."""
    if own is None:
        return received if received else first
    if not received or not neighbours:
        return own
    return apply_step(own, received, eta)


def parse_alpha(value: Any) -> Any:
    """An RBF bandwidth: a number >= 0, or "median" (1 / the median pairwise squared distance)."""
    if value == "median":
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number >= 0 or 'median', got {value!r}") from None
    if not 0 <= number < math.inf:
        raise ValueError(f"expected a number >= 0 or 'median', got {value!r}")
    return number


def alpha_for(alpha: float | str, median: float) -> float:
    """The bandwidth to use: the given number, or ``median`` when the setting is "median"."""
    return median if alpha == "median" else float(alpha)
