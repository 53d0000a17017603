"""ATLAS's server half: clients clustered by task fingerprint, FedAvg strictly inside each cluster.

Each base-model family's fingerprints are PCA-reduced, clustered by k-means with k chosen by seed 003's combined
score (or fixed by ``atlas.k``, or given by the clients' task sets with ``atlas.clustering = "oracle"``), and every
cluster averages its members' LoRA adapters by FedAvg. Every clustering is reported in the aggregate metrics row:
k, the three scikit-learn scores, the score of every k tried, the PCA's explained variance, each client's cluster
and the clusters' task purity.

How the sums travel (``secure``): each cluster is one group. In plaintext any size is fine; under SecAgg+ a cluster
of fewer than ``atlas.min-group-size`` is merged into its nearest cluster by centroid distance (logged, and the
purity of the merged groups reported apart from the clustering's). The server learns the fingerprints, the
clusters and one mean adapter per group, never one client's adapter. The math lives in ``clustering.py``.

Per-layer ranks (``atlas.memory-mb`` or a node's ``memory-mb``): after each clustering every client with a budget
gets ranks from ``atlas.ranks`` per LoRA layer, greedily by its layer importances (``ranks.allocate_ranks``) within
its budget times its cluster's complexity scale. A group's arrays travel at its members' largest rank per layer,
each member's slots zero-padded with a slot mask, and each slot is averaged over the members that have it
(``ranks.slot_average``): a linear rule, so SecAgg+'s sums carry it. The math lives in ``ranks.py``, with
``RankPlan``, which keeps who has which ranks; the instruction keys that carry them are ``wire.py``'s.

MIRA inside the clusters (``atlas.laplacian-eta`` > 0, seed 003 phase 4): every client keeps its own adapter and is
sent the neighbour term N_k = sum_l a_kl W_l over its own cluster (a_kl MIRA's row-normalised RBF adjacency with
a_kl = 0 across clusters), and steps W_k <- (1 - eta) W_k + eta N_k itself. In plaintext every client is its own
group and N_k is exact (the server sees every W_l, as in MIRA); under SecAgg+ each group's mean is the only
neighbour term its members can get (N_k = the group mean, client k included): with eta = 1 that is ATLAS's FedAvg.
With ranks, the masks are mixed with the same weights, so each slot is averaged over the neighbours that have it.
The math lives in ``neighbours.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from common.adapters.lora import ranks as lora_ranks
from common.logs import get_logger

from ..base import Arrays, ClientInfo, FinalAdapter, Group, GroupResult, partition_state, read_partition_state
from ..families import family_key
from ..fingerprint import FingerprintReport, FingerprintSection, FingerprintStrategy
from ..fingerprint.laplacian import median_alpha
from ..fingerprint.plots import adjacency as adjacency_plots
from . import plots
from .clustering import LOW_PURITY, Grouping, clustering_row, group_clients, purity
from .config import AtlasSection
from .neighbours import Neighbourhood, Unit, named_groups, neighbour_terms, neighbourhood, training_units
from .ranks import Layer, MemberRanks, RankPlan, adapter_mb, check_budget, lora_layers, mask_problem, padded, wire_ranks
from .wire import AtlasWire, in_layer_order

if TYPE_CHECKING:
    from common.config import RunConfig

log = get_logger("tessera.server")


class Atlas(FingerprintStrategy):
    """ATLAS: task clusters from gradient fingerprints, FedAvg within each cluster.

    Args:
        cfg: the ``atlas`` section (clustering mode, k, k-max, re-clustering, min group size).
        fingerprint: the ``fingerprint`` section (the PCA dimension).
        secure: cluster means through SecAgg+ (small clusters merged first).
        seed: the run's seed (PCA and k-means).

    State: ``adapter-<partition>`` (the adapter of each client's cluster, or its neighbour term with a Laplacian
    step: it follows the client when clusters change) and ``fingerprint-<partition>`` (the clusters, ranks and
    adjacency are recomputed from these, deterministically).
    """

    name = "atlas"
    label = "atlas"

    def __init__(self, cfg: AtlasSection, fingerprint: FingerprintSection, secure: bool = False, seed: int = 0) -> None:
        super().__init__(cfg.recluster_every, fingerprint, secure, seed)
        self.cfg = cfg
        self.groupings: dict[str, Grouping] = {}  # family -> its clusters and groups (clusters after merges)
        self.adapter_of: dict[int, Arrays] = {}  # partition -> its cluster's adapter
        self.plan = RankPlan(cfg.ranks)  # which clients have their own LoRA ranks (a memory budget), and what
        self.eta = cfg.laplacian_eta
        self.neighbourhoods: dict[str, Neighbourhood] = {}  # family -> its a_kl inside clusters (with a Laplacian step)

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Atlas:
        return cls(cfg.section(AtlasSection), cfg.section(FingerprintSection), cfg.secure, cfg.seed)

    def initialise(self, clients: dict[int, ClientInfo]) -> None:
        super().initialise(clients)
        if self.cfg.memory_mb:  # the simulation's budgets: a budget that fits no rank is a config error, up front
            for info in clients.values():
                budget = self.cfg.budget(info.partition_id, {})
                try:
                    check_budget(self.layers(family_key(info.model)), budget, self.cfg.ranks)
                except ValueError as err:
                    raise ValueError(f"atlas.memory-mb: partition {info.partition_id}: {err}") from None

    def layers(self, family: str) -> list[Layer]:
        """The family's LoRA layers (sorted paths) with their widths."""
        return lora_layers(self.initial[family])

    def read_report(self, arrays: Arrays, metrics: dict[str, Any]) -> FingerprintReport:
        """A valid fingerprint, and a memory budget that fits the smallest rank on every layer of its model."""
        report = super().read_report(arrays, metrics)
        family = family_key(str(metrics.get("model", "")))
        if report.memory_mb is not None and family in self.initial:
            check_budget(self.layers(family), report.memory_mb, self.cfg.ranks)
        return report

    def _points(self, family: str) -> np.ndarray:
        """The family's PCA-reduced fingerprints (one zero per member while there is no PCA: fewer than 2)."""
        return self.reduced[family].points if family in self.reduced else np.zeros((len(self.members[family]), 1))

    def regroup(self, server_round: int, families: list[str]) -> None:
        for family in families:
            members = self.members[family]
            if not members:
                continue
            tasks = [self.reports[p].tasks for p in members]
            grouping = group_clients(self._points(family), self.cfg, self.seed, tasks, self.secure, server_round)
            self.groupings[family] = grouping
            labels = grouping.clustering.labels
            cluster_purity, group_purity = purity(labels.tolist(), tasks), purity(grouping.groups.tolist(), tasks)
            _log_grouping(server_round, family, members, grouping, (cluster_purity, group_purity), self.cfg)
            self._allocate(server_round, family, labels)
            if self.eta:
                points = self._points(family)
                alpha = self.cfg.alpha_for(median_alpha(points))
                self.neighbourhoods[family] = neighbourhood(points, alpha, labels.tolist())
            if cluster_purity < LOW_PURITY:
                log.warning(
                    "round %d: low cluster-task purity %.2f (< %.1f) in %s",
                    server_round,
                    cluster_purity,
                    LOW_PURITY,
                    family,
                )

    def _allocate(self, server_round: int, family: str, labels: np.ndarray) -> None:
        """Ranks for every member with a budget (``RankPlan.allocate``), logged."""
        members, layers = self.members[family], self.layers(family)
        reports = [self.reports[p] for p in members]
        given = self.plan.allocate(
            layers,
            members,
            np.stack([r.fingerprint for r in reports]),
            labels,
            [dict(zip(r.layer_names, r.importance.tolist())) for r in reports],
            [r.memory_mb for r in reports],
        )
        for partition, plan in given:
            _log_ranks(server_round, partition, layers, plan, self.reports[partition].memory_mb)

    def _own(self, partition: int) -> dict[str, int]:
        return self.plan.own(partition, self.initial[self.family_of_partition[partition]])

    def _wire(self, partition: int) -> dict[str, int]:
        """The ranks ``partition``'s arrays travel at: its group's largest per layer (alone: its own and its
        adapter's)."""
        placed = next((ps for _, ps in self._groups() if partition in ps), None)
        parts = placed or [partition]
        sizes = [self._own(p) for p in parts] + ([] if placed else [lora_ranks.ranks(self._adapter(partition))])
        return wire_ranks(sizes)

    def _outgoing(self, partition: int) -> Arrays:
        """What ``partition`` is sent: its adapter at the wire ranks (fresh slots seeded alike for every client),
        with its slot masks; without ranks, its adapter as it is."""
        adapter = self._adapter(partition)
        if not self.plan.any_own_ranks:
            return adapter
        return padded(adapter, self._own(partition), self._wire(partition), self.seed)

    def _rank_config(self, partition: int) -> dict[str, Any]:
        if not self.plan.any_own_ranks:
            return {}
        return {"own_ranks": in_layer_order(self._own(partition)), "wire_ranks": in_layer_order(self._wire(partition))}

    def _groups(self) -> list[Unit]:
        """(name, partitions) of every group: ``<family>-c<label>``."""
        return named_groups({family: g.groups for family, g in self.groupings.items()}, self.members)

    def _units(self) -> list[Unit]:
        """(name, partitions) of what trains as one group (``neighbours.training_units``)."""
        return training_units(self._groups(), bool(self.eta), self.secure)

    def _config(self, partition: int) -> AtlasWire:
        """What ``partition``'s instructions carry: its ranks, and whether it is sent its neighbour term."""
        neighbour_term = True if self.eta and partition in self.adapter_of else None
        return AtlasWire(**self._rank_config(partition), neighbour_term=neighbour_term)

    def train_groups(self, server_round: int, node_ids: list[int]) -> list[Group]:
        node_of = {self.partition_of[nid]: nid for nid in node_ids if nid in self.partition_of}
        groups = []
        for name, partitions in self._units():
            start = {node_of[p]: self._outgoing(p) for p in partitions if p in node_of}
            if start:
                configs = {node_of[p]: self._config(p) for p in partitions if p in node_of}
                self.plan.start(name, next(iter(start.values())))
                groups.append(Group(name, start, member_configs=configs))
        placed = {p for _, partitions in self._groups() for p in partitions}
        unplaced = sorted(set(node_of) - placed)
        if unplaced:
            log.warning(
                "round %d: partitions %s have no valid fingerprint: not trained this round", server_round, unplaced
            )
        return groups

    def _adapter(self, partition: int) -> Arrays:
        return self.adapter_of.get(partition, self.initial[self.family_of_partition[partition]])

    def check_sum(self, result: GroupResult) -> str | None:
        """With per-client ranks, the group's mean rank masks must be ones its members can send
        (``ranks.mask_problem``): ``slot_mean`` divides by them."""
        if result.mean is None or not self.plan.any_own_ranks:
            return None
        weights = [float(result.metrics.get(n, {}).get("num_examples", 0)) for n in result.contributors]
        problem = mask_problem(result.mean, weights)
        return f"atlas ranks: {problem}" if problem else None

    def update(self, server_round: int, results: list[GroupResult]) -> None:
        by_name = {r.name: r.mean for r in results if r.mean is not None}
        if self.eta:
            self._neighbour_terms(by_name)
            return
        for name, partitions in self._groups():
            if name in by_name:
                for p in partitions:
                    self.adapter_of[p] = self.plan.finish(by_name[name], name)

    def _neighbour_terms(self, means: dict[str, Arrays]) -> None:
        """Every grouped client's adapter: its neighbour term over its cluster (``neighbours.neighbour_terms``)."""
        units = self._units()
        for _, partitions in self._groups():
            family = self.family_of_partition[partitions[0]]
            adjacency, members = self.neighbourhoods[family].adjacency, self.members[family]
            for p, unit, term in neighbour_terms(adjacency, members, partitions, units, means, self.initial[family]):
                self.adapter_of[p] = self.plan.finish(term, unit)

    def eval_arrays(self, node_id: int) -> Arrays:
        return self._outgoing(self.partition_of[node_id])

    def eval_config(self, node_id: int) -> AtlasWire:
        return self._config(self.partition_of[node_id])

    def report(self) -> dict[str, Any]:
        out = self.family_report()
        for family, row in out.items():
            if family not in self.groupings:
                continue
            row.update(clustering_row(self.groupings[family], row["tasks"]))
            if family in self.neighbourhoods:
                row.update(self.neighbourhoods[family].row(self.eta))
            budgets = {p: self.reports[p].memory_mb for p in row["partitions"] if p in self.plan.ranks_of}
            row.update(self.plan.rows(self.layers(family), row["partitions"], budgets))
        return {"atlas": out}

    def plot_round(self, server_round: int, aggregate_row: dict[str, Any], run_dir: Path) -> list[Path]:
        families = aggregate_row.get("atlas", {})
        return [
            *plots.fingerprints(server_round, families, run_dir / "clusters"),
            *plots.rank_allocation(server_round, families, run_dir / "ranks"),
            *adjacency_plots(server_round, plots.by_cluster(families), run_dir / "adjacency"),
        ]

    def plot_run(self, rows: list[dict[str, Any]], run_dir: Path) -> list[Path]:
        return [plots.cluster_loss(rows, run_dir / "cluster-loss.png")]

    # ------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Arrays]:
        return {**partition_state("adapter-", self.adapter_of), **self.fingerprint_state()}

    def load_state_dict(self, state: dict[str, Arrays]) -> None:
        self.adapter_of.update(read_partition_state(state, "adapter-"))
        self.load_fingerprint_state(state)

    def final_adapters(self) -> list[FinalAdapter]:
        """One adapter per group (``<family>-c<label>``): what its members were last averaged to; none with a
        Laplacian step (every client saves its own, ``client-adapters/partition-<id>``)."""
        if self.eta:
            return []
        return [
            FinalAdapter(name, self.model_of_family[name.rsplit("-c", 1)[0]], self._adapter(partitions[0]))
            for name, partitions in self._groups()
        ]


