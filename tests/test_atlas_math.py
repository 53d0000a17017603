"""ATLAS's pure math: the k score against scikit-learn's metrics, k chosen on blobs, purity, merging of small
clusters, the rank allocator and the zero-padded per-slot average."""

import numpy as np
import pytest
from sklearn.datasets import make_blobs
from sklearn.metrics import calinski_harabasz_score, davies_bouldin_score, silhouette_score

from common.adapters.lora import ranks as lora_ranks
from strategies.atlas.clustering import (
    canonical_labels,
    choose_clusters,
    combined_score,
    merge_small_clusters,
    oracle_clusters,
    purity,
)
from strategies.atlas.ranks import Layer, adapter_mb, allocate_ranks, slot_average
from strategies.fingerprint.pca import reduce_fingerprints


@pytest.mark.parametrize("true_k", [2, 3, 4])
def test_choose_clusters_finds_the_k_of_separated_blobs(true_k):
    points, truth = make_blobs(n_samples=24, centers=true_k, n_features=5, cluster_std=0.3, random_state=true_k)
    clustering = choose_clusters(points, k_max=6, seed=0)
    assert clustering.k == true_k
    assert purity(clustering.labels.tolist(), [str(t) for t in truth]) == 1.0
    assert sorted(clustering.scores) == [2, 3, 4, 5, 6]
    # the chosen k's score is seed 003's formula over scikit-learn's three metrics
    sil = silhouette_score(points, clustering.labels)
    db = davies_bouldin_score(points, clustering.labels)
    ch = calinski_harabasz_score(points, clustering.labels)
    assert clustering.silhouette == pytest.approx(sil)
    expected = 0.5 * (sil + 1) / 2 + 0.3 / (1 + db) + 0.2 * ch / (ch + 1000)
    assert combined_score(sil, db, ch) == pytest.approx(expected)
    assert clustering.scores[true_k] == pytest.approx(expected)
    assert clustering.scores[true_k] == max(clustering.scores.values())


def test_too_few_clients_form_one_cluster():
    clustering = choose_clusters(np.array([[0.0, 1.0], [5.0, 5.0]]), k_max=4)
    assert clustering.k == 1 and clustering.labels.tolist() == [0, 0] and clustering.silhouette is None


def test_purity_is_the_mean_dominant_share():
    assert purity([0, 0, 1, 1], ["a", "a", "b", "b"]) == 1.0
    assert purity([0, 0, 0, 1], ["a", "a", "b", "b"]) == pytest.approx((2 / 3 + 1) / 2)
    with pytest.raises(ValueError):
        purity([0, 1], ["a"])


def test_oracle_clusters_follow_task_sets_and_labels_are_canonical():
    clustering = oracle_clusters(np.zeros((4, 2)) + np.arange(4)[:, None], ["b", "a", "b", "a"])
    assert clustering.labels.tolist() == [0, 1, 0, 1]
    assert canonical_labels(np.array([2, 2, 0, 1])).tolist() == [0, 0, 1, 2]


def test_small_clusters_merge_into_the_nearest_centroid():
    labels = np.array([0, 0, 0, 1, 1, 1, 2])
    centroids = np.array([[0.0], [10.0], [9.0]])
    merged, log = merge_small_clusters(labels, centroids, min_size=3)
    assert merged.tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert len(log) == 1 and "cluster 2 (1 clients) merged into cluster 1" in log[0]
    # two clusters of 2: they end as one group of 4, never a group of fewer than 3
    merged, _ = merge_small_clusters(np.array([0, 0, 1, 1]), np.array([[0.0], [1.0]]), min_size=3)
    assert merged.tolist() == [0, 0, 0, 0]


def test_pca_reports_explained_variance():
    rng = np.random.default_rng(0)
    low_rank = rng.normal(size=(8, 2)) @ rng.normal(size=(2, 50))
    reduced = reduce_fingerprints(low_rank + 1e-6 * rng.normal(size=(8, 50)), dim=2)
    assert reduced.points.shape == (8, 2) and reduced.explained_variance > 0.999
    noise = reduce_fingerprints(rng.normal(size=(8, 50)), dim=2)
    assert noise.explained_variance < 0.7
    assert reduce_fingerprints(rng.normal(size=(3, 50)), dim=64).points.shape == (3, 2)  # at most n - 1


