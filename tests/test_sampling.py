"""Client sampling (server_app/sampling.py): Flower's size rule, a draw that depends on the seed, the round and the
partitions only (not on node ids, which change every run), and who is evaluated."""

from __future__ import annotations

from collections import Counter

import pytest
from child import run_tiny_federation

from server_app.sampling import EVALUATE, TRAIN, round_participants, sample_nodes, sample_size
from strategies import load_run_config
from strategies.base import ClientInfo


def test_the_sample_size_follows_flowers_rule():
    assert sample_size(20, 0.25, 2) == 5  # int(n * fraction)
    assert sample_size(20, 0.1, 3) == 3  # at least the minimum
    assert sample_size(20, 0.01, 0) == 0 and sample_size(4, 0.5, 9) == 4  # never more than there are


def test_the_draw_is_a_function_of_seed_round_and_partitions_not_node_ids():
    first = {1000 + p: p for p in range(20)}  # node id -> partition
    second = {7 * p + 3: p for p in range(20)}  # the same partitions behind other node ids (a rerun, a resume)
    for server_round in (1, 2, 3):
        a = sample_nodes(first, 0.25, 0, seed=0, server_round=server_round)
        b = sample_nodes(second, 0.25, 0, seed=0, server_round=server_round)
        assert len(a) == 5 and sorted(first[n] for n in a) == sorted(second[n] for n in b)
        assert a == sample_nodes(first, 0.25, 0, seed=0, server_round=server_round)  # the same draw again
    rounds = [sample_nodes(first, 0.25, 0, seed=0, server_round=r) for r in range(1, 6)]
    assert len({tuple(r) for r in rounds}) > 1  # rounds differ
    assert sample_nodes(first, 0.25, 0, 0, 1, TRAIN) != sample_nodes(first, 0.25, 0, 0, 1, EVALUATE)
    assert sample_nodes(first, 0.25, 0, 1, 1) != sample_nodes(first, 0.25, 0, 0, 1)  # the seed matters


def test_every_client_is_sampled_about_equally_often():
    nodes = {n: n for n in range(20)}
    counts = Counter(n for r in range(1, 401) for n in sample_nodes(nodes, 0.25, 0, seed=3, server_round=r))
    assert set(counts) == set(nodes)
    assert all(80 <= c <= 120 for c in counts.values()), counts  # 100 expected each (binomial sd ~8.7)


def _clients(n: int) -> dict[int, ClientInfo]:
    return {100 + p: ClientInfo(100 + p, p, "m", {}) for p in range(n)}


def test_who_trains_and_who_is_evaluated():
    clients = _clients(20)
    nodes = sorted(clients)
    full = load_run_config({})
    assert round_participants(full, nodes, clients, 1) == (nodes, nodes)  # the default: everyone, as before
    assert round_participants(full, nodes, clients, 0) == ([], nodes)  # round 0 trains nobody
    cfg = load_run_config({"fraction-train": 0.25, "fraction-evaluate": 0.1, "min-evaluate-nodes": 1})
    trained, evaluated = round_participants(cfg, nodes, clients, 1)
    assert len(trained) == 5 and set(trained) <= set(evaluated) and len(evaluated) < 20
    every = load_run_config({"fraction-train": 0.25, "fraction-evaluate": 0.1, "evaluate-all-every": 2})
    assert round_participants(every, nodes, clients, 0)[1] == nodes  # a starting point for every client
    assert (
        round_participants(every, nodes, clients, 2)[1] == nodes
        and len(round_participants(every, nodes, clients, 3)[1]) < 20
    )
    # a node that answered but was left out at admission (e.g. its own data refused) is never asked to evaluate:
    # the strategy holds no adapter for it (the server used to crash with a KeyError at round 0)
    stranger = max(nodes) + 1
    assert round_participants(full, [*nodes, stranger], clients, 0) == ([], nodes)
    assert stranger not in round_participants(full, [*nodes, stranger], clients, 1)[1]


