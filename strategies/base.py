"""The small abstract base every Tessera strategy's server half implements.

A round is: (for strategies that ask) ``observe_reports`` receives every client's report (e.g. SimGrad's
sanitised signature and block salience), each validated by ``read_report``; ``train_groups`` says which clients
form each group, which adapter each member starts from and how members are weighted; the ServerApp's transport
(plain or SecAgg+, ``server_app.transport``) returns each group's weighted mean; ``update`` combines those means
into the strategy's new state. ``eval_arrays`` says which adapter a client is evaluated with. Strategies never see
Flower messages, and their math lives in pure functions beside them. Why this is not Flower's ``Strategy``: see
docs/adding-a-strategy.md.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from common.messages import WEIGHT_BY_EXAMPLES, WEIGHT_EQUALLY, DpPart, Part
from common.plots import drawn
from common.secure_bounds import MIN_SECURE_GROUP  # noqa: F401  (re-exported: groups are sized by it)

if TYPE_CHECKING:
    from common.config import RunConfig

__all__ = ["WEIGHT_BY_EXAMPLES", "WEIGHT_EQUALLY"]  # re-exported: how a strategy weighs a group (common.messages)
Arrays = dict[str, np.ndarray]


def partition_state(prefix: str, by_partition: dict[int, Arrays]) -> dict[str, Arrays]:
    """Per-client arrays as checkpoint entries ``<prefix><partition id>`` (a server's ``state_dict`` part)."""
    return {f"{prefix}{pid}": arrays for pid, arrays in sorted(by_partition.items())}


def read_partition_state(state: dict[str, Arrays], prefix: str) -> dict[int, Arrays]:
    """The inverse of ``partition_state``: the entries of ``state`` under ``prefix``, by partition id."""
    return {int(key.removeprefix(prefix)): arrays for key, arrays in state.items() if key.startswith(prefix)}


@dataclass
class ClientInfo:
    """What the server knows about a connected client before round 1 (from its answer to the initial query).

    Attributes:
        node_id: Flower's node id (changes when a node restarts or a simulation is re-run).
        partition_id: the client's stable identity (its node-config ``partition-id``); per-client state is keyed by it.
        model: the base model the client loaded.
        initial: the client's initial adapter (the names and shapes it will send); clients of one model share one
            (the server fetches it from one of them and checks the others' digests).
        digest: the digest the client reported for its initial adapter ("" when only ``initial`` is known).
    """

    node_id: int
    partition_id: int
    model: str
    initial: Arrays
    digest: str = ""


@dataclass
class Group:
    """Clients whose updates are summed together (through SecAgg+ when secure).

    Attributes:
        name: a label for logs and metrics.
        start: per member node id, the adapter it trains from this round.
        send_back: the array names members return (default: every name in ``start``).
        config: the strategy's part of the members' train instructions (its ``StrategySpec.wire`` schema, e.g. the
            blocks SimGrad routes them to), or None.
        member_configs: per member node id, its part for that member only (e.g. its own LoRA ranks).
        weight_by: each member's weight in the group's sum (``common.messages.WeightingPart``): ``"examples"``,
            ``"equal"`` or a name the strategy's client half knows (``StrategyClient.member_weight``); the client
            reports it as a whole number.
        max_weight: SecAgg+'s ``max_weight`` for this group (weights are divided by it and clipped at 1 before
            masking); None: the examples a member may train per round for ``"examples"``, else 1.
        dp: differential privacy's part of the members' instructions (set by the ServerApp under ``dp.*``).
    """

    name: str
    start: dict[int, Arrays]
    send_back: list[str] | None = None
    config: Part | None = None
    member_configs: Mapping[int, Part] = field(default_factory=dict)
    weight_by: str = WEIGHT_BY_EXAMPLES
    max_weight: float | None = None
    dp: DpPart | None = None

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
        aggregate_rejected: why a secure group's unmasked aggregate was refused as a whole (None if it was not).
    """

    name: str
    mean: Arrays | None
    total_weight: float
    contributors: list[int]
    rejected: dict[int, str] = field(default_factory=dict)
    metrics: dict[int, dict[str, Any]] = field(default_factory=dict)
    aggregate_rejected: str | None = None


@dataclass
class FinalAdapter:
    """An adapter the server saves at the end of a run.

    Attributes:
        name: its directory under ``adapters/``; empty for the run's single adapter (saved as ``adapter/``).
        base_model: the base model it belongs to (written into PEFT's ``adapter_config.json``).
        arrays: its weights.
    """

    name: str
    base_model: str
    arrays: Arrays


class Strategy(ABC):
    """Abstract base of a strategy's server half: state, grouping and the combination of group means.

    Attributes:
        name: the run-config value that selects the strategy (its registry entry).
        wants_reports: True if the ServerApp must ask every client for a report before training (every round unless
            ``report_nodes`` says otherwise).
        reply_metrics: train-reply metrics the client half adds, copied into the per-node rows of metrics.jsonl
            (name -> element type of a list metric, or None for a number).
        aggregates: False for a strategy whose groups send the server no adapter (local-only training): its
            rounds take the plain transport in secure mode too, as there is nothing for SecAgg+ to mask.
    """

    name: ClassVar[str] = "abstract"
    wants_reports: ClassVar[bool] = False
    aggregates: ClassVar[bool] = True
    reply_metrics: ClassVar[dict[str, type | None]] = {}

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Strategy:
        """The strategy for a validated run config (override to read the strategy's own section)."""
        return cls()

    @abstractmethod
    def initialise(self, clients: dict[int, ClientInfo]) -> None:
        """Add clients (node id -> info): those connected before round 1, and later any node that joins (a restarted
        SuperNode has a new node id). Raises ValueError if they cannot take part (e.g. incompatible adapters)."""

    def report_nodes(self, server_round: int, node_ids: list[int]) -> list[int]:
        """Which of this round's (sampled) nodes the ServerApp asks for a report before training (default: all of
        them when ``wants_reports``, every round; fingerprint strategies ask on the rounds they re-cluster, and
        between them only the clients without a fingerprint)."""
        return list(node_ids) if self.wants_reports else []

    def read_report(self, arrays: Arrays, metrics: dict[str, Any]) -> Any:
        """Validate and decode one client's report (raise ValueError with the reason to leave it out)."""
        raise NotImplementedError(f"strategy {self.name} asks for no reports")

    def observe_reports(self, server_round: int, reports: dict[int, Any]) -> dict[int, str]:
        """Receive this round's valid reports (only called when ``wants_reports``); return the nodes left out of
        them on second thought (e.g. reports that disagree with the majority), with the reason."""
        return {}

    def report(self) -> dict[str, Any]:
        """Diagnostics of the last round for the metrics file (e.g. a relevance matrix); JSON-friendly."""
        return {}

    @abstractmethod
    def train_groups(self, server_round: int, node_ids: list[int]) -> list[Group]:
        """The groups of this round and each member's starting adapter."""

    def check_sum(self, result: GroupResult) -> str | None:
        """Why a group's mean cannot come from honest members (None if it can), checked before ``update`` divides
        by anything in it: the server refuses it, the group's round is lost and named, and in secure mode its
        members are suspects (``server_app.offenders``). Default: nothing to check beyond the transport's bounds."""
        return None

    @abstractmethod
    def update(self, server_round: int, results: list[GroupResult]) -> None:
        """Fold this round's group means into the state (those ``check_sum`` refused have no mean)."""

    @abstractmethod
    def eval_arrays(self, node_id: int) -> Arrays:
        """The adapter ``node_id`` is evaluated with (and keeps, at the end)."""

    def eval_config(self, node_id: int) -> Part | None:
        """The strategy's part of ``node_id``'s evaluate instruction beside its arrays (default: none; ATLAS: the
        ranks its arrays travel at)."""
        return None

    @abstractmethod
    def state_dict(self) -> dict[str, Arrays]:
        """Everything needed to resume, as named groups of arrays."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Arrays]) -> None:
        """Restore from ``state_dict``."""

    @abstractmethod
    def final_adapters(self) -> list[FinalAdapter]:
        """Adapters to save at the end."""

    def plot_round(self, server_round: int, aggregate_row: dict[str, Any], run_dir: Path) -> list[Path]:
        """Figures of one round, drawn from its aggregate metrics row (default: none). A strategy's own never raises
        (see ``__init_subclass__``)."""
        return []

    def plot_run(self, rows: list[dict[str, Any]], run_dir: Path) -> list[Path]:
        """Figures of the whole run, drawn from every metrics row (default: none; the eval-loss plot is shared). A
        strategy's own never raises (see ``__init_subclass__``)."""
        return []

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A figure never stops a run: the ``plot_round`` / ``plot_run`` a strategy defines are wrapped so that
        whatever they raise is logged, naming the strategy and the figures, and they return no path
        (``common.plots.drawn``), wherever the ServerApp calls them."""
        super().__init_subclass__(**kwargs)
        for method in ("plot_round", "plot_run"):
            if method in cls.__dict__:
                setattr(cls, method, _never_raising(cls.__dict__[method], method))


def _never_raising(draw: Callable[..., list[Path]], method: str) -> Callable[..., list[Path]]:
    @functools.wraps(draw)
    def guarded(self: Strategy, *args: Any, **kwargs: Any) -> list[Path]:
        return drawn(f"{self.name} {method}", lambda: draw(self, *args, **kwargs), [])

    return guarded
