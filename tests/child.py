"""Run a test module's function in a child Python process: for in-process Flower simulations, whose Ray cluster,
actors and ServerApp threads (and the environment Flower's Ray backend rewrites) must end with the federation,
whatever happens, so that a failure cannot leak into the tests after it. The child's log is in the failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parent

# One ClientApp actor per in-process federation, whatever the cores: the tiny models' work is milliseconds, an actor's
# start (imports, model load) seconds of CPU; xdist runs other tests on the other cores.
SIMULATION_BACKEND = {"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 1}}


def run_in_child(module: str, function: str, *args: Any, timeout: float = 600) -> None:
    """``module.function(*args)`` (JSON-able arguments) in a fresh interpreter; fail the test if it fails."""
    __tracebackhide__ = True
    code = f"import json, sys, {module}; {module}.{function}(*json.loads(sys.argv[1]))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)])}
    cmd = [sys.executable, "-c", code, json.dumps(list(args))]
    try:
        proc = subprocess.run(cmd, cwd=TESTS, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{module}.{function} did not finish in {timeout:.0f}s; its log:\n{_tail(err.stdout, err.stderr)}")
    if proc.returncode != 0:
        pytest.fail(f"{module}.{function} failed (exit {proc.returncode}); its log:\n{_tail(proc.stdout, proc.stderr)}")


def _tail(stdout: Any, stderr: Any, chars: int = 6000) -> str:
    text = "\n".join(s.decode() if isinstance(s, bytes) else (s or "") for s in (stdout, stderr))
    return text[-chars:]


def flwr_run_once(workdir: Path, run_config: str, num_clients: int, timeout: float = 1500) -> tuple[Path, list[dict]]:
    """``flwr run . local`` to the end on a Flower home of its own (its managed SuperLink stopped after), with
    ``run-dir`` under ``workdir``; the run dir and its metrics rows. Fails the test if the run fails."""
    __tracebackhide__ = True
    from deploy.local_sim import flwr_run, prepare_home, stop_superlink

    home = prepare_home(workdir / "flwr-home")
    run_dir = workdir / "run"
    try:
        proc = flwr_run(home, f"{run_config} run-dir='{run_dir}'", num_clients=num_clients, timeout=timeout)
    finally:
        stop_superlink(home)
    if proc.returncode != 0 or not (run_dir / "metrics.jsonl").exists():
        pytest.fail(f"flwr run failed (exit {proc.returncode}); its log:\n{_tail(proc.stdout, proc.stderr)}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return run_dir, rows


def run_tiny_federation(model_dir: Path, tmp_path: Path, config: dict, clients: int, rounds: int = 2) -> list[dict]:
    """An in-process federation of ``clients`` on the tiny model at ``model_dir`` (``rounds`` rounds, ``config`` on
    top; the real ServerApp and ClientApp, ``test_toy_strategy.run_in_process``), in a child process; its metrics
    rows (the run dir is ``tmp_path / "run"``)."""
    run_dir = tmp_path / "run"
    base = {
        "model.name": str(model_dir),
        "model.quantization": "fp32",
        "model.device": "cpu",
        "num-server-rounds": rounds,
        "eval.max-examples": 2,
        "eval.max-new-tokens": 1,
        "run-dir": str(run_dir),
        "node-wait-timeout": 120.0,
    }
    run_in_child("test_toy_strategy", "run_in_process", {**base, **config}, clients, timeout=900)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
