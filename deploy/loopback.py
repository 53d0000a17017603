"""A TLS-authenticated federation on one machine, driven from Python: the deploy/ scripts started as real
processes (a SuperLink and N SuperNodes on 127.0.0.1), for the deployment test and the deployment benchmark.

Every process runs in its own session, so stopping one (by PID) stops its children (SuperExec, ClientApps) and
nothing else; the model workers the ClientApps start notice their SuperExec is gone and exit on their own.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from deploy.certs import generate
from deploy.local_sim import ROOT, flwr_env, prepare_home
from deploy.outcome import checked

CONNECTION = "tessera-loopback"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, timeout: float = 60, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex((host, port)) == 0:
                return
        time.sleep(0.5)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout}s")


class LoopbackFederation:
    """One SuperLink (state in ``work/state.db``) and SuperNodes ``0..num_nodes-1``, each a process group.

    Args:
        work: directory for certificates, the Flower home, the state database and one log per process.
        num_nodes: SuperNodes (partitions); each gets node-config ``partition-id=i num-partitions=num_nodes``.
        node_config: extra node-config for every SuperNode (e.g. ``worker="off"``).
        node_configs: extra node-config for single SuperNodes, by partition (e.g. its own ``data-path``).
        threads: OMP_NUM_THREADS per SuperNode (several nodes share this machine's cores).
        hosts: names the SuperLink is reached by, besides 127.0.0.1 and localhost (its certificate's names).
    """

    def __init__(
        self,
        work: Path,
        num_nodes: int = 3,
        node_config: str = "",
        threads: int = 1,
        hosts: list[str] | None = None,
        node_configs: dict[int, str] | None = None,
    ) -> None:
        self.work = work
        self.num_nodes = num_nodes
        self.node_config = node_config
        self.node_configs = node_configs or {}
        self.threads = threads
        self.certs = generate(work / "certs", ["127.0.0.1", "localhost", *(hosts or [])], nodes=num_nodes)
        self.home = prepare_home(work / "flwr-home")
        self.port = free_port()
        self.env = {
            **flwr_env(self.home),
            "TESSERA_CERTS": str(self.certs),
            "SUPERLINK_HOST": "127.0.0.1",
            "SUPERLINK_PORT": str(self.port),
            "SUPERLINK": f"127.0.0.1:{self.port}",
            "SUPERLINK_DB": str(work / "state.db"),
        }
        self.superlink: subprocess.Popen | None = None
        self.nodes: dict[int, subprocess.Popen] = {}
        self._others: list[subprocess.Popen] = []
        self._starts = 0

    # -------------------------------------------------------------------------------------------- processes
    def _start(self, name: str, cmd: list[str], env: dict) -> subprocess.Popen:
        self._starts += 1
        log = open(self.work / f"{name}.log", "a")
        log.write(f"\n===== start {self._starts}: {' '.join(cmd)}\n")
        log.flush()
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    @staticmethod
    def stop(proc: subprocess.Popen | None, sig: int = signal.SIGTERM, timeout: float = 20) -> None:
        """Signal the process group of ``proc`` and wait for it (SIGKILL after ``timeout``)."""
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout)
        except ProcessLookupError:
            pass

    def start_superlink(self) -> subprocess.Popen:
        self.superlink = self._start("superlink", ["bash", "deploy/superlink.sh"], self.env)
        wait_for_port(self.port)
        return self.superlink

    def register(self) -> None:
        """Add the ``flwr`` connection and register every node's public key (deploy/connect.sh)."""
        done = subprocess.run(
            ["bash", "deploy/connect.sh", CONNECTION, f"127.0.0.1:{self.port}"],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise RuntimeError(f"deploy/connect.sh failed:\n{done.stdout}\n{done.stderr}")

    def start_node(self, index: int, key: Path | None = None, name: str | None = None) -> subprocess.Popen:
        env = {**self.env, "SUPERNODE_PORT": str(free_port()), "OMP_NUM_THREADS": str(self.threads)}
        if key is not None:
            env["NODE_KEY"] = str(key)
        proc = self._start(
            name or f"supernode-{index}",
            ["bash", "deploy/supernode.sh", str(index), str(self.num_nodes), self.extra_config(index)],
            env,
        )
        if name is None:
            self.nodes[index] = proc
        else:
            self._others.append(proc)
        return proc

    def extra_config(self, index: int) -> str:
        """SuperNode ``index``'s node-config beyond its partition: what every node has, then its own."""
        return " ".join(part for part in (self.node_config, self.node_configs.get(index, "")) if part)

    def up(self) -> LoopbackFederation:
        self.start_superlink()
        self.register()
        for index in range(self.num_nodes):
            self.start_node(index)
        return self

    def close(self) -> None:
        for proc in self._others + list(self.nodes.values()) + [self.superlink]:
            self.stop(proc)

    # -------------------------------------------------------------------------------------------- flwr CLI
    def flwr(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """A ``flwr`` command against this federation's SuperLink (its Control API)."""
        return subprocess.run(["flwr", *args], cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)

    def online_nodes(self) -> int:
        """SuperNodes the SuperLink lists as online (0 while it cannot answer)."""
        out = self.flwr("supernode", "list", CONNECTION, "--format", "json")
        try:
            nodes = json.loads(out.stdout).get("nodes", [])
        except json.JSONDecodeError:
            return 0
        return sum(1 for n in nodes if str(n.get("status", "")).lower() == "online")

    # -------------------------------------------------------------------------------------------- runs
    def run_command(self, run_config: str) -> list[str]:
        return ["flwr", "run", ".", CONNECTION, "--stream", "--run-config", run_config]

    def run(self, run_config: str, timeout: float = 1800) -> subprocess.CompletedProcess:
        """``flwr run`` of this repository's app to the end (stdout holds the streamed ServerApp log; non-zero where
        the SuperLink records the run as failed: ``deploy.outcome``)."""
        done = subprocess.run(
            self.run_command(run_config), cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        return checked(done, CONNECTION, self.env)

    def start_run(self, run_config: str, log_name: str = "flwr-run") -> subprocess.Popen:
        """``flwr run`` in the background (its log: ``work/<log_name>.log``)."""
        return self._start(log_name, self.run_command(run_config), self.env)
