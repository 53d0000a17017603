"""MIRA's pure math: the RBF adjacency, the Laplacian step against the explicit double loop, eta = 0, and the
client-side form of the step from the server's neighbour term (exact in plaintext, group-level in secure mode)."""

import numpy as np
import pytest

from strategies.aggregation import mix_group_means
from strategies.fingerprint.laplacian import (
    apply_step,
    laplacian_step,
    median_alpha,
    normalised_adjacency,
    rbf_adjacency,
)

rng = np.random.default_rng(0)
FINGERPRINTS = rng.normal(size=(5, 7))
ADAPTERS = [{"a": rng.normal(size=(3, 2)), "b": rng.normal(size=4)} for _ in range(5)]


def test_adjacency_is_mira_rbf_with_zero_diagonal_and_unit_rows():
    raw = rbf_adjacency(FINGERPRINTS, 0.1)
    d = ((FINGERPRINTS[:, None] - FINGERPRINTS[None]) ** 2).sum(-1)
    np.testing.assert_allclose(raw, np.exp(-0.1 * d) * (1 - np.eye(5)))
    norm = normalised_adjacency(FINGERPRINTS, 0.1)
    np.testing.assert_allclose(norm, raw / raw.sum(1, keepdims=True))
    np.testing.assert_allclose(norm.sum(1), 1.0)
    # a huge alpha underflows exp, but the normalised rows stay defined (all weight on the nearest neighbour)
    far = normalised_adjacency(FINGERPRINTS, 1e6)
    np.testing.assert_allclose(far.sum(1), 1.0)
    assert median_alpha(FINGERPRINTS) == pytest.approx(1 / np.median(d[~np.eye(5, dtype=bool)]))


def test_laplacian_step_equals_the_explicit_double_loop():
    a = normalised_adjacency(FINGERPRINTS, median_alpha(FINGERPRINTS))
    eta = 0.3
    stepped = laplacian_step(ADAPTERS, a, eta)
    for k in range(5):
        for name in ("a", "b"):
            expected = ADAPTERS[k][name].copy()
            for j in range(5):
                expected = expected - eta * a[k, j] * (ADAPTERS[k][name] - ADAPTERS[j][name])
            np.testing.assert_allclose(stepped[k][name], expected, rtol=1e-5, atol=1e-6)


def test_eta_zero_is_the_identity():
    a = normalised_adjacency(FINGERPRINTS, 1.0)
    for before, after in zip(ADAPTERS, laplacian_step(ADAPTERS, a, 0.0)):
        for name in before:
            np.testing.assert_allclose(after[name], before[name], rtol=1e-6)
        for name, value in apply_step(before, {"a": np.ones((3, 2)), "b": np.ones(4)}, 0.0).items():
            np.testing.assert_allclose(value, before[name], rtol=1e-6)


def test_client_side_step_from_singleton_group_means_is_exact():
    a = normalised_adjacency(FINGERPRINTS, 1.0)
    neighbours = mix_group_means(a, [[i] for i in range(5)], ADAPTERS)  # plaintext: one group per client
    exact = laplacian_step(ADAPTERS, a, 0.5)
    for k in range(5):
        for name, value in apply_step(ADAPTERS[k], neighbours[k], 0.5).items():
            np.testing.assert_allclose(value, exact[k][name], rtol=1e-5, atol=1e-6)


def test_adjacency_inside_clusters_is_zero_across_and_a_lone_client_has_no_neighbours():
    clusters = [0, 1, 0, 1, 2]
    norm = normalised_adjacency(FINGERPRINTS, 0.1, clusters)
    raw = rbf_adjacency(FINGERPRINTS, 0.1)
    same = np.equal.outer(clusters, clusters)
    assert np.all(norm[~same] == 0)
    for k in range(4):  # inside a cluster: the same RBF weights, renormalised over the cluster
        inside = raw[k] * same[k]
        np.testing.assert_allclose(norm[k], inside / inside.sum())
    assert np.all(norm[4] == 0)  # partition 4 is alone in cluster 2: the step leaves it as it is
    with pytest.raises(ValueError, match="4 cluster labels for 5 clients"):
        normalised_adjacency(FINGERPRINTS, 0.1, clusters[:4])
