"""Deployment on loopback: a real SuperLink with TLS and SuperNode authentication and three real SuperNodes, as
separate processes started from the deploy/ scripts, running the app with the real 4-bit model."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from deploy.certs import generate
from deploy.local_sim import ROOT, flwr_env, prepare_home

pytestmark = pytest.mark.e2e


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


class Processes:
    """Processes started by a test, each in its own session so that stopping it stops its children."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, cmd: list[str], env: dict) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "w")
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            self.stop(proc)


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    work = tmp_path_factory.mktemp("deploy")
    certs = generate(work / "certs", ["127.0.0.1", "localhost"], nodes=3)
    home = prepare_home(work / "flwr-home")
    port = free_port()
    env = {**flwr_env(home), "TESSERA_CERTS": str(certs), "SUPERLINK_HOST": "127.0.0.1", "SUPERLINK_PORT": str(port),
           "SUPERLINK": f"127.0.0.1:{port}", "SUPERLINK_DB": str(work / "state.db")}
    procs = Processes(work)
    try:
        procs.start("superlink", ["bash", "deploy/superlink.sh"], env)
        wait_for_port(port)
        connect = subprocess.run(["bash", "deploy/connect.sh", "tessera-test", f"127.0.0.1:{port}"], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=120)
        assert connect.returncode == 0, connect.stdout + connect.stderr
        for pid in range(3):
            # three nodes share this machine's cores: one thread each (measured: 5.3 min instead of 9 for the run)
            node_env = {**env, "SUPERNODE_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
            procs.start(f"supernode-{pid}", ["bash", "deploy/supernode.sh", str(pid), "3"], node_env)
        yield {"work": work, "env": env, "procs": procs, "certs": certs, "port": port}
    finally:
        procs.stop_all()


def test_tls_authenticated_federation_runs_to_the_end(federation):
    run_dir = federation["work"] / "run"
    config = f"num-server-rounds=1 min-train-replies=3 train.local-steps=4 eval.max-examples=4 eval.max-new-tokens=8 run-dir='{run_dir}'"
    proc = subprocess.run(["flwr", "run", ".", "tessera-test", "--stream", "--run-config", config], cwd=ROOT,
                          env=federation["env"], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    before = {r["partition_id"]: r["eval_loss"] for r in rows if r["round"] == 0 and r["node"] is not None}
    after = {r["partition_id"]: r["eval_loss"] for r in rows if r["round"] == 1 and r["node"] is not None}
    assert sorted(before) == sorted(after) == [0, 1, 2], proc.stdout[-3000:]
    assert all(after[p] < before[p] for p in before), (before, after)


def test_unregistered_supernode_is_refused(federation, tmp_path):
    stranger = generate(tmp_path / "stranger", ["127.0.0.1"], nodes=1)  # a key pair nobody registered
    env = {**federation["env"], "NODE_KEY": str(stranger / "node-0.key"), "SUPERNODE_PORT": str(free_port())}
    proc = federation["procs"].start("stranger", ["bash", "deploy/supernode.sh", "0", "3"], env)
    log = federation["work"] / "stranger.log"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and "Failed to activate SuperNode" not in log.read_text() and proc.poll() is None:
        time.sleep(1)
    text = log.read_text()
    federation["procs"].stop(proc)
    assert "Failed to activate SuperNode" in text or proc.returncode not in (None, 0), text[-2000:]
