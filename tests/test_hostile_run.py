"""Hostile members through the whole run (the real ServerApp and ClientApp, in-process simulation, tiny model):
a member whose reply carries metrics that once crashed the server, a VEMoE member that votes 8 for a birth every
round, and an ATLAS member whose rank mask shrinks its group's mean mask. Each run completes every round; in the
clear the hostile reply alone is left out, named, and the others train; under SecAgg+ the group's round is refused,
named, and the next honest round trains everyone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from child import run_in_child


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _base(tiny_llama_dir, run_dir: Path) -> dict:
    return {
        "model.name": str(tiny_llama_dir),
        "model.quantization": "fp32",
        "model.device": "cpu",
        "train.local-steps": 2,
        "train.batch-size": 2,
        "train.learning-rate": 0.05,
        "eval.max-examples": 2,
        "eval.max-new-tokens": 2,
        "run-dir": str(run_dir),
        "node-wait-timeout": 120.0,
    }


def _partition_of(rows: list[dict]) -> dict[str, int]:
    return {str(r["node"]): r["partition_id"] for r in rows if r["round"] == 0 and r["node"] is not None}


@pytest.mark.e2e
def test_in_the_clear_a_vemoe_vote_of_8_and_crashing_metrics_cost_only_their_senders(tiny_llama_dir, tmp_path):
    run_dir = tmp_path / "run"
    cfg = {
        **_base(tiny_llama_dir, run_dir),
        "strategy": "vemoe",
        "num-server-rounds": 2,
        "min-train-replies": 2,
        "experts.k-max": 4,
        "experts.r": 2,
        "vemoe.k-init": 2,
        "vemoe.birth-min-votes": 1,  # one vote would be enough for a birth: the 8 must not get one
    }
    every_round = {"1": "vote", "2": "vote"}
    run_in_child("test_toy_strategy", "run_in_process", cfg, 4, None, {"0": every_round, "1": {"1": "metric"}})
    rows = _rows(run_dir)
    partition_of = _partition_of(rows)
    for server_round in (1, 2):
        summary = next(r for r in rows if r["round"] == server_round and r["node"] is None)
        reasons = {partition_of[n]: why for n, why in summary["rejected"].items()}
        assert "birth votes" in reasons[0], reasons  # VEMoE's sum check, on the member's reply alone
        trained = {r["partition_id"] for r in rows if r["round"] == server_round and r.get("accepted")}
        assert trained == ({2, 3} if server_round == 1 else {1, 2, 3}), server_round
        assert not summary.get("aggregates_rejected")  # the honest members' pool is used
    first = next(r for r in rows if r["round"] == 1 and r["node"] is None)
    why = {partition_of[n]: w for n, w in first["rejected"].items()}[1]
    assert "secagg_clipped" in why or "vemoe_top" in why or "beta" in why, why
    assert all(r.get("eval_loss") is not None for r in rows if r["round"] == 2 and r["node"] is not None)


@pytest.mark.e2e
def test_under_secagg_an_atlas_mask_sum_and_a_crashing_metric_each_cost_their_groups_round(tiny_llama_dir, tmp_path):
    run_dir = tmp_path / "run"
    cfg = {
        **_base(tiny_llama_dir, run_dir),
        "strategy": "atlas",
        "secure": True,
        "num-server-rounds": 3,
        "min-train-replies": 3,
        "lora.r": 4,
        "lora.alpha": 8,
        "atlas.memory-mb": "3",
        "atlas.ranks": "2,4",
    }
    run_in_child("test_toy_strategy", "run_in_process", cfg, 3, None, {"0": {"1": "mask"}, "1": {"2": "metric"}})
    rows = _rows(run_dir)
    summaries = {r["round"]: r for r in rows if r["node"] is None and r["round"] in (1, 2, 3)}
    (first,) = summaries[1]["aggregates_rejected"].values()
    assert "below the least member's share" in first, summaries[1]
    (second,) = summaries[2]["aggregates_rejected"].values()
    assert "whose replies were refused" in second, summaries[2]
    reasons = {_partition_of(rows)[n]: why for n, why in summaries[2]["rejected"].items()}
    assert "secagg_clipped" in reasons[1] or "beta" in reasons[1], reasons
    third = [r for r in rows if r["round"] == 3 and r["node"] is not None and "accepted" in r]
    assert len(third) == 3 and all(r["accepted"] for r in third)
    assert not summaries[3].get("aggregates_rejected")
