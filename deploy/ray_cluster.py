"""A Ray cluster on 127.0.0.1 — a head and more Ray nodes, each started by `ray start` as its own processes — for
running the Flower simulation on a cluster instead of the Ray instance it would start itself.

Flower's Ray backend calls ``ray.init()``, which joins the cluster named by ``RAY_ADDRESS``; so the simulation
lands on the cluster when the managed SuperLink is started with ``RAY_ADDRESS`` set (a fresh ``FLWR_HOME``: an
already running SuperLink keeps the environment it was started with). Everything this module starts is found
again by its ``--temp-dir`` (every Ray daemon's command line names it) and stopped by PID, never by ``ray stop``,
which would stop every Ray on the machine. The temp dir also holds ``ray_current_cluster``, the file a bare
``ray.init()`` on this machine reads to join a running cluster: remove the directory after ``down`` (with Ray's
default temp dir, ``/tmp/ray``, a cluster stopped by PID would leave every later simulation trying to join it).

    python -m deploy.ray_cluster up --temp-dir /tmp/tessera-ray --nodes 2 --cpus 1   # prints the address
    python -m deploy.ray_cluster down --temp-dir /tmp/tessera-ray
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
from pathlib import Path

import psutil

HOST = "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def ray_env() -> dict[str, str]:
    return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}


def start(temp_dir: Path, nodes: int = 2, cpus: int = 1, timeout: float = 180) -> str:
    """Start a head and ``nodes - 1`` more Ray nodes (``cpus`` CPUs each) on 127.0.0.1; return the address."""
    temp_dir.mkdir(parents=True, exist_ok=True)  # Unix socket paths under it must stay short (~100 characters)
    port = _free_port()
    address = f"{HOST}:{port}"
    common = ["--node-ip-address", HOST, "--num-cpus", str(cpus), "--disable-usage-stats"]
    head = ["ray", "start", "--head", "--port", str(port), "--temp-dir", str(temp_dir), "--include-dashboard=false"]
    commands = [head + common] + [["ray", "start", "--address", address, *common]] * (nodes - 1)
    for command in commands:
        proc = subprocess.run(command, env=ray_env(), capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            stop(temp_dir)
            raise RuntimeError(f"{' '.join(command)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return address


def processes(temp_dir: Path) -> list[psutil.Process]:
    """The cluster's daemons (their command lines name ``temp_dir``) and everything they started (workers, actors)."""
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if str(temp_dir) in " ".join(proc.info["cmdline"] or []) and proc.pid != os.getpid():
            try:
                for member in [proc, *proc.children(recursive=True)]:
                    found[member.pid] = member
            except psutil.NoSuchProcess:
                continue
    return list(found.values())


def stop(temp_dir: Path, grace: float = 10) -> int:
    """SIGTERM the cluster's processes, SIGKILL what is left after ``grace`` seconds; the number stopped."""
    procs = processes(temp_dir)
    for proc in procs:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)
    return len(procs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--temp-dir", type=Path, required=True, help="Ray's --temp-dir: names this cluster")
    parser.add_argument("--nodes", type=int, default=2, help="Ray nodes, the head included")
    parser.add_argument("--cpus", type=int, default=1, help="CPUs each Ray node offers")
    args = parser.parse_args(argv)
    if args.action == "up":
        print(start(args.temp_dir.resolve(), args.nodes, args.cpus))
    else:
        print(f"stopped {stop(args.temp_dir.resolve())} processes")


if __name__ == "__main__":
    main()
