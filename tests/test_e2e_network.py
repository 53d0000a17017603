"""Chaos on a real network (``deploy/netns.py``): the SuperLink and 4 SuperNodes each in their own network namespace
with their own address, TLS with certificates for those addresses, SuperNode authentication on, the real 4-bit
model, SecAgg+ on. One 4-round run goes through: a clean round; a round with 5 % packet loss and a 1 Mbit/s link on
every node; a round in which one node's cable is pulled while it trains (a SecAgg+ dropout: the unmasked aggregate
must equal the plain weighted mean of the others' updates, as each node kept them, ``audit-dir``); a SuperNode and
the SuperLink killed in the last round and the run resumed. Rounds lost: none. A stranger on the network cannot
reach the Control API (``deploy/fleet_gate.py``). Skips, saying why, where namespaces cannot be made."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import numpy as np
import pytest

from deploy.netns import GATE_PORT, Network, NetworkFederation, network_unavailable
from strategies.aggregation import secagg_error_bound, weighted_mean

pytestmark = [pytest.mark.e2e, pytest.mark.deployment, pytest.mark.timeout(2700)]

NODES, ROUNDS = 4, 4
STEP_TIMEOUT = 600
# how long SecAgg+ waits for a stage's replies, training included (2-3x its time here). The cut node costs round 3
# less: the SuperLink answers for it once it misses its heartbeats (2 x Flower's 30 s interval; measured: round 3
# ended 60 s after the cut)
SECAGG_TIMEOUT = 180
NETWORK_PROBLEM = network_unavailable()


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    if NETWORK_PROBLEM:
        pytest.skip(f"no network namespaces here: {NETWORK_PROBLEM}")
    work = tmp_path_factory.mktemp("network")
    fed = NetworkFederation(work, num_nodes=NODES, node_config=f'audit-dir="{work / "audit"}"')
    try:
        yield fed.up()
    finally:
        fed.close()


def rows(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def aggregate(run_dir, server_round: int) -> dict:
    return next(r for r in rows(run_dir) if r["round"] == server_round and r["node"] is None)


def checkpoint(run_dir) -> dict:
    meta = run_dir / "checkpoint" / "state.json"
    try:
        return json.loads(meta.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {"round": -1}


def wait_for(condition, what: str, fed: NetworkFederation, timeout: float = STEP_TIMEOUT, poll: float = 1.0, run=None):
    """``condition()`` once it is true; fails with every log's tail after ``timeout`` or once ``run`` has ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (run is None or run.poll() is None):
        if value := condition():
            return value
        time.sleep(poll)
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted(fed.work.glob("*.log")))
    ended = "" if run is None or run.poll() is None else f" (`flwr run` ended with {run.returncode})"
    raise TimeoutError(f"{what}: not within {timeout:.0f}s{ended}{logs}")


def test_a_stranger_on_the_network_reaches_only_the_fleet_api(federation):
    fed = federation
    stranger = (  # holds the CA certificate, as every node does
        "import httpx, sys\n"
        "for path in sys.argv[3:]:\n"
        "    print(path, httpx.post(sys.argv[2] + path, verify=sys.argv[1], content=b'').status_code)\n"
    )
    base = f"https://{fed.link_address}:{GATE_PORT}"
    paths = ["/v1/control/start-run", "/v1/control/list-runs", "/v1/runtime/pull-messages"]
    probe = ["python3", "-c", stranger, str(fed.certs / "ca.crt"), base, *paths]
    out = subprocess.run(Network.inside("ts-node0", probe), capture_output=True, text=True, timeout=60)
    assert [line.split()[-1] for line in out.stdout.splitlines()] == ["403"] * 3, out.stdout + out.stderr
    # and the SuperLink's own port is not on the network at all (it listens on its host's 127.0.0.1)
    direct = f"import socket; print(socket.socket().connect_ex(('{fed.link_address}', {fed.port})))"
    out = subprocess.run(Network.inside("ts-node0", ["python3", "-c", direct]), capture_output=True, text=True)
    assert out.stdout.strip() != "0", "the SuperLink's port is reachable from a node"


