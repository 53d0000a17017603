"""The MIRA strategy without Flower: exact neighbour terms in plaintext, group-level ones in secure mode, the
client's step, eta = 0, model families kept apart, bad fingerprints left out, resume."""

import numpy as np
import pytest

from strategies import ClientInfo, GroupResult, load_run_config
from strategies.aggregation import group_by_relevance, mix_group_means
from strategies.fingerprint import FingerprintReport, FingerprintSection, read_fingerprint
from strategies.fingerprint.laplacian import apply_step, laplacian_step, normalised_adjacency
from strategies.mira import Mira, MiraSection

SHAPES = {"a": (3, 2), "b": (4,)}


def asks_anyone(strategy, server_round: int) -> bool:
    """Whether the strategy asks any of its clients for a report before this round (all of them sampled)."""
    return bool(strategy.report_nodes(server_round, sorted(strategy.partition_of)))


def initial():
    return {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}


def clients(n, models=("small",)):
    return {100 + i: ClientInfo(100 + i, i, models[i % len(models)], initial()) for i in range(n)}


def report(i, size=12, seed=0):
    rng = np.random.default_rng(seed + i)
    task = np.eye(size)[i % 2] * 5  # two tasks: even and odd partitions
    return FingerprintReport(task + 0.1 * rng.normal(size=size), ["block1.q", "block1.v"], np.ones(2), f"t{i % 2}")


def trained(i):
    rng = np.random.default_rng(50 + i)
    return {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}


def run_round(strategy, n, server_round=1):
    groups = strategy.train_groups(server_round, [100 + i for i in range(n)])
    results = []
    for g in groups:
        members = [nid - 100 for nid in g.members]
        mean = {k: np.mean([trained(i)[k] for i in members], axis=0) for k in SHAPES}
        results.append(GroupResult(g.name, mean, float(len(members)), g.members))
    strategy.update(server_round, results)
    return groups


def mira(n, secure=False, models=("small",), **cfg):
    strategy = Mira(MiraSection(**cfg), FingerprintSection(), secure=secure)
    strategy.initialise(clients(n, models))
    assert asks_anyone(strategy, 1)
    strategy.observe_reports(1, {100 + i: report(i) for i in range(n)})
    return strategy


def test_plaintext_neighbour_terms_give_the_exact_laplacian_step():
    strategy = mira(5, eta=0.4, alpha=0.05)
    groups = run_round(strategy, 5)
    assert [g.members for g in groups] == [[100], [101], [102], [103], [104]]
    points = strategy.reduced["small"].points
    a = normalised_adjacency(points, 0.05)
    exact = laplacian_step([trained(i) for i in range(5)], a, 0.4)
    for i in range(5):
        stepped = apply_step(trained(i), strategy.eval_arrays(100 + i), 0.4)
        for k in SHAPES:
            np.testing.assert_allclose(stepped[k], exact[i][k], rtol=1e-5, atol=1e-6)
    # the same-task neighbours carry most of the weight
    assert a[0, 2] + a[0, 4] > 0.9
    assert not asks_anyone(strategy, 2)  # refresh-every 0: fingerprints once


def test_secure_groups_have_three_members_and_mix_group_means():
    strategy = mira(6, secure=True, eta=0.5)
    groups = run_round(strategy, 6)
    assert all(len(g.members) >= 3 for g in groups)
    assert sorted(sorted(m - 100 for m in g.members) for g in groups) == [[0, 2, 4], [1, 3, 5]]  # by task
    a = strategy.adjacency["small"]
    index_groups = group_by_relevance(a, 3)
    means = [{k: np.mean([trained(i)[k] for i in g], axis=0) for k in SHAPES} for g in index_groups]
    expected = mix_group_means(a, index_groups, means)
    for i in range(6):
        for k in SHAPES:
            np.testing.assert_allclose(strategy.eval_arrays(100 + i)[k], expected[i][k], rtol=1e-6)


def test_secure_refuses_a_model_family_below_three():
    with pytest.raises(ValueError, match="fewer than 3"):
        Mira(MiraSection(), FingerprintSection(), secure=True).initialise(clients(4, ("small", "wide")))


def test_model_families_are_never_compared():
    strategy = mira(6, models=("small", "wide"))
    assert strategy.members == {"small": [0, 2, 4], "wide": [1, 3, 5]}
    run_round(strategy, 6)
    assert strategy.adjacency["small"].shape == (3, 3) and strategy.adjacency["wide"].shape == (3, 3)


def test_a_bad_or_mismatched_fingerprint_is_left_out_and_the_round_goes_on():
    with pytest.raises(ValueError, match="NaN"):
        read_fingerprint({"fingerprint": np.array([1.0, np.nan])}, {"layer_names": ["x"], "layer_importance": [1.0]})
    with pytest.raises(ValueError, match="one number for each"):
        read_fingerprint({"fingerprint": np.ones(3)}, {"layer_names": "x,y", "layer_importance": "1.0"})
    strategy = Mira(MiraSection(), FingerprintSection())
    strategy.initialise(clients(4))
    reports = {100 + i: report(i) for i in range(4)}
    reports[103] = report(3, size=7)
    left_out = strategy.observe_reports(1, reports)
    assert list(left_out) == [103] and "7 numbers" in left_out[103]
    groups = run_round(strategy, 4)
    assert sorted(m for g in groups for m in g.members) == [100, 101, 102]
    assert asks_anyone(strategy, 2)  # asked again while partition 3 has no fingerprint


