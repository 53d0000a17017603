"""End to end: the Flower simulation on an existing Ray cluster — a Ray head and a second Ray node started by
`ray start` on 127.0.0.1 as their own processes (``deploy/ray_cluster.py``), the managed SuperLink pointed at the
cluster with ``RAY_ADDRESS`` — with the real 4-bit SmolLM2: the clients land on both Ray nodes, and everything
started is stopped by PID."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from deploy.local_sim import flwr_run, prepare_home, stop_superlink
from deploy.ray_cluster import processes, ray_env, start, stop

pytestmark = pytest.mark.e2e

RUN = "num-server-rounds=1 train.local-steps=2 eval.max-examples=2 eval.max-new-tokens=2"


def cluster_node_ids(address: str) -> set[str]:
    code = f"import ray; ray.init(address='{address}'); print(' '.join(n['NodeID'] for n in ray.nodes() if n['Alive']))"
    proc = subprocess.run([sys.executable, "-c", code], env=ray_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return set(proc.stdout.split())


def test_the_simulation_runs_on_both_nodes_of_an_existing_ray_cluster(tmp_path, monkeypatch):
    temp = Path(tempfile.mkdtemp(prefix="tray-", dir="/tmp"))  # Ray's socket paths under it must stay short
    home = prepare_home(tmp_path / "flwr-home")  # a fresh SuperLink: it takes RAY_ADDRESS from our environment
    run_dir = tmp_path / "run"
    try:
        address = start(temp, nodes=2, cpus=1)
        ours = cluster_node_ids(address)
        monkeypatch.setenv("RAY_ADDRESS", address)
        # one CPU per client: one ClientApp actor on each one-CPU Ray node
        proc = flwr_run(home, f"{RUN} run-dir='{run_dir}'", num_clients=4, timeout=1500, client_cpus=1)
    finally:
        stop_superlink(home)
        stop(temp)
        shutil.rmtree(temp, ignore_errors=True)  # with it Ray's ray_current_cluster: no later ray.init() joins it
    assert proc.returncode == 0 and (run_dir / "metrics.jsonl").exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trained = [r for r in rows if r["round"] == 1 and r["node"] is not None]
    assert len(trained) == 4 and all(r["accepted"] and np.isfinite(r["eval_loss"]) for r in trained), trained
    assert len(ours) == 2
    assert {r["ray_node"] for r in trained} == ours  # the clients ran on the cluster's two nodes, not a private Ray
    assert len({r["pid"] for r in trained}) == 2  # one actor per node, each serving two clients
    assert not processes(temp)  # the head, the second node and their workers are gone
