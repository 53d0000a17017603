"""The small abstract base every Tessera strategy implements.

A round is: (for strategies that ask) ``observe_reports`` receives every client's sanitised signature and block
salience; ``train_groups`` says which clients form each group and which adapter each member starts from; the
ServerApp's transport (plain or SecAgg+, ``server_app.transport``) returns each group's weighted mean; ``update``
combines those means into the strategy's new state. ``eval_arrays`` says which adapter a client is evaluated
with. Strategies never see Flower messages, and their math lives in pure functions beside them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Arrays = dict[str, np.ndarray]


@dataclass
class ClientInfo:
    """What the server knows about a connected client before round 1 (from its answer to the initial query).

    Attributes:
        node_id: Flower's node id (changes when a node restarts or a simulation is re-run).
        partition_id: the client's stable identity (its node-config ``partition-id``); per-client state is keyed by it.
        model: the base model the client loaded.
        initial: the client's initial adapter (the names and shapes it will send).
    """

    node_id: int
    partition_id: int
    model: str
    initial: Arrays


@dataclass
class ClientReport:
    """A client's per-round report to strategies that ask for one: a sanitised signature and block salience."""

    signature: np.ndarray
    salience: np.ndarray


@dataclass
class Group:
    """Clients whose updates are summed together (through SecAgg+ when secure).

    Attributes:
        name: a label for logs and metrics.
        start: per member node id, the adapter it trains from this round.
        send_back: the array names members return (default: every name in ``start``).
        config: extra train-instruction settings for the members (e.g. which adapter blocks are active).
    """

    name: str
    start: dict[int, Arrays]
    send_back: list[str] | None = None
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def members(self) -> list[int]:
        return sorted(self.start)

    def reply_reference(self, node_id: int) -> Arrays:
        """The names and shapes a member's reply must have."""
        start = self.start[node_id]
        return start if self.send_back is None else {k: start[k] for k in self.send_back}


@dataclass
class GroupResult:
    """What the server learns about one group: its weighted mean, total weight and per-member metrics.

    Attributes:
        mean: sum_i w_i x_i / sum_i w_i over the members whose replies were accepted (None if none were).
        contributors: node ids whose updates are inside ``mean``.
        rejected: node id -> reason, for replies that were left out.
        metrics: node id -> training metrics the client reported (loss, tokens, seconds).
    """

    name: str
    mean: Arrays | None
    total_weight: float
    contributors: list[int]
    rejected: dict[int, str] = field(default_factory=dict)
    metrics: dict[int, dict[str, Any]] = field(default_factory=dict)


class Strategy(ABC):
    """Abstract base: state, grouping and the combination of group means.

    Attributes:
        name: the run-config value that selects the strategy.
        wants_reports: True if the ServerApp must collect a ``ClientReport`` from every client each round.
    """

    name: str = "abstract"
    wants_reports: bool = False

    @abstractmethod
    def initialise(self, clients: dict[int, ClientInfo]) -> None:
        """Add clients (node id -> info): those connected before round 1, and later any node that joins (a restarted
        SuperNode has a new node id). Raises ValueError if they cannot take part (e.g. incompatible adapters)."""

    def observe_reports(self, server_round: int, reports: dict[int, ClientReport]) -> None:
        """Receive this round's valid client reports (only called when ``wants_reports``)."""

    def report(self) -> dict[str, Any]:
        """Diagnostics of the last round for the metrics file (e.g. a relevance matrix); JSON-friendly."""
        return {}

    @abstractmethod
    def train_groups(self, server_round: int, node_ids: list[int]) -> list[Group]:
        """The groups of this round and each member's starting adapter."""

    @abstractmethod
    def update(self, server_round: int, results: list[GroupResult]) -> None:
        """Fold this round's group means into the state."""

    @abstractmethod
    def eval_arrays(self, node_id: int) -> Arrays:
        """The adapter ``node_id`` is evaluated with (and keeps, at the end)."""

    @abstractmethod
    def state_dict(self) -> dict[str, Arrays]:
        """Everything needed to resume, as named groups of arrays."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Arrays]) -> None:
        """Restore from ``state_dict``."""

    def final_adapters(self) -> dict[str, Arrays]:
        """Adapters to save at the end, by directory name (default: the whole state)."""
        return self.state_dict()