def _log_grouping(
    server_round: int,
    family: str,
    members: list[int],
    grouping: Grouping,
    purities: tuple[float, float],
    cfg: AtlasSection,
) -> None:
    """Log a family's new clusters (k, scores, each member's cluster and group, their purities) and its merges."""
    clustering = grouping.clustering
    log.info(
        "round %d: atlas clusters of %s: k=%d (scores %s), clusters %s, purity %.2f; groups %s, purity %.2f",
        server_round,
        family,
        clustering.k,
        {k: round(v, 3) for k, v in clustering.scores.items()},
        dict(zip(members, clustering.labels.tolist())),
        purities[0],
        dict(zip(members, grouping.groups.tolist())),
        purities[1],
    )
    for line in grouping.merges:
        log.info("round %d: %s: %s (SecAgg+ needs %d)", server_round, family, line, cfg.min_group_size)


def _log_ranks(server_round: int, partition: int, layers: list[Layer], plan: MemberRanks, budget: float | None) -> None:
    """Log one client's new ranks: their range and mean, and its adapter's size against its budget."""
    log.info(
        "round %d: partition %d ranks %d..%d (mean %.1f), adapter %.2f MB of %.2f MB (scale %.2f)",
        server_round,
        partition,
        min(plan.ranks),
        max(plan.ranks),
        float(np.mean(plan.ranks)),
        adapter_mb(layers, plan.ranks),
        budget,
        plan.scale,
    )
