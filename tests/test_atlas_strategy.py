"""The ATLAS strategy without Flower: k and purity on two task sets, FedAvg strictly within clusters, small
clusters merged under SecAgg+, oracle clustering, model families apart, resume keeps the clusters."""

import numpy as np
import pytest

from strategies import ClientInfo, GroupResult, load_run_config
from strategies.atlas import Atlas, AtlasSection
from strategies.fingerprint import FingerprintReport, FingerprintSection

SHAPES = {"a": (3, 2), "b": (4,)}


def asks_anyone(strategy, server_round: int) -> bool:
    """Whether the strategy asks any of its clients for a report before this round (all of them sampled)."""
    return bool(strategy.report_nodes(server_round, sorted(strategy.partition_of)))


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
    assert not asks_anyone(resumed, 2)
    for i in range(6):
        np.testing.assert_array_equal(resumed.eval_arrays(100 + i)["a"], strategy.eval_arrays(100 + i)["a"])


def test_recluster_every_asks_again():
    strategy = atlas([0, 1, 0, 1], recluster_every=2)
    assert [asks_anyone(strategy, r) for r in (2, 3, 4, 5)] == [False, True, False, True]


def test_k_larger_than_k_max_is_refused():
    from common.config import ConfigError

    with pytest.raises(ConfigError, match="atlas.k"):
        load_run_config({"strategy": "atlas", "atlas.k": 7})


# ---- per-layer ranks under memory budgets -------------------------------------------------------------------
PEFT = "base_model.model.model.layers.{}.self_attn.q_proj.lora_{}.weight"


def lora_initial(r=8, width=64, blocks=3):
    rng = np.random.default_rng(0)
    out = {}
    for b in range(blocks):
        out[PEFT.format(b, "A")] = rng.normal(size=(r, width)).astype(np.float32)
        out[PEFT.format(b, "B")] = np.zeros((width, r), np.float32)
    return out


def ranked_atlas(budgets, tasks, **cfg):
    strategy = Atlas(AtlasSection(ranks=[4, 8, 16], **cfg), FingerprintSection(), secure=False)
    strategy.initialise({100 + i: ClientInfo(100 + i, i, "small", lora_initial()) for i in range(len(tasks))})
    reports = {}
    for i, (budget, task) in enumerate(zip(budgets, tasks)):
        base = report(i, task)
        names = [f"model.layers.{b}.self_attn.q_proj" for b in range(3)]
        importance = np.array([1.0, 2.0, 3.0]) if i % 2 else np.array([3.0, 2.0, 1.0])
        reports[100 + i] = FingerprintReport(base.fingerprint, names, importance, base.tasks, budget)
    strategy.observe_reports(1, reports)
    return strategy


def test_ranks_follow_budget_and_importance_and_travel_padded_with_masks():
    # rank r on a 64x64 layer: r * 128 params * 16 bytes
    strategy = ranked_atlas([0.1, 0.1, 0.03, 0.03], [0, 0, 0, 0], k=0, clustering="oracle")
    row = strategy.report()["atlas"]["small"]
    assert all(mb <= budget for mb, budget in zip(row["adapter_mb"].values(), row["budget_mb"].values()))
    big_even, big_odd, small = row["ranks"]["0"], row["ranks"]["1"], row["ranks"]["2"]
    assert big_even[0] >= big_even[2] and big_odd[2] >= big_odd[0]  # the most important layer gets the most
    assert sum(small) < sum(big_even)
    (group,) = strategy.train_groups(1, [100, 101, 102, 103])
    wire = [max(row["ranks"][str(p)][layer] for p in range(4)) for layer in range(3)]
    for nid in group.members:
        start = group.start[nid]
        assert start[PEFT.format(0, "A")].shape == (wire[0], 64)
        own = row["ranks"][str(nid - 100)]
        np.testing.assert_array_equal(start["rank-mask.model.layers.0.self_attn.q_proj"], np.arange(wire[0]) < own[0])
        assert group.member_configs[nid].wire() == {
            "lora-ranks": ",".join(map(str, own)),
            "wire-ranks": ",".join(map(str, wire)),
        }
        # fresh slots beyond the initial rank 8 are seeded alike for every member, never zero (dead) A rows
        assert np.all(np.abs(start[PEFT.format(0, "A")]).sum(axis=1) > 0)


