"""VEMoE through the real ServerApp and ClientApp (in-process simulation, tiny model, 3 clients): its config is
checked before round 1, every reply is accepted, the pool and its events reach metrics.jsonl, and the secure pool
(Flower's SecAgg+) equals the plain one to SecAgg+'s quantisation error."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from child import run_in_child

from common.adapters.experts.adapter import split_slots
from common.config import ConfigError, SecAggSection
from strategies import load_run_config
from strategies.aggregation import secagg_error_bound


def test_a_pool_config_that_cannot_hold_its_experts_is_refused_naming_the_key():
    cfg = load_run_config({"strategy": "vemoe"})
    assert cfg.adapter == "experts-dual"  # a personal LoRA beside the pool by default
    assert load_run_config({"strategy": "vemoe", "vemoe.personal-lora": False}).adapter == "experts"
    with pytest.raises(ConfigError, match="vemoe.k-init"):
        load_run_config({"strategy": "vemoe", "experts.k-max": 2, "experts.top-m": 1, "vemoe.k-init": 3})
    with pytest.raises(ConfigError, match="experts.top-m"):
        load_run_config({"strategy": "vemoe", "experts.k-max": 2, "experts.top-m": 3})
    with pytest.raises(ConfigError, match="robust.clip-norm"):  # r * theta is not an update of the pool
        load_run_config({"strategy": "vemoe", "robust.clip-norm": 5.0})


def config(tiny_llama_dir, run_dir: Path, **extra) -> dict:
    return {
        "strategy": "vemoe",
        "model.name": str(tiny_llama_dir),
        "model.quantization": "fp32",
        "model.device": "cpu",
        "num-server-rounds": 1,
        "min-train-replies": 3,
        "train.local-steps": 3,
        "train.batch-size": 2,
        "train.learning-rate": 0.05,
        "eval.max-examples": 4,
        "eval.max-new-tokens": 2,
        "experts.k-max": 4,
        "experts.r": 2,
        "vemoe.k-init": 3,
        "run-dir": str(run_dir),
        "node-wait-timeout": 120.0,
        **extra,
    }


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _pool(run_dir: Path) -> list[dict]:
    from server_app.rundir import RunDirectory

    _, state = RunDirectory(run_dir).load_checkpoint()
    return split_slots(state["pool"], 4)


@pytest.mark.e2e
def test_vemoe_runs_plain_and_secure_and_the_secure_pool_is_the_plain_one(tiny_llama_dir, tmp_path):
    runs = {}
    for secure in (False, True):
        run_dir = tmp_path / f"secure-{secure}"
        settings = config(tiny_llama_dir, run_dir, secure=secure, **{"vemoe.first-round": "gradient"})
        run_in_child("test_toy_strategy", "run_in_process", settings, 3)
        rows = _rows(run_dir)
        trained = [r for r in rows if r["round"] == 1 and r["node"] is not None]
        assert len(trained) == 3 and all(r["accepted"] for r in trained)
        if secure:  # which experts a client uses is what SecAgg+ hides: not in its reply metrics either
            assert not any(k in r for r in trained for k in ("vemoe_top", "vemoe_vote", "vemoe_r", "vemoe_probe"))
        else:
            assert all(len(r["vemoe_top"]) == 2 for r in trained)  # every client routed between its top-2 experts
            for r in trained:  # what routing decided, per client: a probe loss for each live slot, r over them
                assert sum(r["vemoe_r"]) == pytest.approx(1.0, abs=1e-4) and r["vemoe_r"][3] == 0
                # round 1: the experts tie on the probe loss (B = 0); r comes from the gradients, not a uniform tie
                assert len(set(r["vemoe_probe"][:3])) == 1 and max(r["vemoe_r"]) > 1 / 3 + 1e-3, r
                assert all(x > 0 for x in r["vemoe_probe"][:3]) and r["vemoe_probe"][3] == -1.0
            assert (run_dir / "vemoe_separation.json").exists()
        pool = next(r for r in rows if r["round"] == 1 and r["node"] is None)["vemoe"]
        assert pool["experts"] == 3 and sum(pool["responsibility"]) == pytest.approx(3.0, abs=1e-3)
        runs[secure] = _pool(run_dir)
    # the experts are mean(r theta) / mean(r): SecAgg+'s error on each mean, amplified by 1 / mean(r) (>= 1/3 here)
    step_bound = secagg_error_bound([1.0] * 3, SecAggSection().clipping_range, SecAggSection().quantization_range)
    for plain, secure in zip(runs[False], runs[True]):
        for name in plain:
            assert np.abs(plain[name] - secure[name]).max() <= 10 * step_bound, name
    trained = [any(np.any(v) for n, v in expert.items() if ".lora_B." in n) for expert in runs[False]]
    assert sum(trained) >= 2 and not trained[3]  # B left zero: the routed experts trained, the free slot did not


def _checkpoint_round(run_dir: Path) -> int:
    state = run_dir / "checkpoint" / "state.json"
    return json.loads(state.read_text())["round"] if state.exists() else -1


@pytest.mark.e2e
def test_vemoe_resumes_after_a_kill_with_its_pool_and_prune_counters(tiny_llama_dir, tmp_path):
    """SIGKILL the whole federation once round 1 is checkpointed, resume: the rounds before the kill are kept, the
    resumed ones follow them, and each slot's prune counter continues from the checkpoint (a counter restarted at
    zero would read 1 after the first resumed round, not 1 more than at the kill)."""
    import os
    import subprocess
    import sys
    import time

    import psutil
    from child import TESTS

    run_dir = tmp_path / "run"
    # every share of responsibility (about 1/3 each) is "low", and patience is never reached: the counters only count
    cfg = config(tiny_llama_dir, run_dir, **{"num-server-rounds": 3, "vemoe.prune-threshold": 0.9})
    cfg["vemoe.prune-patience"] = 10
    code = "import json, sys, test_toy_strategy as t; t.run_in_process(*json.loads(sys.argv[1]))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)])}
    first = subprocess.Popen(
        [sys.executable, "-c", code, json.dumps([cfg, 3])],
        cwd=TESTS,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 600
    while _checkpoint_round(run_dir) < 1 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert first.poll() is None, "the first run ended before round 1 was checkpointed"
    federation = [first.pid, *(p.pid for p in psutil.Process(first.pid).children(recursive=True))]
    for pid in federation:  # the ServerApp, Ray and its workers: nothing gets to finish the round
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    first.wait(timeout=60)
    psutil.wait_procs([p for p in psutil.process_iter() if p.pid in federation], timeout=30)

    killed_at = _checkpoint_round(run_dir)
    assert 1 <= killed_at < 3, f"killed after round {killed_at}"
    before = [r for r in _rows(run_dir) if r["round"] <= killed_at]
    pool_row = next(r for r in before if r["round"] == killed_at and r["node"] is None)["vemoe"]

    run_in_child("test_toy_strategy", "run_in_process", {**cfg, "resume": True}, 3)
    after = _rows(run_dir)
    assert after[: len(before)] == before  # what was checkpointed is kept, rounds are not re-run
    assert sorted({r["round"] for r in after[len(before) :]}) == list(range(killed_at + 1, 4))
    resumed = next(r for r in after if r["round"] == killed_at + 1 and r["node"] is None)["vemoe"]
    for slot, live in enumerate(resumed["live"]):
        if live and pool_row["live"][slot]:  # low every round (threshold 0.9): one more than at the kill
            assert resumed["low_rounds"][slot] == pool_row["low_rounds"][slot] + 1, slot
    assert _checkpoint_round(run_dir) == 3
    last = {r["partition_id"]: r for r in after if r["round"] == 3 and r["node"] is not None}
    assert len(last) == 3 and all(r["accepted"] for r in last.values())


@pytest.mark.e2e
def test_vemoe_with_a_personal_lora_sends_only_the_pool_and_every_loss_falls(tiny_llama_dir, tmp_path):
    """``vemoe.personal-lora``: the same secure federation with a personal LoRA beside the pool. The server's pool
    has the plain pool's names only (the personal LoRA never travels), every client's loss falls, and each client
    saves its personal LoRA as a PEFT directory. With ``vemoe.birth-spread``, clients no expert serves distinctively
    (a random tiny model tells its experts apart by little: r close to uniform) vote through the sum, and the server
    gives birth from the vote count alone in round 2 (round 1's tie never votes)."""
    run_dir = tmp_path / "run"
    extra = {"secure": True, "num-server-rounds": 2, "vemoe.personal-lora": True, "personal.r": 2}
    extra |= {"vemoe.birth-spread": 0.5, "vemoe.birth-min-votes": 2}
    run_in_child("test_toy_strategy", "run_in_process", config(tiny_llama_dir, run_dir, **extra), 3)
    rows = _rows(run_dir)
    trained = [r for r in rows if r["round"] > 0 and r["node"] is not None]
    assert len(trained) == 6 and all(r["accepted"] for r in trained)
    pools = {r["round"]: r["vemoe"] for r in rows if r["node"] is None and "vemoe" in r}
    assert not [e for e in pools[1]["events"] if e["kind"] == "birth"]  # round 1: the experts tie, nobody votes
    births = [e for e in pools[2]["events"] if e["kind"] == "birth"]
    assert births and births[0]["slot"] == 3 and births[0]["votes"] >= 2, pools[2]
    assert pools[2]["experts"] == 4 and pools[2]["live"][3]
    # the functional distance from the probe sums: none on round 1's tie (fresh experts), every pair by round 2
    assert pools[1]["distance"] == {} and set(pools[2]["distance"]) == {"0,1", "0,2", "1,2"}, pools[2]
    newborn = _pool(run_dir)[3]  # the voters' candidates' mean: a trained expert, not a fresh one (B = 0)
    assert any(np.any(v) for n, v in newborn.items() if ".lora_B." in n)
    for expert in _pool(run_dir):
        assert all(name.startswith("model.layers.") and ".lora_" in name for name in expert), sorted(expert)[:3]
    loss = {(r["partition_id"], r["round"]): r["eval_loss"] for r in rows if r["node"] is not None}
    assert all(loss[p, 2] < loss[p, 0] for p in range(3)), loss
    for p in range(3):
        assert (run_dir / "client-adapters" / f"partition-{p}" / "personal-lora" / "adapter_model.safetensors").exists()
