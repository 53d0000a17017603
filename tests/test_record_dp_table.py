"""The record-level DP table (``bench.record_dp_table``): each configuration at each epsilon, whether every client
learned (resolved against round 0) and how far it is from the same configuration without DP."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench.record_dp_table import BEGIN, END, main, split_label


@pytest.mark.parametrize(
    ("label", "split"),
    [
        ("local", ("local", None)),
        ("fedavg:dp.record-epsilon=8", ("fedavg", 8.0)),
        ("fedavg:fedavg.adapter='sublora' dp.record-epsilon=3", ("fedavg:fedavg.adapter='sublora'", 3.0)),
        ("fedavg:dp.mode='central' dp.target-epsilon=8", ("fedavg:dp.mode='central' dp.target-epsilon=8", None)),
    ],
)
def test_a_label_is_its_configuration_and_its_record_level_epsilon(label, split):
    assert split_label(label) == split


def _rows(label: str, seed: int, shift: dict[int, dict[int, float]]) -> list[dict]:
    """Two clients, 40 held-out examples each: round 0 around 3, round 1 around 3 + shift[client][1]."""
    rng = np.random.default_rng(seed)
    rows = []
    for rnd in (0, 1):
        for client in (0, 1):
            losses = 3.0 + shift[client][rnd] + rng.normal(0, 0.05, 40)
            rows.append(
                {
                    "strategy": label,
                    "seed": seed,
                    "client": client,
                    "round": rnd,
                    "eval_loss": float(losses.mean()),
                    "eval_example_loss": losses.tolist(),
                    "eval_example_tokens": [4] * 40,
                }
            )
    return rows


def test_the_table_says_who_learned_and_how_far_from_no_dp(tmp_path):
    plain = {0: {0: 0.0, 1: -1.0}, 1: {0: 0.0, 1: -1.0}}
    private = {0: {0: 0.0, 1: -0.3}, 1: {0: 0.0, 1: 0.0}}  # client 1 does not learn under DP
    labels = ["fedavg", "fedavg:dp.record-epsilon=8"]
    rows = [r for seed in (0, 1, 2) for r in _rows(labels[0], seed, plain) + _rows(labels[1], seed, private)]
    report = {"strategies": [{"label": label} for label in labels], "rows": rows}
    (tmp_path / "compare.json").write_text(json.dumps(report))
    run = tmp_path / "runs" / "fedavg_dp.record-epsilon=8" / "seed-0"
    run.mkdir(parents=True)
    spent = {"node": 1, "round": 1, "partition_id": 0, "dp_record_epsilon": 7.5}
    spent |= {"dp_record_noise_multiplier": 0.6, "dp_record_sampling_rate": 0.016}
    (run / "metrics.jsonl").write_text(json.dumps(spent) + "\n")
    doc = tmp_path / "page.md"
    doc.write_text(f"before\n{BEGIN}\nold\n{END}\nafter\n")
    records = {r["strategy"]: r for r in main([str(tmp_path), "--doc", str(doc)])}
    assert records["fedavg"]["clients_learned"] == 2 and "vs_no_dp" not in records["fedavg"]
    private_record = records["fedavg:dp.record-epsilon=8"]
    assert private_record["clients_learned"] == 1 and private_record["clients"] == 2
    assert private_record["vs_no_dp_verdict"] == "worse"  # 0.35 nats above no DP on the mean client
    assert private_record["dp_record_epsilon"] == [7.5, 7.5]
    assert "vs_local" not in private_record  # no local-only run in this report to set it beside
    page = doc.read_text()
    assert page.startswith("before\n") and page.endswith(f"{END}\nafter\n") and "old" not in page
    assert "| `fedavg` | 8 | 3 |" in page and "1 of 2" in page
    # a stored report (no run directories) re-renders from its record-dp.json
    (run / "metrics.jsonl").unlink()
    again = {r["strategy"]: r for r in main([str(tmp_path)])}
    assert again["fedavg:dp.record-epsilon=8"]["dp_record_epsilon"] == [7.5, 7.5]


def test_a_merged_report_reads_each_runs_own_directory_and_keeps_what_is_stored_for_the_rest(tmp_path):
    """``bench.compare --merge``: seed 2 ran into another comparison's directory (named by the report's run), seeds
    0-1 are gone and their spending comes from the stored table the new one replaces."""
    label = "fedavg:dp.record-epsilon=8"
    rows = [r for seed in (0, 1, 2) for r in _rows(label, seed, {0: {0: 0.0, 1: -1.0}, 1: {0: 0.0, 1: -1.0}})]
    elsewhere = tmp_path / "other" / "seed-2"
    elsewhere.mkdir(parents=True)
    line = {"round": 1, "dp_record_epsilon": 7.9, "dp_record_noise_multiplier": 0.44, "dp_record_sampling_rate": 0.01}
    (elsewhere / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    report = {
        "strategies": [{"label": label}],
        "rows": rows,
        "runs": [{"strategy": label, "seed": 2, "run_dir": str(elsewhere)}],
    }
    merged, stored = tmp_path / "merged", tmp_path / "stored"
    merged.mkdir()
    stored.mkdir()
    (merged / "compare.json").write_text(json.dumps(report))
    old = {label: {"dp_record_epsilon": [8.0], "dp_record_noise_multiplier": [0.43], "dp_record_sampling_rate": [0.01]}}
    (stored / "record-dp.json").write_text(json.dumps({"spent": old}))
    record = main([str(merged), "--out", str(stored)])[0]
    assert record["dp_record_epsilon"] == [7.9, 8.0] and record["dp_record_noise_multiplier"] == [0.43, 0.44]
    # rendered again from what it stored, with seed 2's directory gone: the same
    (elsewhere / "metrics.jsonl").unlink()
    assert main([str(merged), "--out", str(stored)])[0]["dp_record_epsilon"] == [7.9, 8.0]


def test_a_shared_configuration_is_set_beside_local_only_at_the_same_epsilon(tmp_path):
    """What sharing adds under one budget: fedavg at epsilon 8 beside local at epsilon 8 (not local without DP)."""
    alone, shared = {0: {0: 0.0, 1: -0.2}, 1: {0: 0.0, 1: -0.2}}, {0: {0: 0.0, 1: -0.6}, 1: {0: 0.0, 1: -0.6}}
    labels = ["local", "local:dp.record-epsilon=8", "fedavg:dp.record-epsilon=8"]
    worlds = [{0: {0: 0.0, 1: -1.0}, 1: {0: 0.0, 1: -1.0}}, alone, shared]
    rows = [r for seed in (0, 1, 2) for label, w in zip(labels, worlds) for r in _rows(label, seed, w)]
    (tmp_path / "compare.json").write_text(json.dumps({"strategies": [{"label": x} for x in labels], "rows": rows}))
    records = {r["strategy"]: r for r in main([str(tmp_path)])}
    assert records["fedavg:dp.record-epsilon=8"]["vs_local_verdict"] == "better"  # 0.2 nats below on the mean client
    assert "vs_local" not in records["local:dp.record-epsilon=8"] and "vs_local" not in records["local"]
