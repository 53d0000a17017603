"""The comparison's report math on crafted rows (negative transfer, worst client, spread over seeds, the best per
column) and how ``bench.compare`` builds and checks runs."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from bench.compare import parse_strategy, split_outside_quotes, write_report
from bench.compare_merge import machine_line, merge_report, round_zero_rows, with_merged
from bench.compare_runs import (
    PYPROJECT,
    borrows_round_zero,
    complete,
    default_settings,
    resolved_settings,
    run_config,
    run_problem,
    same_settings,
    set_aside,
)
from bench.presets import PRESETS, preset, toml_value
from bench.report import (
    best_by_column,
    gap_by_round,
    gap_by_round_table,
    hurt,
    markdown_table,
    negative_transfer,
    over_seeds,
    summarise,
    worst,
    worst_by_round,
)
from bench.verdicts import guarded_labels, verdict_tables
from strategies import load_run_config


def rows_of(strategy: str, seed: int, losses_by_round: dict[int, list[float]], bytes_up: int = 0) -> list[dict]:
    return [
        {
            "strategy": strategy,
            "seed": seed,
            "client": c,
            "round": rnd,
            "eval_loss": loss,
            "exact_match": 0.5,
            "rouge_l": 0.25,
            "bytes_up": bytes_up,
            "bytes_down": 3 * bytes_up,
            "seconds": 1.0,
        }
        for rnd, losses in losses_by_round.items()
        for c, loss in enumerate(losses)
    ]


def test_negative_transfer_pairs_each_client_with_itself():
    transfer = negative_transfer({0: 1.0, 1: 2.5, 2: 3.0}, {0: 1.5, 1: 2.0, 2: 3.0, 3: 9.0})
    assert transfer == {0: -0.5, 1: 0.5, 2: 0.0}  # client 3 has no strategy value: left out
    assert hurt(transfer) == (1, 0.5)  # equal is not hurt
    assert hurt({0: -1.0}) == (0, 0.0)
    assert worst({0: 1.0, 1: 4.0}) == 4.0 and math.isnan(worst({}))


def test_spread_is_the_sample_standard_deviation_over_seeds():
    s = over_seeds([1.0, 2.0, 3.0])
    assert (s.mean, s.spread, s.n) == (2.0, 1.0, 3)
    assert over_seeds([4.0]).spread == 0.0 and over_seeds([float("nan"), 2.0]).n == 1
    assert over_seeds([]).n == 0 and str(over_seeds([])) == "n/a"


def test_summary_uses_the_final_round_and_the_same_seed_baseline():
    rows = (
        rows_of("local", 0, {0: [3, 3, 3], 2: [2.0, 1.0, 1.5]})
        + rows_of("local", 1, {0: [3, 3, 3], 2: [2.2, 1.0, 1.5]})
        + rows_of("fedavg", 0, {0: [3, 3, 3], 1: [9, 9, 9], 2: [1.5, 1.5, 1.5]}, bytes_up=100)
        + rows_of("fedavg", 1, {0: [3, 3, 3], 1: [9, 9, 9], 2: [1.9, 1.2, 1.0]}, bytes_up=100)
    )
    local, fedavg = summarise(rows, "local", {("fedavg", 0): 10.0, ("fedavg", 1): 20.0})
    assert local.worst_loss.mean == pytest.approx(2.1) and local.worst_loss.spread == pytest.approx(math.sqrt(0.02))
    assert local.hurt_count.n == 0  # the baseline is not compared with itself
    assert fedavg.mean_loss.mean == pytest.approx((1.5 + (1.9 + 1.2 + 1.0) / 3) / 2)
    assert fedavg.worst_loss.mean == pytest.approx(1.7)  # round 1's 9.0 is not the final round
    # seed 0: clients 1 and 2 hurt by 0.5 and 0.0 -> (1, 0.5); seed 1: client 1 by 0.2 -> (1, 0.2)
    assert fedavg.hurt_count.mean == 1 and fedavg.hurt_size.mean == pytest.approx(0.35)
    assert fedavg.worst_vs_baseline.mean == pytest.approx(((1.5 - 2.0) + (1.9 - 2.2)) / 2)
    assert fedavg.bytes_up_per_round.mean == 100 and fedavg.bytes_down_per_round.mean == 300
    assert fedavg.wall_seconds.mean == 15.0
    best = best_by_column([local, fedavg])
    assert best["worst_loss"] == "fedavg" and best["bytes_up_per_round"] == "local"
    assert "hurt_count" not in best  # only fedavg has it (the baseline is not compared with itself): no best
    table = markdown_table([local, fedavg])
    assert "| local | 2 |" in table and "**1.700 ± 0.283**" in table
    assert worst_by_round(rows, "fedavg")[1].mean == 9


def test_strategy_items_and_overrides_become_one_run_config():
    assert split_outside_quotes("fedavg, simgrad:data.tasks='a,b' seed=1,local") == [
        "fedavg",
        "simgrad:data.tasks='a,b' seed=1",
        "local",
    ]
    assert parse_strategy("simgrad:pqlora.r=4") == ("simgrad:pqlora.r=4", "simgrad", "pqlora.r=4")
    with pytest.raises(SystemExit, match="'sublora' is not a registered strategy"):
        parse_strategy("sublora")
    from pathlib import Path

    text = run_config(
        preset("tasks-distinct"), 5, 2, "simgrad", "train.local-steps=3", "eval.max-examples=2", Path("/r")
    )
    from flwr.common.config import parse_config_args

    flat = parse_config_args([text])  # what `flwr run --run-config` will read: every key once, later ones win
    assert flat["train.local-steps"] == 3 and flat["eval.max-examples"] == 2 and flat["seed"] == 2
    assert flat["strategy"] == "simgrad" and flat["num-server-rounds"] == 5 and flat["run-dir"] == "/r"
    assert toml_value(True) == "true" and toml_value("a b") == "'a b'"
    with pytest.raises(SystemExit, match="--run-config"):
        run_config(preset("tasks-distinct"), 1, 0, "local", "", "x=1.2.3", Path("/r"))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_a_valid_run_config(name):
    chosen = preset(name)
    cfg = load_run_config({**chosen.overrides, "strategy": "simgrad", "num-server-rounds": chosen.rounds})
    assert cfg.data.validation_fraction > 0  # tuning never reads the reported split
    with pytest.raises(ValueError, match="not a preset"):
        preset("tasks-everything")


def test_the_partnerless_preset_has_two_task_pairs_and_two_clients_alone():
    from common.data.bank import client_splits, load_task_bank

    chosen = preset("few-shot-partnerless")
    cfg = load_run_config({**chosen.overrides, "strategy": "local", "num-server-rounds": chosen.rounds})
    bank = load_task_bank(cfg.data)
    tasks = [{e.task for e in client_splits(bank, c, chosen.clients, cfg.data)["train"]} for c in range(6)]
    assert all(len(t) == 1 for t in tasks)
    sharers = {c: [o for o in range(6) if tasks[o] == tasks[c]] for c in range(6)}
    assert sharers == {0: [0, 4], 1: [1, 5], 2: [2], 3: [3], 4: [0, 4], 5: [1, 5]}
    assert tasks[2] | tasks[3] == {"xsum", "commonsenseqa"}


def test_a_run_without_every_clients_loss_is_not_comparable(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = [{"round": r, "node": n, "eval_loss": 1.0} for r in (0, 1) for n in (1, 2)]
    path.write_text("\n".join(json.dumps(r) for r in good))
    assert run_problem(path, rounds=1, clients=2) is None
    broken = good[:3] + [{"round": 1, "node": 2, "eval_loss": None, "eval_error": "client error: boom"}]
    path.write_text("\n".join(json.dumps(r) for r in broken))
    assert "round 1: 1 of 2 clients" in run_problem(path, rounds=1, clients=2) and "boom" in run_problem(path, 1, 2)
    assert run_problem(tmp_path / "missing.jsonl", 1, 2) == "no metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in good[2:]))  # round 0 borrowed from another run of the seed
    assert "round 0: 0 of 2" in run_problem(path, 1, 2) and run_problem(path, 1, 2, initial=False) is None


@pytest.mark.parametrize(
    "overrides, borrows",
    [("", True), ("pqlora.r=4 simgrad.temperature=0.1", True), ("fedavg.adapter='sublora'", True),
     ("data.max-train-examples=8", False), ("eval.final-examples=16", False), ("model.name='x'", False),
     ("seed=3", False), ("model.overrides='qwen2.5-coder-0.5b-instruct:pqlora.gate-init=2.0'", True)],
)  # fmt: skip
def test_only_settings_that_cannot_change_the_base_models_evaluation_borrow_round_zero(overrides, borrows):
    assert borrows_round_zero(overrides) is borrows


def test_a_run_that_borrowed_round_zero_is_charged_for_it_and_the_report_says_so(tmp_path):
    rows = [r for label in ("local", "fedavg") for r in _example_rows(label, 0, [0.0, 0.1])]
    report = {
        **_report([0], "A"),
        "strategies": [{"label": s, "name": s, "overrides": ""} for s in ("local", "fedavg")],
        "runs": [
            {"strategy": "local", "seed": 0, "ok": True, "wall_seconds": 100.0},
            {"strategy": "fedavg", "seed": 0, "ok": True, "wall_seconds": 80.0, "initial_from": "local",
             "initial_seconds": 15.0},
        ],
        "rows": rows,
    }  # fmt: skip
    write_report(tmp_path, report)
    text = (tmp_path / "compare.md").read_text()
    assert "evaluated once per seed and shared by the other strategies of that seed (seed 0: local)" in text
    fedavg = next(line for line in text.splitlines() if line.startswith("| fedavg | 1 |"))
    assert "95 ± 0" in fedavg  # 80 s of its own and the 15 s its lender spent on round 0


def test_a_run_is_reused_only_with_the_settings_it_ran_with(tmp_path):
    """The override string alone would reuse a SimGrad run made before a PQ-LoRA default changed (it did once)."""
    changed = tmp_path / "pyproject.toml"
    text = PYPROJECT.read_text()
    changed.write_text(re.sub(r"\npqlora\.blocks = \d+", "\npqlora.blocks = 3", text, count=1))
    assert changed.read_text() != text
    for name, same in (("fedavg", True), ("local", True), ("simgrad", False)):
        config = f"strategy='{name}' seed=1 data.tasks='boolq'"
        now, before = resolved_settings(config), resolved_settings(config, changed)
        assert (now == before) is same, name
        assert now["seed"] == 1 and now["data.tasks"] == "boolq" and "train.local-steps" in now
    assert "pqlora.blocks" not in resolved_settings("strategy='fedavg'")
    assert resolved_settings("run-dir='/a'") == resolved_settings("run-dir='/b'")  # where it writes is not what it is
    assert resolved_settings("strategy='local' local.adapter='pqlora'")["pqlora.blocks"] == 24


def test_a_run_records_whether_it_was_guarded_and_the_guards_keys_only_where_it_was():
    """``guard.enabled = 'auto'`` is recorded as what it came to; an unguarded run made before a guard default changed
    (``guard.examples`` was 16) is still the same run, a guarded one is not."""
    defaults = default_settings()
    simgrad = resolved_settings("strategy='simgrad' data.validation-fraction=0.2")
    assert simgrad["guard.enabled"] is True and simgrad["guard.examples"] == 64
    assert resolved_settings("strategy='simgrad'")["guard.enabled"] is False  # no validation split: off
    fedavg = resolved_settings("strategy='fedavg' data.validation-fraction=0.2")
    assert fedavg["guard.enabled"] is False
    assert [k for k in fedavg if k.startswith("guard.")] == ["guard.enabled"]
    recorded = {**fedavg, "guard.examples": 16, "guard.reference": "alone"}
    assert same_settings(recorded, fedavg, defaults)
    assert not same_settings({**simgrad, "guard.examples": 16}, simgrad, defaults)
    assert not same_settings({**fedavg, "guard.enabled": True}, fedavg, defaults)


def test_a_key_added_after_a_run_matches_only_at_its_default(tmp_path):
    """A run recorded before ``fraction-train`` existed is the same run while ``fraction-train`` stays 1.0."""
    defaults = default_settings()
    now = json.loads(json.dumps(resolved_settings("strategy='fedavg' seed=1")))
    assert now["fraction-train"] == 1.0
    before = {k: v for k, v in now.items() if k != "fraction-train"}
    assert same_settings(before, now, defaults)
    assert not same_settings(before, {**now, "fraction-train": 0.5}, defaults)
    assert not same_settings({**now, "seed": 2}, now, defaults)
    assert not same_settings({**now, "a-removed-key": 1}, now, defaults)

    run_dir = tmp_path / "seed-1"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("{}\n")
    (run_dir / "compare-run.json").write_text(json.dumps({"ok": True, "settings": before}))
    assert complete(run_dir, now, defaults)
    assert not complete(run_dir, {**now, "seed": 2}, defaults)
    # a finished run with other settings is moved aside, never written over; twice gives two names
    assert set_aside(run_dir) == tmp_path / "seed-1.superseded-1"
    assert (tmp_path / "seed-1.superseded-1" / "metrics.jsonl").read_text() == "{}\n" and not run_dir.exists()
    assert set_aside(run_dir) is None  # nothing finished there
    run_dir.mkdir()
    (run_dir / "compare-run.json").write_text("{}")
    assert set_aside(run_dir) == tmp_path / "seed-1.superseded-2"


def test_memory_is_the_largest_client_process_and_training_time_the_mean_per_client_round():
    rows = rows_of("fedavg", 0, {0: [2.0, 2.0], 1: [1.0, 1.5]}) + rows_of("fedavg", 1, {0: [2.0, 2.0], 1: [1.0, 1.0]})
    for row, rss, train in zip(rows, [900, 1000, 950, 1200, 800, 800, 700, 600], [None, None, 4, 6, None, None, 2, 2]):
        row["peak_rss_mb"], row["train_seconds"] = rss, train
    (summary,) = summarise(rows, baseline=None)
    assert (summary.peak_rss_mb.mean, summary.peak_rss_mb.n) == (1000.0, 2)  # max per seed: 1200 and 800
    assert summary.train_seconds.mean == 3.5  # seed 0: (4 + 6) / 2, seed 1: 2; round 0 does not train
    assert "peak RSS MB" in markdown_table([summary]) and "1000 ± 283" in markdown_table([summary])


def _report(seeds: list[int], cpu: str, common: str = "train.local-steps=8") -> dict:
    rows = [r for s in seeds for r in rows_of("fedavg", s, {0: [2.0, 2.0], 1: [1.0 + s, 1.5]})]
    return {
        "preset": "tasks-distinct",
        "about": "a test",
        "clients": 2,
        "rounds": 1,
        "common_config": common,
        "baseline": "local",
        "strategies": [{"label": "fedavg", "name": "fedavg", "overrides": ""}],
        "seeds": seeds,
        "machine": {"cpu": cpu, "cores": 2, "avx512_bf16": cpu == "B", "cuda": None},
        "runs": [{"strategy": "fedavg", "seed": s, "ok": True, "wall_seconds": 1.0} for s in seeds],
        "rows": rows,
    }


def test_merged_seeds_join_the_summary_and_name_their_machine(tmp_path):
    path = tmp_path / "compare.json"
    path.write_text(json.dumps(_report([0, 1], "A")))
    here = _report([2], "B")
    merged = with_merged(here, [merge_report(here, path)])
    assert merged["seeds"] == [0, 1, 2] and len(merged["rows"]) == 3 * len(here["rows"])
    (summary,) = summarise(merged["rows"], None, {})
    assert summary.worst_loss.mean == pytest.approx((1.5 + 2.0 + 3.0) / 3)  # seeds 0, 1 from the file, 2 from here
    assert machine_line(merged) == (
        "Machines: seeds [0, 1] on A, 2 cores, AVX512-BF16 False, CUDA None; seeds [2] on B, 2 cores, "
        "AVX512-BF16 True, CUDA None."
    )
    write_report(tmp_path, here, [merge_report(here, path)])
    assert "seeds [0, 1] on A" in (tmp_path / "compare.md").read_text()
    assert json.loads((tmp_path / "compare.json").read_text())["seeds"] == [0, 1, 2]


def test_a_report_names_its_split_rule_and_one_made_under_another_rule_is_not_merged(tmp_path):
    """Reports made before the split by content (no "split") say so, and are not paired with runs made after it."""
    from common.data import SPLIT_RULE

    path = tmp_path / "compare.json"
    path.write_text(json.dumps(_report([0, 1], "A")))  # an old report: no split recorded
    here = {**_report([2], "A"), "split": SPLIT_RULE}
    with pytest.raises(SystemExit, match=r"split differs \(.by seed \(made before the split by content"):
        merge_report(here, path)
    write_report(tmp_path, here)
    assert f"Split: {SPLIT_RULE}." in (tmp_path / "compare.md").read_text()
    path.write_text(json.dumps({**_report([0, 1], "A"), "split": SPLIT_RULE}))
    assert merge_report(here, path)  # the same rule: merged


def test_other_strategies_on_the_same_seeds_join_the_report_and_are_paired(tmp_path):
    def report(label: str, cpu: str, shift: float, seeds=(0, 1), packed: bool = False) -> dict:
        settings = {"model.cpu-packed-inference": packed}  # False: fp32 evaluation on either machine, one path
        return {
            **_report(list(seeds), cpu),
            "strategies": [{"label": label, "name": label, "overrides": ""}],
            "runs": [
                {"strategy": label, "seed": s, "ok": True, "wall_seconds": 1.0, "settings": settings} for s in seeds
            ],
            "rows": [r for s in seeds for r in _example_rows(label, s, [shift, shift])],
        }

    path = tmp_path / "compare.json"
    path.write_text(json.dumps(report("fedavg", "A", 0.3)))
    here = report("local", "B", 0.0)
    merged = with_merged(here, [merge_report(here, path)])
    assert [s["label"] for s in merged["strategies"]] == ["local", "fedavg"] and merged["seeds"] == [0, 1]
    assert machine_line(merged) == (
        "Machines: fedavg seeds [0, 1] on A, 2 cores, AVX512-BF16 False, CUDA None; local seeds [0, 1] on B, 2 cores, "
        "AVX512-BF16 True, CUDA None."
    )
    write_report(tmp_path, here, [merge_report(here, path)])
    written = json.loads((tmp_path / "compare.json").read_text())
    verdicts = {(v["a"], v["b"], v["statistic"]): v for v in written["verdicts"]}
    assert verdicts["fedavg", "local", "mean client"]["estimate"] == pytest.approx(0.3)  # paired seed by seed
    # two seeds cannot show how much seeds disagree: resolved on examples only, not seed-aware
    assert verdicts["fedavg", "local", "mean client"]["verdict_examples_only"] == "worse"
    assert verdicts["fedavg", "local", "mean client"]["verdict"] == "not resolved"
    # the merged report takes a third seed of both strategies, and keeps who ran where
    third = {**report("local", "C", 0.0, seeds=(2,)), "strategies": written["strategies"]}
    again = with_merged(third, [merge_report(third, tmp_path / "compare.json")])
    assert again["seeds"] == [0, 1, 2]
    assert [again["machines"][k]["cpu"] for k in ("fedavg 0", "local 1", "local 2")] == ["A", "B", "C"]
    # machine B evaluating with its packed bf16 kernel is another numeric path: never paired with A's fp32 runs
    (fedavg_only := tmp_path / "fedavg.json").write_text(json.dumps(report("fedavg", "A", 0.3)))
    packed = report("local", "B", 0.0, packed=True)
    write_report(tmp_path, packed, [merge_report(packed, fedavg_only)])
    written = json.loads((tmp_path / "compare.json").read_text())
    assert not [v for v in written["verdicts"] if {v["a"], v["b"]} == {"fedavg", "local"}]
    md = (tmp_path / "compare.md").read_text()
    assert "fedavg − local seed 0: cpu, nf4, eval in fp32 against cpu, nf4, eval in bf16 (packed kernel" in md


def test_one_label_with_other_settings_there_is_not_merged(tmp_path):
    """A label is one strategy: a report whose runs recorded other resolved settings under it (e.g. made before a
    default changed) is refused, naming the key; the same settings, or a report without them, merge."""
    defaults = default_settings()
    old_default = resolved_settings("strategy='simgrad' simgrad.mix-self=false seed=0")
    earlier = _report([0], "A")
    earlier["runs"] = [{**earlier["runs"][0], "settings": {**old_default, "strategy": "fedavg"}}]
    path = tmp_path / "compare.json"
    path.write_text(json.dumps(earlier))
    here = _report([1], "B")
    now = {"fedavg": {**resolved_settings("strategy='simgrad' seed=1"), "strategy": "fedavg"}}
    with pytest.raises(SystemExit, match=r"'fedavg' ran with other settings there \(simgrad.mix-self\)"):
        merge_report(here, path, now, defaults)
    same = {"fedavg": {**old_default, "seed": 1, "strategy": "fedavg"}}  # the seed differs run to run: not a setting
    assert merge_report(here, path, same, defaults)["seeds"] == [0]
    earlier["runs"] = [{k: v for k, v in earlier["runs"][0].items() if k != "settings"}]
    path.write_text(json.dumps(earlier))
    assert merge_report(here, path, now, defaults)["seeds"] == [0]  # an older report recorded none: not checked


def test_a_run_config_written_in_another_key_order_is_the_same_run_config(tmp_path):
    path = tmp_path / "compare.json"
    path.write_text(json.dumps(_report([0], "A", common="train.local-steps=4 eval.max-examples=8")))
    here = _report([1], "B", common="eval.max-examples=8 train.local-steps=4")
    assert merge_report(here, path)["seeds"] == [0]


@pytest.mark.parametrize(
    "earlier, message",
    [
        (_report([0], "A", common="train.local-steps=4"), "common_config differs"),
        (_report([2], "A"), "fedavg seed 2 ran there too"),
        (_report([0, 2], "A"), "fedavg seed 2 ran there too"),
    ],
)
def test_a_report_that_compared_something_else_is_not_merged(tmp_path, earlier, message):
    path = tmp_path / "compare.json"
    path.write_text(json.dumps(earlier))
    with pytest.raises(SystemExit, match=re.escape(message)):
        merge_report(_report([2], "B"), path)


def test_a_clustering_strategys_purity_and_silhouette_get_columns_only_when_present(tmp_path):
    from bench.compare_runs import read_run

    metrics = tmp_path / "metrics.jsonl"
    lines = [
        {"round": 0, "node": None, "seconds": 1.0},
        {"round": 1, "node": None, "seconds": 2.0, "atlas": {"m": {"purity": 1.0, "silhouette": 0.6}}},
        {"round": 2, "node": None, "seconds": 2.0, "atlas": {"m": {"purity": 0.5, "silhouette": 0.2}}},
    ] + [
        {"round": r, "node": 10 + c, "partition_id": c, "eval_loss": 2.0 - r, "bytes_up": 0, "bytes_down": 0}
        for r in range(3)
        for c in range(2)
    ]
    metrics.write_text("\n".join(json.dumps(line) for line in lines))
    atlas = read_run(metrics, "atlas", 0)
    assert {(r["purity"], r["silhouette"]) for r in atlas} == {(0.5, 0.2)}  # the run's last clustering
    plain = rows_of("fedavg", 0, {0: [2.0, 2.0], 2: [1.0, 1.5]})
    without = markdown_table(summarise(plain, None))
    assert "purity" not in without and "silhouette" not in without
    table = markdown_table(summarise(plain + atlas, None))
    header, _, fedavg_line, atlas_line = table.splitlines()
    assert header.endswith("| purity | silhouette |")
    assert fedavg_line.endswith("| – | – |") and atlas_line.endswith("| 0.50 ± 0.00 | 0.20 ± 0.00 |")


def _example_rows(strategy: str, seed: int, shift: list[float], tasks=("boolq", "xsum")) -> list[dict]:
    """Final-round rows of one run whose per-example held-out losses are a fixed draw plus a per-client shift."""
    rows = []
    for c, offset in enumerate(shift):
        draw = np.random.default_rng(100 * seed + c)
        losses = (1.0 + c + 0.5 * draw.standard_normal(64)).clip(0.01) + offset
        tokens = draw.integers(1, 6, 64)
        for rnd, values in ((0, losses + 1.0), (2, losses)):
            rows.append(
                {
                    "strategy": strategy,
                    "seed": seed,
                    "client": c,
                    "round": rnd,
                    "tasks": [tasks[c % len(tasks)]],
                    "model": "HuggingFaceTB/smollm2",
                    "eval_loss": float((values * tokens).sum() / tokens.sum()),
                    "eval_example_loss": values.tolist(),
                    "eval_example_tokens": tokens.tolist(),
                    "exact_match": 0.5,
                    "rouge_l": 0.2,
                    "bytes_up": 0,
                    "bytes_down": 0,
                    "seconds": 1.0,
                }
            )
    return rows


def test_verdicts_pair_each_strategy_with_the_references_and_name_who_is_hurt(tmp_path):
    rows = []
    for seed in (0, 1, 2):
        rows += _example_rows("local", seed, [0.0, 0.0, 0.0, 0.0])
        rows += _example_rows("fedavg", seed, [0.0, 0.0, 0.0, 0.0])  # the same as local-only, example for example
        rows += _example_rows("better", seed, [-0.3, -0.3, -0.3, 0.4])  # helps three clients, hurts client 3
    text, records = verdict_tables(rows, ["local", "fedavg"], replicates=500)
    verdict = {(r["a"], r["b"], r["statistic"]): r for r in records}
    assert verdict[("fedavg", "local", "worst client")]["verdict"] == "not resolved"
    assert verdict[("fedavg", "local", "worst client")]["estimate"] == 0.0
    assert verdict[("better", "local", "mean client")]["verdict"] == "better"
    assert verdict[("better", "local", "worst client")]["verdict"] == "worse"  # client 3 is the worst and hurt
    assert verdict[("better", "local", "mean client")]["per_seed"] == pytest.approx([-0.125] * 3, abs=0.02)
    per_client = verdict[("better", "local", "per client")]["clients"]
    assert [per_client[str(c)]["verdict"] for c in range(4)] == ["better", "better", "better", "worse"]
    assert ("fedavg", "local", "worst client") in verdict and ("local", "fedavg", "worst client") not in verdict
    assert ("local", "local", "worst client") not in verdict  # each pair once, never a strategy with itself
    assert "| better − local | 3 | 1 | 0 | 3 (xsum, smollm2): +0.400" in text
    # the evidence target, read off the same records: "better" helps the mean client but its worst is hurt
    assert text.startswith("Target not met (better: worst client − local worse, Holm p ")
    assert "client 3 worse than local" in text.splitlines()[0]
    assert "Do no harm" not in text  # no strategy ran with the guard: the target's second half is not judged
    report = {
        **_report([0, 1, 2], "A"),
        "references": ["local", "fedavg"],
        "strategies": [{"label": s} for s in ("local", "fedavg", "better")],
        "runs": [],
        "rows": rows,
    }
    write_report(tmp_path, report)
    md = (tmp_path / "compare.md").read_text()
    assert "| better − fedavg | mean client |" in md and "client 1 (xsum, smollm2)" in md
    stored = json.loads((tmp_path / "compare.json").read_text())["verdicts"]
    assert [(r["a"], r["b"], r["statistic"], r.get("verdict")) for r in stored] == [
        (r["a"], r["b"], r["statistic"], r.get("verdict")) for r in records
    ]


def test_runs_without_per_example_losses_get_no_verdict():
    rows = rows_of("local", 0, {0: [2.0, 2.0], 2: [1.0, 1.5]}) + rows_of("fedavg", 0, {0: [2.0, 2.0], 2: [1.0, 1.2]})
    text, records = verdict_tables(rows, ["local"])
    assert records == [] and text.startswith("No paired verdicts")


def test_the_gap_by_round_shows_when_a_strategy_gains_and_when_it_gives_it_back():
    rows = []
    for seed in (0, 1):
        rows += rows_of("local", seed, {0: [3.0, 2.0], 1: [2.5, 1.5], 2: [2.0, 1.0]})
        rows += rows_of("early", seed, {0: [3.0, 2.0], 1: [2.3, 1.3], 2: [2.1, 1.1]})  # ahead, then behind
    assert gap_by_round(rows, "early", "local") == {
        1: (pytest.approx(-0.2), 0, 4),
        2: (pytest.approx(0.1), 4, 4),
    }
    table = gap_by_round_table(rows, "local")
    assert table.splitlines()[0] == "| A − local | round 1 | round 2 |"
    assert table.splitlines()[2] == "| early | -0.200 (0/4 above) | +0.100 (4/4 above) |"
    assert gap_by_round_table(rows, "fedavg") == ""  # no baseline run: no table


def test_a_new_run_borrows_round_zero_from_a_merged_report_of_its_seed():
    merged = [
        {"rows": [{"strategy": "local", "seed": 0, "round": r, "client": c} for r in (0, 1) for c in (0, 1)]},
        {"rows": [{"strategy": s, "seed": 1, "round": 0, "client": 0} for s in ("fedavg", "atlas")]},
    ]
    lenders = round_zero_rows(merged)
    assert sorted(lenders) == [0, 1]
    assert [(r["strategy"], r["client"]) for r in lenders[0]] == [("local", 0), ("local", 1)]  # round 0 only
    assert [r["strategy"] for r in lenders[1]] == ["fedavg"]  # one strategy's rows, not every strategy's
    assert round_zero_rows([]) == {}


def test_rerender_recomputes_a_stored_reports_verdicts_and_keeps_what_it_said_once(tmp_path):
    from bench.compare import rerender

    rows = [r for seed in (0, 1, 2) for s, shift in (("local", 0.0), ("fedavg", 0.2)) for r in
            _example_rows(s, seed, [shift] * 4)]  # fmt: skip
    old = [{"a": "fedavg", "b": "local", "statistic": "worst client", "estimate": 0.2, "low": 0.1, "high": 0.3,
            "per_seed": [0.2] * 3, "verdict": "worse"}]  # fmt: skip
    report = {
        **_report([0, 1, 2], "A"),
        "references": ["local", "fedavg"],
        "strategies": [{"label": s} for s in ("local", "fedavg")],
        "runs": [
            {"strategy": s, "seed": seed, "ok": True, "wall_seconds": 1.0}
            for s in ("local", "fedavg")
            for seed in (0, 1, 2)
        ],
        "rows": rows,
        "verdicts": old,
    }
    (tmp_path / "compare.json").write_text(json.dumps(report))
    rerender(tmp_path)
    again = rerender(tmp_path)  # a second rerender keeps the first verdicts, not its own
    assert again["verdicts_before"] == old
    new = {(v["a"], v["b"], v["statistic"]): v for v in again["verdicts"]}
    assert new[("fedavg", "local", "worst client")]["claim_p"] is not None
    assert "Numeric path: cpu, nf4, eval in fp32" in (tmp_path / "compare.md").read_text()


def test_a_pair_that_cannot_be_formed_is_refused_not_a_crash_and_its_claim_stays_in_the_family():
    rows = []
    for seed in (0, 1, 2):
        rows += _example_rows("local", seed, [0.0] * 4)
        rows += _example_rows("fedavg", seed, [0.3] * 4)
        rows += _example_rows("fewer", seed, [-0.3] * 4)
        rows += _example_rows("good", seed, [-0.3, -0.3, -0.3, -0.3])
    for row in rows:  # "fewer" evaluated 32 held-out examples, not the 64 the others did
        if row["strategy"] == "fewer":
            row["eval_example_loss"], row["eval_example_tokens"] = (
                row["eval_example_loss"][:32],
                row["eval_example_tokens"][:32],
            )
    text, records = verdict_tables(rows, ["local", "fedavg"], replicates=300)
    assert not [r for r in records if "fewer" in (r["a"], r["b"])]
    assert "fewer − local: seed 0, client 0: the two runs evaluated different held-out examples" in text
    claims = [r for r in records if r.get("primary")]
    assert {(r["a"], r["b"]) for r in claims} == {("good", "local"), ("good", "fedavg")}
    assert "Holm-corrected over these 4" in text  # fewer's two declared claims count, as p = 1


def test_the_target_judges_every_guarded_strategy_on_harm_to_any_client():
    rows = []
    guarded, unguarded = "simgrad:guard.enabled=true", "simgrad"
    for seed in (0, 1, 2):
        rows += _example_rows("local", seed, [0.0, 0.0, 0.0, 0.0])
        rows += _example_rows("fedavg", seed, [0.1, 0.1, 0.1, 0.1])
        rows += _example_rows(unguarded, seed, [-0.3, -0.3, -0.3, 0.4])  # hurts client 3
        rows += _example_rows(guarded, seed, [-0.3, -0.3, -0.3, 0.0])  # client 3 kept its own adapter
    text, _ = verdict_tables(rows, ["local", "fedavg"], replicates=500)
    status = text.splitlines()[0]
    assert status.endswith(f"Do no harm (against local): {guarded}: worse on no client of 4.")
    rows += _example_rows("fedsa-lora:guard.enabled=true", 0, [0.0, 0.0, 0.0, 0.5])
    rows += _example_rows("fedsa-lora:guard.enabled=true", 1, [0.0, 0.0, 0.0, 0.5])
    rows += _example_rows("fedsa-lora:guard.enabled=true", 2, [0.0, 0.0, 0.0, 0.5])
    status = verdict_tables(rows, ["local", "fedavg"], replicates=500)[0].splitlines()[0]
    assert "fedsa-lora:guard.enabled=true: worse on client 3 of 4" in status
    one_seed = [r for r in rows if r["seed"] == 0]
    status = verdict_tables(one_seed, ["local", "fedavg"], replicates=200)[0].splitlines()[0]
    assert f"{guarded}: not judged yet (1 seed, 3 needed)" in status  # "worse on no client" would be vacuous
    # a label guarded by default (its runs' resolved guard.enabled) is judged as one guarded by name
    report = {"runs": [{"strategy": unguarded, "settings": {"guard.enabled": True}}, {"strategy": "fedavg"}]}
    assert guarded_labels(report) == {unguarded}
    status = verdict_tables(rows, ["local", "fedavg"], replicates=500, guarded=guarded_labels(report))[0]
    assert f"{unguarded}: worse on client 3 of 4" in status.splitlines()[0]


def test_each_run_says_when_it_starts_and_how_long_the_rest_will_take():
    from bench.compare import start_line

    assert start_line(1, 6, "local", 0, []) == "[compare] 1/6 local seed 0: starting (no run timed yet)"
    done = [{"ok": True, "wall_seconds": 240.0}, {"ok": True, "wall_seconds": 360.0}, {"ok": True, "reused": True}]
    # 300 s a run so far (the reused run took no time), this one and the three after it to go
    assert start_line(3, 6, "fedavg", 0, done).endswith("about 5 min a run so far, about 20 min left")


def test_a_comparison_with_a_failed_run_exits_1_naming_it(capsys):
    from bench.compare import exit_code

    assert exit_code({"runs": [{"strategy": "local", "seed": 0, "ok": True}]}) == 0
    assert exit_code({"runs": [{"strategy": "fedavg", "seed": 1, "ok": False}, {"strategy": "local", "ok": True}]}) == 1
    assert "1 run(s) failed: fedavg seed 1" in capsys.readouterr().err


def test_a_refused_configuration_stops_the_comparison_before_any_run_naming_its_label_and_key(tmp_path, capsys):
    from bench.compare import main

    out = tmp_path / "cmp"
    argv = ["--preset", "cross-silo", "--seeds", "0", "--out", str(out)]
    with pytest.raises(SystemExit) as stopped:
        main([*argv, "--strategies", "local,fedavg:train.local-steps=0"])
    message = str(stopped.value.code)
    assert message.startswith("[compare] fedavg:train.local-steps=0: invalid run config:")
    assert "train.local-steps: Input should be greater than or equal to 1" in message and "nothing was run" in message
    assert not (out / "runs").exists() and "starting" not in capsys.readouterr().out
