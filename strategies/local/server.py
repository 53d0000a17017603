"""Local-only training: the baseline every federated strategy must beat on the clients it claims to help.

Each client trains its own adapter on its own data with the same steps, schedule and evaluation as every other
strategy, and nothing is aggregated: the server sends no adapter after the initial query and receives none (train
and evaluation messages carry only their config and the client's metrics). The adapters stay on the clients, which
save their own copies at the end (``client-adapters/partition-<id>/``).
"""

from __future__ import annotations

from ..base import WEIGHT_EQUALLY, Arrays, ClientInfo, FinalAdapter, Group, GroupResult, Strategy


class LocalOnly(Strategy):
    """No federation: one group per client, with nothing in it to sum.

    State: none on the server (each client keeps its adapter; see ``strategies.local.client``).
    """

    name = "local"
    aggregates = False  # no adapter reaches the server: nothing for SecAgg+ to mask, in either mode

    def __init__(self) -> None:
        self.partition_of: dict[int, int] = {}  # node id -> partition id (the group's name in logs and rows)

    def initialise(self, clients: dict[int, ClientInfo]) -> None:
        self.partition_of.update({nid: info.partition_id for nid, info in clients.items()})

    def train_groups(self, server_round: int, node_ids: list[int]) -> list[Group]:
        return [
            Group(f"partition-{self.partition_of[nid]}", {nid: {}}, weight_by=WEIGHT_EQUALLY)
            for nid in node_ids
            if nid in self.partition_of
        ]

    def update(self, server_round: int, results: list[GroupResult]) -> None:
        """Nothing to combine."""

    def eval_arrays(self, node_id: int) -> Arrays:
        return {}  # the client evaluates the adapter it keeps

    def state_dict(self) -> dict[str, Arrays]:
        return {}

    def load_state_dict(self, state: dict[str, Arrays]) -> None:
        """Nothing to restore on the server."""

    def final_adapters(self) -> list[FinalAdapter]:
        return []  # every client saves its own