def test_rounds_survive_loss_a_slow_link_a_cut_cable_and_killed_processes(federation):
    fed = federation
    run_dir, audit = fed.work / "run", fed.work / "audit"
    # LoRA rank 2 (a quarter of the default's 1.8 MB a node sends, masked, and twice that it receives): round 2's
    # 1 Mbit/s link still carries every stage of SecAgg+ under 5 % loss, in a quarter of the time
    config = (
        f"num-server-rounds={ROUNDS} min-train-replies=3 secure=true secagg.timeout={SECAGG_TIMEOUT} lora.r=2 "
        f"train.local-steps=2 eval.max-examples=2 eval.max-new-tokens=4 run-dir='{run_dir}'"
    )
    first = fed.start_run(config, "flwr-run-1")
    wait_for(lambda: checkpoint(run_dir)["round"] >= 1, "round 1 (clean network)", fed, run=first)

    # Round 2: every node loses 5 % of its packets, both ways, and its link is limited to 1 Mbit/s.
    for i in range(NODES):
        fed.network.lose(fed.node_ns(i), 0.05)
        fed.network.limit(fed.node_ns(i), "1mbit")
    wait_for(lambda: checkpoint(run_dir)["round"] >= 2, "round 2 (5 % loss, 1 Mbit/s)", fed, run=first)
    for i in range(NODES):
        fed.network.heal(fed.node_ns(i))

    # Round 3: node 3's cable is pulled while it trains; SecAgg+ goes on with the 3 others (threshold 0.67).
    node3 = fed.work / "supernode-3.log"
    wait_for(lambda: "round 3: training" in node3.read_text(), "node 3 training round 3", fed, run=first)
    fed.network.cut(fed.node_ns(3))
    wait_for(lambda: checkpoint(run_dir)["round"] >= 3, "round 3 (node 3 cut off)", fed, run=first)
    fed.network.cut(fed.node_ns(3), down=False)
    state = checkpoint(run_dir)
    with np.load(run_dir / "checkpoint" / state["arrays"]) as saved:
        secure_mean = {k.split("/", 1)[1]: saved[k] for k in saved.files if k.startswith("global/")}

    round3 = [r for r in rows(run_dir) if r["round"] == 3 and r["node"] is not None]  # node 3: only its absence
    assert {r.get("partition_id") for r in round3 if r.get("accepted")} == {0, 1, 2}, round3
    assert "dropped out of SecAgg+" in json.dumps(aggregate(run_dir, 3)["rejected"]), aggregate(run_dir, 3)
    kept = {}
    for p in range(NODES):  # every node trained round 3 and kept what it sent (node 3's never arrived)
        with np.load(audit / f"round-3-partition-{p}.npz") as sent:
            kept[p] = ({k: sent[k] for k in sent.files if k != "__weight__"}, int(sent["__weight__"]))
    plain = weighted_mean([kept[p][0] for p in (0, 1, 2)], [kept[p][1] for p in (0, 1, 2)])
    with_node3 = weighted_mean([kept[p][0] for p in range(NODES)], [kept[p][1] for p in range(NODES)])
    assert sorted(secure_mean) == sorted(plain)
    error = max(float(np.abs(secure_mean[k] - plain[k]).max()) for k in plain)
    distance_to_node3 = max(float(np.abs(secure_mean[k] - with_node3[k]).max()) for k in plain)
    tolerance = 5 * secagg_error_bound([1.0] * 3, 8.0, 2**22)  # SecAgg+'s quantisation at the default ranges
    assert error <= tolerance < distance_to_node3, (error, tolerance, distance_to_node3)

    # Round 4: the SuperLink and then SuperNode 1 are killed (SIGKILL) while the nodes train (the SuperLink first:
    # while it lives, the round completes without node 1); both restart; the run resumes after round 3.
    wait_for(
        lambda: "round 4: training" in (fed.work / "supernode-1.log").read_text(), "round 4 under way", fed, run=first
    )
    fed.stop(fed.superlink, signal.SIGKILL)
    fed.stop(fed.nodes[1], signal.SIGKILL)
    assert checkpoint(run_dir)["round"] == 3, "round 4 completed before the SuperLink was killed"
    try:
        first.wait(timeout=120)
    finally:
        fed.stop(first)
    fed.start_superlink()
    fed.start_node(1)
    wait_for(lambda: fed.online_nodes() == NODES, "every SuperNode back online", fed, poll=3)
    resumed = fed.run(config + " resume=true", timeout=STEP_TIMEOUT)
    assert "resuming after round 3" in resumed.stdout + resumed.stderr, resumed.stdout[-3000:]

    done = rows(run_dir)
    assert sorted(r["round"] for r in done if r["node"] is None) == list(range(ROUNDS + 1))  # none lost, none redone
    final = {r["partition_id"]: r for r in done if r["round"] == ROUNDS and r["node"] is not None}
    # the resumed round trains with a secure group of at least 3 (the restarted SuperNode 1 has been seen to miss it)
    assert len(final) >= 3 and all(r["accepted"] for r in final.values()), final
    seconds = {n: aggregate(run_dir, n)["seconds"] for n in range(1, ROUNDS + 1)}
    print(f"round seconds: clean {seconds[1]:.0f}, 5% loss + 1 Mbit/s {seconds[2]:.0f}, one cut {seconds[3]:.0f}")
    (fed.work / "round-seconds.json").write_text(json.dumps(seconds))
