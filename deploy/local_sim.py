"""Drive `flwr run . local` from Python (tests, benchmarks): a private Flower home, the run, and clean-up.

`flwr run . local` starts a detached managed SuperLink (simulation, Ray) that outlives the run; ``stop_superlink``
stops the one belonging to a given Flower home, found by its command line, which names that home.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def prepare_home(home: Path) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    config = home / "config.toml"
    if not config.exists():
        config.write_text('[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n')
    return home


def flwr_env(home: Path) -> dict[str, str]:
    return {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",  # else each run tries `uv sync` against the registry
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
    }


def flwr_run(home: Path, run_config: str, num_clients: int = 3, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run the app in this repository to the end; return the finished process (stdout holds the streamed log)."""
    prepare_home(home)
    cmd = [
        "flwr",
        "run",
        ".",
        "local",
        "--stream",
        "--federation-config",
        f"num-supernodes={num_clients}",
        "--run-config",
        run_config,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=flwr_env(home), capture_output=True, text=True, timeout=timeout)


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
