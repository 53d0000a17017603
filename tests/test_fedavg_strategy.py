"""The FedAvg strategy without Flower: one global adapter per model family; nodes may join mid-run."""

import numpy as np

from strategies import ClientInfo, GroupResult
from strategies.fedavg import FedAvg


def adapter(value: float) -> dict:
    return {"x.lora_A.weight": np.full((2, 3), value, np.float32), "x.lora_B.weight": np.zeros((3, 2), np.float32)}


def test_a_node_that_joins_mid_run_trains_from_the_current_global_adapter():
    strategy = FedAvg()
    strategy.initialise({1: ClientInfo(1, 0, "smollm2", adapter(0.0)), 2: ClientInfo(2, 1, "smollm2", adapter(0.0))})
    (group,) = strategy.train_groups(1, [1, 2])
    strategy.update(1, [GroupResult(group.name, adapter(0.5), 16.0, [1, 2])])
    strategy.initialise({9: ClientInfo(9, 2, "smollm2", adapter(0.0))})  # joined after round 1 with a fresh adapter
    (group,) = strategy.train_groups(2, [1, 2, 9])
    assert group.members == [1, 2, 9]
    np.testing.assert_array_equal(group.start[9]["x.lora_A.weight"], adapter(0.5)["x.lora_A.weight"])
    np.testing.assert_array_equal(strategy.eval_arrays(9)["x.lora_A.weight"], adapter(0.5)["x.lora_A.weight"])
