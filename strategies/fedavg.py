"""FedAvg over LoRA adapters: the baseline every other strategy is compared with.

One group holding every client; the new global adapter is the example-weighted mean of their trained adapters
(McMahan et al., 2017). In secure mode the server learns only that mean (through SecAgg+), never one client's
adapter.
"""

from __future__ import annotations

from .base import Arrays, Group, GroupResult, Strategy


class FedAvg(Strategy):
    """Federated averaging of the full adapter.

    State: ``global`` — the current global adapter. A round whose group produced no mean (every reply rejected,
    or too few) keeps the previous global adapter.
    """

    name = "fedavg"

    def __init__(self) -> None:
        self.global_arrays: Arrays | None = None

    def initialise(self, initial: Arrays) -> None:
        self.global_arrays = {k: v.copy() for k, v in initial.items()}

    def train_groups(self, server_round: int, node_ids: list[int]) -> list[Group]:
        assert self.global_arrays is not None, "initialise() first"
        return [Group("all", {nid: self.global_arrays for nid in node_ids})]

    def update(self, server_round: int, results: list[GroupResult]) -> None:
        (result,) = results
        if result.mean is not None:
            self.global_arrays = result.mean

    def eval_arrays(self, node_id: int) -> Arrays:
        assert self.global_arrays is not None, "initialise() first"
        return self.global_arrays

    def state_dict(self) -> dict[str, Arrays]:
        assert self.global_arrays is not None, "initialise() first"
        return {"global": self.global_arrays}

    def load_state_dict(self, state: dict[str, Arrays]) -> None:
        self.global_arrays = state["global"]
