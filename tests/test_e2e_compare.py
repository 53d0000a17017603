"""End to end: ``python -m bench.compare`` with two strategies (FedAvg and the local-only baseline), one seed and a
tiny budget on the real 4-bit SmolLM2 through `flwr run . local`; the report has a row per strategy and client, and
round 0 is evaluated once for both."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[1]


def test_one_command_compares_two_strategies_on_the_same_clients(tmp_path):
    out = tmp_path / "report"
    cmd = [
        sys.executable,
        "-m",
        "bench.compare",
        "--strategies",
        "fedavg,local",
        "--seeds",
        "0",
        "--preset",
        "tasks-distinct",
        "--clients",
        "3",
        "--rounds",
        "1",
        "--run-config",
        "train.local-steps=3 eval.max-examples=3 eval.final-examples=5 eval.generate-examples=2 eval.max-new-tokens=4",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # per run a line when it starts (the second with the time left) and one when it ends, then the report's path
    assert proc.stdout.count("[compare] ") == 5, proc.stdout[-3000:]
    assert "2/2 local seed 0: starting; about" in proc.stdout and "min left" in proc.stdout
    report = json.loads((out / "compare.json").read_text())
    assert all(run["ok"] for run in report["runs"]), report["runs"]
    final = {(r["strategy"], r["client"]): r for r in report["rows"] if r["round"] == 1}
    assert sorted(final) == [(s, c) for s in ("fedavg", "local") for c in range(3)]
    first = {(r["strategy"], r["client"]): r["eval_loss"] for r in report["rows"] if r["round"] == 0}
    # round 0 (the base model) was evaluated once, by the seed's first run; local-only borrowed it (eval.initial=false)
    local_run = next(run for run in report["runs"] if run["strategy"] == "local")
    assert local_run["initial_from"] == "fedavg" and "eval.initial=false" in local_run["run_config"]
    local_metrics = [
        json.loads(line) for line in (Path(local_run["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    assert not [m for m in local_metrics if m["round"] == 0] and sorted(first) == [
        (s, c) for s in ("fedavg", "local") for c in range(3)
    ]
    for client in range(3):  # both trained every client; only FedAvg moved adapter bytes
        assert final[("local", client)]["eval_loss"] < first[("local", client)]
        assert final[("local", client)]["bytes_up"] == 0 < final[("fedavg", client)]["bytes_up"]
    for row in final.values():  # the loss on eval.final-examples at the last round, each example's recorded
        assert row["eval_examples"] == len(row["eval_example_loss"]) == len(row["eval_example_tokens"]) == 5
    verdicts = {(v["a"], v["b"], v["statistic"]): v for v in report["verdicts"]}
    worst = verdicts[("fedavg", "local", "worst client")]  # paired on the same held-out examples of the same clients
    assert worst["low"] <= worst["estimate"] <= worst["high"] and worst["verdict"] in (
        "better",
        "worse",
        "not resolved",
    )
    assert "Paired differences" in (out / "compare.md").read_text() and "fedavg − local" in proc.stdout
    text = (out / "compare.md").read_text()
    assert "| fedavg | 1 |" in text and "| local | 1 |" in text and "client 2" in text
    assert (out / "compare.png").stat().st_size > 10_000
