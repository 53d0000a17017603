"""ATLAS with MIRA inside the clusters (``atlas.laplacian-eta`` > 0, seed 003 phase 4), without Flower: exact
same-cluster neighbour terms in plaintext, group means under SecAgg+, per-slot neighbour terms with ranks, the
client's own adapter kept and stepped, the adjacency in the report and its figure in cluster order."""

import numpy as np
import pytest
from test_atlas_strategy import PEFT, SHAPES, clients, lora_initial, report, trained

from strategies import ClientInfo, GroupResult, load_run_config
from strategies.atlas import Atlas, AtlasSection
from strategies.fingerprint import FingerprintReport, FingerprintSection

TASKS = [0, 1, 0, 1, 0, 1]


def laplacian_atlas(tasks=TASKS, secure=False, eta=0.5, k=2):
    strategy = Atlas(AtlasSection(laplacian_eta=eta, k=k), FingerprintSection(), secure=secure)
    strategy.initialise(clients(len(tasks)))
    strategy.observe_reports(1, {100 + i: report(i, t) for i, t in enumerate(tasks)})
    return strategy


def test_plaintext_neighbour_terms_are_exact_and_stay_inside_each_cluster():
    strategy = laplacian_atlas()
    groups = strategy.train_groups(1, [100 + i for i in range(6)])
    assert sorted(g.members for g in groups) == [[100 + i] for i in range(6)]  # every W_l seen: N_k exact
    assert not any("neighbour-term" in c for g in groups for c in g.member_configs.values())  # nothing yet
    strategy.update(1, [GroupResult(g.name, trained(g.members[0] - 100), 1.0, g.members) for g in groups])
    row = strategy.report()["atlas"]["small"]
    a, clusters = np.array(row["adjacency"]), row["clusters"]
    for k in range(6):
        expected = sum(a[k, j] * trained(j)["a"] for j in range(6))  # the explicit sum over every client
        np.testing.assert_allclose(strategy.eval_arrays(100 + k)["a"], expected, rtol=1e-5)
        assert all(a[k, j] == 0 for j in range(6) if clusters[j] != clusters[k])
        np.testing.assert_allclose(a[k].sum(), 1.0)
    assert strategy.eval_config(100).neighbour_term is True
    assert row["laplacian_eta"] == 0.5 and len(row["adjacency_raw"]) == 6


def test_secure_neighbour_term_is_the_clusters_group_mean():
    strategy = laplacian_atlas(secure=True)
    groups = strategy.train_groups(1, [100 + i for i in range(6)])
    assert sorted(g.members for g in groups) == [[100, 102, 104], [101, 103, 105]]
    means = {g.name: {k: np.mean([trained(m - 100)[k] for m in g.members], axis=0) for k in SHAPES} for g in groups}
    strategy.update(1, [GroupResult(g.name, means[g.name], 3.0, g.members) for g in groups])
    for g in groups:
        for m in g.members:
            np.testing.assert_allclose(strategy.eval_arrays(m)["a"], means[g.name]["a"], rtol=1e-6)


def test_a_client_alone_in_its_cluster_keeps_its_own_adapter_and_a_failed_neighbour_is_left_out():
    strategy = laplacian_atlas(tasks=[0, 0, 0, 1, 1, 2], k=3)
    row = strategy.report()["atlas"]["small"]
    alone = next(p for p in range(6) if row["clusters"].count(row["clusters"][p]) == 1)
    groups = strategy.train_groups(1, [100 + i for i in range(6)])
    failed = next(p for p in range(6) if p != alone and row["clusters"].count(row["clusters"][p]) == 2)
    partner = next(p for p in range(6) if p != failed and row["clusters"][p] == row["clusters"][failed])
    results = [GroupResult(g.name, trained(g.members[0] - 100), 1.0, g.members) for g in groups]
    strategy.update(1, [r for r in results if r.contributors != [100 + failed]])
    np.testing.assert_allclose(strategy.eval_arrays(100 + alone)["a"], trained(alone)["a"])
    # the partner's only neighbour failed: it keeps its own trained adapter as its term (no pull this round)
    np.testing.assert_allclose(strategy.eval_arrays(100 + partner)["a"], trained(partner)["a"])


