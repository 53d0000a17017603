import numpy as np
import pytest

from strategies.aggregation import secagg_error_bound, secagg_weights, weighted_mean


def random_updates(n, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {"a": rng.normal(size=(4, 3)).astype(np.float32), "b": rng.normal(size=(5,)).astype(np.float32)}
        for _ in range(n)
    ]


def test_weighted_mean_matches_numpy_average():
    updates, weights = random_updates(4), [10, 1, 3, 6]
    mean = weighted_mean(updates, weights)
    for key in ("a", "b"):
        expected = np.average(np.stack([u[key] for u in updates]), axis=0, weights=weights)
        np.testing.assert_allclose(mean[key], expected, rtol=1e-6, atol=1e-7)
        assert mean[key].dtype == np.float32


def test_equal_weights_is_plain_mean_and_single_update_is_identity():
    updates = random_updates(3, seed=1)
    np.testing.assert_allclose(
        weighted_mean(updates, [1, 1, 1])["a"], np.mean([u["a"] for u in updates], axis=0), rtol=1e-6
    )
    np.testing.assert_array_equal(weighted_mean(updates[:1], [7])["b"], updates[0]["b"])


@pytest.mark.parametrize("weights", [[0, 0], [-1, 2], [1]])
def test_bad_weights_raise(weights):
    with pytest.raises(ValueError):
        weighted_mean(random_updates(2), weights)


def test_secagg_weights_and_error_bound():
    assert secagg_weights([16, 32, 64], max_weight=32) == [0.5, 1.0, 1.0]
    # 3 members at full weight: error below one quantisation step (16 / 2**22) per member / total weight
    assert secagg_error_bound([1, 1, 1], 8.0, 2**22) == pytest.approx(16 / 2**22)
