"""ATLAS phase 1 as pure functions: (PCA-reduced) fingerprints -> k-means with k chosen by a combined score ->
purity, and the merge of clusters too small for SecAgg+; ``group_clients`` clusters and groups a family the way
``atlas.*`` says (a ``Grouping``) and ``clustering_row`` puts one in the metrics row.

NumPy in, NumPy out; scikit-learn does the k-means and the three cluster-quality scores (seed 003); the PCA is
``strategies.fingerprint.pca``. No Flower here: ``server.py`` calls these on the fingerprints the clients reported.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .config import AtlasSection

LOW_PURITY = 0.8  # seed 003's bar for cluster-task alignment


def combined_score(silhouette: float, davies_bouldin: float, calinski_harabasz: float) -> float:
    """Seed 003's k score: 0.5 (silhouette + 1) / 2 + 0.3 / (1 + DB) + 0.2 CH / (CH + 1000); higher is better."""
    return (
        0.5 * (silhouette + 1) / 2 + 0.3 / (1 + davies_bouldin) + 0.2 * calinski_harabasz / (calinski_harabasz + 1000)
    )


@dataclass
class Clustering:
    """A clustering of n clients: their labels (0..k-1) and how good it is.

    Attributes:
        labels: cluster of each client, in the order of the fingerprints.
        k: number of clusters.
        silhouette, davies_bouldin, calinski_harabasz: scikit-learn's scores of ``labels`` (None where undefined:
            one cluster, or as many clusters as clients).
        scores: combined score of every k tried (k -> score); empty when k was fixed or given by an oracle.
        centroids: the k cluster centres in the reduced space (k x d).
    """

    labels: np.ndarray
    k: int
    silhouette: float | None = None
    davies_bouldin: float | None = None
    calinski_harabasz: float | None = None
    scores: dict[int, float] = field(default_factory=dict)
    centroids: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))


def cluster_scores(points: np.ndarray, labels: np.ndarray) -> tuple[float, float, float] | None:
    """(silhouette, Davies-Bouldin, Calinski-Harabasz) of a labelling; None when k is 1 or every point alone."""
    from sklearn.metrics import calinski_harabasz_score, davies_bouldin_score, silhouette_score

    k = len(set(labels.tolist()))
    if not 2 <= k <= len(labels) - 1:
        return None
    return (
        float(silhouette_score(points, labels)),
        float(davies_bouldin_score(points, labels)),
        float(calinski_harabasz_score(points, labels)),
    )


def _centroids(points: np.ndarray, labels: np.ndarray, k: int) -> np.ndarray:
    return np.stack([points[labels == c].mean(axis=0) for c in range(k)])


def _kmeans(points: np.ndarray, k: int, seed: int) -> np.ndarray:
    from sklearn.cluster import KMeans

    return KMeans(n_clusters=k, n_init=10, random_state=seed).fit_predict(points).astype(np.int64)


def _with_scores(points: np.ndarray, labels: np.ndarray, scores: dict[int, float] | None = None) -> Clustering:
    labels = canonical_labels(labels)
    k = int(labels.max()) + 1 if labels.size else 0
    metrics = cluster_scores(points, labels)
    sil, db, ch = metrics if metrics is not None else (None, None, None)
    return Clustering(labels, k, sil, db, ch, dict(scores or {}), _centroids(points, labels, k))


def choose_clusters(points: np.ndarray, k_max: int, seed: int = 0, min_size: int = 1) -> Clustering:
    """k-means for every k in 2..min(k_max, n - 1), keeping the k with the highest ``combined_score`` (ties: the
    smaller k) among those whose every cluster holds at least ``min_size`` clients; if no k does, the best of all.
    With fewer than 3 clients no k in that range exists: everyone is one cluster.

    ``min_size`` 2 keeps a client from being clustered alone when a k exists that pairs everyone: a cluster of one
    trains alone, which is what clustering is meant to improve on (the secure path already merges clusters below 3).
    """
    n = points.shape[0]
    candidates = range(2, min(k_max, n - 1) + 1)
    best: tuple[float, np.ndarray] | None = None
    best_sized: tuple[float, np.ndarray] | None = None
    scores: dict[int, float] = {}
    for k in candidates:
        labels = _kmeans(points, k, seed)
        metrics = cluster_scores(points, labels)
        if metrics is None:  # k-means left a cluster empty (duplicate points): this k is not really k
            continue
        scores[k] = combined_score(*metrics)
        if best is None or scores[k] > best[0]:
            best = (scores[k], labels)
        if np.bincount(labels).min() >= min_size and (best_sized is None or scores[k] > best_sized[0]):
            best_sized = (scores[k], labels)
    chosen = best_sized or best
    if chosen is None:
        return _with_scores(points, np.zeros(n, dtype=np.int64))
    return _with_scores(points, chosen[1], scores)


def fixed_clusters(points: np.ndarray, k: int, seed: int = 0) -> Clustering:
    """k-means with the given k (at most the number of clients)."""
    k = min(k, points.shape[0])
    return _with_scores(points, _kmeans(points, k, seed) if k > 1 else np.zeros(points.shape[0], dtype=np.int64))