def test_a_secure_sample_never_falls_below_a_secagg_group():
    clients = _clients(20)
    cfg = load_run_config({"secure": True, "min-train-replies": 3, "fraction-train": 0.05})  # int(20 * 0.05) = 1
    for server_round in range(1, 6):
        assert len(round_participants(cfg, sorted(clients), clients, server_round)[0]) == 3
    with pytest.raises(Exception, match="fraction-train"):
        load_run_config({"fraction-train": 0})


@pytest.mark.e2e
def test_twenty_clients_a_quarter_sampled_train_through_secagg(tiny_llama_dir, tmp_path):
    """FedAvg, secure, 20 simulated clients, fraction-train=0.25 (in-process, tiny model): each round exactly the 5
    sampled clients train (one SecAgg+ group of 5), they are the ones the seeded draw names, and the aggregate row
    lists them."""
    config = {
        "strategy": "fedavg",
        "secure": True,
        "min-train-replies": 3,
        "fraction-train": 0.25,
        "fraction-evaluate": 0.25,
        "evaluate-all-every": 2,  # rounds 0 and 2: every client (so every node's partition is in the rows)
        "train.local-steps": 2,
    }
    rows = run_tiny_federation(tiny_llama_dir, tmp_path, config, clients=20)
    partition_of = {r["node"]: r["partition_id"] for r in rows if r["node"] is not None}
    assert sorted(partition_of.values()) == list(range(20))
    evaluated = [sum(1 for r in rows if r["round"] == k and r["node"] is not None) for k in (0, 1, 2)]
    assert evaluated[0] == evaluated[2] == 20 and 5 <= evaluated[1] < 20  # round 1: a sample plus those who trained
    trained_partitions = []
    for server_round in (1, 2):
        aggregate = next(r for r in rows if r["round"] == server_round and r["node"] is None)
        clients = [r for r in rows if r["round"] == server_round and r["node"] is not None]
        trained = sorted(r["node"] for r in clients if r.get("accepted"))
        assert trained == sorted(aggregate["sampled"]) and len(trained) == 5
        assert all(r["bytes_up"] == 0 for r in clients if r["node"] not in trained)  # the others sent nothing
        # the seeded draw over the 20 partitions names them
        assert trained == sample_nodes(partition_of, 0.25, 3, seed=0, server_round=server_round)
        trained_partitions.append(sorted(partition_of[n] for n in trained))
    assert trained_partitions[0] != trained_partitions[1]


@pytest.mark.e2e
def test_atlas_under_sampling_asks_each_client_for_its_fingerprint_once(tiny_llama_dir, tmp_path):
    """ATLAS, 8 simulated clients, half sampled per round (in-process, tiny model): round 1's sample reports
    fingerprints and is clustered; round 2 asks only its newly sampled clients, who join the clustering; only the
    sampled train."""
    config = {"strategy": "atlas", "fraction-train": 0.5, "train.local-steps": 1, "fingerprint.batches": 2}
    config["atlas.k"] = 2
    rows = run_tiny_federation(tiny_llama_dir, tmp_path, config, clients=8)
    partition_of = {r["node"]: r["partition_id"] for r in rows if r["node"] is not None}
    reported: list[set[int]] = []
    for server_round in (1, 2):
        aggregate = next(r for r in rows if r["round"] == server_round and r["node"] is None)
        clients = [r for r in rows if r["round"] == server_round and r["node"] is not None]
        assert sorted(r["node"] for r in clients if r.get("accepted")) == sorted(aggregate["sampled"])
        assert len(aggregate["sampled"]) == 4
        reported.append({partition_of[r["node"]] for r in clients if r.get("report_bytes")})
        clustered = set(next(iter(aggregate["atlas"].values()))["partitions"])
        assert clustered == set().union(*reported)  # exactly the clients that have reported so far
    sampled = [
        {partition_of[n] for n in next(r for r in rows if r["round"] == k and r["node"] is None)["sampled"]}
        for k in (1, 2)
    ]
    assert sampled[1] & sampled[0] and sampled[1] - sampled[0]  # seed 0 draws both kinds in round 2
    assert reported[0] == sampled[0]
    assert reported[1] == sampled[1] - sampled[0]  # asked once: those sampled in round 1 are not asked again
