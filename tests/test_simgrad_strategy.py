"""The SimGrad strategy without Flower: personalised mixing, routing, secure grouping, state by partition."""

import numpy as np
import pytest

from strategies import ClientInfo, GroupResult
from strategies.simgrad import ClientReport, SimGrad, SimGradSection

R = 2
NAMES = [f"block{b}.{p}.{k}" for b in range(2) for p in ("q_proj", "v_proj") for k in ("P", "Q")]


def zeros() -> dict:
    return {n: np.zeros((R, R) if n.endswith("P") else (R,), np.float32) for n in sorted(NAMES)}


def clients(n: int, models=("small", "wide")) -> dict[int, ClientInfo]:
    return {100 + i: ClientInfo(100 + i, i, models[i % len(models)], zeros()) for i in range(n)}


def reports(n: int, seed: int = 0, salience=None) -> dict[int, ClientReport]:
    rng = np.random.default_rng(seed)
    family = [rng.normal(size=16) for _ in range(2)]  # two task families
    return {
        100 + i: ClientReport(
            family[i % 2] + 0.1 * rng.normal(size=16), np.asarray(salience[i] if salience else [1.0, 2.0])
        )
        for i in range(n)
    }


def local_update(i: int) -> dict:
    rng = np.random.default_rng(10 + i)
    return {k: rng.normal(size=v.shape).astype(np.float32) for k, v in zeros().items()}


def first_round(n: int, secure: bool, **cfg) -> tuple[SimGrad, dict[int, ClientReport], list]:
    """A strategy over ``n`` clients that has seen its round-1 reports, and its round-1 groups."""
    strategy = SimGrad(SimGradSection(**cfg), secure=secure)
    strategy.initialise(clients(n))
    reps = reports(n)
    strategy.observe_reports(1, reps)
    return strategy, reps, strategy.train_groups(1, sorted(reps))


def reference_weights(reps: dict[int, ClientReport], tau: float, mix_self: bool = True) -> np.ndarray:
    sig = np.stack([reps[n].signature for n in sorted(reps)])
    unit = sig / np.linalg.norm(sig, axis=1, keepdims=True)
    s = unit @ unit.T / tau
    e = np.exp(s - s.max(axis=1, keepdims=True))
    if not mix_self:  # the row is over the other clients
        np.fill_diagonal(e, 0.0)
    return e / e.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("mix_self", [False, True])
def test_plain_mode_gives_every_client_its_exact_relevance_weighted_mix(mix_self):
    strategy, reps, groups = first_round(4, secure=False, temperature=0.5, route_budget=0, mix_self=mix_self)
    assert [g.members for g in groups] == [[100], [101], [102], [103]]  # plain: every client is its own group
    assert all(g.send_back == sorted(NAMES) for g in groups)
    updates = [local_update(i) for i in range(4)]
    strategy.update(1, [GroupResult(g.name, updates[i], 8.0, g.members) for i, g in enumerate(groups)])
    w = reference_weights(reps, 0.5, mix_self)
    assert (np.diag(w) > 0).all() == mix_self
    for i in range(4):
        for name in NAMES:
            expected = sum(w[i, j] * updates[j][name] for j in range(4))
            np.testing.assert_allclose(strategy.eval_arrays(100 + i)[name], expected, rtol=1e-5, atol=1e-6)
    # same-family clients (0, 2) weigh each other more than the other family
    assert w[0, 2] > w[0, 1] and w[0, 2] > w[0, 3]
    assert strategy.report()["relevance_partitions"] == [0, 1, 2, 3]


def test_routing_sends_only_salient_blocks_and_keeps_the_others():
    strategy = SimGrad(SimGradSection(route_budget=1, mixing="uniform"), secure=False)
    strategy.initialise(clients(3))
    strategy.observe_reports(1, reports(3, salience=[[0.1, 5.0], [3.0, 0.2], [0.0, 1.0]]))
    groups = strategy.train_groups(1, [100, 101, 102])
    assert [g.config.wire()["active-blocks"] for g in groups] == ["1", "0", "1"]
    assert all(all(n.startswith(f"block{g.config.wire()['active-blocks']}.") for n in g.send_back) for g in groups)
    ups = [{k: v for k, v in local_update(i).items() if k in g.send_back} for i, g in enumerate(groups)]
    strategy.update(1, [GroupResult(g.name, ups[i], 8.0, g.members) for i, g in enumerate(groups)])
    mixed = strategy.eval_arrays(100)
    # block 1 was sent by clients 0 and 2: their uniform mean; block 0 only by client 1
    np.testing.assert_allclose(
        mixed["block1.q_proj.P"], (ups[0]["block1.q_proj.P"] + ups[2]["block1.q_proj.P"]) / 2, rtol=1e-6
    )
    np.testing.assert_allclose(mixed["block0.q_proj.P"], ups[1]["block0.q_proj.P"], rtol=1e-6)