LAYERS = [Layer(f"block{i}.q_proj", 64, 64) for i in range(6)]


def test_rank_allocation_stays_within_budget_and_favours_important_layers():
    importance = [0.1, 0.9, 0.5, 0.3, 0.7, 0.2]
    for budget in [0.1, 0.3, 0.5, 1.0, 3.0, 100.0]:
        ranks = allocate_ranks(LAYERS, importance, budget)
        assert adapter_mb(LAYERS, ranks) <= budget
        order = np.argsort(importance)[::-1]  # equal-sized layers: rank never grows as importance falls
        assert all(ranks[a] >= ranks[b] for a, b in zip(order, order[1:]))
    assert allocate_ranks(LAYERS, importance, 100.0) == [64] * 6
    tight = allocate_ranks(LAYERS, importance, 0.3)
    assert tight[1] > tight[0]


def test_a_budget_that_fits_no_rank_is_an_error():
    with pytest.raises(ValueError, match="fits no rank"):
        allocate_ranks(LAYERS, [1.0] * 6, 0.01)


def test_zero_padded_slot_average_equals_a_hand_computed_case():
    # client 0: rank 1, weight 1; client 1: rank 2, weight 3 (A is r x in, B is out x r)
    a0, b0 = np.array([[1.0, 1.0]]), np.array([[2.0], [2.0]])
    a1, b1 = np.array([[5.0, 5.0], [7.0, 7.0]]), np.array([[6.0, 8.0], [6.0, 8.0]])
    names = ("base_model.model.x.lora_A.weight", "base_model.model.x.lora_B.weight")
    padded = [lora_ranks.resize(dict(zip(names, ab)), {"x": 2}) for ab in ((a0, b0), (a1, b1))]
    (pa0, pb0), (pa1, pb1) = ((p[names[0]], p[names[1]]) for p in padded)
    w = np.array([1.0, 3.0])
    mean_a = (w[0] * pa0 + w[1] * pa1) / w.sum()
    mean_b = (w[0] * pb0 + w[1] * pb1) / w.sum()
    masks = [lora_ranks.masks({"x": r}, {"x": 2})["rank-mask.x"] for r in (1, 2)]
    mask = (w[0] * masks[0] + w[1] * masks[1]) / w.sum()
    avg_a, avg_b = slot_average(mean_a, mask, axis=0), slot_average(mean_b, mask, axis=1)
    # slot 0: both clients, weights 1 and 3; slot 1: client 1 alone
    np.testing.assert_allclose(avg_a, [[(1 + 3 * 5) / 4] * 2, [7.0, 7.0]])
    np.testing.assert_allclose(avg_b, [[(2 + 3 * 6) / 4, 8.0]] * 2)
    np.testing.assert_allclose(slot_average(mean_a, np.array([0.25, 0.0]), axis=0)[1], 0.0)


def test_min_size_keeps_a_spread_pair_together():
    # three tight pairs and one spread pair: the best score splits the spread pair into two clients alone (k=5);
    # with min_size=2 the best k without a cluster of one is taken: the four pairs
    rng = np.random.default_rng(0)
    centres = np.array([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    tight = np.concatenate([centres + rng.normal(0, 0.05, centres.shape) for _ in range(2)])
    points = np.concatenate([tight, [[10.0, 8.5], [10.0, 11.5]]])
    pairs = ["a", "b", "c", "a", "b", "c", "d", "d"]
    alone = choose_clusters(points, k_max=6, seed=0)
    assert np.bincount(alone.labels).min() == 1
    paired = choose_clusters(points, k_max=6, seed=0, min_size=2)
    assert paired.k == 4 and purity(paired.labels.tolist(), pairs) == 1.0
    assert paired.scores == alone.scores and paired.scores[4] < max(alone.scores.values())
    # no k without a cluster of one: the best of all, as with min_size=1
    assert choose_clusters(points, k_max=6, seed=0, min_size=5).labels.tolist() == alone.labels.tolist()
