"""End to end: VEMoE through `flwr run . local` on the real 4-bit SmolLM2 with Natural-Instructions clients of two
keyword categories (question generation: partitions 0 and 2, answer generation: partition 1), every payload summed
by Flower's SecAgg+ in one group of the three. One round keeps CI time in check; the comparison runs longer."""

from __future__ import annotations

import numpy as np
import pytest
from child import flwr_run_once

pytestmark = pytest.mark.e2e

K_MAX = 4
RUN = (
    "strategy='vemoe' data.source='natural-instructions' secure=true min-train-replies=3 num-server-rounds=1 "
    f"experts.k-max={K_MAX} vemoe.k-init=3 train.local-steps=4 eval.max-examples=4 eval.max-new-tokens=4"
)


@pytest.fixture(scope="module")
def vemoe_run(tmp_path_factory):
    from common.assets import natural_instructions_tasks

    natural_instructions_tasks()  # the first use downloads the bank: once here, not once per client
    return flwr_run_once(tmp_path_factory.mktemp("vemoe"), RUN, num_clients=3)


def test_every_client_of_both_categories_improves_through_secagg(vemoe_run):
    _, rows = vemoe_run
    before, after = ({r["partition_id"]: r for r in rows if r["round"] == k and r["node"] is not None} for k in (0, 1))
    assert len(before) == 3 and set(after) == set(before)
    assert {r["tasks"] for r in before.values()} == {"question generation", "answer generation"}
    for partition, row in after.items():
        assert row["accepted"] and np.isfinite(row["train_loss"]), row
        assert row["eval_loss"] < before[partition]["eval_loss"], (
            f"partition {partition} ({row['tasks']}) did not improve"
        )
        assert "vemoe_top" not in row and "vemoe_vote" not in row  # who uses which expert: hidden by SecAgg+


def test_the_pool_its_events_and_the_plots_are_reported(vemoe_run):
    run_dir, rows = vemoe_run
    pool = next(r for r in rows if r["round"] == 1 and r["node"] is None)["vemoe"]
    assert len(pool["live"]) == K_MAX and 1 <= pool["experts"] <= K_MAX
    assert sum(pool["responsibility"]) == pytest.approx(3.0, abs=1e-3)  # each client's r sums to one
    assert isinstance(pool["events"], list) and len(pool["low_rounds"]) == K_MAX
    for name in ("expert_utilization.png", "worst_client.png"):
        assert (run_dir / name).stat().st_size > 1000, name
    trained = sorted(p.name for p in (run_dir / "adapter").iterdir())
    assert trained and all(name.startswith("expert-") for name in trained)
    # each trained expert is a PEFT LoRA directory on top of the real 4-bit base
    from peft import PeftModel

    from common.model import load_base_model

    model = PeftModel.from_pretrained(
        load_base_model("smollm2-135m-instruct", "nf4", "cpu"), run_dir / "adapter" / trained[0]
    )
    assert any("lora_B" in name and p.abs().max() > 0 for name, p in model.named_parameters())  # B moved off zero
