"""SimGrad relevance math as pure functions (NumPy in, NumPy out; no Flower, no torch).

Each client sends a sanitised gradient signature (see ``signatures.py``); the server turns the signatures into
a relevance matrix S (cosine), a row-stochastic mixing matrix W (row softmax with a temperature) and, for every
client i, a personalised aggregate sum_j w_ij x_j. Under SecAgg+ the server only sees group sums, so the secure
path groups clients by relevance (``group_by_relevance``) and mixes group means (``mix_group_means``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Arrays = dict[str, np.ndarray]
MIXINGS = ("relevance", "uniform", "local-only")


def cosine_relevance(signatures: np.ndarray, overlap: bool = True) -> np.ndarray:
    """S (n x n) with S_ij = <s_i, s_j> / (|s_i| |s_j| + 1e-12) for signatures (n x m).

    With ``overlap`` the norms are taken over the coordinates BOTH clients kept (nonzero in both): each client
    keeps an independent random subsample of its signature, and the plain cosine of two identical gradients
    with independent 60% masks is only 0.6; the overlap cosine is 1 (measured on real SmolLM2 probe gradients of
    four tasks: within-task 0.41 -> 0.70, across-task 0.21 -> 0.35). For dense signatures both are the cosine.
    Computed in float64. The diagonal is exactly 1 for every nonzero row; a zero row has zero relevance to all.
    """
    sig = np.asarray(signatures, dtype=np.float64)
    if sig.ndim != 2:
        raise ValueError(f"signatures must be 2-D (clients x coordinates), got shape {sig.shape}")
    norms = np.linalg.norm(sig, axis=1)
    if overlap:
        kept = (sig != 0).astype(np.float64)
        restricted = (sig**2) @ kept.T  # [i, j]: |s_i|^2 over the coordinates j kept
        scores = (sig @ sig.T) / (np.sqrt(restricted * restricted.T) + 1e-12)
    else:
        scores = (sig @ sig.T) / (np.outer(norms, norms) + 1e-12)
    idx = np.flatnonzero(norms > 0)
    scores[idx, idx] = 1.0
    return scores


def row_softmax(scores: np.ndarray, temperature: float) -> np.ndarray:
    """Softmax of every row of scores / temperature (max-subtracted for stability); rows sum to 1.

    Raises ValueError for temperature <= 0. Lower temperatures concentrate each row on its most relevant peers.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    z = np.asarray(scores, dtype=np.float64) / temperature
    if z.ndim != 2:
        raise ValueError(f"scores must be 2-D, got shape {z.shape}")
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def relevance_weights(
    signatures: np.ndarray, temperature: float, mixing: str = "relevance", include_self: bool = True
) -> np.ndarray:
    """The mixing matrix W (n x n, rows sum to 1) for n clients' signatures.

    ``relevance``: row_softmax(cosine_relevance(signatures), temperature); ``uniform``: every entry 1/n (FedAvg
    with equal weights); ``local-only``: the identity (no collaboration). Raises ValueError for another mixing.

    ``include_self=False`` (relevance mixing, n > 1) gives w_ii = 0 and the softmax over the OTHER clients: every
    client's similarity to itself is 1, the largest score in its row, so with it a partner never gets much of the
    mix at any temperature; without it the temperature decides how much goes to the most relevant partner. For a
    client with a local path of its own (a personal LoRA, or P_L/Q_L) the self term is already there.
    """
    n = np.asarray(signatures).shape[0]
    if mixing == "relevance":
        scores = cosine_relevance(signatures)
        if not include_self and n > 1:
            np.fill_diagonal(scores, -np.inf)  # exp(-inf) = 0: no weight on oneself
        return row_softmax(scores, temperature)
    if mixing == "uniform":
        return np.full((n, n), 1.0 / n)
    if mixing == "local-only":
        return np.eye(n)
    raise ValueError(f"mixing must be one of {MIXINGS}, got {mixing!r}")


def _names(dicts: Sequence[Arrays | None]) -> list[str]:
    """Every key of the dicts, in order of first appearance."""
    return list(dict.fromkeys(k for d in dicts if d is not None for k in d))


def personalised_mix(
    weights: np.ndarray, updates: list[Arrays], available: list[set[str]] | None = None
) -> list[Arrays]:
    """Client i's aggregate of name k: sum_j w_ij x_j[k] / sum_j w_ij over the clients j that provided k.

    ``available[j]`` is the set of names client j provided (default: the keys of ``updates[j]``); a client that
    did not provide a name neither contributes to it nor dilutes it. A name nobody provided is absent from every
    result, and a name whose providers all have weight 0 in row i (e.g. ``local-only`` mixing) is absent from
    client i's result (the client keeps its own). Accumulated in float64, returned as float32.
    """
    w = np.asarray(weights, dtype=np.float64)
    n = len(updates)
    if w.shape != (n, n):
        raise ValueError(f"weights shape {w.shape} does not match {n} updates")
    if available is None:
        available = [set(u) for u in updates]
    if len(available) != n:
        raise ValueError(f"{len(available)} availability sets for {n} updates")
    for j, (update, names) in enumerate(zip(updates, available)):
        if missing := set(names) - set(update):
            raise ValueError(f"client {j} is marked as providing {sorted(missing)} but did not send them")
    out: list[Arrays] = [{} for _ in range(n)]
    for key in _names(updates):
        providers = [j for j in range(n) if key in available[j]]
        if not providers:
            continue
        stack = np.stack([np.asarray(updates[j][key], dtype=np.float64) for j in providers])
        sub = w[:, providers]  # (n x P)
        totals = sub.sum(axis=1)
        mixed = np.tensordot(sub, stack, axes=1)  # (n, *shape)
        for i in range(n):
            if totals[i] > 0:
                out[i][key] = (mixed[i] / totals[i]).astype(np.float32)
    return out