def test_checkpoint_keeps_the_graph_and_the_neighbour_terms():
    strategy = mira(5)
    run_round(strategy, 5)
    state = strategy.state_dict()
    resumed = Mira(MiraSection(), FingerprintSection())
    resumed.initialise(clients(5))
    resumed.load_state_dict(state)
    np.testing.assert_allclose(resumed.adjacency["small"], strategy.adjacency["small"])
    assert not asks_anyone(resumed, 2)
    for i in range(5):
        for k in SHAPES:
            np.testing.assert_array_equal(resumed.eval_arrays(100 + i)[k], strategy.eval_arrays(100 + i)[k])


def test_eta_zero_clients_train_only_their_own_adapter():
    """mira.eta = 0 reduces to local-only training: whatever neighbour term arrives, a client starts every round
    from exactly the adapter it trained (with eta > 0 it moves toward the term)."""
    from types import SimpleNamespace

    from flwr.app import RecordDict

    from common.adapters import ClientState
    from strategies.mira.client import OWN_ADAPTER, MiraClient

    def client(eta):
        cfg = load_run_config({"strategy": "mira", "mira.eta": eta})
        state = ClientState(RecordDict(), (OWN_ADAPTER,))
        rt = SimpleNamespace(state=state, adapter=SimpleNamespace(initial={k: v.copy() for k, v in initial().items()}))
        return MiraClient(cfg), rt

    neighbours = trained(4)
    for eta in (0.0, 0.5):
        mira_client, rt = client(eta)
        np.testing.assert_array_equal(mira_client.start(rt, initial())["a"], initial()["a"])  # round 1
        sent, _ = mira_client.outgoing(rt, trained(1))  # the trained adapter is kept and sent
        np.testing.assert_array_equal(sent["a"], trained(1)["a"])
        start = mira_client.start(rt, neighbours)
        expected = trained(1)["a"] if eta == 0 else 0.5 * trained(1)["a"] + 0.5 * neighbours["a"]
        np.testing.assert_allclose(start["a"], expected, rtol=1e-6)


def test_under_sampling_fingerprints_join_as_clients_are_first_sampled_and_absent_clients_keep_theirs():
    """Round 1 samples 4 of 6: only they report and are placed; round 2 (no refresh) asks only the sampled clients
    without a fingerprint, keeps the others', and mixes only the means of the clients that trained."""
    strategy = Mira(MiraSection(eta=0.5), FingerprintSection())
    strategy.initialise(clients(6))
    first = [100, 101, 102, 103]
    assert strategy.report_nodes(1, first) == first
    strategy.observe_reports(1, {nid: report(nid - 100) for nid in first})
    assert strategy.members["small"] == [0, 1, 2, 3]
    groups = strategy.train_groups(1, first)
    assert sorted(m for g in groups for m in g.members) == first
    kept = {p: strategy.reports[p].fingerprint.copy() for p in (0, 1, 2, 3)}

    second = [101, 103, 104, 105]
    assert asks_anyone(strategy, 2) and strategy.report_nodes(2, second) == [104, 105]  # 101 and 103 have one
    strategy.observe_reports(2, {104: report(4, seed=9), 105: report(5, seed=9)})
    assert strategy.members["small"] == list(range(6))
    for p, fingerprint in kept.items():  # not asked again, not dropped: partitions 0 and 2 sat round 2 out
        np.testing.assert_array_equal(strategy.reports[p].fingerprint, fingerprint)
    assert not asks_anyone(strategy, 3) and strategy.report_nodes(3, [100, 102]) == []
    groups = strategy.train_groups(2, second)
    assert sorted(m for g in groups for m in g.members) == second  # only the sampled train
    means = {g.name: trained(g.members[0] - 100) for g in groups}
    strategy.update(2, [GroupResult(name, mean, 1.0, []) for name, mean in means.items()])
    # partition 0's neighbour term mixes only what trained in round 2 (1, 3, 4, 5), with its row's weights
    a = strategy.adjacency["small"]
    present = [1, 3, 4, 5]
    w = a[0, present] / a[0, present].sum()
    expected = sum(wi * trained(p)["a"] for wi, p in zip(w, present))
    np.testing.assert_allclose(strategy.eval_arrays(100)["a"], expected, rtol=1e-5)


def test_a_refresh_under_sampling_replaces_only_the_reporters_fingerprints():
    strategy = Mira(MiraSection(refresh_every=2), FingerprintSection())
    strategy.initialise(clients(4))
    strategy.observe_reports(1, {100 + i: report(i) for i in range(4)})
    before = {p: r.fingerprint.copy() for p, r in strategy.reports.items()}
    assert strategy.report_nodes(3, [100, 101]) == [100, 101]  # round 3 refreshes: every sampled client
    bad = report(1, size=7)  # a wrong layout: left out, and it sits out until it sends a valid one
    left_out = strategy.observe_reports(3, {100: report(0, seed=5), 101: bad})
    assert list(left_out) == [101] and 1 not in strategy.reports
    assert not np.array_equal(strategy.reports[0].fingerprint, before[0])
    for p in (2, 3):
        np.testing.assert_array_equal(strategy.reports[p].fingerprint, before[p])
