"""Each primary claim with one seed left out (bench/robustness.py): on synthetic per-example losses where the
per-seed differences are known exactly (both strategies share every example's draw; only a per-seed shift differs)."""

from __future__ import annotations

import json

import pytest
from test_compare_report import _example_rows

from bench.robustness import leave_one_seed_out, main, stands
from bench.tables import robustness
from bench.verdicts import verdict_tables

SEEDS = (0, 1, 2, 3, 4)
# steady: well below local-only on every seed; fragile: -0.1 on four seeds and 0 on the fifth, which resolves with
# all five (paired t p 0.016) and not with one of its -0.1 seeds gone (four seeds: t p 0.058)
SHIFTS = {"local": [0.0] * 5, "steady": [-0.2, -0.25, -0.2, -0.22, -0.21], "fragile": [-0.1, -0.1, -0.1, -0.1, 0.0]}


def _rows():
    return [r for s, shifts in SHIFTS.items() for seed in SEEDS for r in _example_rows(s, seed, [shifts[seed]] * 3)]


def _report(rows):
    primary = {"statistic": "worst client", "references": ["local"]}
    _, verdicts = verdict_tables(rows, ["local"], primary, replicates=400)
    return primary, verdicts


def test_a_claim_that_needs_every_seed_is_named_with_the_seeds_it_rests_on():
    rows = _rows()
    primary, verdicts = _report(rows)
    claims = {v["a"]: v for v in verdicts if v.get("primary")}
    assert claims["steady"]["verdict"] == claims["fragile"]["verdict"] == "better"
    records = {r["a"]: r for r in leave_one_seed_out(rows, primary, list(claims.values()), replicates=400)}
    assert stands(records["steady"]) is True
    assert all(w["verdict"] == "better" for w in records["steady"]["without"].values())
    fragile = records["fragile"]["without"]
    assert set(fragile) == {str(s) for s in SEEDS} and stands(records["fragile"]) is False
    assert [s for s, w in fragile.items() if w["verdict"] != "better"] == ["0", "1", "2", "3"]
    assert fragile["4"]["verdict"] == "better"  # leaving out the seed that found nothing only strengthens it


def test_a_claim_on_three_of_the_reports_five_seeds_has_no_leave_one_out():
    rows = [r for r in _rows() if r["strategy"] != "fragile" or r["seed"] < 3]
    primary, verdicts = _report(rows)
    claims = [v for v in verdicts if v.get("primary")]
    records = {r["a"]: r for r in leave_one_seed_out(rows, primary, claims, replicates=400)}
    assert stands(records["fragile"]) is None and stands(records["steady"]) is True


def test_three_seeds_have_no_leave_one_out_and_say_so():
    rows = [r for r in _rows() if r["seed"] < 3]
    primary, verdicts = _report(rows)
    records = leave_one_seed_out(rows, primary, [v for v in verdicts if v.get("primary")], replicates=400)
    assert records and all(r["without"] == {} and stands(r) is None for r in records)


def test_the_stored_robustness_is_rendered_and_refused_once_the_claims_have_changed(tmp_path):
    rows = _rows()
    primary, verdicts = _report(rows)
    report = {
        "preset": "p",
        "clients": 3,
        "rounds": 2,
        "machine": {"cpu": "A", "cores": 2, "avx512_bf16": False, "cuda": None},
        "runs": [{"strategy": s, "seed": seed, "ok": True} for s in SHIFTS for seed in SEEDS],
        "rows": rows,
        "primary": primary,
        "verdicts": verdicts,
    }
    (tmp_path / "compare.json").write_text(json.dumps(report))
    assert main([str(tmp_path)]) == 0
    stored = json.loads((tmp_path / "compare.json").read_text())
    text = robustness(stored, "r/compare.md")
    assert "| fragile − local | worst client | 5 | better |" in text and "| 0, 1, 2, 3 | **no** |" in text
    stored["verdicts"] = [{**v, "holm_p": 0.5} if v.get("primary") else v for v in stored["verdicts"]]
    with pytest.raises(SystemExit, match="older than its claims"):
        robustness(stored, "r/compare.md")
