"""Drive `flwr run . local` from Python (tests, benchmarks): a private Flower home, the run, and clean-up.

`flwr run . local` starts a detached managed SuperLink (simulation, Ray) that outlives the run; each Flower home
gets its own ports for it (``local_ports``), and ``stop_superlink`` stops the one belonging to a given home, found by
its command line, which names that home.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

from deploy.outcome import checked

ROOT = Path(__file__).resolve().parents[1]


def prepare_home(home: Path) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    config = home / "config.toml"
    if not config.exists():
        config.write_text('[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n')
    return home


def local_ports(home: Path) -> dict[str, str]:
    """The managed local SuperLink's ports for this Flower home, chosen free once and kept in the home: Flower's
    defaults (39091, 39093) are fixed, so two homes on one machine would share (and fight over) one SuperLink."""
    home.mkdir(parents=True, exist_ok=True)
    record = home / "tessera-local-ports.json"
    if record.exists():
        return json.loads(record.read_text())
    ports = {"FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(_free_port()), "FLWR_LOCAL_CONTROL_API_PORT": str(_free_port())}
    record.write_text(json.dumps(ports))
    return ports


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def flwr_env(home: Path) -> dict[str, str]:
    return {
        **os.environ,
        **local_ports(home),
        "FLWR_HOME": str(home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",  # else each run tries `uv sync` against the registry
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
    }


def federation_config(num_clients: int, client_cpus: int | None = None) -> str:
    """``flwr run``'s federation config: ``num_clients`` simulated SuperNodes, each given ``client_cpus`` CPUs (by
    default ``OMP_NUM_THREADS`` where set, else Flower's own default)."""
    if client_cpus is None and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        client_cpus = max(1, int(os.environ["OMP_NUM_THREADS"]))
    return f"num-supernodes={num_clients}" + (f" client-resources-num-cpus={client_cpus}" if client_cpus else "")


def flwr_run(
    home: Path, run_config: str, num_clients: int = 3, timeout: float = 900, client_cpus: int | None = None
) -> subprocess.CompletedProcess:
    """Run the app in this repository to the end; return the finished process (stdout holds the streamed log; its
    return code is non-zero where the run failed, though `flwr run` itself exits 0 then).
    ``client_cpus``: CPUs per simulated client: Ray runs (cores // client_cpus) ClientApp actors at once, each with
    that many torch threads. By default ``OMP_NUM_THREADS`` where the caller set it (a client computing with N threads
    needs N CPUs; one thread each on two cores: two actors at once), else Flower's 2."""
    prepare_home(home)
    cmd = [
        "flwr",
        "run",
        ".",
        "local",
        "--stream",
        "--federation-config",
        federation_config(num_clients, client_cpus),
        "--run-config",
        run_config,
    ]
    env = flwr_env(home)
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return checked(done, "local", env)  # non-zero where the SuperLink records the run as failed (deploy.outcome)


def stop_superlink(home: Path) -> int:
    """SIGTERM every process whose command line names ``home`` (the managed SuperLink) and its children."""
    import psutil

    stopped = 0
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if str(home) in " ".join(proc.info["cmdline"] or []) and proc.pid != os.getpid():
            for target in proc.children(recursive=True) + [proc]:
                try:
                    target.send_signal(signal.SIGTERM)
                    stopped += 1
                except psutil.NoSuchProcess:
                    pass
    return stopped


if __name__ == "__main__":  # `python -m deploy.local_sim ports HOME`: the ports as shell exports (scripts/flwr_env.sh)
    import sys

    if sys.argv[1:2] != ["ports"] or len(sys.argv) != 3:
        sys.exit("usage: python -m deploy.local_sim ports FLWR_HOME")
    for name, port in local_ports(Path(sys.argv[2])).items():
        print(f"export {name}={port}")
