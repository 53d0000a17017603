"""Aggregation math as pure functions over groups (NumPy in, NumPy out; no Flower).

"Strategies speak in sums": SecAgg+ can give the server, for one group of clients, the weighted mean
sum_i w_i x_i / sum_i w_i and nothing else. Every strategy is therefore written as (1) a choice of groups and of
what each member sends, (2) group means, (3) a combination of group means. This module holds the math every
strategy may share: (2), the grouping of clients by a score matrix into groups of at least 3
(``group_by_relevance``), (3) as a per-client mix of group means (``mix_group_means``: SimGrad, MIRA, ATLAS's
in-cluster step) and its plaintext reference (``personalised_mix``), which the secure path is tested against.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Arrays = dict[str, np.ndarray]


def weighted_mean(updates: Sequence[Arrays], weights: Sequence[float]) -> Arrays:
    """sum_i w_i x_i / sum_i w_i, key by key, accumulated in float64 and returned as float32."""
    if not updates:
        raise ValueError("weighted_mean of no updates")
    if len(updates) != len(weights):
        raise ValueError(f"{len(updates)} updates but {len(weights)} weights")
    w = np.asarray(weights, dtype=np.float64)
    if np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {list(weights)}")
    keys = list(updates[0])
    out = {}
    for key in keys:
        acc = np.zeros(np.shape(updates[0][key]), dtype=np.float64)
        for wi, update in zip(w, updates):
            acc += wi * np.asarray(update[key], dtype=np.float64)
        out[key] = (acc / w.sum()).astype(np.float32)
    return out


def secagg_weights(num_examples: Sequence[int], max_weight: float) -> list[float]:
    """The weights SecAgg+ applies: num_examples / max_weight, at most 1 (our members cap their weight)."""
    return [min(n / max_weight, 1.0) for n in num_examples]


def secagg_error_bound(weights: Sequence[float], clipping_range: float, quantization_range: int) -> float:
    """An upper bound on |SecAgg+ mean - exact weighted mean| per coordinate, for values inside the clipping range.

    Each member's weighted value is quantised (stochastic rounding) on a grid of step
    2 * clipping_range / quantization_range, an error below one step each; the server divides the sum of the
    members' errors by the total weight.
    """
    step = 2.0 * clipping_range / quantization_range
    return len(weights) * step / sum(weights)


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
