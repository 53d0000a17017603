"""End to end: ATLAS under SecAgg+ and MIRA in plaintext through `flwr run . local` on the real 4-bit SmolLM2,
with clients of two clearly different task sets (BoolQ and ASDiv). ATLAS must find exactly those two clusters from
the clients' gradient fingerprints; under both strategies every client's held-out loss must fall, and a run stopped
after round 1 and resumed keeps its clusters, ranks and graph without new fingerprints."""

from __future__ import annotations

import json

import pytest

from deploy.local_sim import flwr_run, prepare_home, stop_superlink

pytestmark = pytest.mark.e2e

COMMON = "data.tasks='boolq,asdiv' train.local-steps=4 eval.max-examples=4 eval.max-new-tokens=4 fingerprint.batches=4"


def run_and_resume(tmp_path_factory, name: str, config: str, clients: int) -> tuple:
    """One round, then the server stopped and the run resumed to round 2: a new simulation, so the server restores
    its state from the checkpoint and the clients' node state is new. Returns the run dir, metrics rows and logs."""
    home = prepare_home(tmp_path_factory.mktemp(f"flwr-home-{name}"))
    run_dir = tmp_path_factory.mktemp(name) / "run"
    logs = ""
    try:
        for extra in ("num-server-rounds=1", "num-server-rounds=2 resume=true"):
            proc = flwr_run(home, f"{COMMON} {config} {extra} run-dir='{run_dir}'", num_clients=clients, timeout=1500)
            assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
            logs += proc.stdout + proc.stderr
    finally:
        stop_superlink(home)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return run_dir, rows, logs


def loss_change(rows: list[dict], clients: int) -> dict[int, float]:
    """Per partition: held-out loss after the last round minus before round 1."""
    last = max(r["round"] for r in rows)
    before = {r["partition_id"]: r["eval_loss"] for r in rows if r["round"] == 0 and r["node"] is not None}
    after = {r["partition_id"]: r["eval_loss"] for r in rows if r["round"] == last and r["node"] is not None}
    assert len(before) == len(after) == clients, (before, after)
    return {p: after[p] - before[p] for p in after}


@pytest.fixture(scope="module")
def atlas_run(tmp_path_factory):
    """The clusters and ranks come back from the checkpoint's fingerprints, the cluster adapters from its arrays."""
    config = "strategy='atlas' secure=true min-train-replies=3 atlas.memory-mb='6,12,24'"
    return run_and_resume(tmp_path_factory, "atlas", config, clients=6)


def test_atlas_finds_the_two_task_clusters_and_secures_each(atlas_run):
    run_dir, rows, log = atlas_run
    aggregate = next(r for r in rows if r["round"] == 1 and r["node"] is None)
    (family,) = aggregate["atlas"].values()
    assert family["k"] == 2 and family["purity"] == 1.0 and family["group_purity"] == 1.0, family
    groups = {}
    for partition, group in zip(family["partitions"], family["groups"]):
        groups.setdefault(group, []).append(partition)
    assert sorted(groups.values()) == [[0, 2, 4], [1, 3, 5]]
    trained = [r for r in rows if r["round"] == 1 and r["node"] is not None]
    assert len(trained) == 6 and all(r["accepted"] for r in trained)
    assert "SecAgg+" in log and {r["group"] for r in trained} == {
        "smollm2-135m-instruct-c0",
        "smollm2-135m-instruct-c1",
    }
    assert (run_dir / "clusters" / "round-001-smollm2-135m-instruct.png").exists()
    assert (run_dir / "cluster-loss.png").exists()


def test_atlas_ranks_fit_each_budget_and_differ_between_clients(atlas_run):
    run_dir, rows, _ = atlas_run
    aggregate = next(r for r in rows if r["round"] == 1 and r["node"] is None)
    (family,) = aggregate["atlas"].values()
    assert len(family["layers"]) == 60 and len(family["ranks"]) == 6  # q/v of SmolLM2's 30 blocks
    for partition, budget in family["budget_mb"].items():
        assert budget == [6, 12, 24][int(partition) % 3]
        assert family["adapter_mb"][partition] <= budget
    totals = {p: sum(r) for p, r in family["ranks"].items()}
    assert totals["2"] > totals["0"] and totals["5"] > totals["3"]  # more memory, more rank
    assert (run_dir / "ranks" / "round-001-smollm2-135m-instruct.png").exists()


def test_atlas_every_clients_held_out_loss_falls(atlas_run):
    change = loss_change(atlas_run[1], 6)
    assert all(delta < 0 for delta in change.values()), change


def test_atlas_resume_keeps_the_clusters_and_ranks_without_new_fingerprints(atlas_run):
    _, rows, _ = atlas_run
    assert [r["round"] for r in rows if r["node"] is None] == [0, 1, 2]  # round 0 and 1 not re-run
    by_round = {k: next(r for r in rows if r["round"] == k and r["node"] is None) for k in (1, 2)}
    (first,), (second,) = by_round[1]["atlas"].values(), by_round[2]["atlas"].values()
    for key in ("clusters", "groups", "ranks", "purity"):
        assert second[key] == first[key], key
    assert not any("report_bytes" in r for r in rows if r["round"] == 2 and r["node"] is not None)
    trained = [r for r in rows if r["round"] == 2 and r["node"] is not None]
    assert len(trained) == 6 and all(r["accepted"] for r in trained)


@pytest.fixture(scope="module")
def mira_run(tmp_path_factory):
    """The graph and the neighbour terms come back from the checkpoint."""
    return run_and_resume(tmp_path_factory, "mira", "strategy='mira' mira.eta=0.5", clients=4)


def test_mira_every_clients_held_out_loss_falls(mira_run):
    run_dir, rows, _ = mira_run
    change = loss_change(rows, 4)
    assert all(delta < 0 for delta in change.values()), change
    aggregate = next(r for r in rows if r["round"] == 1 and r["node"] is None)
    (family,) = aggregate["mira"].values()
    adjacency = family["adjacency"]
    # the same-task neighbour (partitions 0-2, 1-3) carries the largest weight of every row
    assert [max(range(4), key=lambda j: row[j]) for row in adjacency] == [2, 3, 0, 1], adjacency
    assert (run_dir / "adjacency" / "round-001-smollm2-135m-instruct.png").exists()
    for partition in range(4):
        assert (run_dir / "client-adapters" / f"partition-{partition}" / "adapter_config.json").exists()


def test_mira_resume_keeps_the_graph_without_new_fingerprints(mira_run):
    _, rows, _ = mira_run
    by_round = {k: next(r for r in rows if r["round"] == k and r["node"] is None) for k in (1, 2)}
    assert by_round[2]["mira"] == by_round[1]["mira"]  # restored from the checkpoint, not recomputed from new data
    assert all("report_bytes" in r for r in rows if r["round"] == 1 and r["node"] is not None)
    assert not any("report_bytes" in r for r in rows if r["round"] == 2 and r["node"] is not None)
