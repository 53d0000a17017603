"""Which numeric path a comparison run took (bench.numeric_path), and that pairs and round 0 never cross paths."""

from __future__ import annotations

import json

from bench.compare_merge import merge_report, round_zero_rows
from bench.numeric_path import CPU_FP32, CPU_PACKED_BF16, lendable, numeric_path, with_paths

BF16_CPU = {"cpu": "EPYC", "avx512_bf16": True, "cuda": None}
PLAIN_CPU = {"cpu": "EPYC", "avx512_bf16": False, "cuda": None}


def test_the_path_follows_the_machine_and_the_setting():
    packed, fp32 = (
        {"settings": {"model.cpu-packed-inference": True}},
        {"settings": {"model.cpu-packed-inference": False}},
    )
    assert numeric_path(packed, BF16_CPU) == CPU_PACKED_BF16
    assert numeric_path(packed, PLAIN_CPU) == numeric_path(fp32, BF16_CPU) == numeric_path(fp32, PLAIN_CPU) == CPU_FP32
    assert numeric_path({}, BF16_CPU) == CPU_PACKED_BF16  # a run that recorded nothing ran with the default then
    assert numeric_path({"run_config": "seed=0 model.cpu-packed-inference=false"}, BF16_CPU) == CPU_FP32
    assert numeric_path({}, {**BF16_CPU, "cuda": "H200"}).startswith("cuda (H200)")
    assert numeric_path({"settings": {"model.device": "cpu"}}, {**PLAIN_CPU, "cuda": "H200"}) == CPU_FP32
    assert numeric_path({"settings": {"model.quantization": "bf16"}}, PLAIN_CPU) == "cpu, bf16"


def _report(machine: dict, seeds=(0,), settings=None) -> dict:
    rows = [
        {"strategy": s, "seed": seed, "client": c, "round": rnd, "eval_loss": 1.0}
        for s in ("local", "fedavg")
        for seed in seeds
        for c in (0, 1)
        for rnd in ((1,) if s == "fedavg" else (0, 1))
    ]
    runs = [
        {"strategy": "local", "seed": seed, "ok": True, **({"settings": settings} if settings else {})}
        for seed in seeds
    ]
    runs += [{**r, "strategy": "fedavg", "initial_from": "local"} for r in runs]
    return {
        "preset": "tasks-distinct",
        "clients": 2,
        "rounds": 1,
        "common_config": "",
        "baseline": "local",
        "strategies": [{"label": s, "name": s, "overrides": ""} for s in ("local", "fedavg")],
        "seeds": list(seeds),
        "machine": machine,
        "runs": runs,
        "rows": rows,
    }


def test_rows_carry_their_run_path_and_a_borrowed_round_zero_its_lenders():
    report = _report(BF16_CPU)
    report["machines"] = {"local 0": PLAIN_CPU, "fedavg 0": BF16_CPU}  # merged: the two ran on different machines
    annotated = with_paths(report)
    path = {(r["strategy"], r["round"]): r["path"] for r in annotated["rows"]}
    assert path[("local", 0)] == path[("local", 1)] == CPU_FP32
    assert path[("fedavg", 1)] == CPU_PACKED_BF16
    assert [r["path"] for r in annotated["runs"]] == [CPU_FP32, CPU_PACKED_BF16]


def test_round_zero_is_never_lent_across_numeric_paths(tmp_path):
    earlier = tmp_path / "compare.json"
    earlier.write_text(json.dumps(_report(BF16_CPU, seeds=(0,))))  # made with the packed default on a bf16 CPU
    here = {**_report(PLAIN_CPU, seeds=(1,)), "strategies": [{"label": "mira", "name": "mira", "overrides": ""}]}
    lenders = round_zero_rows([merge_report(here, earlier)])
    assert {row["path"] for row in lenders[0]} == {CPU_PACKED_BF16}
    assert not lendable(lenders[0], CPU_FP32) and lendable(lenders[0], CPU_PACKED_BF16)
    assert not lendable([], CPU_FP32)
