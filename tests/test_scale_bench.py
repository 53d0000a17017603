"""The scale benchmark's bookkeeping (``bench/scale_bench.py``): the grid it runs, the run config it sends, and what it
reads back from a run's metrics rows. The runs themselves are real simulations; these tests need none."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import scale_bench  # noqa: E402
from conftest import ROOT  # noqa: E402
from flwr.common.config import parse_config_args  # noqa: E402

from common.config import pyproject_defaults  # noqa: E402
from strategies import load_run_config  # noqa: E402


def test_grid_items_and_the_secure_floor():
    assert scale_bench.parse_grid("10/10, 1000/5,100") == [(10, 10), (1000, 5), (100, 100)]
    for bad in ("10/2", "5/10"):  # fewer than a secure group, more sampled than exist
        with pytest.raises(SystemExit, match=bad):
            scale_bench.parse_grid(bad)


@pytest.mark.parametrize("total,sampled", [(10, 10), (1000, 10), (1000, 5), (30, 7)])
def test_the_run_config_samples_exactly_the_asked_number(total, sampled, tmp_path):
    from server_app.sampling import sample_size

    text = scale_bench.run_config(total, sampled, "fedavg", True, 2, tmp_path / "run", "")
    cfg = load_run_config(
        pyproject_defaults(ROOT / "pyproject.toml") | parse_config_args([text])
    )  # as Flower parses it
    assert cfg.secure and cfg.num_server_rounds == 2
    assert sample_size(total, cfg.fraction_train, max(cfg.min_train_nodes, cfg.min_train_replies)) == sampled
    assert sample_size(total, cfg.fraction_evaluate, cfg.min_evaluate_nodes) == sampled
    assert cfg.evaluate_all_every == 0


def _rows(server_rss: list[float], pids: list[list[int]]) -> list[dict]:
    rows: list[dict] = [{"round": 0, "node": None, "seconds": 5.0}]
    for rnd, (rss, round_pids) in enumerate(zip(server_rss, pids), start=1):
        rows.append({"round": rnd, "node": None, "seconds": 10.0 * rnd, "server_rss_mb": rss, "eval_loss": 1.0})
        for i, pid in enumerate(round_pids):
            rows.append(
                {"round": rnd, "node": i, "accepted": True, "eval_loss": 1.0, "pid": pid, "peak_rss_mb": 100.0 + i}
                | {"bytes_up": 1000, "bytes_down": 2000}
            )
    return rows


def test_rounds_are_summarised_and_round_one_is_left_out_of_the_steady_state():
    rounds = scale_bench.summarise(_rows([400.0, 410.0, 420.0], [[7, 7, 8], [7, 8, 8], [7, 7, 7]]))
    assert [r["round"] for r in rounds] == [1, 2, 3]  # round 0 (the first evaluation) is not a training round
    assert [r["new_processes"] for r in rounds] == [2, 0, 0] and rounds[0]["actor_processes"] == 2
    assert rounds[1]["trained"] == 3 and rounds[1]["bytes_up"] == 3000 and rounds[1]["peak_client_rss_mb"] == 102.0
    assert scale_bench.outside_rounds(_rows([400.0, 410.0, 420.0], [[7], [7], [7]]), 100.0) == pytest.approx(35.0)
    steady = scale_bench.steady(rounds)
    assert steady["wall_seconds"] == pytest.approx(25.0)  # rounds 2 and 3, not round 1's 10 s
    assert steady["server_rss_mb_max"] == 420.0


def test_server_memory_per_idle_client_compares_runs_that_differ_only_in_size():
    def result(total, rss, mode="plain"):
        steady = {"server_rss_mb_max": rss}
        return {"strategy": "fedavg", "mode": mode, "total": total, "sampled": 10, "steady": steady}

    per_client = scale_bench.idle_client_memory(
        [result(10, 400.0), result(100, 409.0), result(1000, 499.0), result(10, 500.0, "secure")]
    )
    assert per_client == {"fedavg/plain/10 sampled": pytest.approx(0.1)}  # (499 - 400) / 990; secure has one run
    repeated = [result(10, 400.0), result(1000, 499.0), result(1000, 519.0), result(1000, 509.0, "secure")]
    assert scale_bench.idle_client_memory(repeated) == {"fedavg/plain/10 sampled": pytest.approx(109 / 990)}  # mean 509


def test_secure_overhead_pairs_each_secure_run_with_its_plain_twin():
    def result(mode, total, seconds, strategy="fedavg"):
        return {"strategy": strategy, "mode": mode, "total": total, "sampled": 10, "steady": {"wall_seconds": seconds}}

    runs = [result("plain", 10, 40.0), result("secure", 10, 50.0), result("secure", 1000, 60.0)]
    runs.append(result("secure", 10, 30.0, "simgrad"))  # no plain twin: no overhead claimed
    assert scale_bench.secure_overhead(runs) == {"fedavg 10/10": pytest.approx(0.25)}
    runs.append(result("plain", 10, 60.0))  # a repeated plain run: the plain time is the mean, 50 s
    assert scale_bench.secure_overhead(runs) == {"fedavg 10/10": pytest.approx(0.0)}


def test_reports_of_several_invocations_join_only_on_one_machine(tmp_path):
    import json

    machine = {"cpu": "X", "cores": 2, "avx512_bf16": True, "cuda": None}
    for name, cpu in (("a", "X"), ("b", "X"), ("c", "Y")):
        run = {"strategy": name, "mode": "plain", "total": 10, "sampled": 10}
        report = {"machine": machine | {"cpu": cpu}, "rounds": 2, "runs": [run]}
        (tmp_path / f"{name}.json").write_text(json.dumps(report))
    joined = scale_bench.join_reports([str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert [r["strategy"] for r in joined["runs"]] == ["a", "b"] and joined["machine"]["cpu"] == "X"
    with pytest.raises(SystemExit, match="machine"):
        scale_bench.join_reports([str(tmp_path / "a.json"), str(tmp_path / "c.json")])