def test_ranked_group_mean_averages_each_slot_over_members_that_have_it():
    strategy = ranked_atlas([0.1, 0.03, 0.1, 0.03], [0, 0, 0, 0], clustering="oracle")
    (group,) = strategy.train_groups(1, [100, 101, 102, 103])
    own = {nid: strategy._own(nid - 100) for nid in group.members}
    path = "model.layers.0.self_attn.q_proj"
    a_name = PEFT.format(0, "A")
    wire = group.start[100][a_name].shape[0]
    sent = {}
    for nid in group.members:
        a = np.zeros((wire, 64), np.float32)
        a[: own[nid][path]] = float(nid - 99)  # member k's slots all hold k
        sent[nid] = a
    mean_a = sum(sent.values()) / 4
    mask = sum((np.arange(wire) < own[nid][path]).astype(np.float32) for nid in group.members) / 4
    result = {k: np.mean([group.start[n][k] for n in group.members], axis=0) for k in group.start[100]}
    result[a_name], result["rank-mask." + path] = mean_a, mask
    strategy.update(1, [GroupResult(group.name, result, 4.0, group.members)])
    new_a = strategy.adapter_of[0][a_name]
    for slot in range(wire):
        holders = [nid - 99 for nid in group.members if own[nid][path] > slot]
        np.testing.assert_allclose(new_a[slot], np.mean(holders), rtol=1e-6)
    assert not any(k.startswith("rank-mask") for k in strategy.adapter_of[0])


def test_a_budget_that_fits_no_rank_is_refused():
    with pytest.raises(ValueError, match="atlas.memory-mb: partition 1: a memory budget of 0.001 MB fits no rank"):
        strategy = Atlas(AtlasSection(memory_mb=[1.0, 0.001]), FingerprintSection())
        strategy.initialise({100 + i: ClientInfo(100 + i, i, "small", lora_initial()) for i in range(2)})
    strategy = Atlas(AtlasSection(), FingerprintSection())
    strategy.initialise({100: ClientInfo(100, 0, "small", lora_initial())})
    with pytest.raises(ValueError, match="fits no rank"):  # a node's own budget: its report is left out
        strategy.read_report(
            {"fingerprint": np.ones(4)},
            {"layer_names": ["x"], "layer_importance": [1.0], "memory_mb": 0.001, "model": "small"},
        )


def test_figures_of_a_clustering_round_and_the_run(tmp_path):
    strategy = ranked_atlas([0.1, 0.03, 0.1, 0.03], [0, 1, 0, 1], k=2)
    row = {"atlas": strategy.report()["atlas"]}
    drawn = strategy.plot_round(1, row, tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in drawn) == [
        "clusters/round-001-small.png",
        "ranks/round-001-small.png",
    ]
    assert strategy.plot_round(2, row, tmp_path) == []  # no new clustering in round 2: nothing redrawn
    rows = [row | {"round": 1, "node": None}] + [
        {"round": r, "node": 100 + p, "partition_id": p, "eval_loss": 2.0 - r * (p + 1) / 10}
        for r in (0, 1)
        for p in range(4)
    ]
    (figure,) = strategy.plot_run(rows, tmp_path)
    assert figure.name == "cluster-loss.png" and figure.stat().st_size > 5_000


def test_under_sampling_clusters_grow_as_clients_are_first_sampled_and_absent_members_follow_their_cluster():
    """ATLAS with half of the clients sampled: round 1's sample is clustered; clients sampled later join
    the clustering with the fingerprint they report then; a cluster averages what came, and its members that sat
    the round out are given the new cluster adapter."""
    strategy = Atlas(AtlasSection(k=2), FingerprintSection())
    strategy.initialise(clients(8))
    tasks = [0, 1, 0, 1, 0, 1, 0, 1]
    first = [100, 101, 102, 103]
    strategy.observe_reports(1, {nid: report(nid - 100, tasks[nid - 100]) for nid in first})
    assert strategy.members["small"] == [0, 1, 2, 3] and strategy.report()["atlas"]["small"]["purity"] == 1.0
    second = [102, 104, 105, 106]
    assert strategy.report_nodes(2, second) == [104, 105, 106]
    strategy.observe_reports(2, {nid: report(nid - 100, tasks[nid - 100]) for nid in (104, 105, 106)})
    row = strategy.report()["atlas"]["small"]
    assert row["partitions"] == [0, 1, 2, 3, 4, 5, 6] and row["purity"] == 1.0
    groups = strategy.train_groups(2, second)
    assert sorted(sorted(g.members) for g in groups) == [[102, 104, 106], [105]]
    strategy.update(2, [GroupResult(g.name, trained(len(g.members)), 1.0, g.members) for g in groups])
    np.testing.assert_array_equal(strategy.eval_arrays(100)["a"], trained(3)["a"])  # sat out, same cluster as 102
    np.testing.assert_array_equal(strategy.eval_arrays(101)["a"], trained(1)["a"])
    np.testing.assert_array_equal(strategy.eval_arrays(107)["a"], np.zeros((3, 2)))  # never sampled: the initial


def test_client_sampling_is_accepted_for_atlas_and_mira():
    for name in ("atlas", "mira"):
        assert load_run_config({"strategy": name, "fraction-train": 0.25}).fraction_train == 0.25