def test_with_ranks_each_slot_is_mixed_over_the_neighbours_that_have_it():
    strategy = Atlas(AtlasSection(ranks=[4, 8, 16], laplacian_eta=1.0, clustering="oracle"), FingerprintSection())
    strategy.initialise({100 + i: ClientInfo(100 + i, i, "small", lora_initial()) for i in range(3)})
    names = [f"model.layers.{b}.self_attn.q_proj" for b in range(3)]
    strategy.observe_reports(
        1,
        {
            100 + i: FingerprintReport(report(i, 0).fingerprint, names, np.ones(3), "task0", budget)
            for i, budget in enumerate([0.1, 0.03, 0.1])
        },
    )
    groups = strategy.train_groups(1, [100, 101, 102])
    a_name = PEFT.format(0, "A")
    sent = {}
    for g in groups:
        (nid,) = g.members
        own = int(g.member_configs[nid].wire()["lora-ranks"].split(",")[0])
        arrays = dict(g.start[nid])
        arrays[a_name] = np.where(np.arange(arrays[a_name].shape[0])[:, None] < own, float(nid - 99), 0.0)
        arrays[a_name] = arrays[a_name] * np.ones_like(g.start[nid][a_name])
        sent[nid] = (own, arrays)
    strategy.update(1, [GroupResult(g.name, sent[g.members[0]][1], 1.0, g.members) for g in groups])
    a = np.array(strategy.report()["atlas"]["small"]["adjacency"])
    term = strategy.adapter_of[0][a_name]
    assert sent[100][0] > sent[101][0]  # partition 1 (the small budget) has fewer slots than its neighbours
    for slot in range(term.shape[0]):
        holders = [j for j in (1, 2) if sent[100 + j][0] > slot]  # partition 0's neighbours that have the slot
        weights = [a[0, j] for j in holders]
        expected = sum(w * (j + 1) for w, j in zip(weights, holders)) / sum(weights)
        np.testing.assert_allclose(term[slot], expected, rtol=1e-5)
    assert not any(name.startswith("rank-mask") for name in strategy.adapter_of[0])


def test_the_client_keeps_its_own_adapter_and_steps_only_toward_a_neighbour_term():
    from types import SimpleNamespace

    from flwr.app import RecordDict

    from common.adapters import ClientState
    from strategies.atlas.client import OWN_ADAPTER, AtlasClient

    initial = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    for eta in (0.0, 0.25):
        cfg = load_run_config({"strategy": "atlas", "atlas.laplacian-eta": eta})
        rt = SimpleNamespace(state=ClientState(RecordDict(), (OWN_ADAPTER,)), adapter=SimpleNamespace(initial=initial))
        client = AtlasClient(cfg)
        client.neighbour_term = False
        np.testing.assert_array_equal(client.start(rt, trained(7))["a"], trained(7)["a"])  # round 1: what was sent
        client.outgoing(rt, trained(1))
        client.neighbour_term = True
        start = client.start(rt, trained(5))
        expected = trained(5)["a"] if eta == 0 else 0.75 * trained(1)["a"] + 0.25 * trained(5)["a"]
        np.testing.assert_allclose(start["a"], expected, rtol=1e-6)  # eta = 0: ATLAS's FedAvg start, as before
        if eta:
            client.neighbour_term = False  # not a neighbour term (the server has none yet): the own adapter
            np.testing.assert_array_equal(client.start(rt, trained(5))["a"], trained(1)["a"])


def test_the_adjacency_figure_is_drawn_in_cluster_order(tmp_path):
    strategy = laplacian_atlas()
    row = {"atlas": strategy.report()["atlas"]}
    drawn = strategy.plot_round(1, row, tmp_path)
    assert "adjacency/round-001-small.png" in [p.relative_to(tmp_path).as_posix() for p in drawn]
    from strategies.atlas.plots import by_cluster

    ordered = by_cluster(row["atlas"])["small"]
    assert ordered["clusters"] == sorted(ordered["clusters"])
    assert sorted(ordered["partitions"]) == list(range(6))


def test_laplacian_keys_are_validated():
    from common.config import ConfigError

    with pytest.raises(ConfigError, match="atlas.laplacian-eta"):
        load_run_config({"strategy": "atlas", "atlas.laplacian-eta": 1.5})
    with pytest.raises(ConfigError, match="atlas.laplacian-alpha"):
        load_run_config({"strategy": "atlas", "atlas.laplacian-alpha": "wide"})


def test_clusters_with_different_wire_ranks_mix_only_their_own_shapes():
    strategy = Atlas(AtlasSection(ranks=[4, 8, 16], laplacian_eta=0.5, k=2), FingerprintSection())
    strategy.initialise({100 + i: ClientInfo(100 + i, i, "small", lora_initial()) for i in range(4)})
    names = [f"model.layers.{b}.self_attn.q_proj" for b in range(3)]
    budgets = [0.1, 0.03, 0.1, 0.03]  # cluster of task 0: large ranks; task 1: small ones
    strategy.observe_reports(
        1,
        {
            100 + i: FingerprintReport(report(i, i % 2).fingerprint, names, np.ones(3), f"task{i % 2}", budgets[i])
            for i in range(4)
        },
    )
    groups = strategy.train_groups(1, [100, 101, 102, 103])
    a_name = PEFT.format(0, "A")
    wires = {g.members[0]: g.start[g.members[0]][a_name].shape[0] for g in groups}
    assert wires[100] == wires[102] > wires[101] == wires[103]
    sent = {}
    for g in groups:
        (nid,) = g.members
        arrays = dict(g.start[nid])
        arrays[a_name] = np.full_like(arrays[a_name], float(nid - 99))  # client p's A holds p + 1
        sent[g.name] = arrays
    strategy.update(1, [GroupResult(g.name, sent[g.name], 1.0, g.members) for g in groups])
    for p in range(4):  # the only neighbour in p's cluster is p ^ 2: its term is that partner's adapter
        term = strategy.adapter_of[p][a_name]
        assert term.shape[0] == wires[100 + p]
        np.testing.assert_allclose(term, float((p ^ 2) + 1))
