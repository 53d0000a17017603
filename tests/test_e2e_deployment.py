"""Deployment on loopback: a real SuperLink with TLS and SuperNode authentication and three real SuperNodes, as
separate processes started from the deploy/ scripts (``deploy/loopback.py``), running the app with the real 4-bit
model. One 2-round run of the dual path (a global LoRA averaged, a personal LoRA kept on each node) goes through
what operators meet: a SuperNode killed mid-run, the SuperLink killed mid-run and restarted on its state database,
the run resumed from the server checkpoint, and every node's personal state read back from its disk."""

from __future__ import annotations

import hashlib
import json
import re
import signal
import time
from pathlib import Path

import pytest

from common.data.members import write_members
from deploy.certs import generate
from deploy.loopback import LoopbackFederation

pytestmark = [pytest.mark.e2e, pytest.mark.deployment]

ROUNDS = 2
STEP_TIMEOUT = 600  # seconds for any one stage; the whole module is bounded by a few of them


EXAMPLES_PER_NODE = 60  # each member's own file (common.data.members: three formats, real text)


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    work = tmp_path_factory.mktemp("deploy")
    own = write_members(work / "member-data", EXAMPLES_PER_NODE)
    fed = LoopbackFederation(
        work,
        num_nodes=3,
        node_config=f"state-dir='{work / 'client-state'}'",
        node_configs={p: f"data-path='{path}'" for p, (path, _) in own.items()},
    )
    fed.own_data = own
    try:
        yield fed.up()
    finally:
        fed.close()


