"""SubLoRA in a federation through the real ServerApp and ClientApp (in-process simulation, tiny model, 3 clients):
FedAvg sends d numbers per client and round, plain and through SecAgg+ (the secure global alpha is the plain one
to SecAgg+'s quantisation error), local-only keeps each client's alpha; every client exports a PEFT adapter and
reports the compression bound."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from child import run_in_child

from common.config import SecAggSection
from strategies import load_run_config
from strategies.aggregation import secagg_error_bound

D = 48


def config(tiny_llama_dir, run_dir: Path, **extra) -> dict:
    return {
        "strategy": "fedavg",
        "fedavg.adapter": "sublora",
        "sublora.intrinsic-dim": D,
        "sublora.r": 2,
        "sublora.learning-rate": 0.05,
        "model.name": str(tiny_llama_dir),
        "model.quantization": "fp32",
        "model.device": "cpu",
        "num-server-rounds": 2,
        "min-train-replies": 3,
        "train.local-steps": 4,
        "train.batch-size": 2,
        "eval.max-examples": 4,
        "eval.max-new-tokens": 2,
        "run-dir": str(run_dir),
        "node-wait-timeout": 120.0,
        **extra,
    }


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _global_alpha(run_dir: Path) -> np.ndarray:
    from server_app.rundir import RunDirectory

    _, state = RunDirectory(run_dir).load_checkpoint()
    return state["global"]["alpha"]


def test_the_strategies_that_carry_sublora_pick_it_from_the_config():
    assert load_run_config({"strategy": "fedavg", "fedavg.adapter": "sublora"}).adapter == "sublora"
    assert load_run_config({"strategy": "fedavg"}).adapter == "lora"
    assert load_run_config({"strategy": "local", "local.adapter": "sublora"}).adapter == "sublora"


@pytest.mark.e2e
def test_fedavg_of_sublora_sends_d_numbers_plain_and_secure_and_every_client_reports_its_bound(
    tiny_llama_dir, tmp_path
):
    alphas = {}
    for secure in (False, True):
        run_dir = tmp_path / f"secure-{secure}"
        run_in_child("test_toy_strategy", "run_in_process", config(tiny_llama_dir, run_dir, secure=secure), 3)
        rows = _rows(run_dir)
        for server_round in (1, 2):
            trained = [r for r in rows if r["round"] == server_round and r["node"] is not None]
            assert len(trained) == 3 and all(r["accepted"] for r in trained)
            # what a client sent: alpha's d float32 numbers (the evaluation messages carry nothing up)
            assert all(r["bytes_up"] == 4 * D for r in trained), [r["bytes_up"] for r in trained]
        last = [r for r in rows if r["round"] == 2 and r["node"] is not None]
        for row in last:
            assert row["bound_code_bits"] < row["bound_raw_bits"]  # the code is shorter than alpha in float32
            assert row["bound_bits_per_token"] > row["bound_train_bits_per_token"] > 0
            assert 0 <= row["bound_train_top1_error"] <= row["bound_top1_error"] <= 1
            adapter = run_dir / "client-adapters" / f"partition-{row['partition_id']}"
            assert (adapter / "adapter_config.json").exists() and (adapter / "adapter_model.safetensors").exists()
        mean = {r["round"]: r["eval_loss"] for r in rows if r["node"] is None}
        assert mean[2] < mean[0]  # the federation's held-out loss fell (per client: the real-model e2e test)
        assert (run_dir / "adapter" / "sublora.json").exists()  # the server's copy: alpha and how to rebuild P
        alphas[secure] = _global_alpha(run_dir)
    assert np.any(alphas[False])
    step = secagg_error_bound([1.0] * 3, SecAggSection().clipping_range, SecAggSection().quantization_range)
    assert np.abs(alphas[False] - alphas[True]).max() <= 4 * step  # two rounds of SecAgg+'s quantisation error


@pytest.mark.e2e
def test_local_only_sublora_keeps_each_clients_own_alpha(tiny_llama_dir, tmp_path):
    run_dir = tmp_path / "local"
    cfg = config(tiny_llama_dir, run_dir, strategy="local", **{"local.adapter": "sublora"})
    del cfg["fedavg.adapter"]
    run_in_child("test_toy_strategy", "run_in_process", cfg, 3)
    rows = _rows(run_dir)
    last = [r for r in rows if r["round"] == 2 and r["node"] is not None]
    assert len(last) == 3 and all(r["bytes_up"] == 0 for r in last)  # nothing leaves a local-only client
    saved = [np.load(run_dir / "client-adapters" / f"partition-{r['partition_id']}" / "subspace.npz") for r in last]
    assert all(np.any(s["alpha"]) for s in saved)
    assert not np.allclose(saved[0]["alpha"], saved[1]["alpha"])  # each client trained its own


@pytest.mark.e2e
@pytest.mark.parametrize(
    "extra",
    [
        {"secure": True},  # FedAvg of alpha, through SecAgg+
        {"strategy": "local", "local.adapter": "pqlora", "pqlora.blocks": 2},  # PQ-LoRA, trained alone
    ],
    ids=["fedavg-sublora-secure", "local-pqlora"],
)
def test_record_level_dp_sgd_trains_sublora_and_pqlora_and_every_row_says_what_it_spent(
    tiny_llama_dir, tmp_path, extra
):
    """Record-level DP-SGD on the adapter kinds beside LoRA, in a whole federation: each member calibrates its own
    noise for the planned steps, trains by it (its adapter moves), states what it spent in every train row and keeps
    what it computed from its records outside the noised steps (training loss; SubLoRA's bound) on its node."""
    run_dir = tmp_path / "run"
    cfg = config(tiny_llama_dir, run_dir, **{"dp.record-epsilon": 8.0, "data.max-train-examples": 40, **extra})
    if cfg["strategy"] == "local":
        del cfg["fedavg.adapter"]
    run_in_child("test_toy_strategy", "run_in_process", cfg, 3)
    rows = _rows(run_dir)
    for server_round in (1, 2):
        trained = [r for r in rows if r["round"] == server_round and r["node"] is not None]
        assert len(trained) == 3, trained
        for r in trained:
            assert 0 < r["dp_record_epsilon"] <= 8.0 and r["dp_record_noise_multiplier"] > 0, r
            assert r["dp_record_sampling_rate"] == pytest.approx(2 / 40), r
            assert r["train_loss"] is None, r  # computed from the sampled records: kept on the node
            assert not any(k.startswith("bound_") for k in r), r  # the bound reads the training records
    if cfg["strategy"] == "fedavg":
        assert np.any(_global_alpha(run_dir))  # noised, averaged, applied
    else:
        from safetensors.numpy import load_file

        saved = [load_file(d / "pqlora_model.safetensors") for d in sorted((run_dir / "client-adapters").iterdir())]
        assert len(saved) == 3
        local_p = [np.concatenate([v.ravel() for k, v in sorted(s.items()) if k.endswith(".P_L")]) for s in saved]
        assert all(np.any(p) for p in local_p)  # each member's own PQ-LoRA moved from its zero start ...
        assert not np.allclose(local_p[0], local_p[1])  # ... by its own DP-SGD steps
