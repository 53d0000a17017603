"""A toy strategy, written the way docs/adding-a-strategy.md says, in this ONE file: a server half, a client
half with its own client state, its own config section, and a registry entry. ``test_toy_strategy.py`` runs it
end to end (plain and SecAgg+) through the real ServerApp, ClientApp and transport.

"toymean": the mean of the clients' LoRA adapters weighted by partition id + 1 (a weighting FedAvg does not
have), moved towards by ``toymean.step``; with ``toymean.groups`` = g, clients form g groups (partition id mod g)
whose means are averaged. Each client counts the rounds it trained (client state) and reports it;
it also writes every update it sends to the run directory, so the test can recompute the server's mean.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
from pydantic import Field

from common.config import RunConfig, Section
from strategies import ClientInfo, FinalAdapter, Group, GroupResult, Strategy, StrategyClient, StrategySpec, register
from strategies.base import Arrays
from strategies.client import ClientRuntime

WEIGHT_BY_PARTITION = "partition"


class ToyMeanSection(Section):
    """``toymean.*``: how far the global adapter moves towards the round's mean."""

    key: ClassVar[str] = "toymean"
    step: float = Field(1.0, gt=0, le=1)
    groups: int = Field(1, ge=1)


class ToyMean(Strategy):
    """Server half: one group of every client, weighted by partition id + 1; global += step * (mean - global)."""

    name = "toymean"
    reply_metrics = {"rounds_trained": None}

    def __init__(self, step: float = 1.0, groups: int = 1) -> None:
        self.step, self.groups = step, groups
        self.global_arrays: Arrays = {}
        self.partition_of: dict[int, int] = {}
        self.model = ""

    @classmethod
    def from_config(cls, cfg: RunConfig) -> ToyMean:
        section = cfg.section(ToyMeanSection)
        return cls(section.step, section.groups)

    def initialise(self, clients: dict[int, ClientInfo]) -> None:
        for nid, info in clients.items():
            self.global_arrays = self.global_arrays or {k: v.copy() for k, v in info.initial.items()}
            self.model = self.model or info.model
            self.partition_of[nid] = info.partition_id

    def train_groups(self, server_round: int, node_ids: list[int]) -> list[Group]:
        groups = []
        for g in range(self.groups):
            start = {nid: self.global_arrays for nid in node_ids if self.partition_of[nid] % self.groups == g}
            groups.append(Group(f"g{g}", start, weight_by=WEIGHT_BY_PARTITION, max_weight=float(len(node_ids))))
        return groups

    def update(self, server_round: int, results: list[GroupResult]) -> None:
        means = [r.mean for r in results if r.mean is not None]
        if means:
            target = {k: np.mean([m[k] for m in means], axis=0) for k in self.global_arrays}
            self.global_arrays = {k: v + self.step * (target[k] - v) for k, v in self.global_arrays.items()}

    def eval_arrays(self, node_id: int) -> Arrays:
        return self.global_arrays

    def state_dict(self) -> dict[str, Arrays]:
        return {"global": self.global_arrays}

    def load_state_dict(self, state: dict[str, Arrays]) -> None:
        self.global_arrays = state["global"]

    def final_adapters(self) -> list[FinalAdapter]:
        return [FinalAdapter("", self.model, self.global_arrays)]


class ToyMeanClient(StrategyClient):
    """Client half: counts its rounds in its own client state; weighs itself by partition id + 1."""

    state_keys: ClassVar[tuple[str, ...]] = ("toymean.rounds",)

    def outgoing(self, rt: ClientRuntime, arrays: Arrays) -> tuple[Arrays, dict[str, Any]]:
        kept = rt.state.get("toymean.rounds")
        rounds = 1 + (int(kept["n"]) if kept is not None else 0)
        rt.state.put("toymean.rounds", {"n": np.asarray(rounds, np.float32)})
        out = rt.cfg.run_path() / "toy-updates" / f"partition-{rt.partition_id}-round-{rounds}.npz"
        out.parent.mkdir(parents=True, exist_ok=True)
        np.savez(out, **arrays)
        return arrays, {"rounds_trained": rounds}

    def member_weight(self, weight_by: str, train_metrics: dict[str, Any]) -> int:
        if weight_by == WEIGHT_BY_PARTITION:
            return int(train_metrics["partition-id"]) + 1
        return super().member_weight(weight_by, train_metrics)


SPEC = register(StrategySpec("toymean", ToyMean, ToyMeanClient, adapter="lora", section=ToyMeanSection))
