"""End to end: SimGrad (FedMosaic) through `flwr run . local` with two REAL base models in one federation —
SmolLM2-135M (Llama, width 576) and Qwen2.5-Coder-0.5B (Qwen2, width 896), both 4-bit — exchanging only PQ-LoRA's
P/Q through Flower's SecAgg+. One round keeps CI time in check; the benchmark runs longer federations."""

from __future__ import annotations

import json

import numpy as np
import pytest
from child import flwr_run_once

pytestmark = pytest.mark.e2e

SMOL, QWEN = "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"
RUN = (
    f"strategy='simgrad' secure=true min-train-replies=3 num-server-rounds=1 data.tasks='boolq,asdiv' "
    f"model.partition-models='{SMOL},{QWEN},{SMOL}' train.local-steps=4 eval.max-examples=4 eval.max-new-tokens=8 "
    "simgrad.probe-examples=4 simgrad.route-budget=2 pqlora.r=8 pqlora.blocks=4"
)
PQ_BYTES_PER_ROUTED_ROUND = 2 * 2 * (8 * 8 + 8) * 4  # 2 active blocks x (q_proj, v_proj) x (P + Q) float32


@pytest.fixture(scope="module")
def simgrad_run(tmp_path_factory):
    return flwr_run_once(tmp_path_factory.mktemp("simgrad"), RUN, num_clients=3)


def test_two_real_models_federate_and_the_aggregate_loss_falls(simgrad_run):
    run_dir, rows = simgrad_run
    clients = {r["node"]: r for r in rows if r["round"] == 1 and r["node"] is not None}
    assert len(clients) == 3 and all(r.get("eval_loss") is not None for r in clients.values())
    assert sorted(r["model"] for r in clients.values()) == [QWEN, SMOL, SMOL]
    assert all(r["accepted"] and np.isfinite(r["train_loss"]) for r in clients.values()), clients
    before, after = (next(r for r in rows if r["round"] == k and r["node"] is None) for k in (0, 1))
    assert after["eval_loss"] < before["eval_loss"]


def test_only_routed_pq_and_the_signature_travel(simgrad_run):
    _, rows = simgrad_run
    trained = [r for r in rows if r["round"] == 1 and r["node"] is not None]
    assert len(trained) == 3, trained  # every client's row, so the checks below cannot pass on none
    for row in trained:
        assert len(row["active_blocks"]) == 2 and len(row["beta"]) == 4
        assert row["bytes_up"] - row["report_bytes"] == PQ_BYTES_PER_ROUTED_ROUND  # not LoRA's ~1.8 MB
        assert row["routing_bytes_saved"] == PQ_BYTES_PER_ROUTED_ROUND  # the 2 inactive blocks of 4 stayed home
        assert row["report_bytes"] == 8 * 576 * 4  # buckets x probe width float32, the same for both models


def test_relevance_matrix_groups_and_plots(simgrad_run):
    run_dir, rows = simgrad_run
    aggregate = next(r for r in rows if r["round"] == 1 and r["node"] is None)
    scores, weights = np.asarray(aggregate["relevance"]), np.asarray(aggregate["relevance_weights"])
    assert scores.shape == weights.shape == (3, 3)
    np.testing.assert_allclose(np.diag(scores), 1.0)
    np.testing.assert_allclose(weights.sum(axis=1), 1.0, atol=1e-5)
    assert sorted(map(len, aggregate["groups"])) == [3]  # secure: one SecAgg+ group of >= 3
    assert (run_dir / "relevance" / "round-001.png").stat().st_size > 10_000
    assert (run_dir / "gates.png").exists() and (run_dir / "eval_loss.png").exists()


def test_clients_keep_full_adapters_of_their_own_width(simgrad_run):
    run_dir, rows = simgrad_run
    widths = {}
    for pid in range(3):
        meta = json.loads((run_dir / "client-adapters" / f"partition-{pid}" / "pqlora_config.json").read_text())
        widths[meta["base_model_name"]] = meta["layers"]["block0.q_proj"]["d_in"]
    assert widths == {SMOL: 576, QWEN: 896}
    server_side = sorted(p.name for p in (run_dir / "adapters").iterdir())
    assert server_side == ["client-0", "client-1", "client-2"]  # each client's personalised global P/Q


def test_every_clients_held_out_loss_falls(simgrad_run):
    """Per client, not only the aggregate: a client whose trained PQ-LoRA has no effect at evaluation (as on
    AVX512-BF16 CPUs before common.bnb_cpu: held-out loss identical to the last digit in every round) fails here,
    whatever the exit code."""
    _, rows = simgrad_run
    before = {r["node"]: r for r in rows if r["round"] == 0 and r["node"] is not None}
    after = {r["node"]: r for r in rows if r["round"] == 1 and r["node"] is not None}
    assert len(before) == 3 and set(before) == set(after)
    change = {after[n]["partition_id"]: after[n]["eval_loss"] - before[n]["eval_loss"] for n in after}
    assert all(delta < 0 for delta in change.values()), change