def group_by_relevance(scores: np.ndarray, min_size: int = 3) -> list[list[int]]:
    """Partition clients 0..n-1 into groups of at least ``min_size`` (the SecAgg+ minimum) by relevance.

    Average-linkage agglomeration on the symmetrised scores (S + S^T) / 2: start from singletons and repeatedly
    merge the pair of clusters with the highest mean cross-cluster score, considering only pairs in which at least
    one cluster is still smaller than ``min_size``; stop when none is. Ties go to the pair with the lowest
    (first-member) indices. If n < min_size, everyone forms one group. Groups are sorted; the list is sorted by
    first member.
    """
    s = np.asarray(scores, dtype=np.float64)
    n = s.shape[0]
    if s.shape != (n, n):
        raise ValueError(f"scores must be square, got shape {s.shape}")
    if min_size < 1:
        raise ValueError(f"min_size must be >= 1, got {min_size}")
    if n < min_size:
        return [list(range(n))]
    s = (s + s.T) / 2
    clusters = [[i] for i in range(n)]  # kept sorted by first member
    while any(len(c) < min_size for c in clusters):
        best, best_pair = -np.inf, None
        for a in range(len(clusters)):
            for b in range(a + 1, len(clusters)):
                if len(clusters[a]) >= min_size and len(clusters[b]) >= min_size:
                    continue
                score = s[np.ix_(clusters[a], clusters[b])].mean()
                if best_pair is None or score > best:
                    best, best_pair = score, (a, b)
        # Some cluster is below min_size and there are >= 2 clusters (n >= min_size), so a pair was scored.
        assert best_pair is not None
        a, b = best_pair
        clusters[a] = sorted(clusters[a] + clusters[b])
        del clusters[b]
        clusters.sort(key=lambda c: c[0])
    return clusters


def group_weights(weights: np.ndarray, groups: list[list[int]]) -> np.ndarray:
    """The (n x G) matrix Wg with Wg_ig = sum_{j in group g} w_ij: client i's weight on each whole group."""
    w = np.asarray(weights, dtype=np.float64)
    return np.stack([w[:, g].sum(axis=1) for g in groups], axis=1)


def mix_group_means(weights: np.ndarray, groups: list[list[int]], group_means: list[Arrays | None]) -> list[Arrays]:
    """Secure-mode personalised aggregate from group means: sum_g Wg_ig mean_g[k] / sum_g Wg_ig.

    With Wg = ``group_weights(weights, groups)``, the sums run over the groups whose mean is not None and holds
    name k; a name in no mean is absent, and so is a name whose groups all have weight 0 for client i.

    This equals ``personalised_mix(weights, updates)`` exactly when the weights are constant inside each group
    (w_ij = c_ig for every j in g) and every mean is the plain mean of all its members' updates: then
    sum_j w_ij x_j = sum_g c_ig |g| mean_g = sum_g Wg_ig mean_g. Otherwise it is the group-level approximation
    that SecAgg+ allows, since the server sees only group sums, not the members' individual updates.
    Returned as float32.
    """
    if len(groups) != len(group_means):
        raise ValueError(f"{len(groups)} groups but {len(group_means)} group means")
    wg = group_weights(weights, groups)
    n = wg.shape[0]
    out: list[Arrays] = [{} for _ in range(n)]
    for key in _names(group_means):
        held = [(g, mean[key]) for g, mean in enumerate(group_means) if mean is not None and key in mean]
        holders = [g for g, _ in held]
        stack = np.stack([np.asarray(value, dtype=np.float64) for _, value in held])
        sub = wg[:, holders]
        totals = sub.sum(axis=1)
        mixed = np.tensordot(sub, stack, axes=1)
        for i in range(n):
            if totals[i] > 0:
                out[i][key] = (mixed[i] / totals[i]).astype(np.float32)
    return out


def route_blocks(salience: np.ndarray, budget: int) -> list[int]:
    """Indices of the ``budget`` most salient blocks, sorted ascending.

    Ties go to the lower index; a NaN salience counts as +inf (unknown salience: the block must be trained).
    A budget <= 0 or >= the number of blocks selects every block.
    """
    s = np.asarray(salience, dtype=np.float64).ravel()
    if budget <= 0 or budget >= len(s):
        return list(range(len(s)))
    s = np.where(np.isnan(s), np.inf, s)
    order = np.argsort(-s, kind="stable")  # stable: equal values keep index order
    return sorted(int(i) for i in order[:budget])


def within_across_relevance(scores: np.ndarray, families: list[str]) -> tuple[float, float]:
    """(mean S_ij over pairs i != j with the same family label, mean over pairs with different labels).

    Each is nan when there is no such pair. A diagnostic: relevance is informative when within > across.
    """
    s = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(families)
    if s.shape != (len(labels), len(labels)):
        raise ValueError(f"scores shape {s.shape} does not match {len(labels)} family labels")
    same = labels[:, None] == labels[None, :]
    off = ~np.eye(len(labels), dtype=bool)
    within, across = s[same & off], s[~same]
    return (
        float(within.mean()) if within.size else float("nan"),
        float(across.mean()) if across.size else float("nan"),
    )