@pytest.mark.parametrize("mix_self", [False, True])
def test_secure_mode_groups_of_three_and_mixes_group_means(mix_self):
    strategy, reps, groups = first_round(6, secure=True, temperature=0.5, route_budget=0, mix_self=mix_self)
    assert [g.members for g in groups] == [[100, 102, 104], [101, 103, 105]]  # the two planted families
    updates = {100 + i: local_update(i) for i in range(6)}
    means = [{k: np.mean([updates[m][k] for m in g.members], axis=0) for k in NAMES} for g in groups]
    strategy.update(1, [GroupResult(g.name, means[i], 24.0, g.members) for i, g in enumerate(groups)])
    w = reference_weights(reps, 0.5, mix_self)
    members = [[m - 100 for m in g.members] for g in groups]
    for i in range(6):
        wg = np.array([w[i, idx].sum() for idx in members])
        expected = sum(wg[g] * means[g]["block0.q_proj.P"] for g in range(2))
        np.testing.assert_allclose(strategy.eval_arrays(100 + i)["block0.q_proj.P"], expected, rtol=1e-5, atol=1e-6)


def test_state_is_keyed_by_partition_so_a_restarted_federation_resumes():
    strategy, _, groups = first_round(3, secure=False, route_budget=0)
    strategy.update(1, [GroupResult(g.name, local_update(i), 8.0, g.members) for i, g in enumerate(groups)])
    state = strategy.state_dict()
    assert sorted(state) == ["client-0", "client-1", "client-2"]
    restarted = SimGrad(SimGradSection(route_budget=0), secure=False)
    new_nodes = {7 + i: ClientInfo(7 + i, i, "small", zeros()) for i in range(3)}  # new node ids, same partitions
    restarted.initialise(new_nodes)
    restarted.load_state_dict(state)
    for i in range(3):
        for k in NAMES:
            np.testing.assert_array_equal(restarted.eval_arrays(7 + i)[k], strategy.eval_arrays(100 + i)[k])


def test_clients_with_different_pq_shapes_are_refused():
    bad = clients(3)
    bad[102].initial["block0.q_proj.P"] = np.zeros((R + 1, R + 1), np.float32)
    with pytest.raises(ValueError, match="node 102"):
        SimGrad(SimGradSection()).initialise(bad)


def test_a_restarted_node_rejoins_mid_run_with_its_partitions_state():
    strategy, _, groups = first_round(3, secure=False, route_budget=0)
    strategy.update(1, [GroupResult(g.name, local_update(i), 8.0, g.members) for i, g in enumerate(groups)])
    before = strategy.eval_arrays(102)
    strategy.initialise({55: ClientInfo(55, 2, "wide", zeros())})  # partition 2's SuperNode restarted: new node id
    for k in NAMES:
        np.testing.assert_array_equal(strategy.eval_arrays(55)[k], before[k])  # not reset to the fresh adapter
    strategy.observe_reports(2, {nid: rep for nid, rep in reports(3).items() if nid != 102} | {55: reports(3)[102]})
    assert 55 in {m for g in strategy.train_groups(2, [100, 101, 55]) for m in g.members}
    late = {56: ClientInfo(56, 3, "small", {k: np.zeros(3, np.float32) for k in NAMES})}
    with pytest.raises(ValueError, match="node 56"):  # a late joiner is held to the same P/Q shapes
        strategy.initialise(late)


@pytest.mark.parametrize("mix_self", [False, True])
def test_a_client_that_sits_out_a_sampled_round_keeps_its_mix_and_weighs_in_no_one(mix_self):
    """Client sampling: only the sampled clients report and train. Relevance is built from this round's signatures
    alone (no stale signature of the absent client decides a weight), the absent client's personal global P/Q is
    left as it was, and the present clients' mixes are the exact ones over the present clients."""
    strategy, _, groups = first_round(4, secure=False, temperature=0.5, route_budget=0, mix_self=mix_self)
    strategy.update(1, [GroupResult(g.name, local_update(i), 8.0, g.members) for i, g in enumerate(groups)])
    absent_before = {k: v.copy() for k, v in strategy.eval_arrays(103).items()}
    present = {nid: rep for nid, rep in reports(4, seed=1).items() if nid != 103}
    strategy.observe_reports(2, present)
    groups = strategy.train_groups(2, sorted(present))
    assert [g.members for g in groups] == [[100], [101], [102]] and strategy.weights.shape == (3, 3)
    updates = [local_update(20 + i) for i in range(3)]
    strategy.update(2, [GroupResult(g.name, updates[i], 8.0, g.members) for i, g in enumerate(groups)])
    for name, value in absent_before.items():
        np.testing.assert_array_equal(strategy.eval_arrays(103)[name], value)
    w = reference_weights(present, 0.5, mix_self=mix_self)
    for i in range(3):
        expected = sum(w[i, j] * updates[j]["block0.q_proj.P"] for j in range(3))
        np.testing.assert_allclose(strategy.eval_arrays(100 + i)["block0.q_proj.P"], expected, rtol=1e-5, atol=1e-6)


def test_one_members_salience_cannot_choose_its_groups_blocks_alone():
    """Salience counts as each member's shares of its own total: a member reporting 1e300 on one block has the
    say of one member, not of all (a review had it choose its SecAgg+ group's blocks)."""
    strategy = SimGrad(SimGradSection(route_budget=1, mixing="uniform", min_group_size=3), secure=True)
    strategy.initialise(clients(3))
    strategy.observe_reports(1, reports(3, salience=[[4.0, 1.0], [4.0, 1.0], [0.0, 1e300]]))
    (group,) = strategy.train_groups(1, [100, 101, 102])
    assert group.config.wire() == {"active-blocks": "0"}  # shares: block 0 has 0.8 + 0.8, block 1 0.2 + 0.2 + 1
