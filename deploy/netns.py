"""A federation on a real (virtual) network: the SuperLink and every SuperNode in its own Linux network namespace,
each with its own address on one bridge, for the chaos test (``tests/test_e2e_network.py``).

    bridge tessera-br (10.77.0.1/24, in the host namespace)
    ├── ts-link   10.77.0.10   SuperLink on its own 127.0.0.1, fleet gate (deploy/fleet_gate.py) on 10.77.0.10
    ├── ts-node0  10.77.0.20   SuperNode 0 -> 10.77.0.10:9092 (the gate)
    └── ...

Faults are made with what this kernel has: ``tc ... tbf`` (rate), ``iptables -m statistic`` (random loss) and
``ip link set ... down`` (a cut cable); netem is not available here. Needs root, iproute2 and iptables.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from deploy.local_sim import ROOT
from deploy.loopback import CONNECTION, LoopbackFederation

SUBNET = "10.77.0"
BRIDGE = "tessera-br"
LINK_NS = "ts-link"
GATE_PORT = 9092
# Traffic between the namespaces crosses the host's bridge; where br_netfilter is loaded (a Docker host) that
# passes the host's FORWARD chain, whose policy Docker sets to DROP (and leaves so after it stops).
BRIDGE_ACCEPT = ["FORWARD", "-i", BRIDGE, "-o", BRIDGE, "-j", "ACCEPT"]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def network_unavailable() -> str | None:
    """Why namespaces cannot be made here (None if they can): the chaos test skips with this reason."""
    for tool in ("ip", "tc", "iptables"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2 and iptables are needed)"
    probe = "ts-probe"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as err:
        return f"cannot create a network namespace (root and CAP_SYS_ADMIN needed): {err.stderr.strip()}"
    try:
        done = subprocess.run(
            ["ip", "netns", "exec", probe, "iptables", "-L"], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            return f"iptables does not work in a namespace: {done.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


class Network:
    """The bridge and one namespace per host; ``hosts``: name -> address. ``close`` removes all of it."""

    def __init__(self, names: list[str]) -> None:
        self.hosts = {name: f"{SUBNET}.{10 if name == LINK_NS else 20 + i}" for i, name in enumerate(names)}
        self.close()  # leftovers of an interrupted run
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        for name, address in self.hosts.items():
            _ip("netns", "add", name)
            _ip("link", "add", f"{name}-h", "type", "veth", "peer", "name", f"{name}-n")
            _ip("link", "set", f"{name}-n", "netns", name)
            _ip("link", "set", f"{name}-h", "master", BRIDGE, "up")
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", f"{name}-n")
            _ip("-n", name, "link", "set", f"{name}-n", "up")
            _ip("-n", name, "link", "set", "lo", "up")
        subprocess.run(["iptables", "-I", *BRIDGE_ACCEPT], check=True, capture_output=True)

    def close(self) -> None:
        for name in self.hosts:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
            subprocess.run(["ip", "link", "del", f"{name}-h"], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, check=False)
        while subprocess.run(["iptables", "-D", *BRIDGE_ACCEPT], capture_output=True, check=False).returncode == 0:
            pass  # every copy, leftovers of interrupted runs included

    @staticmethod
    def inside(name: str, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", name, *cmd]

    # ------------------------------------------------------------------------------------------------ faults
    def lose(self, name: str, probability: float) -> None:
        """Drop each packet in and out of ``name`` with ``probability`` (iptables' statistic match)."""
        for chain in ("INPUT", "OUTPUT"):
            rule = ["-m", "statistic", "--mode", "random", "--probability", str(probability), "-j", "DROP"]
            subprocess.run(self.inside(name, ["iptables", "-A", chain, *rule]), check=True, capture_output=True)

    def limit(self, name: str, rate: str = "1mbit") -> None:
        """A slow link: ``name``'s traffic out, and the bridge's traffic to it, through a token bucket."""
        tbf = ["tbf", "rate", rate, "burst", "32kbit", "latency", "400ms"]
        _ip_tc(["-n", name, "qdisc", "replace", "dev", f"{name}-n", "root", *tbf])
        _ip_tc(["qdisc", "replace", "dev", f"{name}-h", "root", *tbf])

    def heal(self, name: str) -> None:
        """Remove loss and rate limits from ``name``."""
        subprocess.run(self.inside(name, ["iptables", "-F"]), check=True, capture_output=True)
        for args in (
            ["-n", name, "qdisc", "del", "dev", f"{name}-n", "root"],
            ["qdisc", "del", "dev", f"{name}-h", "root"],
        ):
            subprocess.run(["tc", *args], capture_output=True, check=False)

    def cut(self, name: str, down: bool = True) -> None:
        """Pull (or plug back) ``name``'s cable: its end of the veth pair goes down (up)."""
        _ip("-n", name, "link", "set", f"{name}-n", "down" if down else "up")


def _ip_tc(args: list[str]) -> None:
    subprocess.run(["tc", *args], check=True, capture_output=True, text=True)


class NetworkFederation(LoopbackFederation):
    """``LoopbackFederation``'s processes, placed on a ``Network``: the SuperLink and the fleet gate in
    ``ts-link`` (the SuperLink bound to that namespace's 127.0.0.1, so Control is reachable only there), SuperNode
    ``i`` in ``ts-node<i>`` connecting to the gate's address."""

    def __init__(self, work: Path, num_nodes: int = 4, node_config: str = "", threads: int = 1) -> None:
        self.network = Network([LINK_NS] + [f"ts-node{i}" for i in range(num_nodes)])
        self.link_address = self.network.hosts[LINK_NS]
        super().__init__(work, num_nodes, node_config, threads, hosts=[self.link_address])
        self.gate: subprocess.Popen | None = None

    def node_ns(self, index: int) -> str:
        return f"ts-node{index}"

    def start_superlink(self) -> subprocess.Popen:
        self.superlink = self._start("superlink", Network.inside(LINK_NS, ["bash", "deploy/superlink.sh"]), self.env)
        self.wait_inside(LINK_NS, "127.0.0.1", self.port)
        if self.gate is None or self.gate.poll() is not None:
            gate = ["python3", "-m", "deploy.fleet_gate", "--listen", f"{self.link_address}:{GATE_PORT}"]
            gate += ["--superlink", f"127.0.0.1:{self.port}", "--certs", str(self.certs)]
            self.gate = self._start("fleet-gate", Network.inside(LINK_NS, gate), self.env)
            self.wait_inside(LINK_NS, self.link_address, GATE_PORT)
        return self.superlink

    def wait_inside(self, name: str, host: str, port: int, timeout: float = 60) -> None:
        probe = f"from deploy.loopback import wait_for_port; wait_for_port({port}, {timeout}, host={host!r})"
        subprocess.run(Network.inside(name, ["python3", "-c", probe]), cwd=ROOT, check=True, timeout=timeout + 30)

    def register(self) -> None:
        cmd = Network.inside(LINK_NS, ["bash", "deploy/connect.sh", CONNECTION, f"127.0.0.1:{self.port}"])
        done = subprocess.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"deploy/connect.sh failed:\n{done.stdout}\n{done.stderr}")

    def start_node(self, index: int, key: Path | None = None, name: str | None = None) -> subprocess.Popen:
        env = {**self.env, "SUPERLINK": f"{self.link_address}:{GATE_PORT}", "SUPERNODE_PORT": "9094"}
        env["OMP_NUM_THREADS"] = str(self.threads)
        if key is not None:
            env["NODE_KEY"] = str(key)
        script = ["bash", "deploy/supernode.sh", str(index), str(self.num_nodes), self.extra_config(index)]
        proc = self._start(name or f"supernode-{index}", Network.inside(self.node_ns(index), script), env)
        if name is None:
            self.nodes[index] = proc
        else:
            self._others.append(proc)
        return proc

    def run_command(self, run_config: str) -> list[str]:
        return Network.inside(LINK_NS, super().run_command(run_config))

    def flwr(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """A ``flwr`` command on the SuperLink's host (where the Control API is reachable)."""
        cmd = Network.inside(LINK_NS, ["flwr", *args])
        return subprocess.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)

    def close(self) -> None:
        super().close()
        self.stop(self.gate)
        self.network.close()