def oracle_clusters(points: np.ndarray, task_sets: Sequence[str]) -> Clustering:
    """One cluster per distinct task set (the baseline seed 003 asks for): what perfect fingerprints would give."""
    order = {name: i for i, name in enumerate(dict.fromkeys(task_sets))}
    return _with_scores(points, np.array([order[t] for t in task_sets], dtype=np.int64))


def cluster(points: np.ndarray, cfg: AtlasSection, seed: int, task_sets: Sequence[str]) -> Clustering:
    """The clustering ``cfg`` asks for: by task set (``atlas.clustering = "oracle"``), with a fixed ``atlas.k``, or
    with k chosen up to ``atlas.k-max`` (preferring clusters of at least ``atlas.min-cluster-size``)."""
    if cfg.clustering == "oracle":
        return oracle_clusters(points, task_sets)
    if cfg.k:
        return fixed_clusters(points, cfg.k, seed)
    return choose_clusters(points, cfg.k_max, seed, cfg.min_cluster_size)


@dataclass
class Grouping:
    """A family's clustering and the groups that train from it.

    Attributes:
        clustering: the clusters of its clients (in the family's member order).
        groups: each client's group: its cluster, or under SecAgg+ the cluster a too-small one merged into.
        merges: one line per merge (logged, and in the metrics row).
        clustered_round: the round it was computed in.
    """

    clustering: Clustering
    groups: np.ndarray
    merges: list[str]
    clustered_round: int


def group_clients(
    points: np.ndarray, cfg: AtlasSection, seed: int, task_sets: Sequence[str], secure: bool, server_round: int
) -> Grouping:
    """The clustering ``cfg`` asks for (``cluster``) and its groups: the clusters, or under SecAgg+ the clusters
    with those below ``atlas.min-group-size`` merged into their nearest (``merge_small_clusters``)."""
    clustering = cluster(points, cfg, seed, task_sets)
    groups, merges = clustering.labels, list[str]()
    if secure:
        groups, merges = merge_small_clusters(clustering.labels, clustering.centroids, cfg.min_group_size)
    return Grouping(clustering, groups, merges, server_round)


def clustering_row(grouping: Grouping, tasks: Sequence[str]) -> dict[str, Any]:
    """A family's grouping in the metrics row: k, each client's cluster and group, the three scores, the score of
    every k tried, the task purity of the clusters and of the groups, the merges and the round it was computed in."""
    clustering, groups = grouping.clustering, grouping.groups
    return {
        "k": clustering.k,
        "clusters": clustering.labels.tolist(),
        "groups": groups.tolist(),
        "silhouette": clustering.silhouette,
        "davies_bouldin": clustering.davies_bouldin,
        "calinski_harabasz": clustering.calinski_harabasz,
        "k_scores": {str(k): v for k, v in clustering.scores.items()},
        "purity": purity(clustering.labels.tolist(), tasks),
        "group_purity": purity(groups.tolist(), tasks),
        "merges": grouping.merges,
        "clustered_round": grouping.clustered_round,
    }


def canonical_labels(labels: np.ndarray) -> np.ndarray:
    """Relabel so clusters are numbered by their first client (0 holds client 0): the same partition of clients
    always reads the same, whatever k-means numbered it."""
    mapping: dict[int, int] = {}
    for label in np.asarray(labels).tolist():
        mapping.setdefault(int(label), len(mapping))
    return np.array([mapping[int(label)] for label in np.asarray(labels).tolist()], dtype=np.int64)


def purity(labels: Sequence[int], tasks: Sequence[str]) -> float:
    """Mean over clusters of the dominant task's share of its members (1.0: every cluster holds one task)."""
    if len(labels) != len(tasks):
        raise ValueError(f"{len(labels)} labels but {len(tasks)} task names")
    if not len(labels):
        return 1.0
    shares = []
    for cluster in sorted(set(labels)):
        members = [t for label, t in zip(labels, tasks) if label == cluster]
        shares.append(Counter(members).most_common(1)[0][1] / len(members))
    return float(np.mean(shares))


def merge_small_clusters(labels: np.ndarray, centroids: np.ndarray, min_size: int) -> tuple[np.ndarray, list[str]]:
    """Merge every cluster below ``min_size`` into its nearest cluster by centroid distance (smallest first,
    centroids recomputed as member-weighted means after each merge), until none is below it or one is left.

    Returns the new labels (canonical) and one line per merge for the log. SecAgg+ must never run a group of fewer
    than 3; the merged clusters are the secure groups.
    """
    labels = np.asarray(labels, dtype=np.int64).copy()
    sizes = Counter(labels.tolist())
    centres = {c: np.asarray(centroids[c], dtype=np.float64) for c in sizes}
    merges: list[str] = []
    while len(sizes) > 1:
        small = sorted((n, c) for c, n in sizes.items() if n < min_size)
        if not small:
            break
        _, victim = small[0]
        others = [c for c in sizes if c != victim]
        target = min(others, key=lambda c: (float(np.sum((centres[c] - centres[victim]) ** 2)), c))
        total = sizes[victim] + sizes[target]
        centres[target] = (centres[target] * sizes[target] + centres[victim] * sizes[victim]) / total
        merges.append(f"cluster {victim} ({sizes[victim]} clients) merged into cluster {target} ({sizes[target]})")
        labels[labels == victim] = target
        sizes[target] = total
        del sizes[victim], centres[victim]
    return canonical_labels(labels), merges