def read_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(condition, what: str, timeout: float = STEP_TIMEOUT, poll: float = 1.0, logs: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    tail = "".join(f"\n--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted(logs.glob("*.log"))) if logs else ""
    raise TimeoutError(f"{what}: not within {timeout:.0f}s{tail}")


def checkpoint_round(run_dir: Path) -> int:
    meta = run_dir / "checkpoint" / "state.json"
    return json.loads(meta.read_text())["round"] if meta.exists() else -1


def received_train(fed, partition: int, server_round: int) -> bool:
    """Whether SuperNode ``partition`` logged the whole of a round's train message (Flower's SuperNode log)."""
    log = (fed.work / f"supernode-{partition}.log").read_text()
    return bool(re.search(rf"ROUND {server_round}\]\s*\n.*Receiving: train message.*\n.*Received successfully", log))


def state_digests(fed) -> dict[int, str]:
    """Partition -> digest of the client state its node last wrote (``client_app/state_store.py``)."""
    files = {int(p.stem.removeprefix("partition-")): p for p in (fed.work / "client-state").glob("*/partition-*.pb")}
    return {partition: hashlib.sha256(path.read_bytes()).hexdigest()[:16] for partition, path in files.items()}


def test_a_members_record_level_budget_in_its_node_config_alone_governs_its_training(tmp_path):
    """Two SuperNodes, one of which sets its own record-level budget in its node config (the run config asks for no
    DP): that member trains by DP-SGD within its epsilon, its train row says what it spent, and its steps are in its
    own ledger on its node; the other trains as usual. The same member keeps its evaluation on its node
    (node-config keep-evaluation): the server's rows hold no loss or split count of it, its node's file does. Runs
    before the module's federation starts (its own)."""
    work = tmp_path / "budget"
    fed = LoopbackFederation(
        work,
        num_nodes=2,
        node_config=f"state-dir='{work / 'client-state'}'",
        node_configs={1: "dp-record-epsilon=4.0 dp-record-delta=1e-6 keep-evaluation=true"},
    )
    try:
        fed.up()
        wait_for(lambda: fed.online_nodes() == 2, "two SuperNodes online", poll=3, logs=work)
        run_dir = work / "run"
        done = fed.run(
            "strategy='fedavg' num-server-rounds=1 min-train-replies=2 train.local-steps=4 eval.initial=false "
            f"eval.max-examples=2 eval.generate-examples=1 eval.max-new-tokens=4 run-dir='{run_dir}'",
            timeout=STEP_TIMEOUT,
        )
        out = done.stdout + done.stderr
        assert done.returncode == 0, out[-3000:]
    finally:
        fed.close()
    trained = {r["partition_id"]: r for r in read_rows(run_dir) if r["node"] is not None and r["round"] == 1}
    assert sorted(trained) == [0, 1] and all(r["accepted"] for r in trained.values()), trained
    member = trained[1]
    assert member["dp_record_target"] == 4.0 and member["dp_record_delta"] == 1e-6, member
    assert 0 < member["dp_record_epsilon"] <= 4.0 and member["train_loss"] is None, member
    assert "dp_record_epsilon" not in trained[0] and trained[0]["train_loss"], trained
    assert "record-level DP-SGD, partition 1: epsilon" in out, out[-3000:]
    ledger = [json.loads(line) for line in (work / "client-state" / "privacy-ledger" / "partition-1.jsonl").open()]
    assert [(e["kind"], e["round"], e["steps"]) for e in ledger if e["kind"] == "record"] == [("record", 1, 4)]
    rows = [r for r in read_rows(run_dir) if r["node"] is not None]
    kept = [r for r in rows if r["partition_id"] == 1]
    assert all("data_train" not in r and "data_test" not in r for r in kept), kept  # how many records: its own
    (evaluated,) = [r for r in kept if r.get("eval_kept_on_node")]
    assert evaluated["eval_loss"] is None and "eval_example_loss" not in evaluated, evaluated
    assert [r["eval_loss"] > 0 for r in rows if r["partition_id"] == 0 and "eval_loss" in r] == [True]
    (own,) = [json.loads(line) for line in (run_dir / "client-evaluation" / "partition-1.jsonl").open()]
    assert own["round"] == 1 and own["eval_loss"] > 0 and own["data-test"] > 0, own  # on the member's node
    assert "partition(s) 1 kept their evaluation on their nodes" in out, out[-3000:]


def test_unregistered_supernode_is_refused(federation):
    stranger = generate(federation.work / "stranger", ["127.0.0.1"], nodes=1)  # a key pair nobody registered
    proc = federation.start_node(0, key=stranger / "node-0.key", name="stranger")
    log = federation.work / "stranger.log"
    wait_for(
        lambda: "Failed to activate SuperNode" in log.read_text() or proc.poll() is not None,
        "the stranger's refusal",
        timeout=90,
    )
    federation.stop(proc)
    # the refusal itself, not just any failure (a bad flag or a TLS error would also stop the process)
    assert "Failed to activate SuperNode" in log.read_text(), log.read_text()[-2000:]


def test_run_survives_a_killed_supernode_and_resumes_after_a_superlink_restart(federation):
    fed = federation
    run_dir = fed.work / "run"
    config = (
        f"strategy='fedavg-dual' num-server-rounds={ROUNDS} min-train-replies=2 train.local-steps=4 "
        f"eval.max-examples=4 eval.max-new-tokens=8 run-dir='{run_dir}' robust.bind-partitions=true"
    )  # node authentication: a node id is its registered key, so partitions are bound to node ids
    first = fed.start_run(config, "flwr-run-1")

    # 1. Once every node has evaluated round 0, kill SuperNode 2 (its whole process group, SIGKILL) while round 1
    # trains.
    wait_for(lambda: any(r["round"] == 0 and r["node"] is None for r in read_rows(run_dir)), "round 0", logs=fed.work)
    round0 = {r["partition_id"]: r for r in read_rows(run_dir) if r["round"] == 0 and r["node"] is not None}
    assert sorted(round0) == [0, 1, 2]
    fed.stop(fed.nodes[2], signal.SIGKILL)
    killed = state_digests(fed)[2]  # what node 2 had written before it was killed: nothing writes it now

    # ... round 1 still completes, with the other two (the SuperLink reports the dead node unavailable).
    wait_for(lambda: checkpoint_round(run_dir) >= 1, "round 1 with a node killed", logs=fed.work)
    round1 = [r for r in read_rows(run_dir) if r["round"] == 1 and r["node"] is not None]
    trained = {r["partition_id"] for r in round1 if r.get("accepted")}
    assert trained == {0, 1}, round1

    # 2. Kill the SuperLink mid-run (round 2 has begun); restart it on the same state database, and node 2 with it.
    # Killed once nodes 0 and 1 hold round 2's train message whole: a node still fetching a message's objects when
    # its SuperLink dies, and refused them once the run is over, is left a reply behind by Flower 1.41-1.42 (see
    # docs/deployment.md, "When the SuperLink dies"), and no server can then reach it.
    wait_for(lambda: all(received_train(fed, p, ROUNDS) for p in (0, 1)), "round 2 received", logs=fed.work)
    fed.stop(fed.superlink, signal.SIGKILL)
    try:
        first.wait(timeout=120)  # `flwr run` ends with its SuperLink
    finally:
        fed.stop(first)
    fed.start_superlink()
    fed.start_node(2)  # its key is still registered: the registrations live in the state database
    wait_for(lambda: fed.online_nodes() == 3, "three SuperNodes back online", poll=3, logs=fed.work)
    assert state_digests(fed)[2] == killed  # node 2's state, as it was when it was killed

    # 3. The same run, resumed from the server checkpoint, finishes round 2 with every node.
    # (in the background, so that a run that hangs fails with every process's log, not only the ServerApp's)
    resumed = fed.start_run(config + " resume=true", "flwr-run-2")
    try:
        wait_for(lambda: resumed.poll() is not None, "the resumed run", logs=fed.work)
    finally:
        fed.stop(resumed)
    out = (fed.work / "flwr-run-2.log").read_text()
    assert resumed.returncode == 0 and "resuming after round 1" in out, out[-3000:]
    rows = read_rows(run_dir)
    assert sorted(r["round"] for r in rows if r["node"] is None) == [0, 1, 2]  # round 0 and 1 were not redone
    final = {r["partition_id"]: r for r in rows if r["round"] == ROUNDS and r["node"] is not None}
    assert sorted(final) == [0, 1, 2] and all(r["accepted"] for r in final.values()), final
    assert all(final[p]["node"] == round0[p]["node"] for p in final)  # node 2 came back with its id (its key's)
    assert all(final[p]["eval_loss"] < round0[p]["eval_loss"] for p in final), (round0, final)
    # the resumed run is a new Flower run, so every node started it with empty state and read its own back from disk:
    # node 2 exactly what it had when it was killed (nodes 0 and 1 lived on, and may still have run the first run's
    # last messages after the SuperLink came back, so their files have no fixed "before")
    assert final[2]["state_restored"] == killed, final[2]
    assert final[0]["state_restored"] and final[1]["state_restored"], final
    # the SuperNodes that lived through it kept their model worker: same process, model loaded once
    for p in (0, 1):
        assert final[p]["pid"] == round0[p]["pid"] and final[p]["model_loads"] == 1, (round0[p], final[p])
    assert (run_dir / "adapter" / "adapter_config.json").exists()


def test_members_own_data_stays_on_the_nodes_fedavg_in_the_clear_and_a_personalised_strategy_under_secagg(federation):
    """Three organisations, each with its own file in another format named only in its node config (the run config
    names no data): FedAvg in the clear and fedavg-dual (a personal LoRA beside the averaged one) through SecAgg+.
    Every node trains on its own examples and its held-out loss falls; the server learns counts only: no path, file
    name or row text in its logs, run directories or checkpoints."""
    fed = federation
    wait_for(lambda: fed.online_nodes() == 3, "three SuperNodes online", poll=3, logs=fed.work)
    # the secure run skips round 0: it is the base model on the same held-out examples, which the plain run measured
    runs = {
        "plain": "strategy='fedavg'",
        "secure": "strategy='fedavg-dual' secure=true min-train-replies=3 eval.initial=false",
    }
    before: dict[int, dict] = {}
    for name, strategy in runs.items():
        run_dir = fed.work / f"own-{name}"
        config = (
            f"{strategy} num-server-rounds=1 train.local-steps=6 eval.max-examples=8 eval.generate-examples=2 "
            f"eval.max-new-tokens=4 run-dir='{run_dir}'"
        )
        done = fed.run(config, timeout=STEP_TIMEOUT)
        (fed.work / f"flwr-own-{name}.log").write_text(done.stdout + done.stderr)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        rows = [r for r in read_rows(run_dir) if r["node"] is not None]
        before = before or {r["partition_id"]: r for r in rows if r["round"] == 0}
        after = {r["partition_id"]: r for r in rows if r["round"] == 1}
        assert sorted(before) == sorted(after) == [0, 1, 2] and all(r["accepted"] for r in after.values()), after
        for p, row in after.items():
            assert row["eval_loss"] < before[p]["eval_loss"], (name, p, before[p]["eval_loss"], row["eval_loss"])
            # counts of the node's own file (not the bank's), and no task names from it
            assert row["data_examples"] == EXAMPLES_PER_NODE and row["tasks"] == "node-data", row
            assert row["data_train"] + row["data_test"] == EXAMPLES_PER_NODE and row["data_tokens"] > 0, row
    server_side = [fed.work / "superlink.log", *fed.work.glob("flwr-*.log")]
    server_side += [p for d in fed.work.glob("own-*") for p in d.rglob("*") if p.is_file()]
    secrets = {str(fed.work / "member-data")} | {path.name for path, _ in fed.own_data.values()}
    secrets |= {e.prompt[-40:] for _, examples in fed.own_data.values() for e in examples}
    assert any(p.match("*/checkpoint/*") for p in server_side) and len(secrets) > 100
    for path in server_side:
        text = path.read_bytes().decode("utf-8", "replace")
        leaked = [s for s in secrets if s in text]
        assert not leaked, (path, leaked[:3])
