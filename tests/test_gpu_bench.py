"""``bench/gpu_bench.py`` on a CPU with a tiny shape: the plain Hugging Face QLoRA loop and Tessera's training path
run on the same batches, start from the same loss (LoRA B = 0: the same base model) and report useful tokens."""

from __future__ import annotations

import json

import pytest

from bench.gpu_bench import synthetic_batches
from common.training import IGNORE


def test_synthetic_batches_spread_their_lengths_and_label_only_the_answers():
    batches = synthetic_batches(vocab=512, seq=128, batch=8, count=3)
    lengths = [len(e.input_ids) for b in batches for e in b]
    assert len(batches) == 3 and all(len(b) == 8 for b in batches)
    assert max(lengths) <= 128 and max(lengths) - min(lengths) > 32
    for e in (e for b in batches for e in b):
        answer = [t for t in e.labels if t != IGNORE]
        assert 8 <= len(answer) <= 32 and answer == e.input_ids[-len(answer) :]
    assert synthetic_batches(512, 128, 8, 3)[0][0] == batches[0][0]  # seeded


def test_the_plain_loop_and_tesseras_path_train_on_the_same_batches_from_the_same_loss(tmp_path):
    from bench.gpu_bench import main

    out = tmp_path / "gpu.json"
    result = main(["--shapes", "tiny", "--steps", "2", "--warmup", "1", "--batch", "3", "--seq", "64",
                   "--checkpointing", "off,on", "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == result and result["device"] == "cpu"
    rows = result["rows"]
    assert [(r["checkpointing"], r["variant"]) for r in rows] == [
        (c, v) for c in (False, True) for v in ("plain", "tessera", "tessera-packed")
    ]
    first = rows[0]["first_loss"]
    for row in rows:
        assert row["first_loss"] == pytest.approx(first, rel=1e-4), row
        assert row["useful_tokens_per_second"] > 0 and row["tokens_per_second"] > row["useful_tokens_per_second"]
        assert row["peak_memory_mb"] > 0


def test_the_gpu_federation_table_has_every_client_of_every_trained_round():
    """``bench/gpu_federation.py`` (run on the GPU machine; by hand here on a CPU with ``--shape tiny``): a run's
    metrics rows become one line per trained round and client, with the round's wall seconds; round 0 (evaluation
    only) stays in the JSON, not in the table; the run config asks for every client (SecAgg+ needs 3) on the device."""
    from pathlib import Path

    from bench.gpu_federation import markdown, run_config, summarise

    rows = [{"round": 0, "node": None, "seconds": 3.0}, {"round": 1, "node": None, "seconds": 9.5}]
    for rnd in (0, 1):
        for pid in (2, 0, 1):
            useful = 1000.0 + pid if rnd else None
            rows.append({"round": rnd, "node": 100 + pid, "partition_id": pid, "eval_seconds": 0.5,
                         "loss_tokens_per_second": useful, "gpu_peak_allocated_mb": 900.0})  # fmt: skip
    summary = summarise(rows, "fedavg secure")
    assert [(r["round"], r["client"]) for r in summary] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert {r["round_seconds"] for r in summary if r["round"] == 1} == {9.5}
    table = markdown(summary).splitlines()
    assert len(table) == 2 + 3 and table[2].startswith("| fedavg secure | 1 | 0 | 1000 |") and "| 900 |" in table[2]
    config = run_config("simgrad", True, 2, Path("/m"), "llama-1b", "cuda", Path("/r"))
    assert "secure=true" in config and "min-train-replies=3" in config and "model.device='cuda'" in config
    assert "pqlora.blocks=16" in config  # every block of the 1B shape
