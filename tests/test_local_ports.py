"""Two Flower homes on one machine get their own managed local SuperLink ports (Flower's defaults are fixed, so a
second `flwr run . local` from another home used to reach the first home's SuperLink)."""

from __future__ import annotations

import os
import subprocess
import sys

from deploy.local_sim import ROOT, federation_config, flwr_env, local_ports


def test_each_home_has_its_own_ports_and_keeps_them(tmp_path):
    first, second = local_ports(tmp_path / "a"), local_ports(tmp_path / "b")
    assert set(first.values()).isdisjoint(second.values())
    assert local_ports(tmp_path / "a") == first  # the same home reaches the same SuperLink next time


def test_flower_takes_the_homes_ports(tmp_path):
    """The installed flwr reads them: its managed SuperLink's control address is this home's."""
    env = flwr_env(tmp_path / "home")
    code = (
        "from flwr.cli.constant import LOCAL_CONTROL_API_ADDRESS as a, LOCAL_SUPERLINK_HTTP_API_PORT as p; print(a, p)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [f"127.0.0.1:{env['FLWR_LOCAL_CONTROL_API_PORT']}", env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"]]


def test_the_scripts_export_the_same_ports(tmp_path):
    home = tmp_path / "home"
    script = 'source scripts/flwr_env.sh && echo "$FLWR_LOCAL_CONTROL_API_PORT"'
    env = {**os.environ, "FLWR_HOME": str(home)}
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == local_ports(home)["FLWR_LOCAL_CONTROL_API_PORT"]


def test_a_simulated_client_gets_as_many_cpus_as_its_threads(monkeypatch):
    """With OMP_NUM_THREADS=1 on two cores Ray runs two one-thread actors at once, not one (scripts/test.sh's
    simulation lanes rely on it)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert federation_config(3) == "num-supernodes=3"  # Flower's own default: 2 CPUs a client
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert federation_config(3) == "num-supernodes=3 client-resources-num-cpus=1"
    assert federation_config(4, client_cpus=2) == "num-supernodes=4 client-resources-num-cpus=2"
