"""The ATLAS strategy without Flower: k and purity on two task sets, FedAvg strictly within clusters, small
clusters merged under SecAgg+, oracle clustering, model families apart, resume keeps the clusters."""

import numpy as np
import pytest

from strategies import ClientInfo, GroupResult
from strategies.atlas import Atlas, AtlasSection
from strategies.fingerprint import FingerprintReport, FingerprintSection

SHAPES = {"a": (3, 2), "b": (4,)}


def clients(n, models=("small",)):
    return {
        100 + i: ClientInfo(
            100 + i, i, models[i % len(models)], {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
        )
        for i in range(n)
    }


def report(i, task, size=16):
    rng = np.random.default_rng(i)
    centre = np.eye(size)[task] * 4
    return FingerprintReport(centre + 0.2 * rng.normal(size=size), ["block1.q"], np.ones(1), f"task{task}")


def atlas(tasks, secure=False, models=("small",), **cfg):
    strategy = Atlas(AtlasSection(**cfg), FingerprintSection(), secure=secure)
    strategy.initialise(clients(len(tasks), models))
    strategy.observe_reports(1, {100 + i: report(i, t) for i, t in enumerate(tasks)})
    return strategy


def trained(i):
    return {k: np.full(s, float(i), np.float32) for k, s in SHAPES.items()}


def test_two_task_sets_give_k_2_purity_1_and_fedavg_only_inside_clusters():
    strategy = atlas([0, 1, 0, 1, 0, 1], secure=True)
    row = strategy.report()["atlas"]["small"]
    assert row["k"] == 2 and row["purity"] == 1.0 and row["group_purity"] == 1.0
    assert set(row["k_scores"]) == {"2", "3", "4", "5"} and row["silhouette"] > 0.5
    groups = strategy.train_groups(1, [100 + i for i in range(6)])
    assert sorted(g.members for g in groups) == [[100, 102, 104], [101, 103, 105]]
    results = []
    for g in groups:
        w = [10.0 * (1 + m - 100) for m in g.members]  # FedAvg weights: examples
        mean = {k: sum(wi * trained(m - 100)[k] for wi, m in zip(w, g.members)) / sum(w) for k in SHAPES}
        results.append(GroupResult(g.name, mean, sum(w), g.members))
    strategy.update(1, results)
    even = (10 * 0 + 30 * 2 + 50 * 4) / 90
    np.testing.assert_allclose(strategy.eval_arrays(100)["a"], even)
    np.testing.assert_allclose(strategy.eval_arrays(104)["b"], even)
    assert not np.allclose(strategy.eval_arrays(101)["a"], even)  # the other cluster never sees these updates


def test_small_clusters_merge_under_secagg_but_not_in_plaintext():
    tasks = [0, 0, 0, 1, 1, 2, 2]
    plain = atlas(tasks, k=3)
    assert sorted(len(g.members) for g in plain.train_groups(1, [100 + i for i in range(7)])) == [2, 2, 3]
    secure = atlas(tasks, secure=True, k=3)
    groups = secure.train_groups(1, [100 + i for i in range(7)])
    assert all(len(g.members) >= 3 for g in groups)
    row = secure.report()["atlas"]["small"]
    assert row["purity"] == 1.0 and row["group_purity"] < 1.0 and row["merges"]


def test_oracle_clusters_by_task_sets():
    strategy = atlas([0, 1, 1, 0], clustering="oracle")
    assert strategy.report()["atlas"]["small"]["clusters"] == [0, 1, 1, 0]


def test_model_families_cluster_separately():
    strategy = atlas([0, 0, 1, 1, 0, 0, 1, 1], models=("small", "wide"), k=2)
    report = strategy.report()["atlas"]
    assert set(report) == {"small", "wide"}
    names = {g.name for g in strategy.train_groups(1, [100 + i for i in range(8)])}
    assert names == {"small-c0", "small-c1", "wide-c0", "wide-c1"}


def test_resume_keeps_the_clusters_and_adapters():
    strategy = atlas([0, 1, 0, 1, 0, 1])
    groups = strategy.train_groups(1, [100 + i for i in range(6)])
    strategy.update(1, [GroupResult(g.name, trained(g.members[0] - 100), 1.0, g.members) for g in groups])
    resumed = Atlas(AtlasSection(), FingerprintSection())
    resumed.initialise(clients(6))
    resumed.load_state_dict(strategy.state_dict())
    assert resumed.report()["atlas"]["small"]["clusters"] == strategy.report()["atlas"]["small"]["clusters"]
    assert not resumed.wants_report(2)
    for i in range(6):
        np.testing.assert_array_equal(resumed.eval_arrays(100 + i)["a"], strategy.eval_arrays(100 + i)["a"])


def test_recluster_every_asks_again():
    strategy = atlas([0, 1, 0, 1], recluster_every=2)
    assert [strategy.wants_report(r) for r in (2, 3, 4, 5)] == [False, True, False, True]


def test_k_larger_than_k_max_is_refused():
    from common.config import ConfigError, RunConfig

    with pytest.raises(ConfigError, match="atlas.k"):
        RunConfig.from_flat({"strategy": "atlas", "atlas.k": 7})
